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

import inspect
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch

from shoal.comm import collectives
from shoal.comm import dist as comm
from shoal.comm import heartbeat
from shoal.errors import ShoalError
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
        # a param this replica did not use stays None: the exchange flags it, and one no member had stays None (as a
        # plain loop leaves it: the optimizer skips it, no weight decay on it)
        grads = {n: p.grad for n, p in self.named}
        mean = self.mean.mean_gradients(self.step(), [(grads, self.share)])
        with torch.no_grad():
            for n, p in self.named:
                given = mean.get(n)
                if given is None:  # no member had one (the replicated exchange says so)
                    p.grad = None
                elif given.dtype == p.dtype and given.device == p.device and given.is_contiguous():
                    p.grad = given  # a view of the exchange's summed buffer, as DDP's gradient_as_bucket_view: no copy
                elif p.grad is None:
                    p.grad = given.clone()
                elif given is not p.grad:
                    p.grad.copy_(given)
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


# -- Downpour in a user's loop (not wired yet): what a server needs to build the user's optimizer --------------------
# A server process never sees the user's module or optimizer (it runs the script only up to shoal.session()), so the
# chief describes the optimizer as plain JSON: torch.optim's class by name (looked up among torch.optim's own classes
# only: nothing received names code to run), its defaults and each param group by param name. Each push carries the
# groups' numeric hyper-parameters as the user's scheduler left them (`hyper_vector`), so the server's update follows
# the user's schedule at the pushing group's own step.

NOT_HYPER = frozenset({"params", "param_names", "initial_lr"})  # initial_lr: a scheduler's note, not the update's


class RecipeError(ShoalError, ValueError):
    """An optimizer that cannot be described to, or built on, a Downpour server: one line naming what."""


def _plain(value, where: str):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return list(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:  # (a tensor lr: its value)
        return float(value)
    raise RecipeError(f"{where}: {type(value).__name__} cannot travel to a Downpour server (numbers, flags and tuples of numbers do)")


def optimizer_recipe(optimizer: torch.optim.Optimizer, named: list[tuple[str, torch.Tensor]]) -> dict:
    """The JSON description of `optimizer` over the module's trained params `named` (what a server builds it from)."""
    cls = type(optimizer)
    if getattr(torch.optim, cls.__name__, None) is not cls:
        raise RecipeError(f"run.optimizer: a Downpour server builds torch.optim's optimizers only, not {cls.__module__}.{cls.__name__}")
    name_of = {id(p): n for n, p in named}
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        names = [name_of.get(id(p)) for p in group["params"]]
        if None in names:
            raise RecipeError(f"run.optimizer: param group {index} holds a tensor that is not a trained param of run.model's module")
        groups.append({"params": names, "hyper": {k: _plain(v, f"run.optimizer: param group {index}'s {k}")
                                                  for k, v in group.items() if k not in NOT_HYPER}})
    defaults = {k: _plain(v, f"run.optimizer: default {k}") for k, v in optimizer.defaults.items() if k not in NOT_HYPER}
    return {"class": cls.__name__, "defaults": defaults, "groups": groups}


def optimizer_from_recipe(recipe, named: list[tuple[str, torch.Tensor]]) -> torch.optim.Optimizer:
    """The optimizer `recipe` (optimizer_recipe's, received) describes, over `named`; anything else refused in one line."""
    if not isinstance(recipe, dict) or not isinstance(recipe.get("groups"), list) or not isinstance(recipe.get("defaults", {}), dict):
        raise RecipeError("Downpour server: the chief's optimizer recipe is not one (class, defaults, groups)")
    name = recipe.get("class")
    cls = getattr(torch.optim, name, None) if isinstance(name, str) and name in torch.optim.__all__ else None
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer):
        raise RecipeError(f"Downpour server: {str(name)[:80]!r} is not one of torch.optim's optimizers")
    by_name = dict(named)
    groups = []
    for index, group in enumerate(recipe["groups"]):
        names, hyper = (group.get("params"), group.get("hyper", {})) if isinstance(group, dict) else (None, None)
        if not isinstance(names, list) or not isinstance(hyper, dict) or any(n not in by_name for n in names):
            raise RecipeError(f"Downpour server: param group {index} of the chief's recipe names params this module does not have")
        groups.append({"params": [by_name[n] for n in names],
                       **{k: tuple(v) if isinstance(v, list) else v for k, v in hyper.items() if k not in NOT_HYPER}})
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    defaults = {k: tuple(v) if isinstance(v, list) else v for k, v in recipe.get("defaults", {}).items() if k in accepted}
    try:
        return cls(groups, **defaults)
    except (TypeError, ValueError) as err:
        raise RecipeError(f"Downpour server: torch.optim.{name} refused the chief's recipe: {str(err).splitlines()[0] if str(err) else type(err).__name__}") from None


def _hyper_layout(optimizer: torch.optim.Optimizer) -> list[tuple[int, str, int]]:
    """(group, key, length) of every numeric hyper-parameter, in a fixed order: both sides compute it alike."""
    layout = []
    for index, group in enumerate(optimizer.param_groups):
        for key in sorted(k for k in group if k not in NOT_HYPER):
            value = group[key]
            if isinstance(value, bool) or value is None:
                continue
            if isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1):
                layout.append((index, key, 0))
            elif isinstance(value, (tuple, list)) and value and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
                layout.append((index, key, len(value)))
    return layout


def hyper_vector(optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """Every group's numeric hyper-parameters (lr, weight_decay, betas...) now, as one float64 vector (a push's part)."""
    values: list[float] = []
    for index, key, length in _hyper_layout(optimizer):
        value = optimizer.param_groups[index][key]
        values.extend([float(v) for v in value] if length else [float(value)])
    return torch.tensor(values, dtype=torch.float64)


def hyper_size(optimizer: torch.optim.Optimizer) -> int:
    return sum(length or 1 for _, _, length in _hyper_layout(optimizer))


def set_hyper(optimizer: torch.optim.Optimizer, vector: torch.Tensor) -> None:
    """A push's hyper-parameters on the server's optimizer, before its update (kinds kept: an int stays an int)."""
    values, at = vector.tolist(), 0
    for index, key, length in _hyper_layout(optimizer):
        group = optimizer.param_groups[index]
        old = group[key]
        if length:
            group[key] = type(old)(type(o)(v) for o, v in zip(old, values[at : at + length]))
            at += length
        elif isinstance(old, torch.Tensor):
            old.fill_(values[at])
            at += 1
        else:
            group[key] = type(old)(values[at])
            at += 1
