"""A torch.optim optimizer as a server's updater (shoal.fit's `optimizer=` factory).

The factory is called once, on the module's params as (name, tensor) pairs in
`named_parameters` order, the tensors being the server's values:
`lambda params: torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)`, or param
groups chosen by name or shape (e.g. no decay where `p.dim() < 2`, nanoGPT's
rule for biases and norms). Each update hands the optimizer the group's
gradient as `.grad` and calls `step()`, so the formula, its defaults and its
numerics are torch's own.

The optimizer's per-param state is the server's state dict of that param (the
very dict object), pre-filled with the optimizer's state at zero (one step of
a scratch copy on zero gradients, zeroed): a checkpoint saves it and a resume
copies into it, as for SINGA's updaters. Zeros equal torch's lazy first state
for Adam, AdamW, Adamax, NAdam, RAdam, RMSprop, Adagrad (initial accumulator 0)
and SGD without dampening.

Only a server that updates all the module's params whole, the same tensors
every step, may run it: one worker, or the synchronous workers of one process
with one server (shoal.fit refuses other layouts before training).
"""
from __future__ import annotations

from typing import Callable, ClassVar, Optional, Sequence

import torch

from shoal.config import job_pb2
from shoal.errors import ShoalError
from shoal.neuralnet.updaters import ParamUpdate, Updater, register_updater

OPTIMIZER_UPDATER = "shoal.fit.Optimizer"
OptimizerFactory = Callable[[list[tuple[str, torch.Tensor]]], torch.optim.Optimizer]


class OptimizerError(ShoalError, ValueError):
    """The optimizer factory cannot serve as this job's updater."""


def _made(factory: OptimizerFactory, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    optimizer = factory(params)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise OptimizerError(f"shoal.fit: optimizer must be a factory returning a torch.optim.Optimizer, got {type(optimizer).__name__}")
    return optimizer


class TorchOptimizer(Updater):
    factory: ClassVar[Optional[OptimizerFactory]] = None  # bound by register_torch_optimizer
    names: ClassVar[list[str]] = []  # the module's trained params, in named_parameters order
    shapes: ClassVar[list[tuple[int, ...]]] = []

    def __init__(self, conf: job_pb2.UpdaterProto):
        super().__init__(conf)
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.values: list[torch.Tensor] = []  # the server's values, as init_state saw them (its names' order)
        self.states: list[dict[str, torch.Tensor]] = []
        self._zeros: Optional[list[dict[str, torch.Tensor]]] = None

    def _zero_states(self) -> list[dict[str, torch.Tensor]]:
        """The optimizer's state of every param at zero (a scalar, Adam's step, as one element: checkpoints
        hold tensors of at least one dimension)."""
        scratch = [(name, torch.zeros(shape)) for name, shape in zip(self.names, self.shapes)]
        for _, tensor in scratch:
            tensor.grad = torch.zeros_like(tensor)
        optimizer = _made(type(self).factory, scratch)
        optimizer.step()
        return [{k: torch.zeros_like(v).reshape(-1) if v.dim() == 0 else torch.zeros_like(v)
                 for k, v in optimizer.state[tensor].items() if isinstance(v, torch.Tensor)} for _, tensor in scratch]

    def init_state(self, value: torch.Tensor) -> dict[str, torch.Tensor]:
        """Called by the server once per param it owns, in its names' order: the module's order."""
        i = len(self.values)
        if i >= len(self.names) or tuple(value.shape) != tuple(self.shapes[i]):
            raise OptimizerError("shoal.fit: a torch optimizer needs one server holding the module's params whole")
        if self._zeros is None:
            self._zeros = self._zero_states()
        state = {k: v.to(value.device) for k, v in self._zeros[i].items()}
        self.values.append(value)
        self.states.append(state)
        return state

    @torch.no_grad()
    def update_many(self, step: int, params: Sequence[ParamUpdate], grad_scale: float = 1.0) -> None:
        if self.optimizer is None:
            if len(self.values) != len(self.names):
                raise OptimizerError("shoal.fit: a torch optimizer needs one server holding the module's params whole")
            self.optimizer = _made(type(self).factory, list(zip(self.names, self.values)))
            for value, state in zip(self.values, self.states):
                self.optimizer.state[value] = state  # the server's dict: checkpoints and resumes see it
        known = {id(v) for v in self.values}
        if any(id(p.value) not in known for p in params):
            raise OptimizerError("shoal.fit: a torch optimizer runs only where one server updates whole params "
                                 "(one worker, or synchronous workers in one process)")
        for p in params:
            p.value.grad = None if p.grad is None else (p.grad if grad_scale == 1 else p.grad * grad_scale)
        self.optimizer.step()
        for p in params:
            p.value.grad = None


def register_torch_optimizer(factory: OptimizerFactory, params: list[tuple[str, torch.Tensor]]) -> None:
    """Bind `factory` and the module's trained (name, param) pairs to the user updater type OPTIMIZER_UPDATER."""

    @register_updater(OPTIMIZER_UPDATER)
    class BoundTorchOptimizer(TorchOptimizer):
        pass

    BoundTorchOptimizer.factory = staticmethod(factory)
    BoundTorchOptimizer.names = [name for name, _ in params]
    BoundTorchOptimizer.shapes = [tuple(p.shape) for _, p in params]
