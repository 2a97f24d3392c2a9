"""The exchange side of `shoal.session()` (the user's own loop): what runs inside the user's `backward` and `opt.step()`.

The user's module keeps its params and the user's torch optimizer updates them (the replicated update: every replica
applies the group's mean gradient), so the exchange only has to make the gradients, or the params, what the layout
says:

- one worker in one process: nothing (the loop is the user's plain loop);
- a synchronous group over processes (AllReduce, one worker per process): the group's mean gradient is in every
  replica's `.grad` when `backward` returns, as under DDP: each param's post-accumulate-grad hook queues, once per
  backward, an autograd engine callback that runs when the whole backward is done and hands every gradient, weighted
  by this worker's share of the group's batch, to `mean_gradients(step, parts)`. The strategy's replicated exchange
  answers it: AllReduce attaches the replicated exchange for every user loop (runtime/exchanges/replicated.py: the
  mean over the members that came; `heal(step, state)` after the loop's body: a restarted process
  takes the module's, the optimizers' and the schedulers' state, frontend/session.py);
- Local SGD / DiLoCo over processes (one group per process): the user's optimizer is the inner one; after each
  `opt.step()` the strategy's PeriodicExchange is handed the step with no gradient of its own (its inner updater
  applies nothing) and meets every local_steps steps, moving the user's params to the new anchor in place;
- Distributed Hogwild over processes (one group per process, `hogwild_exchange`): the user's optimizer is the group's
  local update; after each `opt.step()` the strategy's HogwildExchange is handed the step with no gradient (its
  server's updater applies nothing) and every cluster.sync_freq steps syncs the slices this group does not master with
  their masters (SINGA's delta rule), in place in the user's params; its masters answer the other groups on threads of
  their own, adding their deltas under the exchange's lock, which the session holds around every `opt.step()` (so a
  delta never lands half-way through the user's update).

The exchanges come from `plan.strategy.attach_exchanges(run)` with `SessionRun`, a process's part whose one trainer
is the user's module (`SessionMember`: its ParamStore views the module's params, no copy).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch

from shoal.comm import collectives
from shoal.comm import dist as comm
from shoal.comm import heartbeat
from shoal.neuralnet.algorithms import Grads
from shoal.neuralnet.params import ParamStore
from shoal.planning.plan import JobPlan


@dataclass
class SessionMember:
    """What a strategy's `attach_exchanges` / `after_values` read of a trainer, for the user's module."""

    store: ParamStore
    group: int
    start_step: int = 0
    workers: list = field(default_factory=list)  # no GroupMember: the user's loop computes
    metrics: Optional[object] = None  # the run log the exchange annotates (summary.json); the chief's
    exchange: Optional[object] = None
    workspace: Optional[object] = None
    log: Callable[[str], None] = print  # the chief's lines (a step that went on without a process)

    def attach_exchange(self, exchange) -> None:
        self.exchange = exchange


@dataclass
class SessionRun:
    """A process's part as a strategy sees it (runtime/assemble.py's ProcessRun, for one user module)."""

    plan: JobPlan
    rank: int
    trainers: list[SessionMember]
    process_groups: dict = field(default_factory=dict)
    board: Optional[object] = None
    rejoining: bool = False

    @property
    def chief(self) -> SessionMember:
        return self.trainers[0]


@dataclass(frozen=True)
class StartSpec:
    """What a strategy's `after_values` reads of the RunSpec."""

    resume_from: Optional[object] = None
    rejoin: Optional[object] = None


def attached_exchange(plan: JobPlan, rank: int, store: ParamStore, group: int, start_step: int, resumed: bool,
                      saved: Optional[dict] = None, metrics=None, log: Callable[[str], None] = print, rejoining: bool = False):
    """The exchange the plan's strategy attaches for the user's module in process `rank`, its state restored from
    `saved` (a checkpoint's exchange tensors) and started at `start_step`; `rejoining`: a process restarted into the
    running loop (in no process group: it knocks, and the session takes the chief's state at run.batches())."""
    groups = collectives.create(plan.process_groups) if not plan.in_one_process and not rejoining else {}
    member = SessionMember(store, group, start_step, metrics=metrics, log=log)
    run = SessionRun(plan, rank, [member], groups, rejoining=rejoining)
    plan.strategy.attach_exchanges(run)
    exchange = member.exchange
    if saved:
        load_exchange_state(exchange, saved)
    plan.strategy.after_values(run, StartSpec(resume_from="checkpoint" if resumed else None))
    return exchange


def exchange_state(exchange) -> dict[str, torch.Tensor]:
    """An exchange's checkpoint part: its updater's slots (Local SGD's anchor and outer state) and its own state."""
    tensors = {f"updater/{name}/{slot}": value for name, slots in exchange.updater_state().items() for slot, value in slots.items()}
    own = getattr(exchange, "own_state", None)  # the Exchange contract: only exchanges with state of their own have it
    if own is not None:
        tensors |= {f"own/{key}": value for key, value in own().items()}
    return tensors


def load_exchange_state(exchange, tensors: dict[str, torch.Tensor]) -> None:
    updater: dict[str, dict[str, torch.Tensor]] = {}
    own = {}
    for key, value in tensors.items():
        kind, _, rest = key.partition("/")
        if kind == "updater":
            name, _, slot = rest.rpartition("/")
            updater.setdefault(name, {})[slot] = value
        elif kind == "own":
            own[rest] = value
    exchange.load_updater_state(updater)
    if own and hasattr(exchange, "load_own_state"):
        exchange.load_own_state(own)


class GradientMean:
    """The group's mean gradient in every replica's `.grad` at the end of each backward (DDP's contract), through
    `mean.mean_gradients(step, [(grads, share)])`; `accumulating()` skips it (gradient accumulation's inner
    micro-batches, as DDP's no_sync)."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]], mean, share: int, step: Callable[[], int]):
        self.named = [(n, p) for n, p in named if p.requires_grad]
        self.mean, self.share, self.step = mean, share, step
        self._queued = False
        self._paused = False
        self.seconds = 0.0  # spent in the mean, since the caller last took it
        self._handles = [p.register_post_accumulate_grad_hook(self._accumulated) for _, p in self.named]

    def _accumulated(self, param: torch.Tensor) -> None:
        if self._queued or self._paused:
            return
        self._queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._queued = False
        started = time.perf_counter()
        # a param this replica did not use has no gradient: zeros, so that every member sums the same tensors
        grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in self.named}
        mean = self.mean.mean_gradients(self.step(), [(grads, self.share)])
        with torch.no_grad():
            for n, p in self.named:
                if mean.get(n) is None:  # no member had one (the replicated exchange says so)
                    p.grad = None
                elif p.grad is None:
                    p.grad = mean[n].clone()
                elif mean[n] is not p.grad:
                    p.grad.copy_(mean[n])
        self.seconds += time.perf_counter() - started

    @contextmanager
    def accumulating(self) -> Iterator[None]:
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def replicated_exchange(plan: JobPlan, rank: int, store: ParamStore, start_step: int, saved: Optional[dict], metrics,
                        log: Callable[[str], None], rejoining: bool = False):
    """The strategy's exchange for a synchronous group over processes: AllReduce attaches the replicated one for a
    user's loop (runtime/exchanges/replicated.py: the mean over the members that came; the group goes on without a
    dead process, and with cluster.max_restarts a restarted one heals from the chief)."""
    exchange = attached_exchange(plan, rank, store, 0, start_step, resumed=saved is not None, saved=saved, metrics=metrics,
                                 log=log, rejoining=rejoining)
    assert hasattr(exchange, "mean_gradients"), f"{type(exchange).__name__}: not a replicated exchange"  # check_layout's
    return exchange


def hogwild_exchange(plan: JobPlan, rank: int, store: ParamStore, group: int, start_step: int, saved: Optional[dict], metrics,
                     log: Callable[[str], None], rejoining: bool = False):
    """Distributed Hogwild's exchange for group `group`'s process: its masters and syncs over the user's module's params,
    `plan` the session's with those params cut into its slices (planning/plan.py's `sliced_for`: a session's job has no
    net, so its own plan has none)."""
    exchange = attached_exchange(plan, rank, store, group, start_step, resumed=saved is not None, saved=saved, metrics=metrics,
                                 log=log, rejoining=rejoining)  # (restarted: it knocks at the live groups at run.batches())
    assert hasattr(exchange, "sync_freq"), f"{type(exchange).__name__}: not Distributed Hogwild's exchange"  # check_layout's
    return exchange


def broadcast_values(tensors: list[torch.Tensor]) -> None:
    """Rank 0's values in every process (the replicas start equal)."""
    with torch.no_grad():
        for tensor in tensors:
            comm.broadcast(tensor, 0)


def note_step(step: int) -> None:
    """The heartbeat's next beat says this process got to `step` (who stopped answering, when one hangs)."""
    heartbeat.note_step(step)
