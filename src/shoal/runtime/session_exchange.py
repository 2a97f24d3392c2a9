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
  takes the module's, the optimizers' and the schedulers' state, frontend/session_state.py);
- Local SGD / DiLoCo over processes (one group per process): the user's optimizer is the inner one; after each
  `opt.step()` the strategy's PeriodicExchange is handed the step with no gradient of its own (its inner updater
  applies nothing) and meets every local_steps steps, moving the user's params to the new anchor in place;
- Distributed Hogwild over processes (one group per process, `hogwild_exchange`): the user's optimizer is the group's
  local update; after each `opt.step()` the strategy's HogwildExchange is handed the step with no gradient (its
  server's updater applies nothing) and every cluster.sync_freq steps syncs the slices this group does not master with
  their masters (SINGA's delta rule), in place in the user's params; its masters answer the other groups on threads of
  their own, adding their deltas under the exchange's lock, which the session holds around every `opt.step()` (so a
  delta never lands half-way through the user's update);
- Downpour over processes (one worker per process, servers in processes of their own): the servers run the user's
  optimizer, built from its recipe (`serve_downpour`: a server process never runs the loop); `opt.step()`'s pre-hook
  pushes the gradients with the optimizer's hyper-parameters (`hyper_vector`) and installs the servers' answer in the
  params, leaving every `.grad` None so that the user's optimizer updates nothing (frontend/session_pushes.py, `push`); a
  scheduler given as `run.scheduler(s, steps="update")` follows the servers' update count instead of each group's
  steps: the chief's rows of its hyper-parameters per position (`UpdateSchedule`), set by each server at its count;
- Sandblaster over processes (its one group's servers in processes of their own): Downpour's servers and pushes with
  the group's one stub (strategies/sandblaster.py), synchronous, and, as under AllReduce, the group's mean gradient in
  every `.grad` when backward ends (`StubGroupMean`), which the stub alone then pushes; under cluster.max_restarts with
  one worker per process the strategy's LoopSandblasterExchange instead (runtime/exchanges/sandblaster_loop.py: the
  mean through the worker processes' quorum, which goes on without a dead one; a restarted one heals as AllReduce's);
- several workers in a process under Downpour and Sandblaster (threads, run.each_worker): the process's workers'
  gradients meet in their mean (frontend/session_worker.py's LocalMean: Sandblaster's through `StubGroupMean`, so the
  group's), which their opt.step()s push once (`SessionWorker._push_process`);
- in-memory Downpour and Hogwild (groups as threads of one process, `group_exchanges`): the strategy's GroupExchanges
  around one in-process server running the user's optimizer from its recipe; a group's workers' gradients meet in
  their mean, and its workers' `opt.step()` pre-hooks push it there once, with the group's optimizer's
  hyper-parameters (the push carries them, as over processes: `GroupExchange.carry_hyper`, `Server.carry_hyper`); the
  group's copy takes the server's answer (Downpour), or the server updates the one copy every group computes on
  (Hogwild);
- Local SGD / DiLoCo's groups in one process (threads, `meeting_exchanges`): the strategy's PeriodicExchange for each
  group, meeting in memory (its InMemoryMeeting), each group's replicas updated by its workers' own optimizers; the
  group's workers' `opt.step()`s hand its exchange the step once, in the group's thread, so the groups meet there
  (frontend/session_threads.py's `WorkerThreads.group_boundary`).

The exchanges come from `plan.strategy.attach_exchanges(run)` with `SessionRun`, a process's part whose one trainer
is the user's module (`SessionMember`: its ParamStore views the module's params, no copy).
"""
from __future__ import annotations

import inspect
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterator, Optional

import torch

from shoal.comm import collectives
from shoal.comm import dist as comm
from shoal.comm import heartbeat
from shoal.errors import ShoalError
from shoal.neuralnet.params import ParamStore
from shoal.neuralnet.singa_optimizer import SingaOptimizer
from shoal.planning.plan import JobPlan
from shoal.runtime.assemble import server_start_line
from shoal.runtime.interfaces import FaultInjection


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

    def attach_exchange(self, exchange, may_take_over: bool = False) -> None:
        self.exchange = exchange  # (the session takes a dead chief's place itself: session_healing.take_over)

    def start_at(self, step: int) -> None:  # (Downpour's groups other than 0: where group 0's warm-up ends)
        self.start_step = step


@dataclass
class SessionRun:
    """A process's part as a strategy sees it (runtime/assemble.py's ProcessRun, for one user module)."""

    plan: JobPlan
    rank: int
    trainers: list[SessionMember]
    process_groups: dict = field(default_factory=dict)
    board: Optional[object] = None
    rejoining: bool = False
    faults: FaultInjection = field(default_factory=FaultInjection)  # (none in a user's loop)
    server: Optional[object] = None  # a Downpour server process's (attach_exchanges sets it)

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


class StubGroupMean:
    """Sandblaster in a user's loop: `GradientMean`'s mean over the group's processes (the plan's group of them, the
    request/response exchange's `group_comm`; none for a group of one process), in one flat all-reduce, so that
    `.grad` holds the group's mean when backward ends, as under DDP (a clip_grad_norm_ in the loop clips the global
    norm). `opt.step()` then pushes the stub's copy alone: the exchange's own sum at the stub adds the others' zeros.
    Several workers in a process (run.each_worker's LocalMean) hand their parts together: each weighs its rows."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]], exchange):
        self.named = [(n, p) for n, p in named if p.requires_grad]
        self.exchange = exchange
        self.total = sum(p.numel() for _, p in self.named)

    def mean_gradients(self, step: int, parts: list[tuple[dict, int]]) -> dict[str, Optional[torch.Tensor]]:
        # fresh each step: its views become the params' .grad (the flags last: whether any process had a gradient)
        flat = torch.zeros(self.total + len(self.named))
        for part, (grads, share) in enumerate(parts):
            weight, at = share / self.exchange.global_batch, 0
            for index, (name, param) in enumerate(self.named):
                grad = grads.get(name)
                if grad is not None:
                    weighted = grad.detach().reshape(-1).to(flat) * weight
                    if part == 0:  # (one worker: the product itself, as before; several: summed in worker order)
                        flat[at : at + param.numel()] = weighted
                    else:
                        flat[at : at + param.numel()] += weighted
                    flat[self.total + index] = 1
                at += param.numel()
        if self.exchange.group_comm is not None:
            self.exchange.group_comm.all_reduce_sum(flat).wait()
        mean, at = {}, 0
        for index, (name, param) in enumerate(self.named):
            had = bool(flat[self.total + index] > 0)
            mean[name] = flat[at : at + param.numel()].view(param.shape) if had else None
            at += param.numel()
        return mean


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


def broadcast_values(plan: JobPlan, tensors: list[torch.Tensor]) -> None:
    """Rank 0's values in every process (the replicas start equal), over the plan's whole-job group."""
    job = collectives.whole_job(plan.process_groups)
    with torch.no_grad():
        for tensor in tensors:
            comm.broadcast(tensor, 0, job)


def note_step(step: int) -> None:
    """The heartbeat's next beat says this process got to `step` (who stopped answering, when one hangs)."""
    heartbeat.note_step(step)


# -- Downpour in a user's loop: what a server needs to build the user's optimizer ---------------------------------
# A server process never sees the user's module or optimizer (it runs the script only up to shoal.session()), so the
# chief describes the optimizer as plain JSON: torch.optim's class by name (looked up among torch.optim's own classes
# only: nothing received names code to run), its defaults and each param group by param name. Each push carries the
# groups' numeric hyper-parameters as the user's scheduler left them (`hyper_vector`), so the server's update follows
# the user's schedule at the pushing group's own step.

NOT_HYPER = frozenset({"params", "param_names", "initial_lr",  # initial_lr: a scheduler's note, not the update's
                       "updater"})  # shoal.SingaOptimizer's updater: the recipe's own field, the same for every group
SINGA_OPTIMIZER = "shoal.SingaOptimizer"  # the recipe's name for it (torch.optim's classes go by their own)


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
    """The JSON description of `optimizer` over the module's trained params `named` (what a server builds it from): one
    of torch.optim's classes, or shoal.SingaOptimizer, whose updater travels as its UpdaterProto's JSON fields."""
    cls = type(optimizer)
    if cls is SingaOptimizer:
        name = SINGA_OPTIMIZER
    elif getattr(torch.optim, cls.__name__, None) is cls:
        name = cls.__name__
    else:
        raise RecipeError(f"run.optimizer: servers build torch.optim's optimizers and shoal.SingaOptimizer only, not "
                          f"{cls.__module__}.{cls.__name__}")
    name_of = {id(p): n for n, p in named}
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        names = [name_of.get(id(p)) for p in group["params"]]
        if None in names:
            raise RecipeError(f"run.optimizer: param group {index} holds a tensor that is not a trained param of run.model's module")
        groups.append({"params": names, "hyper": {k: _plain(v, f"run.optimizer: param group {index}'s {k}")
                                                  for k, v in group.items() if k not in NOT_HYPER}})
    defaults = {k: _plain(v, f"run.optimizer: default {k}") for k, v in optimizer.defaults.items() if k not in NOT_HYPER}
    recipe = {"class": name, "defaults": defaults, "groups": groups}
    if cls is SingaOptimizer:
        recipe["updater"] = optimizer.defaults["updater"]  # its UpdaterProto's fields, as the optimizer keeps them
    return recipe


def optimizer_from_recipe(recipe, named: list[tuple[str, torch.Tensor]]) -> torch.optim.Optimizer:
    """The optimizer `recipe` (optimizer_recipe's, received) describes, over `named`; anything else refused in one line."""
    if not isinstance(recipe, dict) or not isinstance(recipe.get("groups"), list) or not isinstance(recipe.get("defaults", {}), dict):
        raise RecipeError("Downpour server: the chief's optimizer recipe is not one (class, defaults, groups)")
    name = recipe.get("class")
    if name == SINGA_OPTIMIZER:
        cls = SingaOptimizer
    else:
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
    if cls is SingaOptimizer:  # its updater's fields, parsed by protobuf (an unknown field or type refused in one line)
        defaults["updater"] = recipe.get("updater")
    try:
        return cls(groups, **defaults)
    except (TypeError, ValueError) as err:
        raise RecipeError(f"Downpour server: {name if cls is SingaOptimizer else 'torch.optim.' + name} refused the chief's recipe: {str(err).splitlines()[0] if str(err) else type(err).__name__}") from None


HyperLayout = list[tuple[int, str, int]]


def _hyper_layout(optimizer: torch.optim.Optimizer) -> HyperLayout:
    """(group, key, length) of every numeric hyper-parameter, in a fixed order: both sides compute it alike."""
    return _numeric_layout(optimizer.param_groups)


def recipe_layout(recipe: dict) -> HyperLayout:
    """The hyper-parameters a push carries: the recipe's numeric ones (keys a scheduler adds later, OneCycleLR's
    max_lr say, are not the optimizer's and do not travel). The chief and the server compute it from one recipe."""
    return _numeric_layout([group["hyper"] for group in recipe["groups"]])


def _numeric_layout(groups: list[dict]) -> HyperLayout:
    layout = []
    for index, group in enumerate(groups):
        for key in sorted(k for k in group if k not in NOT_HYPER):
            value = group[key]
            if isinstance(value, bool) or value is None:
                continue
            if isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1):
                layout.append((index, key, 0))
            elif isinstance(value, (tuple, list)) and value and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
                layout.append((index, key, len(value)))
    return layout


def hyper_vector(optimizer: torch.optim.Optimizer, layout: Optional[HyperLayout] = None) -> torch.Tensor:
    """Every group's numeric hyper-parameters (lr, weight_decay, betas...) now, as one float64 vector (a push's part)."""
    values: list[float] = []
    for index, key, length in _hyper_layout(optimizer) if layout is None else layout:
        value = optimizer.param_groups[index][key]
        values.extend([float(v) for v in value] if length else [float(value)])
    return torch.tensor(values, dtype=torch.float64)


def hyper_size(optimizer: torch.optim.Optimizer) -> int:
    return layout_size(_hyper_layout(optimizer))


def layout_size(layout: HyperLayout) -> int:
    """The floats a push's hyper-parameter vector of `layout` holds."""
    return sum(length or 1 for _, _, length in layout)


def set_hyper(optimizer: torch.optim.Optimizer, vector: torch.Tensor, layout: Optional[HyperLayout] = None) -> None:
    """A push's hyper-parameters on the server's optimizer, before its update (kinds kept: an int stays an int)."""
    values, at = vector.tolist(), 0
    for index, key, length in _hyper_layout(optimizer) if layout is None else layout:
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


def hyper_layout(optimizer: torch.optim.Optimizer) -> HyperLayout:
    """The layout of `optimizer`'s pushes, as `recipe_layout` computes it from its recipe (at run.optimizer: before a
    scheduler adds keys of its own)."""
    return _hyper_layout(optimizer)


# -- a schedule that follows the servers' updates (run.scheduler(s, steps="update")) -------------------------------
# By default the user's scheduler is stepped by each group's loop and each push carries what it set: the schedule
# follows each group's own steps. With steps="update" it follows the servers' update count (every group's), as
# shoal.fit's default scheduler_steps="update" (a torch scheduler on the job path's server). A server cannot run the
# user's scheduler (it never sees it: no code travels), so the scheduler's hyper-parameters at every position the run
# can reach are worked out where it lives, the chief's process at run.scheduler, as one float64 row per position of
# the columns it moves; the chief publishes them before the servers' first values (SCHEDULE_KEY), and a server sets
# the row of its update count over each push's own vector before that push's update.
SCHEDULE_KEY = "session/downpour/schedule"
SCHEDULER_STEPS = ("group", "update")  # run.scheduler's steps=: what a schedule's position counts


@dataclass
class UpdateSchedule:
    """A scheduler's hyper-parameters at positions 0 .. len(rows) - 1: `columns`, the indices into a push's vector that
    it moves (the rest stay the push's), and `rows`, their float64 values at each position."""

    columns: list[int]
    rows: torch.Tensor

    def at(self, vector: torch.Tensor, position: int) -> torch.Tensor:
        """A push's `vector` with the schedule's columns at `position` (past the last row: the last row's)."""
        if not self.columns or not len(self.rows):
            return vector
        out = vector.clone()
        out[self.columns] = self.rows[max(0, min(position, len(self.rows) - 1))]
        return out

    def as_text(self) -> str:
        """Plain JSON (the rows as base64 float64 bytes): what the chief publishes."""
        import base64
        import json

        return json.dumps({"columns": self.columns, "positions": len(self.rows),
                           "rows": base64.b64encode(self.rows.contiguous().numpy().tobytes()).decode("ascii")})

    @classmethod
    def from_text(cls, text: str, size: int) -> "UpdateSchedule":
        """The chief's published schedule for pushes of `size` floats; anything malformed refused in one line."""
        import base64
        import binascii
        import json

        try:
            got = json.loads(text)
            columns, positions = got["columns"], got["positions"]
            raw = base64.b64decode(got["rows"], validate=True)
        except (ValueError, KeyError, TypeError, binascii.Error):
            raise RecipeError("Downpour server: the chief's schedule by update is not readable") from None
        if not (isinstance(columns, list) and all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c < size for c in columns)
                and len(set(columns)) == len(columns) and isinstance(positions, int) and not isinstance(positions, bool)
                and positions >= 0 and len(raw) == positions * len(columns) * 8):
            raise RecipeError("Downpour server: the chief's schedule by update does not fit its pushes")
        rows = torch.frombuffer(bytearray(raw), dtype=torch.float64) if raw else torch.zeros(0, dtype=torch.float64)
        return cls(columns, rows.reshape(positions, len(columns)))


def update_schedule(scheduler, layout: HyperLayout, positions: int) -> UpdateSchedule:
    """What `scheduler` (at its first position) sets on its optimizer, where `layout` says (a push's), at positions 0 ..
    `positions` - 1: stepped there and put back, its optimizer's param groups too, as they were."""
    import copy
    import warnings

    optimizer = scheduler.optimizer
    state = copy.deepcopy(scheduler.state_dict())
    kept = [{k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in group.items()
             if k not in ("params", "param_names")} for group in optimizer.param_groups]
    rows = [hyper_vector(optimizer, layout)]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (torch warns of a scheduler stepped before its optimizer)
            for _ in range(positions - 1):
                scheduler.step()
                rows.append(hyper_vector(optimizer, layout))
    finally:
        scheduler.load_state_dict(state)
        for group, values in zip(optimizer.param_groups, kept):
            for key in [k for k in group if k not in values and k not in ("params", "param_names")]:
                del group[key]
            for key, value in values.items():
                if isinstance(group.get(key), torch.Tensor) and isinstance(value, torch.Tensor):
                    group[key].copy_(value)
                else:
                    group[key] = value
    table = torch.stack(rows)
    columns = [i for i in range(table.shape[1]) if not bool((table[:, i] == table[0, i]).all())]
    return UpdateSchedule(columns, table[:, columns].contiguous())


def _publish_parts(key: str, text: str) -> None:
    """`text` under `key` in the job's signed store, in parts (a store value is bounded); the count last."""
    parts = [text[i : i + DESCRIPTION_PART_CHARS] for i in range(0, len(text), DESCRIPTION_PART_CHARS)] or [""]
    for index, part in enumerate(parts):
        comm.publish(f"{key}/{index}", part)
    comm.publish(f"{key}/parts", str(len(parts)))  # last: a reader reads the parts once it sees the count


def publish_schedule(schedule: Optional[UpdateSchedule]) -> None:
    """The chief's, before the servers' first values: its schedule by update, or that there is none."""
    if schedule is None:
        comm.publish(f"{SCHEDULE_KEY}/parts", "0")
    else:
        _publish_parts(SCHEDULE_KEY, schedule.as_text())


def read_schedule(timeout_s: float, size: int) -> Optional[UpdateSchedule]:
    """A server's, at its first push (the chief published it before its first values): the schedule by update, or None."""
    try:
        count = int(comm.read_published(f"{SCHEDULE_KEY}/parts", timeout_s))
        text = "".join(comm.read_published(f"{SCHEDULE_KEY}/{i}", timeout_s) for i in range(count))
    except (ValueError, RuntimeError):
        raise RecipeError("Downpour server: the chief's word on its schedule by update is not readable") from None
    return UpdateSchedule.from_text(text, size) if count else None


class PushedHyper:
    """What a server sets before a push's update: the push's hyper-parameters, the chief's schedule by update (if it
    gave one) over them at the server's update count. `schedule`: the chief's UpdateSchedule or None, asked once, at
    the first push."""

    def __init__(self, updater, layout: HyperLayout, count: Callable[[], int], schedule: Callable[[], Optional[UpdateSchedule]]):
        self.updater, self.layout, self.count, self._schedule = updater, layout, count, schedule
        self._asked, self.schedule = False, None

    def __call__(self, vector: torch.Tensor) -> None:
        if not self._asked:
            self.schedule, self._asked = self._schedule(), True
        if self.schedule is not None:
            vector = self.schedule.at(vector, self.count())
        if self.updater.optimizer is not None:
            set_hyper(self.updater.optimizer, vector, self.layout)


# -- Downpour in a user's loop: the chief's description, the servers, the groups' exchange --------------------------
# The chief publishes, at run.optimizer(), what a server builds from: the trained params' names and shapes (in
# named_parameters order) and the optimizer's recipe, as JSON in the job's signed store (in parts: a store value is
# bounded). The values themselves go over the chief's channel to each server (DownpourExchange.start_loop's FIRST).
DESCRIPTION_KEY = "session/downpour"
DESCRIPTION_PART_CHARS = 12 * 1024
SESSION_OPTIMIZER = "shoal.session.Optimizer"  # the updater a user's loop's Downpour servers apply: its optimizer


class RecipeOptimizer:
    """The optimizer a recipe describes, as an optimizer factory on (name, param) pairs (neuralnet/torch_optimizer)."""

    def __init__(self, recipe: dict):
        self.recipe = recipe

    def __call__(self, named: list[tuple[str, torch.Tensor]]) -> torch.optim.Optimizer:
        return optimizer_from_recipe(self.recipe, named)


def compensated(plan: JobPlan, recipe: dict) -> tuple[dict, list[str]]:
    """`recipe` as the servers run it: a shoal.SingaOptimizer's momentum compensated under asynchrony as a job file's
    servers compensate the job's updater (planning/plan.py's server_updater: cluster.async_momentum, Downpour's groups
    adding momentum of their own), and the line that says so (none where nothing changed: a torch optimizer, a
    synchronous group, kAsConfigured). Every process computes it alike from the plan and the recipe."""
    from shoal.neuralnet.singa_optimizer import updater_conf
    from shoal.planning.plan import servers_updater

    if recipe.get("class") != SINGA_OPTIMIZER or not isinstance(recipe.get("updater"), dict):
        return recipe, []
    servers, said = servers_updater(plan, updater_conf(recipe["updater"]))
    if not said:
        return recipe, []
    return dict(recipe, updater=dict(recipe["updater"], momentum=servers.momentum)), said


def downpour_plan(plan: JobPlan, names: list[str], shapes: list[tuple[int, ...]], recipe: dict) -> JobPlan:
    """The session's plan for Downpour over the user's module: its params cut into the servers' slices (as a net's
    are) and, as the servers' updater, the user's optimizer built from its recipe (registered in this process)."""
    from dataclasses import replace

    from shoal.config import job_pb2
    from shoal.neuralnet.torch_optimizer import register_torch_optimizer
    from shoal.planning.plan import sliced_for

    register_torch_optimizer(RecipeOptimizer(recipe), [(n, torch.empty(shape, device="meta")) for n, shape in zip(names, shapes)],
                             user_type=SESSION_OPTIMIZER)
    updater = job_pb2.UpdaterProto(type=job_pb2.kUserUpdater, user_type=SESSION_OPTIMIZER)
    updater.learning_rate.type = job_pb2.kFixed
    updater.learning_rate.base_lr = 0.0  # (torch.optim reads its own lr: the recipe's, then each push's)
    sliced = sliced_for(plan, {n: max(1, math.prod(shape)) for n, shape in zip(names, shapes)})
    return replace(sliced, updater_bytes=updater.SerializeToString())


def publish_description(names: list[str], shapes: list[tuple[int, ...]], recipe: dict) -> None:
    """The chief's: what the servers build from (JSON, no code: torch.optim's class by name, numbers)."""
    import json

    _publish_parts(DESCRIPTION_KEY, json.dumps({"names": names, "shapes": [list(s) for s in shapes], "recipe": recipe}))


def read_description(timeout_s: float) -> tuple[list[str], list[tuple[int, ...]], dict]:
    """A server's: the chief's description, once published (it waits while the chief's script builds its module and
    optimizer: the launcher ends the job if the chief dies first); anything malformed refused in one line."""
    import json

    count = None
    while count is None:
        count = comm.published(f"{DESCRIPTION_KEY}/parts", wait_s=5.0)
        if count is None and comm.store_lost():  # the launcher is gone: nobody will publish it
            raise RecipeError("Downpour server: the job's store stopped answering before the chief described its module")
    try:
        text = "".join(comm.read_published(f"{DESCRIPTION_KEY}/{i}", timeout_s) for i in range(int(count)))
        described = json.loads(text)
    except (ValueError, RuntimeError):
        raise RecipeError("Downpour server: the chief's description of its module is not readable") from None
    names, shapes, recipe = (described.get("names"), described.get("shapes"), described.get("recipe")) \
        if isinstance(described, dict) else (None, None, None)
    if not (isinstance(names, list) and isinstance(shapes, list) and len(names) == len(shapes)
            and all(isinstance(n, str) for n in names) and len(set(names)) == len(names)
            and all(isinstance(s, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in s) for s in shapes)):
        raise RecipeError("Downpour server: the chief's description names no params with shapes")
    return names, [tuple(s) for s in shapes], recipe


def serve_downpour(plan: JobPlan, rank: int, workspace, log: Callable[[str], None], restarted: bool = False) -> None:
    """A Downpour server process of a user's loop: it never runs the loop. It builds the user's optimizer over zeros
    shaped as the module's params from the chief's description, takes the chief's values (FIRST) and serves every
    group's pushes (each carrying the hyper-parameters the user's scheduler set) until the chief's last request.
    `restarted` (--max-restarts: in a dead server's place): in no process group; the chief heals it (HEAL, its mirror)."""
    if not restarted:
        collectives.create(plan.process_groups)  # (every rank makes the plan's groups, in order, as the workers do)
    names, shapes, recipe = read_description(plan.comm_timeout_s)
    named = [(n, torch.zeros(shape)) for n, shape in zip(names, shapes)]
    optimizer_from_recipe(recipe, named)  # refused here in one line, not deep inside the server's first update
    served = downpour_plan(plan, names, shapes, recipe)
    for server in served.process(rank).servers:  # (as a job file's server process starts: its log says what it serves)
        log(server_start_line(served, rank, server))
    run = SessionRun(served, rank, [SessionMember(ParamStore.viewing(named), 0, workspace=workspace, log=log)])
    served.strategy.attach_exchanges(run)
    server, layout = run.server, recipe_layout(recipe)
    size = layout_size(layout)
    server.carry_hyper(size, PushedHyper(server.updater, layout, lambda: server.version,  # (asked under its lock)
                                         lambda: read_schedule(plan.comm_timeout_s, size)))
    if not restarted:  # (a restarted one waits for the chief's HEAL instead: DownpourServer.serve)
        server.await_first_values()
    server.serve()


def downpour_exchange(plan: JobPlan, rank: int, store: ParamStore, group: int, recipe: dict, optimizer: torch.optim.Optimizer,
                      start_step: int, saved: Optional[dict], metrics, log: Callable[[str], None], rejoining: bool = False):
    """A worker group's process's side of Downpour in a user's loop: the strategy's DownpourExchange over the module's
    params (its store views them), its pushes carrying `optimizer`'s hyper-parameters as the recipe lays them out."""
    names = store.trainable_names()
    sliced = downpour_plan(plan, names, [tuple(store.info[n].shape) for n in names], recipe)
    exchange = attached_exchange(sliced, rank, store, group, start_step, resumed=saved is not None, saved=saved,
                                 metrics=metrics, log=log, rejoining=rejoining)  # (restarted: it pulls at run.batches())
    layout = recipe_layout(recipe)
    exchange.carry_hyper(layout_size(layout), lambda: hyper_vector(optimizer, layout))
    return exchange


def whole_updater_state(saved: Optional[dict]) -> dict[str, dict[str, torch.Tensor]]:
    """A checkpoint's servers' updater state ({param: {slot: tensor}}) from its exchange tensors (exchange_state's)."""
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in (saved or {}).items():
        kind, _, rest = key.partition("/")
        if kind == "updater":
            name, _, slot = rest.rpartition("/")
            state.setdefault(name, {})[slot] = value
    return state


class GroupsInProcess:
    """In-memory Downpour's groups of this process as the session's one exchange: what a checkpoint holds of them (the
    server's optimizer state, values and update count, through group 0's exchange; every other group's own copy of
    the params, as `group<g>/...`: the job path's parts) and the loop's end."""

    job_bytes_sent = None  # nothing crosses a wire

    def __init__(self, exchanges: list, run: Optional["SessionRun"] = None):
        """`run`: the groups as the strategy attached them (its board counts every group's updates by lag)."""
        self.exchanges, self.run = exchanges, run

    def metrics(self, window) -> dict[str, float]:
        """At a display: group 0's losses, every group's samples and the updates' staleness since the last one (the
        board's, as a job file's in-memory groups record them)."""
        return self.exchanges[0].metrics(window)

    def staleness_histogram(self, plan: JobPlan) -> Optional[dict]:
        """After the loop: every group's updates by lag, and how many each was to apply (summary.json's)."""
        return plan.strategy.staleness_histogram(self.run) if self.run is not None and self.run.board is not None else None

    def first_step(self, group: int) -> int:
        """Where group `group`'s loop starts: after group 0's warm-up (cluster.warmup_steps), as the strategy's board set it."""
        return self.run.trainers[group].start_step

    def updater_state(self):
        return self.exchanges[0].updater_state()

    def load_updater_state(self, state) -> None:
        self.exchanges[0].load_updater_state(state)

    def own_state(self) -> dict[str, torch.Tensor]:
        tensors = dict(self.exchanges[0].own_state())
        for exchange in self.exchanges[1:]:
            tensors |= {f"group{exchange.group}/{key}": value for key, value in exchange.own_state().items()}
        return tensors

    def load_own_state(self, tensors: dict[str, torch.Tensor]) -> None:
        for exchange in self.exchanges:
            prefix = f"group{exchange.group}/"
            own = ({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)} if exchange.group
                   else {k: v for k, v in tensors.items() if not k.startswith("group")})
            if own:
                exchange.load_own_state(own)

    def finish(self) -> None:
        for exchange in self.exchanges:
            exchange.board.stop(exchange.group)


def group_exchanges(plan: JobPlan, stores: list[ParamStore], recipe: dict, optimizers: list[torch.optim.Optimizer],
                    start_step: int, saved: Optional[dict], metrics=None,
                    schedule: Optional[Callable[[], Optional[UpdateSchedule]]] = None) -> GroupsInProcess:
    """In-memory Downpour's exchanges for the groups of this process, one per store (each group's worker's module's
    params, in group order): the strategy's GroupExchanges around one server that runs the user's optimizer, built
    from its recipe (as Downpour's server processes build it), its values the first store's (or, resumed, the
    checkpoint's `saved` exchange tensors: the server's values, its optimizer's state and update count, each group's
    copy); each group's pushes carry its own optimizer's hyper-parameters (`optimizers`, in group order: what its
    scheduler set); `schedule`: the loop's schedule by update (run.scheduler(s, steps="update")), asked at the first
    push, which the server sets over each push's at its update count. Returns them as one exchange
    (`GroupsInProcess.exchanges`: in group order)."""
    names = stores[0].trainable_names()
    served = downpour_plan(plan, names, [tuple(stores[0].info[n].shape) for n in names], recipe)
    members = [SessionMember(store, group, start_step, metrics=metrics if group == 0 else None)
               for group, store in enumerate(stores)]
    run = SessionRun(served, 0, members)
    served.strategy.attach_exchanges(run)
    groups = GroupsInProcess([member.exchange for member in members], run)
    if saved:
        load_exchange_state(groups, saved)
    served.strategy.after_values(run, StartSpec(resume_from="checkpoint" if saved else None))
    layout = recipe_layout(recipe)
    server = members[0].exchange.server  # (every group's exchange pushes to this one)
    server.carry_hyper(PushedHyper(server.updater, layout, lambda: server.updates, schedule or (lambda: None)))
    for member, optimizer in zip(members, optimizers):  # each group's push: its own optimizer's, as its scheduler set them
        member.exchange.carry_hyper(partial(hyper_vector, optimizer, layout))
    return groups


def meeting_exchanges(plan: JobPlan, stores: list[ParamStore], start_step: int, saved: list[Optional[dict]],
                      metrics=None) -> list:
    """Local SGD / DiLoCo's groups as threads of this process: the strategy's PeriodicExchange for each group, one per
    store (each group's first worker's module's params, in group order), meeting in memory (its InMemoryMeeting and
    board, as a job file's groups of one process), each group's state restored from `saved` (its checkpoint part's
    exchange tensors, in group order; None: a fresh run) and started at `start_step`; group 0's annotates `metrics`."""
    members = [SessionMember(store, group, start_step, metrics=metrics if group == 0 else None)
               for group, store in enumerate(stores)]
    run = SessionRun(plan, 0, members)
    plan.strategy.attach_exchanges(run)
    for member, tensors in zip(members, saved):
        if tensors:
            load_exchange_state(member.exchange, tensors)
    plan.strategy.after_values(run, StartSpec(resume_from="checkpoint" if any(saved) else None))
    return [member.exchange for member in members]
