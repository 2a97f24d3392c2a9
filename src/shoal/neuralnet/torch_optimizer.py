"""A torch.optim optimizer as an owner's updater (shoal.fit's `optimizer=` factory).

The factory is called on the module's params as (name, tensor) pairs in
`named_parameters` order: `lambda params: torch.optim.AdamW(params, lr=3e-3,
weight_decay=0.1)`, or param groups chosen by name or shape (e.g. no decay where
`p.dim() < 2`, nanoGPT's rule for biases and norms). It sees whole-shaped
tensors once (a scratch copy), which fixes the groups; each owner of params then
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
replays it; no scheduler object is serialised.
"""
from __future__ import annotations

import threading
from typing import Callable, ClassVar, Optional, Sequence

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


class TorchOptimizer(Updater):
    factory: ClassVar[Optional[OptimizerFactory]] = None  # bound by register_torch_optimizer
    scheduler_factory: ClassVar[Optional[SchedulerFactory]] = None
    clip_grad_norm: ClassVar[Optional[float]] = None  # the exchange clips the whole gradient to it (runtime/exchanges/clipping.py)
    names: ClassVar[list[str]] = []  # the module's trained params, in named_parameters order
    shapes: ClassVar[list[tuple[int, ...]]] = []

    def __init__(self, conf: job_pb2.UpdaterProto):
        super().__init__(conf)
        self.optimizer: Optional[torch.optim.Optimizer] = None  # over this owner's shards, built with the first one
        self.scheduler = None
        self._stepped = 0  # scheduler steps taken
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
        scratch = [(name, torch.zeros(shape)) for name, shape in zip(self.names, self.shapes)]
        name_of = {id(t): name for name, t in scratch}
        for _, tensor in scratch:
            tensor.grad = torch.zeros_like(tensor)
        optimizer = made(type(self).factory, scratch)
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
        if type(self).scheduler_factory is not None:
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

    def _schedule_to(self, step: int) -> None:
        if self.scheduler is None:
            return
        while self._stepped < step:
            self.scheduler.step()
            self._stepped += 1

    @torch.no_grad()
    def update_many(self, step: int, params: Sequence[ParamUpdate], grad_scale: float = 1.0) -> None:
        with self._lock:
            self._update(step, params, grad_scale)

    def _update(self, step: int, params: Sequence[ParamUpdate], grad_scale: float) -> None:
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
        self._schedule_to(step)
        self.optimizer.step()
        for shard in shards:
            shard.grad = None


def register_torch_optimizer(factory: OptimizerFactory, params: list[tuple[str, torch.Tensor]],
                             scheduler: Optional[SchedulerFactory] = None, user_type: str = OPTIMIZER_UPDATER,
                             clip_grad_norm: Optional[float] = None) -> None:
    """Bind `factory` (its scheduler, the global norm its gradients are clipped to) and the module's trained (name, param) pairs to the user updater type `user_type`."""

    @register_updater(user_type)
    class BoundTorchOptimizer(TorchOptimizer):
        pass

    BoundTorchOptimizer.factory = staticmethod(factory)
    BoundTorchOptimizer.scheduler_factory = None if scheduler is None else staticmethod(scheduler)
    BoundTorchOptimizer.clip_grad_norm = clip_grad_norm
    BoundTorchOptimizer.names = [name for name, _ in params]
    BoundTorchOptimizer.shapes = [tuple(p.shape) for _, p in params]
