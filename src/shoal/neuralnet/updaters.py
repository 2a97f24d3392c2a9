"""SINGA 0.3's updaters and learning-rate schedules (`src/utils/updater.cc`).

Every updater prepares the gradient the same way, in SINGA's order:

    if clip_high > clip_low (SGD, Nesterov, AdaGrad, RMSProp only):
        g = clip(grad, clip_low, clip_high)     # on the raw gradient, first
    g = g · grad_scale
    if wd > 0: g += wd · w                      # wd = weight_decay · wd_scale
    lr = schedule(step) · lr_scale

and then applies its own formula to g. `delta` is added inside square roots.

State is a plain dict of tensors per param (or per slice of a param): a server
can own any slice of a param together with the same slice of its slots, and a
checkpoint is just those tensors. Updates happen in place, so `value` and the
slots may be views into larger tensors.

Each formula is written once, on lists of tensors with torch's multi-tensor
(`torch._foreach_*`) ops, as torch.optim's foreach optimizers are: a server
updates all its params in one `update_many`, a few ops per step instead of a
few per param, and `update` is the same formula on a list of one.

Configuration errors raise ValueError("<field path>: <requirement>").
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple, Optional

import torch

from shoal.config import job_pb2

LRSchedule = Callable[[job_pb2.LRGenProto, int], float]

_USER_SCHEDULES: dict[str, LRSchedule] = {}
_USER_UPDATERS: dict[str, type[Updater]] = {}

_LR = "updater.learning_rate"  # the only place an LRGenProto lives in a job


def _require(ok: bool, field: str, requirement: str) -> None:
    if not ok:
        raise ValueError(f"{field}: {requirement}")


# -- learning-rate schedules ------------------------------------------------------
def register_lr_schedule(user_type: str) -> Callable[[LRSchedule], LRSchedule]:
    """Register `fn(conf: LRGenProto, step) -> lr` as the schedule named by learning_rate.user_type."""

    def register(fn: LRSchedule) -> LRSchedule:
        _USER_SCHEDULES[user_type] = fn
        return fn

    return register


def _user_schedule(conf: job_pb2.LRGenProto) -> LRSchedule:
    # SINGA's LRGenerator::Create picks the user class whenever user_type is set, whatever `type` says.
    if not conf.HasField("user_type"):
        raise ValueError(f"{_LR}.type: kUserChange (the default) needs {_LR}.user_type naming a registered schedule")
    if conf.user_type not in _USER_SCHEDULES:
        known = ", ".join(sorted(_USER_SCHEDULES)) or "none"
        raise ValueError(f"{_LR}.user_type: no schedule registered as {conf.user_type!r} (registered: {known})")
    return _USER_SCHEDULES[conf.user_type]


def learning_rate(conf: job_pb2.LRGenProto, step: int) -> float:
    """The learning rate at `step` (SINGA's LRGenerator::Get); `conf` should pass check_schedule.

    kFixed        base_lr
    kInverseT     base_lr / (1 + step / final_lr)
    kInverse      base_lr · (1 + gamma·step)^(−pow)
    kExponential  base_lr / 2^(step / change_freq)            float division
    kLinear       (1 − r)·base_lr + r·final_lr, r = step / change_freq, not clamped for r > 1
    kStep         base_lr · gamma^(step // change_freq)        integer division: stairs
    kFixedStep    step_lr[i] for the last i with step >= step[i], or step_lr[0] before step[0]
    user_type     the registered schedule (kUserChange)
    """
    if conf.HasField("user_type") or conf.type == job_pb2.kUserChange:
        return _user_schedule(conf)(conf, step)
    base, kind = conf.base_lr, conf.type
    if kind == job_pb2.kFixed:
        return base
    if kind == job_pb2.kInverseT:
        return base / (1 + step / conf.inverset_conf.final_lr)
    if kind == job_pb2.kInverse:
        return base * math.pow(1 + conf.inverse_conf.gamma * step, -conf.inverse_conf.pow)
    if kind == job_pb2.kExponential:
        return base / math.pow(2, step / conf.exponential_conf.change_freq)
    if kind == job_pb2.kLinear:
        r = step / conf.linear_conf.change_freq
        return (1 - r) * base + r * conf.linear_conf.final_lr
    if kind == job_pb2.kStep:
        return base * math.pow(conf.step_conf.gamma, step // conf.step_conf.change_freq)
    if kind == job_pb2.kFixedStep:
        # SINGA's FixedStepLRGen starts at index 0 (so step_lr[0] also holds before step[0]) and
        # moves forward as steps pass each boundary; for consecutive steps that is this lookup.
        boundaries = conf.fixedstep_conf.step
        return conf.fixedstep_conf.step_lr[max(bisect.bisect_right(boundaries, step) - 1, 0)]
    raise ValueError(f"{_LR}.type: unknown change method {kind}")


def check_schedule(conf: job_pb2.LRGenProto) -> None:
    """Raise ValueError naming the field when the schedule would fail or divide by zero."""
    if conf.HasField("user_type") or conf.type == job_pb2.kUserChange:
        _user_schedule(conf)
        return
    kind = conf.type
    freq_conf = {job_pb2.kStep: "step_conf", job_pb2.kExponential: "exponential_conf", job_pb2.kLinear: "linear_conf"}
    if kind in freq_conf:
        sub = freq_conf[kind]
        _require(getattr(conf, sub).change_freq > 0, f"{_LR}.{sub}.change_freq", "must be > 0")
    if kind == job_pb2.kLinear:
        _require(conf.linear_conf.HasField("final_lr"), f"{_LR}.linear_conf.final_lr", "required for kLinear")
    if kind == job_pb2.kInverseT:
        # Negative final_lr would make the denominator cross zero at step = −final_lr.
        _require(conf.inverset_conf.final_lr > 0, f"{_LR}.inverset_conf.final_lr", "must be > 0")
    if kind == job_pb2.kFixedStep:
        steps, rates = list(conf.fixedstep_conf.step), list(conf.fixedstep_conf.step_lr)
        _require(
            bool(steps) and len(steps) == len(rates),
            f"{_LR}.fixedstep_conf",
            f"needs as many step_lr as step values, at least one (got {len(steps)} step, {len(rates)} step_lr)",
        )
        # SINGA's generator only moves forward, so boundaries out of order would never be reached.
        _require(steps == sorted(steps), f"{_LR}.fixedstep_conf.step", f"must not decrease (got {steps})")


# -- updaters ---------------------------------------------------------------------
def register_updater(user_type: str) -> Callable[[type[Updater]], type[Updater]]:
    """Register an Updater subclass as the updater named by updater.user_type (kUserUpdater)."""

    def register(cls: type[Updater]) -> type[Updater]:
        _USER_UPDATERS[user_type] = cls
        return cls

    return register


class ParamUpdate(NamedTuple):
    """One param (or slice of one) for `Updater.update_many`; a None `grad` leaves it and its state as they are."""

    value: torch.Tensor
    grad: Optional[torch.Tensor]
    state: dict[str, torch.Tensor]
    lr_scale: float = 1.0
    wd_scale: float = 1.0


Tensors = list[torch.Tensor]
States = list[dict[str, torch.Tensor]]


def _slot(states: States, name: str) -> Tensors:
    return [state[name] for state in states]


class Updater:
    """SINGA's shared gradient preparation; each subclass's `apply_many` is one update formula.

    Subclasses name their state tensors in `slots` and set `clips` when SINGA clips
    for them. A user updater (register_updater) usually only overrides `apply`, the
    formula for one param; the built-in ones override `apply_many`, the same formula
    on lists of params with multi-tensor ops.
    """

    slots: tuple[str, ...] = ()
    clips = False
    clip_grad_norm: Optional[float] = None  # a bound on the whole gradient's norm, applied by the exchange (torch optimizers')

    def __init__(self, conf: job_pb2.UpdaterProto):
        check_schedule(conf.learning_rate)
        self.conf = conf
        self.weight_decay = conf.weight_decay
        clip_enabled = self.clips and conf.clip_high > conf.clip_low
        self.clip_range = (conf.clip_low, conf.clip_high) if clip_enabled else None

    def made_optimizer(self) -> Optional[torch.optim.Optimizer]:
        """The torch optimizer doing the updates, if one does (`shoal plan` names it by its class)."""
        return None

    def learning_rate(self, step: int) -> float:
        """The schedule's rate at `step`, before the param's lr_scale."""
        return learning_rate(self.conf.learning_rate, step)

    def init_state(self, value: torch.Tensor) -> dict[str, torch.Tensor]:
        """Zeroed slots shaped like `value` (SINGA zero-initialises history and update)."""
        return {slot: torch.zeros_like(value) for slot in self.slots}

    def init_shard_state(self, value: torch.Tensor, key: tuple[str, int, int]) -> dict[str, torch.Tensor]:
        """The state of a shard `key` = (param, first flat element, end) an owner holds; SINGA's ignore the key."""
        return self.init_state(value)

    def run_class(self, name: str) -> Optional[int]:
        """Which params an owner may update together as one flat shard of their slices (init_run_state, split_run):
        None, each slice its own update, for SINGA's updaters (shoal.neuralnet.torch_optimizer's element-wise ones
        answer their param group)."""
        return None

    def state_shapes(self, name: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """Each state slot's shape for a whole param `name` of `shape` (a slot not shaped so is per param, whole)."""
        return {slot: tuple(shape) for slot in self.init_state(torch.zeros(1))}

    def prepare_gradients(self, values: Tensors, grads: Tensors, wd_scale: float, grad_scale: float) -> Tensors:
        """g = clip(grad)·grad_scale + wd·w for each param, in SINGA's order (see the module docstring).

        SINGA clips `param->grad` in place before anything else, so clipping bounds the raw
        gradient, not the scaled or decayed one. Returns `grads` themselves when nothing changes
        them (apply only reads g, so the common case copies nothing); otherwise new tensors.
        """
        wd = self.weight_decay * wd_scale
        if self.clip_range is None and grad_scale == 1 and not wd > 0:
            return grads
        if self.clip_range is not None:
            low, high = self.clip_range
            gs = torch._foreach_clamp_min(grads, low)
            torch._foreach_clamp_max_(gs, high)
            if grad_scale != 1:
                torch._foreach_mul_(gs, grad_scale)
        else:
            gs = torch._foreach_mul(grads, grad_scale)
        if wd > 0:  # SINGA ignores weight_decay <= 0 rather than rejecting it
            torch._foreach_add_(gs, values, alpha=wd)
        return gs

    @torch.no_grad()
    def update(
        self,
        step: int,
        value: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, torch.Tensor],
        lr_scale: float = 1.0,
        wd_scale: float = 1.0,
        grad_scale: float = 1.0,
    ) -> None:
        """One update of `value` and `state` in place (either may be a view); `grad` is only read."""
        self.update_many(step, [ParamUpdate(value, grad, state, lr_scale, wd_scale)], grad_scale)

    @torch.no_grad()
    def update_many(self, step: int, params: Sequence[ParamUpdate], grad_scale: float = 1.0,
                    group_step: Optional[tuple[int, int]] = None) -> None:
        """`update` on every param with a gradient, as multi-tensor ops over the params that share
        lr_scale, wd_scale, device and dtype (usually one or two groups). `group_step`: the (worker group, its own
        step) whose push this update applies, where a server serves several asynchronous groups; SINGA's schedules
        follow `step` (a torch scheduler may follow the group's: shoal.neuralnet.torch_optimizer)."""
        groups: dict[tuple, list[ParamUpdate]] = {}
        for p in params:
            if p.grad is None:
                continue
            if p.grad.shape != p.value.shape:  # in-place ops would broadcast a mismatch silently
                raise ValueError(f"gradient shape {tuple(p.grad.shape)} does not match value shape {tuple(p.value.shape)}")
            groups.setdefault((p.lr_scale, p.wd_scale, p.value.device, p.value.dtype), []).append(p)
        if not groups:
            return
        base_lr = self.learning_rate(step)
        for (lr_scale, wd_scale, _, _), group in groups.items():
            values = [p.value for p in group]
            gs = self.prepare_gradients(values, [p.grad for p in group], wd_scale, grad_scale)
            self.apply_many(values, gs, [p.state for p in group], base_lr * lr_scale)

    def apply(self, value: torch.Tensor, g: torch.Tensor, state: dict[str, torch.Tensor], lr: float) -> None:
        """The update formula on one param's prepared gradient `g`, which must not be written (it may be the caller's)."""
        if type(self).apply_many is Updater.apply_many:  # neither formula overridden: they would call each other
            raise NotImplementedError(f"{type(self).__name__} must implement apply()")
        self.apply_many([value], [g], [state], lr)

    def apply_many(self, values: Tensors, gs: Tensors, states: States, lr: float) -> None:
        """The update formula on several params at once (the same lr); by default `apply` on each."""
        for value, g, state in zip(values, gs, states):
            self.apply(value, g, state, lr)


class SGD(Updater):
    """With momentum m > 0: h = m·h − lr·g; w += h.  Otherwise: w −= lr·g."""

    clips = True

    def __init__(self, conf: job_pb2.UpdaterProto):
        super().__init__(conf)
        self.momentum = conf.momentum
        self.slots = ("history",) if self.momentum > 0 else ()

    def apply_many(self, values, gs, states, lr):
        if self.momentum > 0:
            history = _slot(states, "history")
            torch._foreach_mul_(history, self.momentum)
            torch._foreach_add_(history, gs, alpha=-lr)
            torch._foreach_add_(values, history)
        else:
            torch._foreach_add_(values, gs, alpha=-lr)


class Nesterov(Updater):
    """h' = m·h + lr·g; w −= (1 + m)·h' − m·h; h = h'."""

    clips = True
    slots = ("history",)

    def __init__(self, conf: job_pb2.UpdaterProto):
        super().__init__(conf)
        self.momentum = conf.momentum

    def apply_many(self, values, gs, states, lr):
        m, history = self.momentum, _slot(states, "history")
        torch._foreach_add_(values, history, alpha=m)  # the + m·h term, taken before h changes: no copy of h needed
        torch._foreach_mul_(history, m)
        torch._foreach_add_(history, gs, alpha=lr)
        torch._foreach_add_(values, history, alpha=-(1 + m))


def _check_delta(conf: job_pb2.UpdaterProto) -> None:
    # With delta = 0, any element whose gradient has always been 0 computes 0/0 = NaN.
    _require(conf.delta > 0, "updater.delta", f"must be > 0 for {job_pb2.UpdaterType.Name(conf.type)}")


def _check_open_unit(value: float, field: str) -> None:
    _require(0 < value < 1, field, f"must be in (0, 1), got {value:g}")


def _check_beta(value: float, field: str) -> None:
    _require(0 <= value < 1, field, f"must be in [0, 1), got {value:g}")


def _sqrt_plus(tensors: Tensors, delta: float) -> Tensors:
    """√(t + δ) of each tensor, as new tensors."""
    roots = torch._foreach_add(tensors, delta)
    torch._foreach_sqrt_(roots)
    return roots


class AdaGrad(Updater):
    """h += g²; w −= lr·g / √(h + δ).  (`momentum` is not used.)"""

    clips = True
    slots = ("history",)

    def __init__(self, conf: job_pb2.UpdaterProto):
        super().__init__(conf)
        _check_delta(conf)
        self.delta = conf.delta

    def apply_many(self, values, gs, states, lr):
        history = _slot(states, "history")
        torch._foreach_addcmul_(history, gs, gs)
        torch._foreach_addcdiv_(values, gs, _sqrt_plus(history, self.delta), value=-lr)


class RMSProp(Updater):
    """h = ρ·h + (1 − ρ)·g²; w −= lr·g / √(h + δ)   (ρ = rmsprop_conf.rho)."""

    clips = True
    slots = ("history",)

    def __init__(self, conf: job_pb2.UpdaterProto):
        super().__init__(conf)
        _check_delta(conf)
        _check_open_unit(conf.rmsprop_conf.rho, "updater.rmsprop_conf.rho")
        self.rho, self.delta = conf.rmsprop_conf.rho, conf.delta

    def apply_many(self, values, gs, states, lr):
        history = _slot(states, "history")
        torch._foreach_mul_(history, self.rho)
        torch._foreach_addcmul_(history, gs, gs, value=1 - self.rho)
        torch._foreach_addcdiv_(values, gs, _sqrt_plus(history, self.delta), value=-lr)


class AdaDelta(Updater):
    """h = ρh + (1−ρ)g²; t = g·√(u + δ)/√(h + δ); u = ρu + (1−ρ)t²; w −= lr·t   (never clips)."""

    slots = ("history", "update")

    def __init__(self, conf: job_pb2.UpdaterProto):
        super().__init__(conf)
        _check_delta(conf)  # also: with u = 0 at the start, √δ is the whole first step size
        _check_open_unit(conf.adadelta_conf.rho, "updater.adadelta_conf.rho")
        self.rho, self.delta = conf.adadelta_conf.rho, conf.delta

    def apply_many(self, values, gs, states, lr):
        rho, delta = self.rho, self.delta
        history, update = _slot(states, "history"), _slot(states, "update")
        torch._foreach_mul_(history, rho)
        torch._foreach_addcmul_(history, gs, gs, value=1 - rho)
        change = _sqrt_plus(update, delta)  # t
        torch._foreach_mul_(change, gs)
        torch._foreach_div_(change, _sqrt_plus(history, delta))
        torch._foreach_mul_(update, rho)
        torch._foreach_addcmul_(update, change, change, value=1 - rho)
        torch._foreach_add_(values, change, alpha=-lr)


class Adam(Updater):
    """m = β1·m + (1−β1)·g; v = β2·v + (1−β2)·g²; w −= lr·m / √(v + δ)   (no bias correction; never clips)."""

    slots = ("mean", "variance")

    def __init__(self, conf: job_pb2.UpdaterProto):
        super().__init__(conf)
        _check_delta(conf)
        _check_beta(conf.adam_conf.beta1, "updater.adam_conf.beta1")
        _check_beta(conf.adam_conf.beta2, "updater.adam_conf.beta2")
        self.beta1, self.beta2, self.delta = conf.adam_conf.beta1, conf.adam_conf.beta2, conf.delta

    def apply_many(self, values, gs, states, lr):
        mean, variance = _slot(states, "mean"), _slot(states, "variance")
        torch._foreach_lerp_(mean, gs, 1 - self.beta1)  # β1·m + (1−β1)·g in one pass over m, as torch's Adam
        torch._foreach_mul_(variance, self.beta2)
        torch._foreach_addcmul_(variance, gs, gs, value=1 - self.beta2)
        torch._foreach_addcdiv_(values, mean, _sqrt_plus(variance, self.delta), value=-lr)


class AdamMax(Updater):
    """m = β1·m + (1−β1)·g; u = max(β2·u, |g|) + δ; w −= lr·m / u   (δ accumulates in u each step, as in SINGA; never clips)."""

    slots = ("mean", "norm")

    def __init__(self, conf: job_pb2.UpdaterProto):
        super().__init__(conf)
        _check_delta(conf)
        _check_beta(conf.adammax_conf.beta1, "updater.adammax_conf.beta1")
        _check_beta(conf.adammax_conf.beta2, "updater.adammax_conf.beta2")
        self.beta1, self.beta2, self.delta = conf.adammax_conf.beta1, conf.adammax_conf.beta2, conf.delta

    def apply_many(self, values, gs, states, lr):
        mean, norm = _slot(states, "mean"), _slot(states, "norm")
        torch._foreach_lerp_(mean, gs, 1 - self.beta1)  # β1·m + (1−β1)·g in one pass over m, as torch's Adam
        torch._foreach_mul_(norm, self.beta2)
        torch._foreach_maximum_(norm, torch._foreach_abs(gs))
        torch._foreach_add_(norm, self.delta)
        torch._foreach_addcdiv_(values, mean, norm, value=-lr)


_BUILTIN_UPDATERS: dict[int, type[Updater]] = {
    job_pb2.kSGD: SGD,
    job_pb2.kNesterov: Nesterov,
    job_pb2.kAdaGrad: AdaGrad,
    job_pb2.kRMSProp: RMSProp,
    job_pb2.kAdaDelta: AdaDelta,
    job_pb2.kAdam: Adam,
    job_pb2.kAdamMax: AdamMax,
}


def make_updater(conf: job_pb2.UpdaterProto) -> Updater:
    """The updater `conf` describes; a set user_type wins over `type`, as in SINGA's Updater::Create."""
    if conf.HasField("user_type"):
        if conf.user_type not in _USER_UPDATERS:
            known = ", ".join(sorted(_USER_UPDATERS)) or "none"
            raise ValueError(f"updater.user_type: no updater registered as {conf.user_type!r} (registered: {known})")
        return _USER_UPDATERS[conf.user_type](conf)
    if conf.type not in _BUILTIN_UPDATERS:
        raise ValueError(f"updater.type: {job_pb2.UpdaterType.Name(conf.type)} needs updater.user_type naming a registered updater")
    return _BUILTIN_UPDATERS[conf.type](conf)
