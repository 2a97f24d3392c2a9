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
computed on), so only the updater state's progress since the mirror is lost. The chief (process 0) is the stub and the mirror's keeper: its death
restarts the whole job from its newest checkpoint (launcher/job_restarts.py).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from shoal.comm import quorum as quorums
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

    def __init__(self, store: ParamStore, updater: Updater, quorum: quorums.Quorum, rank: int, global_batch: int,
                 stub: Optional[DownpourExchange], log: Callable[[str], None] = print,
                 annotate: Optional[Callable[[dict], None]] = None):
        """`stub`: the chief's side of the servers (None in every other worker process: only the chief pushes)."""
        super().__init__(store, updater, quorum, rank, global_batch, log=log, annotate=annotate)
        self.server.state = {}  # the servers hold the updater's state: the replica's own would be memory nobody reads
        self.stub = stub
        self.trained = store.trainable_names()
        self._servers_counted = 0  # the servers' count of bytes, added to job_bytes_sent at the finish

    def meeting_of(self, step: int) -> int:
        return 2 * step  # (the values' meeting is 2 · step + 1)

    def step(self, step: int, parts: list[tuple[Grads, int]]) -> None:
        """The agreed mean; the processes admitted at it take the chief's values; the chief pushes the mean to the
        servers and takes their values; every worker process takes those."""
        mean = self.mean_gradients(step, parts)
        self.heal(step)
        if self.stub is not None:
            self.stub.step(step, [(mean, self.global_batch)])  # (the stub clips the push by its norm, as Downpour's)
        self._take_values(step)

    def _take_values(self, step: int, admit: bool = False) -> None:
        """The values' meeting of step `step`: the chief's values of every trained param, everyone's copy of them.
        `admit`: restarted processes are admitted at it, and take their handover at the next `heal` (a user's loop's)."""
        values = self.store.values

        def contribution() -> torch.Tensor:
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
        if self.stub is not None:
            self.stub.load_own_state(tensors)
            self.job_bytes_sent = int(tensors.get("count/meetings_bytes_sent", 0))

    def resume_at(self, step: int, version: int) -> None:
        """The chief, resumed at `step` (the servers restored themselves at `version`). The mirror's schedule stays the
        uninterrupted run's (every K steps from step 0), so a resumed run moves the bytes it would have: a server that dies
        in the first K - 1 steps after a resume heals from the chief's values and the updater's first state (its heal's
        line says "no mirror yet")."""
        self.stub.resume_at(step, version)
        self.stub.first_step = 0

    def finish(self) -> None:
        """The chief's last request to the servers (their final values and state), then the steps are over."""
        if self.stub is not None:
            self.stub.finish()
            if self.stub.job_bytes_sent is not None:
                self._servers_counted = self.stub.job_bytes_sent
                self.job_bytes_sent += self._servers_counted
        super().finish()
