"""A torch.optim optimizer as an owner's updater (shoal.fit's `optimizer=`).

What the user gives becomes, once, in the process that calls fit (`optimizer_factory`), a factory called on the
module's trained params as (name, tensor) pairs in `named_parameters` order:
- a factory whose first parameter is named `named…` (`named_params`) is given those pairs, and may choose
  param groups by name or shape (e.g. no decay where `p.dim() < 2`, nanoGPT's rule for biases and norms);
- a factory with another first parameter (`params`; a torch.optim class itself) is given the tensors, as
  `model.parameters()` gives them (requires_grad set: nanoGPT's filter keeps them all);
- a callable taking no argument (`functools.partial(model.configure_optimizers, ...)`) is called as is;
- an optimizer over the model's own parameters (a torch.optim.Optimizer instance, or what any of the above
  returns when it reads the model itself) is rebuilt by name: its class, its defaults and each group's
  hyper-parameters over the params of the names its groups held (RebuiltOptimizer).
The factory sees whole-shaped stand-ins once, which fixes the groups; each owner of params then
runs that optimizer over the shards it owns (whole params, or flat slices of
them: ZeRO-1's shape), a shard of param `w` in the group `w` was put in; an
element-wise optimizer may also get a run of slices of one group concatenated
as one flat shard (init_run_state: one call over the run, not one per slice). Each
update hands the optimizer the summed gradient as `.grad` and calls `step()`,
so the formula, its defaults and its numerics are torch's own.

The optimizer's state of a shard is the owner's state dict of that shard (the
very dict object), pre-filled with the optimizer's state at zero (one step of the
scratch copy on zero gradients, zeroed), its element-wise slots sliced as the
shard is and its per-param slots (Adam's `step`) whole: a checkpoint saves it and
a resume copies into it, as for SINGA's updaters. Zeros equal torch's lazy first
state for Adam, AdamW, Adamax, NAdam, RAdam, RMSprop, Adagrad (initial
accumulator 0) and SGD without dampening.

Over slices only an element-wise optimizer gives one worker's result (each
element's update reads only that element's gradient and state). torch's
element-wise classes are listed in ELEMENTWISE; any other class (Adafactor,
LAMB-like per-tensor norms, a user's) is refused over slices unless it declares
`shoal_elementwise = True`.

The LR scheduler (`scheduler=`, a factory on the optimizer) is stepped once per
update applied: before the update of step s it has been stepped s times (s is
the trainer's step in synchronous layouts, the server's version in Downpour),
so its position is a pure function of the step a checkpoint holds and a resume
replays it; no scheduler object is serialised. With schedule_by_group (fit's
scheduler_steps="group") a server that several asynchronous groups update
follows each group's own step instead: the exchange hands the (group, step) of
each push, a schedule per group (its own scheduler on a stand-in optimizer)
is stepped to that step, and its hyper-parameters (lr, momentum...) are set on
the optimizer's groups before the update.
"""
from __future__ import annotations

import inspect
import threading
from typing import Any, Callable, ClassVar, Optional, Sequence

import torch

from shoal.config import job_pb2
from shoal.errors import ShoalError
from shoal.neuralnet.updaters import ParamUpdate, Updater, register_updater

OPTIMIZER_UPDATER = "shoal.fit.Optimizer"
OUTER_OPTIMIZER_UPDATER = "shoal.fit.OuterOptimizer"
OptimizerFactory = Callable[[list[tuple[str, torch.Tensor]]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]
ShardKey = tuple[str, int, int]  # (param, first flat element, end): the whole param is (name, 0, numel)

ELEMENTWISE = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "Rprop", "ASGD")
    if hasattr(torch.optim, name))


class OptimizerError(ShoalError, ValueError):
    """The optimizer factory cannot serve as this job's updater."""


def made(factory: OptimizerFactory, params: list) -> torch.optim.Optimizer:
    optimizer = factory(params)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise OptimizerError(f"shoal.fit: optimizer must be a factory returning a torch.optim.Optimizer, got {type(optimizer).__name__}")
    return optimizer


NOT_HYPER = ("params", "param_names")  # a param group's keys that are not its hyper-parameters


def stand_ins(names: Sequence[str], shapes: Sequence[tuple[int, ...]]) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs shaped as the params, requiring grad as the module's do, holding one element each
    (zero strides): what a factory is probed with and a per-group schedule's optimizer holds."""
    return [(name, torch.empty_strided(shape, (0,) * len(shape)).zero_().requires_grad_())
            for name, shape in zip(names, shapes)]


class ParamsFactory:
    """A factory written for `model.parameters()`: given the tensors of the (name, param) pairs, in order."""

    def __init__(self, factory: Callable):
        self.factory = factory

    def __call__(self, named: list[tuple[str, torch.Tensor]]) -> torch.optim.Optimizer:
        return self.factory([p for _, p in named])


class CalledAsIs:
    """A callable taking no argument (a model's configure_optimizers, bound): it reads the model itself."""

    def __init__(self, factory: Callable):
        self.factory = factory

    def __call__(self, named: list[tuple[str, torch.Tensor]]) -> torch.optim.Optimizer:
        return self.factory()


class RebuiltOptimizer:
    """An optimizer given over the model's own tensors, as a factory of the same optimizer over any (name, param)
    pairs: its class, its constructor's keyword arguments (from its defaults), and its groups as the names they
    held with their hyper-parameters. Picklable wherever the class is (nothing of the model in it)."""

    def __init__(self, cls: type, kwargs: dict[str, Any], groups: list[tuple[list[str], dict[str, Any]]]):
        self.cls, self.kwargs, self.groups = cls, kwargs, groups

    def __call__(self, named: list[tuple[str, torch.Tensor]]) -> torch.optim.Optimizer:
        by_name = dict(named)
        return self.cls([{**hyper, "params": [by_name[n] for n in names]} for names, hyper in self.groups], **self.kwargs)


def _constructor_kwargs(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The keyword arguments that rebuild `optimizer`: its defaults its constructor takes (torch's keep every one there)."""
    try:
        parameters = inspect.signature(type(optimizer)).parameters
    except (TypeError, ValueError):
        return dict(optimizer.defaults)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in parameters}


def _left_out(trained: Sequence[str], held: set[str], what: str) -> None:
    missing = [n for n in trained if n not in held]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise OptimizerError(f"shoal.fit: {what}= leaves out param {missing[0]}{more}: shoal trains every param with "
                             "requires_grad=True; set requires_grad=False on the ones to freeze")


def _rebuilt(optimizer: torch.optim.Optimizer, model_names: dict[int, str], trained: Sequence[str], what: str) -> RebuiltOptimizer:
    """An optimizer over the model's own params as a RebuiltOptimizer; frozen params it holds are left to torch's rule
    (no gradient, no update), so they are dropped."""
    kind, trained_set = type(optimizer).__name__, set(trained)
    if optimizer.state:
        raise OptimizerError(f"shoal.fit: {what}= is a {kind} that has taken steps (its state is not empty); shoal starts "
                             "its state at zero over its own params: give a fresh one, or a factory")
    groups, held = [], set()
    for group in optimizer.param_groups:
        names = []
        for p in group["params"]:
            if id(p) not in model_names:
                raise OptimizerError(f"shoal.fit: {what}= is a {kind} over a tensor of shape {tuple(p.shape)} that is not "
                                     "a parameter of the model: build it over model.parameters() (or named_parameters())")
            names.append(model_names[id(p)])
        held.update(names)
        names = [n for n in names if n in trained_set]
        if names:
            groups.append((names, {k: v for k, v in group.items() if k not in NOT_HYPER}))
    _left_out(trained, held, what)
    return RebuiltOptimizer(type(optimizer), _constructor_kwargs(optimizer), groups)


def factory_takes(factory: Callable, what: str) -> str:
    """What a factory is given, by its first positional parameter: "named" ((name, param) pairs) for a name starting
    with `named`, "tensors" for any other name, "nothing" when it takes none (every argument bound); a factory whose
    first positional parameter is *args is ambiguous, refused in one line."""
    try:
        parameters = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature
        return "tensors"
    positional = [p for p in parameters if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                       inspect.Parameter.VAR_POSITIONAL)]
    if not positional:
        return "nothing"
    if positional[0].kind is inspect.Parameter.VAR_POSITIONAL:
        raise OptimizerError(f"shoal.fit: {what}= takes *{positional[0].name}, so shoal cannot tell how to give it the "
                             "params: name its first parameter `params` (tensors, as model.parameters() gives them) or "
                             "`named_params` ((name, param) pairs, as model.named_parameters() gives them)")
    return "named" if positional[0].name.startswith("named") else "tensors"


GIVEN = {"named": "the model's (name, param) pairs", "tensors": "the model's params as tensors", "nothing": "no argument"}


def optimizer_factory(given: Any, model: torch.nn.Module, trained: Sequence[str], what: str = "optimizer") -> OptimizerFactory:
    """What fit's `optimizer=` (or `outer_optimizer=`) is, as a factory on (name, param) pairs of the `trained` params
    (see the module docstring for the forms); probed once here on stand-ins, so a form shoal cannot serve is refused in
    one line before anything starts."""
    model_names: dict[int, str] = {}
    for name, p in model.named_parameters():
        model_names.setdefault(id(p), name)
    shapes = dict(model.named_parameters())
    shapes = [tuple(shapes[n].shape) for n in trained]
    if isinstance(given, torch.optim.Optimizer):
        factory: OptimizerFactory = _rebuilt(given, model_names, trained, what)
    elif not callable(given):
        raise OptimizerError(f"shoal.fit: {what}= must be a torch.optim.Optimizer over the model's params or a factory "
                             f"returning one, got {type(given).__name__}")
    else:
        takes = factory_takes(given, what)
        factory = {"named": given, "tensors": ParamsFactory(given), "nothing": CalledAsIs(given)}[takes]
        probe = stand_ins(trained, shapes)
        try:
            optimizer = factory(probe)
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as err:
            raise OptimizerError(f"shoal.fit: {what}= failed when given {GIVEN[takes]} ({type(err).__name__}: {err}); a "
                                 "factory whose first parameter's name starts with `named` gets (name, param) pairs, any "
                                 "other name the tensors, and one taking no argument is called as is") from None
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise OptimizerError(f"shoal.fit: {what} must be a factory returning a torch.optim.Optimizer, got {type(optimizer).__name__}")
        probe_names = {id(t): n for n, t in probe}
        held = [p for group in optimizer.param_groups for p in group["params"]]
        if all(id(p) in probe_names for p in held):
            _left_out(trained, {probe_names[id(p)] for p in held}, what)
        elif all(id(p) not in probe_names for p in held):  # it read the model itself
            factory = _rebuilt(optimizer, model_names, trained, what)
        else:
            raise OptimizerError(f"shoal.fit: {what}= returned a {type(optimizer).__name__} over some of the params it was "
                                 "given and some of the model's own: build it over one or the other")
    if isinstance(factory, RebuiltOptimizer):
        try:
            made(factory, stand_ins(trained, shapes))
        except (TypeError, ValueError) as err:  # a class whose constructor takes more than its defaults
            kind = factory.cls.__name__
            raise OptimizerError(f"shoal.fit: {what}=: a {kind} cannot be rebuilt over shoal's params ({type(err).__name__}: "
                                 f"{err}); give a factory instead, `lambda params: {kind}(params, ...)`") from None
    return factory


def is_elementwise(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a slice of each param may be updated alone (exact classes only: a subclass may add norms)."""
    return type(optimizer) in ELEMENTWISE or getattr(type(optimizer), "shoal_elementwise", False) is True


def check_slices_allowed(optimizer: torch.optim.Optimizer) -> None:
    if not is_elementwise(optimizer):
        raise OptimizerError(f"shoal.fit: {type(optimizer).__name__} is not known to be element-wise, so it cannot update "
                             "slices of params (this layout slices them over owners); use one of "
                             f"{', '.join(c.__name__ for c in ELEMENTWISE)}, set `shoal_elementwise = True` on the class if "
                             "each element's update reads only that element, or train with one process")


def made_scheduler(factory: SchedulerFactory, optimizer: torch.optim.Optimizer):
    scheduler = factory(optimizer)
    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler) or isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise OptimizerError("shoal.fit: scheduler must be a factory returning a torch LR scheduler stepped without a "
                             f"metric (LambdaLR, SequentialLR, CosineAnnealingLR...), got {type(scheduler).__name__}")
    return scheduler


class GroupSchedule:
    """One asynchronous group's schedule (schedule_by_group): the scheduler on an optimizer of stand-ins, stepped to
    the group's own step; the updates read its groups' hyper-parameters."""

    def __init__(self, factory: OptimizerFactory, scheduler: SchedulerFactory, names: Sequence[str], shapes: Sequence[tuple[int, ...]]):
        self.optimizer = made(factory, stand_ins(names, shapes))
        self.optimizer._opt_called = True  # never stepped by design (the owner's optimizer is): torch would warn it was not
        self.scheduler = made_scheduler(scheduler, self.optimizer)
        self.stepped = 0

    def to(self, step: int) -> None:
        while self.stepped < step:
            self.scheduler.step()
            self.stepped += 1


class TorchOptimizer(Updater):
    factory: ClassVar[Optional[OptimizerFactory]] = None  # bound by register_torch_optimizer
    scheduler_factory: ClassVar[Optional[SchedulerFactory]] = None
    clip_grad_norm: ClassVar[Optional[float]] = None  # the exchange clips the whole gradient to it (runtime/exchanges/clipping.py)
    names: ClassVar[list[str]] = []  # the module's trained params, in named_parameters order
    shapes: ClassVar[list[tuple[int, ...]]] = []
    schedule_by_group: ClassVar[bool] = False  # fit's scheduler_steps="group": each pushing group's own step (see above)

    def __init__(self, conf: job_pb2.UpdaterProto):
        super().__init__(conf)
        self.optimizer: Optional[torch.optim.Optimizer] = None  # over this owner's shards, built with the first one
        self.scheduler = None
        self._stepped = 0  # scheduler steps taken
        self._group_schedules: dict[int, GroupSchedule] = {}  # schedule_by_group: per asynchronous group
        self._zeros: dict[str, dict[str, torch.Tensor]] = {}  # per param: its state at zero, whole
        self._scalar_slots: dict[str, set[str]] = {}  # per param: its per-param slots (0-d in torch: Adam's step)
        self._group_of: dict[str, int] = {}
        self._shard_of: dict[tuple[int, int], torch.Tensor] = {}  # (data_ptr, numel) of a shard's memory -> shard
        self._registered: dict[int, torch.Tensor] = {}  # id -> shard: an owner handing the very tensors it registered
        # one update at a time: the optimizer reads the grads it is handed as attributes of the shards (in-memory
        # Hogwild's groups update one server from several threads: with a torch optimizer they take turns)
        self._lock = threading.Lock()

    def _prepare(self) -> None:
        """The factory on a whole-shaped scratch copy: the groups by name, and every slot at zero."""
        # requiring grad as the module's params do (a factory may keep only those, as nanoGPT's does)
        scratch = [(name, torch.zeros(shape, requires_grad=True)) for name, shape in zip(self.names, self.shapes)]
        name_of = {id(t): name for name, t in scratch}
        for _, tensor in scratch:
            tensor.grad = torch.zeros_like(tensor)
        optimizer = made(type(self).factory, scratch)
        with torch.no_grad():
            optimizer.step()
        for name, tensor in scratch:  # a scalar (Adam's step) as one element: checkpoints hold tensors of at least one dimension
            self._zeros[name] = {k: torch.zeros_like(v).reshape(-1) if v.dim() == 0 else torch.zeros_like(v)
                                 for k, v in optimizer.state[tensor].items() if isinstance(v, torch.Tensor)}
            self._scalar_slots[name] = {k for k, v in optimizer.state[tensor].items() if isinstance(v, torch.Tensor) and v.dim() == 0}
        for i, group in enumerate(optimizer.param_groups):
            for tensor in group["params"]:
                self._group_of[name_of[id(tensor)]] = i
            group["params"] = []  # filled with this owner's shards
            if "param_names" in group:
                group["param_names"] = []
        optimizer.state.clear()
        self.optimizer = optimizer
        if type(self).scheduler_factory is not None and not type(self).schedule_by_group:
            self.scheduler = made_scheduler(type(self).scheduler_factory, optimizer)

    def made_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer the factory makes (`shoal plan` names it by its class)."""
        if self.optimizer is None:
            self._prepare()
        return self.optimizer

    def state_shapes(self, name: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        if self.optimizer is None:
            self._prepare()
        return {slot: tuple(v.shape) for slot, v in self._zeros.get(name, {}).items()}

    def init_state(self, value: torch.Tensor) -> dict[str, torch.Tensor]:
        raise OptimizerError("shoal.fit: a torch optimizer runs where params are owned by name (this layout updates "
                             "views it cannot name); give a SINGA updater= for it")

    def init_shard_state(self, value: torch.Tensor, key: ShardKey) -> dict[str, torch.Tensor]:
        """Called by an owner once per shard it owns: the optimizer's state of it, at zero."""
        if self.optimizer is None:
            self._prepare()
        name, start, stop = key
        if name not in self._group_of:
            raise OptimizerError(f"shoal.fit: param {name} is not one the optimizer factory was given")
        whole = self._zeros[name]
        numel = torch.Size(self.shapes[self.names.index(name)]).numel()
        if stop - start != numel:
            check_slices_allowed(self.optimizer)
        # element-wise slots shaped as the shard (a flat slice, or the whole param), per-param slots whole
        state = {slot: (z.reshape(-1)[start:stop].reshape(value.shape) if z.numel() == numel else z).clone().to(value.device)
                 for slot, z in whole.items()}
        self._register(value, state, self._group_of[name], name if stop - start == numel else f"{name}[{start}:{stop}]")
        return state

    def run_class(self, name: str) -> Optional[int]:
        """Params of one class may be updated as one flat shard, their slices concatenated (one optimizer call over
        a bucket's run instead of one per slice): the index of `name`'s param group where the optimizer is one of
        torch's element-wise classes (each element's update reads only that element, and its per-param slots are
        counters every param of a group advances alike), else None (a class declaring `shoal_elementwise` may keep
        per-param statistics of its own: its slices stay one shard each)."""
        if self.optimizer is None:
            self._prepare()
        if name not in self._group_of:
            raise OptimizerError(f"shoal.fit: param {name} is not one the optimizer factory was given")
        return self._group_of[name] if type(self.optimizer) in ELEMENTWISE else None

    def init_run_state(self, value: torch.Tensor, keys: Sequence[ShardKey]) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
        """Called by an owner once per run: a flat shard `value` holding the slices `keys` one after another, all of
        one run_class. Returns the run's state (at zero) and each slice's view of it, shaped as init_shard_state's
        (element-wise slots a flat slice, per-param slots the run's one tensor: every param of a run is updated
        together, so their per-param slots, Adam's step, stay equal)."""
        if self.optimizer is None:
            self._prepare()
        name = keys[0][0]
        scalars = {slot for slot, z in self._zeros[name].items() if slot in self._scalar_slots[name]}
        state = {slot: (z.clone() if slot in scalars else
                        torch.cat([self._zeros[n][slot].reshape(-1)[start:stop] for n, start, stop in keys])).to(value.device)
                 for slot, z in self._zeros[name].items()}
        views, at = [], 0
        for _, start, stop in keys:
            views.append({slot: t if slot in scalars else t[at : at + stop - start] for slot, t in state.items()})
            at += stop - start
        self._register(value, state, self._group_of[name], "+".join(f"{n}[{start}:{stop}]" for n, start, stop in keys))
        return state, views

    def split_run(self, value: torch.Tensor, parts: Sequence[tuple[torch.Tensor, dict[str, torch.Tensor], ShardKey]]) -> list[dict[str, torch.Tensor]]:
        """Replace the run shard `value` by one shard per slice (`parts`: its view of the run, its state views, its
        key), each with a copy of its state: from now on each slice is updated only when its param has a gradient."""
        for group in self.optimizer.param_groups:
            for i, p in enumerate(group["params"]):
                if p is value:
                    del group["params"][i]
                    if "param_names" in group:
                        del group["param_names"][i]
                    break
        del self.optimizer.state[value]
        self._registered.pop(id(value), None)
        self._shard_of.pop((value.data_ptr(), value.numel()), None)
        out = []
        for piece, views, (name, start, stop) in parts:
            state = {slot: t.clone() for slot, t in views.items()}
            self._register(piece, state, self._group_of[name], f"{name}[{start}:{stop}]")
            out.append(state)
        return out

    def _register(self, value: torch.Tensor, state: dict[str, torch.Tensor], group_index: int, label: str) -> None:
        group = self.optimizer.param_groups[group_index]
        group["params"].append(value)
        if "param_names" in group:
            group["param_names"].append(label)
        self.optimizer.state[value] = state  # the owner's dict: checkpoints and resumes see it
        self._shard_of[(value.data_ptr(), value.numel())] = value
        self._registered[id(value)] = value

    def _schedule_to(self, step: int, group_step: Optional[tuple[int, int]]) -> None:
        if type(self).scheduler_factory is None:
            return
        if type(self).schedule_by_group:  # the pushing group's schedule at its own step (its step s: stepped s times)
            group, step = group_step if group_step is not None else (-1, step)
            schedule = self._group_schedules.get(group)
            if schedule is None or schedule.stepped > step:  # a group that went back (restarted) replays from 0
                schedule = self._group_schedules[group] = GroupSchedule(type(self).factory, type(self).scheduler_factory,
                                                                        self.names, self.shapes)
            schedule.to(step)
            for mine, its in zip(self.optimizer.param_groups, schedule.optimizer.param_groups):
                mine.update({k: v for k, v in its.items() if k not in NOT_HYPER})
            return
        while self._stepped < step:
            self.scheduler.step()
            self._stepped += 1

    @torch.no_grad()
    def update_many(self, step: int, params: Sequence[ParamUpdate], grad_scale: float = 1.0,
                    group_step: Optional[tuple[int, int]] = None) -> None:
        with self._lock:
            self._update(step, params, grad_scale, group_step)

    def _update(self, step: int, params: Sequence[ParamUpdate], grad_scale: float, group_step: Optional[tuple[int, int]]) -> None:
        if self.optimizer is None:
            self._prepare()
        shards = []
        for p in params:
            if p.grad is None:
                continue
            shard = self._registered.get(id(p.value))
            if shard is not p.value:  # another view of a registered shard's memory (a slice owner's own view)
                shard = self._shard_of.get((p.value.data_ptr(), p.value.numel()))
            if shard is None or shard.shape != p.value.shape:
                raise OptimizerError("shoal.fit: a torch optimizer updates only the shards its owner registered "
                                     "(this layout updates other views); give a SINGA updater= for it")
            shard.grad = p.grad if grad_scale == 1 else p.grad * grad_scale
            shards.append(shard)
        if not shards:
            return
        self._schedule_to(step, group_step)
        self.optimizer.step()
        for shard in shards:
            shard.grad = None


def register_torch_optimizer(factory: OptimizerFactory, params: list[tuple[str, torch.Tensor]],
                             scheduler: Optional[SchedulerFactory] = None, user_type: str = OPTIMIZER_UPDATER,
                             clip_grad_norm: Optional[float] = None, schedule_by_group: bool = False) -> None:
    """Bind `factory` (a factory on (name, param) pairs: optimizer_factory's), its scheduler (by update, or with
    `schedule_by_group` by each pushing group's own step), the global norm its gradients are clipped to and the module's
    trained (name, param) pairs to the user updater type `user_type`."""

    @register_updater(user_type)
    class BoundTorchOptimizer(TorchOptimizer):
        pass

    BoundTorchOptimizer.factory = staticmethod(factory)
    BoundTorchOptimizer.scheduler_factory = None if scheduler is None else staticmethod(scheduler)
    BoundTorchOptimizer.clip_grad_norm = clip_grad_norm
    BoundTorchOptimizer.schedule_by_group = schedule_by_group
    BoundTorchOptimizer.names = [name for name, _ in params]
    BoundTorchOptimizer.shapes = [tuple(p.shape) for _, p in params]
