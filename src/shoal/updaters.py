"""SINGA's updaters and learning-rate schedules (src/utils/updater.cc of SINGA 0.3).

Every updater first scales the gradient and adds weight decay:
    g = grad · grad_scale;  if wd > 0: g += wd · w
with lr = schedule(step) · lr_scale and wd = weight_decay · wd_scale. SGD,
Nesterov, AdaGrad and RMSProp then clip g to [clip_low, clip_high] when
clip_high > clip_low (the other updaters never clip, as in SINGA). `delta` is
added inside the square roots.

State is a plain dict of tensors per param (or per slice of a param), so a
server can own any slice of a param together with its slots, and a
checkpoint is just those tensors.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from shoal.config import job_pb2

Schedule = Callable[[job_pb2.LRGenProto, int], float]
_USER_SCHEDULES: dict[str, Schedule] = {}
_USER_UPDATERS: dict[str, type["Updater"]] = {}


# -- learning-rate schedules ------------------------------------------------------
def register_lr_schedule(user_type: str) -> Callable[[Schedule], Schedule]:
    """Register a kUserChange schedule fn(conf, step) -> lr, chosen by learning_rate.user_type."""

    def wrap(fn: Schedule) -> Schedule:
        _USER_SCHEDULES[user_type] = fn
        return fn

    return wrap


def learning_rate(conf: job_pb2.LRGenProto, step: int) -> float:
    """The learning rate at `step` (SINGA's LRGenerator::Get)."""
    base, kind = conf.base_lr, conf.type
    if kind == job_pb2.kFixed:
        return base
    if kind == job_pb2.kInverseT:  # base / (1 + step / final_lr)
        return base / (1 + step / conf.inverset_conf.final_lr)
    if kind == job_pb2.kInverse:  # base · (1 + γ·step)^(−pow)
        c = conf.inverse_conf
        return base * math.pow(1 + c.gamma * step, -c.pow)
    if kind == job_pb2.kExponential:  # base / 2^(step / change_freq), float division
        return base / math.pow(2, step / conf.exponential_conf.change_freq)
    if kind == job_pb2.kLinear:  # (1 − r)·base + r·final, r = step / change_freq, no clamp
        r = step / conf.linear_conf.change_freq
        return (1 - r) * base + r * conf.linear_conf.final_lr
    if kind == job_pb2.kStep:  # base · γ^(step / change_freq), integer division: stairs
        c = conf.step_conf
        return base * math.pow(c.gamma, step // c.change_freq)
    if kind == job_pb2.kFixedStep:  # step_lr[i] for the last i with step >= step[i]
        c = conf.fixedstep_conf
        lr = base  # before the first boundary SINGA's generator still holds base_lr
        for boundary, value in zip(c.step, c.step_lr):
            if step >= boundary:
                lr = value
        return lr
    if kind == job_pb2.kUserChange and conf.user_type in _USER_SCHEDULES:
        return _USER_SCHEDULES[conf.user_type](conf, step)
    raise ValueError(f"updater.learning_rate.type {job_pb2.ChangeMethod.Name(kind)} is not supported")


def check_schedule(conf: job_pb2.LRGenProto) -> None:
    """ValueError naming the field when a schedule's conf cannot work."""
    where = "updater.learning_rate"
    kind = conf.type
    if kind in (job_pb2.kStep, job_pb2.kExponential, job_pb2.kLinear):
        sub = {job_pb2.kStep: "step_conf", job_pb2.kExponential: "exponential_conf", job_pb2.kLinear: "linear_conf"}[kind]
        if getattr(conf, sub).change_freq <= 0:
            raise ValueError(f"{where}.{sub}.change_freq: must be > 0")
    if kind == job_pb2.kInverseT and conf.inverset_conf.final_lr == 0:
        raise ValueError(f"{where}.inverset_conf.final_lr: must not be 0")
    if kind == job_pb2.kFixedStep:
        c = conf.fixedstep_conf
        if not c.step or len(c.step) != len(c.step_lr):
            raise ValueError(f"{where}.fixedstep_conf: needs as many step_lr as step values (got {len(c.step)} and {len(c.step_lr)})")
        if list(c.step) != sorted(c.step):
            raise ValueError(f"{where}.fixedstep_conf.step: must increase")
    if kind == job_pb2.kUserChange and conf.user_type not in _USER_SCHEDULES:
        raise ValueError(f"{where}.user_type: no schedule registered as {conf.user_type!r}")


# -- updaters ---------------------------------------------------------------------
def register_updater(user_type: str) -> Callable[[type["Updater"]], type["Updater"]]:
    """Register a kUserUpdater subclass of Updater, chosen by updater.user_type."""

    def wrap(cls: type[Updater]) -> type[Updater]:
        _USER_UPDATERS[user_type] = cls
        return cls

    return wrap


class Updater:
    """Base: gradient preprocessing shared by every SINGA updater."""

    slots: tuple[str, ...] = ()
    clips = False  # SINGA clips only in SGD, Nesterov, AdaGrad and RMSProp

    def __init__(self, conf: job_pb2.UpdaterProto):
        check_schedule(conf.learning_rate)
        self.conf = conf

    def learning_rate(self, step: int) -> float:
        return learning_rate(self.conf.learning_rate, step)

    def init_state(self, value: torch.Tensor) -> dict[str, torch.Tensor]:
        return {slot: torch.zeros_like(value) for slot in self.slots}

    def prepare(self, value: torch.Tensor, grad: torch.Tensor, wd_scale: float, grad_scale: float) -> torch.Tensor:
        """g = grad·grad_scale (+ wd·w), clipped where SINGA clips.

        `grad` itself is returned when nothing changes it (apply() only reads g),
        so the common case costs no copy of the gradient; otherwise a new tensor.
        """
        wd = self.conf.weight_decay * wd_scale
        clip = self.clips and self.conf.clip_high > self.conf.clip_low
        if grad_scale == 1 and wd <= 0 and not clip:
            return grad
        g = grad * grad_scale if grad_scale != 1 else grad.clone()
        if wd > 0:
            g.add_(value, alpha=wd)
        if clip:
            g.clamp_(self.conf.clip_low, self.conf.clip_high)
        return g

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
        """Update `value` and `state` in place (they may be views: slices of larger tensors)."""
        g = self.prepare(value, grad, wd_scale, grad_scale)
        self.apply(value, g, state, self.learning_rate(step) * lr_scale)

    def apply(self, value: torch.Tensor, g: torch.Tensor, state: dict[str, torch.Tensor], lr: float) -> None:
        """Update value and state in place from the prepared gradient g (read only: it may be the caller's)."""
        raise NotImplementedError


class SGD(Updater):
    """With momentum m > 0: h = m·h − lr·g; w += h. Otherwise w −= lr·g."""

    clips = True

    def __init__(self, conf):
        super().__init__(conf)
        self.slots = ("history",) if conf.momentum > 0 else ()

    def apply(self, value, g, state, lr):
        if self.conf.momentum > 0:
            h = state["history"]
            h.mul_(self.conf.momentum).add_(g, alpha=-lr)
            value.add_(h)
        else:
            value.add_(g, alpha=-lr)


class Nesterov(Updater):
    """h' = m·h + lr·g; w −= (1 + m)·h' − m·h; h = h'."""

    clips = True
    slots = ("history",)

    def apply(self, value, g, state, lr):
        m, h = self.conf.momentum, state["history"]
        previous = h.clone()
        h.mul_(m).add_(g, alpha=lr)
        value.sub_(h * (1 + m) - previous * m)


class AdaGrad(Updater):
    """h += g²; w −= lr·g / sqrt(h + δ)."""

    clips = True
    slots = ("history",)

    def apply(self, value, g, state, lr):
        h = state["history"]
        h.addcmul_(g, g)
        value.addcdiv_(g, (h + self.conf.delta).sqrt_(), value=-lr)


class RMSProp(Updater):
    """h = ρ·h + (1 − ρ)·g²; w −= lr·g / sqrt(h + δ)."""

    clips = True
    slots = ("history",)

    def __init__(self, conf):
        super().__init__(conf)
        rho = conf.rmsprop_conf.rho
        if not 0 < rho < 1:
            raise ValueError(f"updater.rmsprop_conf.rho: must be in (0, 1), got {rho}")

    def apply(self, value, g, state, lr):
        rho, h = self.conf.rmsprop_conf.rho, state["history"]
        h.mul_(rho).addcmul_(g, g, value=1 - rho)
        value.addcdiv_(g, (h + self.conf.delta).sqrt_(), value=-lr)


class AdaDelta(Updater):
    """h = ρh + (1−ρ)g²; t = g·sqrt(u + δ)/sqrt(h + δ); u = ρu + (1−ρ)t²; w −= lr·t."""

    slots = ("history", "update")

    def apply(self, value, g, state, lr):
        rho, delta = self.conf.adadelta_conf.rho, self.conf.delta
        h, u = state["history"], state["update"]
        h.mul_(rho).addcmul_(g, g, value=1 - rho)
        t = g * (u + delta).sqrt_() / (h + delta).sqrt_()
        u.mul_(rho).addcmul_(t, t, value=1 - rho)
        value.add_(t, alpha=-lr)


class Adam(Updater):
    """m = β1·m + (1−β1)·g; v = β2·v + (1−β2)·g²; w −= lr·m / sqrt(v + δ) (no bias correction, as SINGA)."""

    slots = ("mean", "variance")

    def apply(self, value, g, state, lr):
        c = self.conf.adam_conf
        m, v = state["mean"], state["variance"]
        m.mul_(c.beta1).add_(g, alpha=1 - c.beta1)
        v.mul_(c.beta2).addcmul_(g, g, value=1 - c.beta2)
        value.addcdiv_(m, (v + self.conf.delta).sqrt_(), value=-lr)


class AdamMax(Updater):
    """m = β1·m + (1−β1)·g; u = max(β2·u, |g|) + δ; w −= lr·m / u."""

    slots = ("mean", "norm")

    def apply(self, value, g, state, lr):
        c = self.conf.adammax_conf
        m, u = state["mean"], state["norm"]
        m.mul_(c.beta1).add_(g, alpha=1 - c.beta1)
        torch.maximum(u * c.beta2, g.abs(), out=u)
        u.add_(self.conf.delta)
        value.addcdiv_(m, u, value=-lr)


_BUILTIN = {
    job_pb2.kSGD: SGD,
    job_pb2.kNesterov: Nesterov,
    job_pb2.kAdaGrad: AdaGrad,
    job_pb2.kRMSProp: RMSProp,
    job_pb2.kAdaDelta: AdaDelta,
    job_pb2.kAdam: Adam,
    job_pb2.kAdamMax: AdamMax,
}


def make_updater(conf: job_pb2.UpdaterProto) -> Updater:
    if conf.type == job_pb2.kUserUpdater:
        if conf.user_type not in _USER_UPDATERS:
            raise ValueError(f"updater.user_type: no updater registered as {conf.user_type!r}")
        return _USER_UPDATERS[conf.user_type](conf)
    return _BUILTIN[conf.type](conf)
