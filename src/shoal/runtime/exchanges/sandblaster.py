"""SandblasterExchange: Sandblaster's worker processes as replicas that go on without a dead one, its servers Downpour's
(a job file under cluster.max_restarts; issue 38, point 1; planning/exchange_choice.py's `served_replicas`).

Each step is two meetings of the worker processes' quorum (shoal.comm.quorum), the server processes in neither:

1. the gradients: every worker process all-reduces Σ rows · grad, its has-gradient flags and its rows, as the
   replicated exchange does (runtime/exchanges/replicated.py, whose step this is); the chief decides after the sum which
   members' rows count, so **a step without a worker process is the mean of the gradients that arrived**, each weighted
   by its rows (the batch is not re-shared among the living: the replicated exchange's text says why; for a given fault
   schedule the result is deterministic). The processes the launcher restarted are admitted here, and take every value
   of the chief (running statistics too) before the update;
2. the chief, the servers' one stub (a Downpour group of one, runtime/exchanges/downpour_stub.py), pushes that mean to
   every server, which updates its slices and answers with their values (the updater's state lives at the servers);
   then the worker processes meet again, admitting nobody: the chief's new values summed with the others' zeros, so
   every worker process, a joiner too, trains the next step on the servers' values. An all-reduce of one member's
   values (twice a broadcast's bytes over a ring), not a broadcast: it is the quorum's one collective that gives up on a
   dead member and is tried again over the living.

A restarted worker process knocks, is admitted at the next step's first meeting, takes the chief's values, and trains
from the step after it on the servers' new values (its data position is the step's, as every worker's; its random
generators start from their seeds, as a replicated process's). A dead server process is restarted into the job and
healed from the chief's mirror of its updater state and counters (runtime/exchanges/downpour_mirror.py), as Downpour's,
and the chief sends it the push it lost again (the stub's `resends`: the heal set it to the values that push was
computed on), so only the updater state's progress since the mirror is lost.

The chief (process 0) is the stub and the mirror's keeper, and its death is survived too (launcher/ranks.py's
`chief_replaceable`): the quorum makes the lowest living worker process the decider (`replaceable`), at the step's
first meeting or, the chief dead after it, at an attempt of the second. That process becomes group 0's stub
(`_succeed`: before it contributes to the values' meeting, or at the next step's push where the second meeting's sum
held the chief's values): it knocks at every server as the group's next incarnation (announced at Downpour's door,
where the servers wait for it; a server serves it only once the dead stub's thread ended, a stopped chief's once the
launcher ended it, so the dead chief's push of the step was applied whole or not at all), reads each server's count of the group's
steps, and pushes the step's mean to each server that did not apply it (DownpourExchange's `succeed`): every step's mean
is applied exactly once, and the run is deterministic for a given fault schedule. Its trainer then takes over the
chief's duties (runtime/trainer.py `_take_over`), and the dead chief's restarted process rejoins as an ordinary worker
process. What the death costs besides the dead process's rows of the steps it missed: the mirror (the new stub asks for
it at once, after its first push; a server that dies before that heals from the new stub's values and the updater's
first state, its counts restarting there) and, with cluster.compression, the dead stub's error feedback (the new stub's
codecs start at zero).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from shoal.comm import channels
from shoal.comm import quorum as quorums
from shoal.comm.channels import DOWNPOUR_DOOR
from shoal.neuralnet.algorithms import Grads
from shoal.neuralnet.params import ParamStore
from shoal.neuralnet.updaters import Updater
from shoal.runtime.endings import MeetingsOver
from shoal.runtime.exchanges.compression import wire_bytes
from shoal.runtime.exchanges.downpour_stub import DownpourExchange
from shoal.runtime.exchanges.replicated import ReplicatedExchange
from shoal.runtime.interfaces import GroupDropped
from shoal.runtime.rejoined import fingerprint


class SandblasterExchange(ReplicatedExchange):
    """One worker process of Sandblaster's group under cluster.max_restarts (see the module's text)."""

    duties_taken_over = ("it decides the steps, tests and validates, writes the run log and the checkpoints, pushes to "
                          "the servers and keeps their mirror")

    def __init__(self, store: ParamStore, updater: Updater, quorum: quorums.Quorum, rank: int, global_batch: int,
                 stub: Optional[DownpourExchange], log: Callable[[str], None] = print,
                 annotate: Optional[Callable[[dict], None]] = None,
                 make_stub: Optional[Callable[[], DownpourExchange]] = None):
        """`stub`: the chief's side of the servers (None in every other worker process: only the chief pushes);
        `make_stub`: this process's side of the servers as group 0's new stub, made when it takes a dead chief's place
        (None: it never does)."""
        super().__init__(store, updater, quorum, rank, global_batch, log=log, annotate=annotate)
        self.server.state = {}  # the servers hold the updater's state: the replica's own would be memory nobody reads
        self.stub = stub
        self.make_stub = make_stub
        self.trained = store.trainable_names()
        self._servers_counted = 0  # the servers' count of bytes, added to job_bytes_sent at the finish
        self._servers_bytes_before = 0  # a resumed run's count of the servers' bytes (its checkpoint's)

    def meeting_of(self, step: int) -> int:
        return 2 * step  # (the values' meeting is 2 · step + 1)

    def step(self, step: int, parts: list[tuple[Grads, int]]) -> None:
        """The agreed mean; the processes admitted at it take the chief's values; the chief pushes the mean to the
        servers and takes their values; every worker process takes those."""
        mean = self.mean_gradients(step, parts)
        self.heal(step)
        self._push(step, mean)
        self._take_values(step, mean)

    def _push(self, step: int, mean: Grads) -> None:
        """The decider's push of step `step`'s mean to the servers, and their values: the chief's, or (the chief dead)
        its successor's, which first becomes group 0's stub (`_succeed`)."""
        if self.stub is not None:
            self.stub.step(step, [(mean, self.global_batch)])  # (the stub clips the push by its norm, as Downpour's)
        elif self.quorum.chief and self.make_stub is not None:
            self._succeed(step, mean)

    def _succeed(self, step: int, mean: Grads) -> None:
        """This process decides the steps now (the dead chief's successor: the quorum's `replaceable`): it becomes group
        0's stub under a new incarnation of the group (announced at Downpour's door, where the servers wait for it), and
        pushes step `step`'s mean to the servers that did not apply the dead chief's push of it (DownpourExchange's
        `succeed`: each server applies it once); it keeps their mirror from now on."""
        stub = self._group_0s_next_stub()
        stub.first_step = step  # (its mirror's schedule: every K steps from here, the first at once)
        applied = stub.succeed(step, [(mean, self.global_batch)])
        self.stub = stub
        if not applied:
            pushed = "pushed the step's mean, which the dead chief had not"
        elif len(applied) == len(stub.servers):
            pushed = "the dead chief had pushed the step's mean to every server already (applied once)"
        else:
            pushed = (f"the dead chief had pushed the step's mean to the server(s) of process(es) "
                      f"{', '.join(map(str, applied))} already; it pushed it to the others (applied once)")
        self._say(f"Process {self.rank} connected to the servers as worker group 0 (restart {stub.incarnation}) at step "
                  f"{step}: {pushed}; it asked for their mirror at once")

    def _succeed_after_the_last_step(self) -> None:
        """The chief died after the last step's values meeting, so the servers applied every push: this process becomes
        group 0's stub only to make the chief's last request (the servers' final values and state, for the final
        checkpoint; without it the servers waited for group 0 for ever)."""
        stub = self._group_0s_next_stub()
        stub.take_the_groups_place(self._last_step)
        self.stub = stub
        self._say(f"Process {self.rank} connected to the servers as worker group 0 (restart {stub.incarnation}) after the "
                  f"last step, for their final values and state (every push applied)")

    def _group_0s_next_stub(self) -> DownpourExchange:
        """This process's side of the servers as group 0's next incarnation (announced at Downpour's door, where the
        servers wait for it)."""
        stub = self._new_stub()
        stub.incarnation = channels.Door(DOWNPOUR_DOOR).next_incarnation(0)
        stub.count_on_from(self._servers_bytes_before)
        return stub

    def _new_stub(self) -> DownpourExchange:
        """This process's side of the servers as group 0's stub (a user's loop's also carries its hyper-parameters)."""
        return self.make_stub()

    def _take_values(self, step: int, mean: Optional[Grads] = None, admit: bool = False) -> None:
        """The values' meeting of step `step`: the decider's values of every trained param, everyone's copy of them.
        `mean`: the step's mean, which a process that takes a dead chief's place during this meeting pushes first
        (`_succeed`: the chief may have died before or after its push); `admit`: restarted processes are admitted at
        it, and take their handover at the next `heal` (a user's loop's)."""
        values = self.store.values

        def contribution() -> torch.Tensor:
            if self.stub is None and mean is not None and self.quorum.chief and self.make_stub is not None:
                self._succeed(step, mean)  # the chief died after the mean's meeting: this attempt is over the living
            if self.stub is None:
                return torch.zeros(sum(values[n].numel() for n in self.trained), device="cpu")
            return torch.cat([values[n].detach().reshape(-1).to("cpu", torch.float32) for n in self.trained])

        try:
            met = self.quorum.meet(self.meeting_of(step) + 1, step,
                                   lambda attempt: attempt.all_reduce_sum(contribution(), in_place=True), admit=admit)
        except quorums.LeftOut as err:
            raise GroupDropped(str(err)) from None
        flat, offset = met.result, 0
        self.job_bytes_sent += wire_bytes([flat]) * len(met.came)
        self.sent_bytes += int(wire_bytes([flat]) * 2 * (len(met.came) - 1) / len(met.came))
        for name in self.trained:
            size = values[name].numel()
            values[name].view(-1).copy_(flat[offset:offset + size])
            offset += size
        if not admit:  # a member lost at this meeting: the next step's group is made without it (else at `heal`)
            self.quorum.welcome(lambda: [])

    # -- a process restarted into the job ------------------------------------------------------------
    def _handover(self) -> list[torch.Tensor]:
        """What a joiner takes from the chief before the step's update: every value (the servers send the trained ones'
        new values after it)."""
        return [self.store.values[n] for n in self.store.names()]

    def rejoin(self, incarnation: int, state=None) -> tuple[int, int, dict]:
        """Knock; once admitted at a step, take the chief's values, then that step's values from the servers through the
        values' meeting; returns (the step to train from, the step it was admitted at, what it took)."""
        before = fingerprint(self._handover())
        try:
            admission = self.quorum.join(incarnation)
        except quorums.MeetingsOver:
            raise MeetingsOver(f"process {self.rank} was restarted after the job's last step: nothing left to join") from None
        self.quorum.receive(self._handover(), admission.donor)
        self.joining = False
        self.present = tuple(m.rank for m in admission.members)
        self._take_values(admission.step)
        took = {"who": f"Process {self.rank}", "before": before, "received": fingerprint(self._handover()),
                "from_process": admission.donor,
                "took": f"the servers' values after step {admission.step}, through process {admission.donor}"}
        return admission.step + 1, admission.step, took

    # -- the Exchange contract: the updater's state is the servers' ----------------------------------------
    def updater_state(self) -> dict[str, dict[str, torch.Tensor]]:
        return self.stub.updater_state() if self.stub is not None else {}

    def load_updater_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """The servers load their slices themselves (DownpourServer.restore)."""

    def own_state(self) -> dict[str, torch.Tensor]:
        """The chief's: the stub's (the servers' count of bytes, the pushes' residuals) and the worker processes' meetings'
        bytes (a resumed run counts both on)."""
        if self.stub is None:
            return {}
        meetings = torch.tensor(self.job_bytes_sent - self._servers_counted, device="cpu")
        return {**self.stub.own_state(), "count/meetings_bytes_sent": meetings}

    def load_own_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Every worker process the job's counts (the meetings', and the servers' as the chief's stub counted them, which
        a successor's stub counts on from), the chief's stub its own state."""
        self.job_bytes_sent = int(tensors.get("count/meetings_bytes_sent", 0))
        self._servers_bytes_before = int(tensors.get("count/job_bytes_sent", 0))
        if self.stub is not None:
            self.stub.load_own_state(tensors)

    def resume_at(self, step: int, version: int) -> None:
        """The chief, resumed at `step` (the servers restored themselves at `version`). The mirror's schedule stays the
        uninterrupted run's (every K steps from step 0), so a resumed run moves the bytes it would have: a server that dies
        in the first K - 1 steps after a resume heals from the chief's values and the updater's first state (its heal's
        line says "no mirror yet")."""
        self.stub.resume_at(step, version)
        self.stub.first_step = 0

    def finish(self) -> None:
        """The steps are over (the chief closes the meetings first: its death from here on is one nobody takes over,
        rejoin.Restarter's `chief_after_the_last_step`, rather than one a successor waits for after its loop ended), then
        the chief's last request to the servers (their final values and state). A process that took a dead chief's
        place at the end (`Quorum.await_close`: it died after the last step's values) becomes the servers' stub first."""
        super().finish()
        if self.stub is None and self.quorum.chief and self.make_stub is not None:
            self._succeed_after_the_last_step()
        if self.stub is not None:
            self.stub.finish()
            if self.stub.job_bytes_sent is not None:
                self._servers_counted = self.stub.job_bytes_sent
                self.job_bytes_sent += self._servers_counted
