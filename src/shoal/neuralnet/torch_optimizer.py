"""A torch.optim optimizer as a server's updater (shoal.fit's `optimizer=` factory).

The factory is called once, on the server's value tensors in the module's
`named_parameters` order: `lambda params: torch.optim.AdamW(params, lr=3e-3,
weight_decay=0.1)`, or param groups built from them (e.g. no decay where
`p.dim() < 2`, nanoGPT's rule for biases and norms). Each update hands the
optimizer the group's gradient as `.grad` and calls `step()`, so the formula,
its defaults and its numerics are torch's own.

The optimizer's per-param state is the server's state dict of that param (the
very dict object), pre-filled with the optimizer's state at zero: a checkpoint
saves it and a resume copies into it, as for SINGA's updaters. Pre-filled
zeros equal torch's lazy initialisation for Adam, AdamW, Adamax, NAdam,
RAdam, RMSprop, Adagrad (initial_accumulator_value 0) and SGD without
dampening.

Only a server that updates whole params, the same tensors every step, may run
it: one worker, or the synchronous groups of one process (shoal.fit refuses
other layouts before training).
"""
from __future__ import annotations

from typing import Callable, ClassVar, Optional, Sequence

import torch

from shoal.config import job_pb2
from shoal.errors import ShoalError
from shoal.neuralnet.updaters import ParamUpdate, Updater, register_updater

OPTIMIZER_UPDATER = "shoal.fit.Optimizer"
OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


class OptimizerError(ShoalError, ValueError):
    """The optimizer factory cannot serve as this job's updater."""


def _made(factory: OptimizerFactory, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    optimizer = factory(params)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise OptimizerError(f"shoal.fit: optimizer must be a factory returning a torch.optim.Optimizer, got {type(optimizer).__name__}")
    return optimizer


class TorchOptimizer(Updater):
    factory: ClassVar[Optional[OptimizerFactory]] = None  # bound by register_torch_optimizer

    def __init__(self, conf: job_pb2.UpdaterProto):
        super().__init__(conf)
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.values: list[torch.Tensor] = []

    def init_state(self, value: torch.Tensor) -> dict[str, torch.Tensor]:
        """The optimizer's state for `value` at zero: one step of a scratch optimizer on a zero gradient, zeroed."""
        scratch = torch.zeros_like(value)
        scratch.grad = torch.zeros_like(value)
        optimizer = _made(type(self).factory, [scratch])
        optimizer.step()
        # a scalar (Adam's step count) as one element: checkpoints hold tensors of at least one dimension
        return {k: torch.zeros_like(v).reshape(-1) if v.dim() == 0 else torch.zeros_like(v)
                for k, v in optimizer.state[scratch].items() if isinstance(v, torch.Tensor)}

    @torch.no_grad()
    def update_many(self, step: int, params: Sequence[ParamUpdate], grad_scale: float = 1.0) -> None:
        if self.optimizer is None:
            self.values = [p.value for p in params]
            self.optimizer = _made(type(self).factory, self.values)
            for p in params:
                self.optimizer.state[p.value] = p.state  # the server's dict: checkpoints and resumes see it
        known = {id(v) for v in self.values}
        if any(id(p.value) not in known for p in params):
            raise OptimizerError("shoal.fit: a torch optimizer runs only where one server updates whole params "
                                 "(one worker, or synchronous workers in one process)")
        for p in params:
            p.value.grad = None if p.grad is None else (p.grad if grad_scale == 1 else p.grad * grad_scale)
        self.optimizer.step()
        for p in params:
            p.value.grad = None


def register_torch_optimizer(factory: OptimizerFactory) -> None:
    """Bind `factory` to the user updater type OPTIMIZER_UPDATER (in every process)."""

    @register_updater(OPTIMIZER_UPDATER)
    class BoundTorchOptimizer(TorchOptimizer):
        pass

    BoundTorchOptimizer.factory = staticmethod(factory)
