"""LoopSandblasterExchange: Sandblaster's worker processes as replicas that go on without a dead one, in a user's own
loop (shoal.session, shoal.fit's loop) under cluster.max_restarts (planning/exchange_choice.py's `loop_served_replicas`;
issue 38, point 1).

A job file's SandblasterExchange (runtime/exchanges/sandblaster.py) in the order of a user's loop, whose steps are the
user's `backward`, `opt.step()` and whatever else its body does (a scheduler's step):

1. at the end of `backward` (frontend/session.py's GradientMean): the worker processes' mean gradient through the
   quorum's first meeting of the step, the mean over the rows that came (the replicated exchange's); nobody is admitted
   there;
2. in `opt.step()`'s pre-hook (`step`): the chief, the servers' one stub, pushes that mean with the user's optimizer's
   hyper-parameters (the servers run the optimizer from its recipe and hold its state), and every worker process takes
   the servers' new values through the second meeting, the chief's values summed with the others' zeros. A restarted
   process is admitted here;
3. after the loop's body (`heal`, the session's): the processes admitted at the step take the chief's handover, as
   AllReduce's restarted process does in a user's loop (frontend/session_state.py: the module's values and buffers,
   the optimizers' and schedulers' state, torch's RNG), and train from the next step.

The chief's (process 0's) death: the lowest living worker process decides in its place and becomes the servers' stub
as a job file's does (runtime/exchanges/sandblaster.py), its pushes carrying its own optimizer's hyper-parameters (every
worker process's scheduler steps alike); its session takes over the chief's duties (frontend/session_healing.py `take_over`,
after the loop's body), and the dead chief's restarted process takes its loop state as any restarted process does.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from shoal.runtime.exchanges.replicated import ReplicatedExchange
from shoal.runtime.exchanges.sandblaster import SandblasterExchange


class LoopSandblasterExchange(SandblasterExchange):
    """One worker process of a user's loop's Sandblaster group under cluster.max_restarts (see the module's text)."""

    admits_at_the_mean = False  # (admitted at the values' meeting, healed after the loop's body)
    stub = None  # (the base's __init__ sets global_batch before SandblasterExchange's sets the stub)
    _hyper: Optional[tuple[int, Callable[[], torch.Tensor]]] = None  # carry_hyper's, for a dead chief's successor's stub

    @property
    def global_batch(self) -> int:
        return self._global_batch

    @global_batch.setter
    def global_batch(self, rows: int) -> None:
        """The group's rows per step (run.batches' batch_size): the stub's push is the mean over them."""
        self._global_batch = rows
        if self.stub is not None:
            self.stub.global_batch = rows

    def carry_hyper(self, size: int, hyper: Callable[[], torch.Tensor]) -> None:
        """The chief's pushes carry the user's optimizer's hyper-parameters as its scheduler left them (a dead chief's
        successor's too: every worker process's optimizer is scheduled alike)."""
        self._hyper = (size, hyper)
        if self.stub is not None:
            self.stub.carry_hyper(size, hyper)

    def _new_stub(self):
        """Group 0's new stub in a dead chief's place, pushing the group's rows' mean with this loop's hyper-parameters."""
        stub = super()._new_stub()
        stub.global_batch = self.global_batch
        if self._hyper is not None:
            stub.carry_hyper(*self._hyper)
        return stub

    def start_loop(self, step: int, whole_state: Optional[dict] = None) -> int:
        """Before the first step: the chief's values start the servers (and, resumed, the checkpoint's updater state
        `whole_state`) and every other worker process (a broadcast over the quorum's group). Returns `step`."""
        if self.stub is not None:
            self.stub.start_loop(step, whole_state)
        for name in self.store.names():
            value = self.store.values[name]
            host = value.detach().to("cpu").clone()
            self.quorum.share(host, self.quorum.chief_rank)
            with torch.no_grad():
                value.copy_(host)
        return step

    def step(self, step: int, parts: list) -> None:
        """`opt.step()`: every worker process holds the group's mean in `.grad` (`parts`' first); the chief pushes it to
        the servers, and every worker process takes their new values (the values' meeting, which admits)."""
        self.quorum.welcome(lambda: [])  # a member lost at the mean's meeting: this meeting is made without it
        mean = parts[0][0]
        self._push(step, mean)  # (the chief's, or its successor's: the stub clips the push by its norm)
        self._take_values(step, mean, admit=True)

    def rejoin(self, incarnation: int, state=None) -> tuple[int, int, dict]:
        """Knock; once admitted at a step's values' meeting, take the chief's handover `state()` after that step's loop
        body (AllReduce's restarted process's, frontend/session_healing.py's `take_chiefs_state`)."""
        return ReplicatedExchange.rejoin(self, incarnation, state)

    def resume_at(self, step: int, version: int) -> None:
        if self.stub is not None:
            super().resume_at(step, version)
