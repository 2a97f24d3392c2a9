"""The layers of a shoal.fit job: a torch module, its loss and its data as three user layers of an ordinary net.

    data (shoal.fit.Data)  ->  model (shoal.fit.Module)  ->  loss (shoal.fit.Loss)      loss_fn(output, target)
    data (shoal.fit.Data)  ->  loss (shoal.fit.ModuleLoss, the module's params)          loss_fn(model, batch)

The data layer hands on the batch its feed read in place from a torch Dataset
(runtime/feed.py's DatasetFeed), whatever its structure. The module computes
on shoal's params, so it never learns whether it is distributed: in training
its layer's own copy holds the worker's param leaves themselves (installed once,
again only when the net rebinds them), so a step calls the module as a plain
loop does, with no per-step reparametrisation; test and validation go through
torch.func.functional_call (worker 0's buffers with shoal's params). Under
loss_fn(model, batch) the call goes through a small wrapper module whose forward
is the user's loss, so every call the loss makes into the model (forward or any
method) computes on shoal's params.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from shoal.config import job_pb2
from shoal.data.in_place import batch_rows, first_batch, first_tensor, to_device
from shoal.frontend.fit_metrics import FitError, report_accuracy, report_metrics  # noqa: F401 (FitError: fit's error, named here too)
from shoal.neuralnet.layers.base import Layer
from shoal.neuralnet.layers.input import fed_batch
from shoal.neuralnet.layers.registry import register_user_layer
from shoal.neuralnet.torch_optimizer import OUTER_OPTIMIZER_UPDATER, register_torch_optimizer
from shoal.report.targets import RunGoals, set_run_goals

DATA_LAYER, MODULE_LAYER, LOSS_LAYER, MODULE_LOSS_LAYER = "shoal.fit.Data", "shoal.fit.Module", "shoal.fit.Loss", "shoal.fit.ModuleLoss"
LOSS_FORMS = ("output", "model")


def module_device(module: torch.nn.Module) -> torch.device:
    """Where a module's params are (the CPU for one without params)."""
    return next((p.device for p in module.parameters()), torch.device("cpu"))


def loss_form(loss_fn: Callable, loss_takes: Optional[str]) -> str:
    """"model" for loss_fn(model, batch), "output" for loss_fn(output, target).

    Given `loss_takes`, that; otherwise "model" when the function's first parameter is named
    `model` or `module`, else "output" (torch's losses name theirs `input`).
    """
    if loss_takes is not None:
        if loss_takes not in LOSS_FORMS:
            raise FitError(f"shoal.fit: loss_takes must be 'output' (loss_fn(output, target)) or 'model' (loss_fn(model, batch)), got {loss_takes!r}")
        return loss_takes
    try:
        first = next(iter(inspect.signature(loss_fn).parameters), None)
    except (TypeError, ValueError):  # builtins without a signature: torch's own losses
        return "output"
    return "model" if first in ("model", "module") else "output"


@dataclass
class FitSpec:
    """Everything a process needs to build a fit job's layers (sent to spawned processes by pickling)."""

    model: torch.nn.Module
    loss_fn: Callable
    form: str  # see loss_form
    datasets: dict  # phase (job_pb2.kTrain/kTest/kVal) -> torch map-style Dataset, or a stream source (data/streams.py)
    seed: int
    shuffle: bool
    optimizer: Optional[Callable] = None  # a torch.optim factory (neuralnet/torch_optimizer.py)
    scheduler: Optional[Callable] = None  # a torch LR scheduler factory on that optimizer
    outer_optimizer: Optional[Callable] = None  # Local SGD / DiLoCo: a torch.optim factory applied to the pseudo-gradient
    clip_grad_norm: Optional[float] = None  # the global norm the optimizer's gradients are clipped to
    grad_accum_steps: int = 1  # micro-batches per worker share and step (runtime/worker.py's micro_batches)
    autocast: Optional[torch.dtype] = None  # forward (module and loss) under torch.autocast at this dtype; params stay fp32
    metrics: dict = field(default_factory=dict)  # name -> callable in the loss's form (frontend/fit_metrics.py), test/validation
    goals: RunGoals = field(default_factory=RunGoals)  # metric directions and targets, for the summary
    scheduler_steps: str = "update"  # what the scheduler follows: each update, or each asynchronous group's own step
    cuts: Optional[dict] = None  # partition_dim 1: the Linears and attentions to cut (run.model's cuts=); None: found

    def computing(self, device: torch.device):
        """The context the module and loss compute in: torch.autocast on the batch's device, or nothing."""
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.autocast)

    @property
    def trained_names(self) -> list[str]:
        return [n for n, p in self.model.named_parameters() if p.requires_grad]


def split_pair(batch: Any) -> tuple[Any, Any]:
    """(inputs, target) of a batch for loss_fn(output, target): its first and second elements."""
    items = list(batch.values()) if isinstance(batch, dict) else list(batch) if isinstance(batch, (list, tuple)) else []
    if len(items) < 2:
        raise FitError(f"shoal.fit: loss_fn(output, target) needs batches of (inputs, target), got a {type(batch).__name__} of "
                       f"{len(items)} element(s); give pairs, or a loss_fn(model, batch) that reads the batch itself")
    return items[0], items[1]


def output_tensor(output: Any) -> torch.Tensor:
    """The first tensor (in structure order) of a model's output, which stands for its shape and rows; a model whose
    output holds none is refused in one line (loss_fn(output, target) gets the output as the model returns it)."""
    first = first_tensor(output)
    if first is None:
        raise FitError(f"shoal.fit: the model returned a {type(output).__name__} holding no tensor; loss_fn(output, "
                       "target) gets the output as the model returns it: a tensor, or a dict/tuple of tensors")
    return first


def scalar_loss(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise FitError(f"shoal.fit: loss_fn must return one number as a tensor (e.g. a mean), got {shape}")
    return loss.reshape(())


def param_slots(module: torch.nn.Module) -> dict[str, list[tuple[torch.nn.Module, str]]]:
    """Every (submodule, attribute) holding each param, by its named_parameters name (a tied param has several)."""
    first_name: dict[int, str] = {}
    slots: dict[str, list[tuple[torch.nn.Module, str]]] = {}
    for path, param in module.named_parameters(remove_duplicate=False):
        name = first_name.setdefault(id(param), path)
        owner, _, attr = path.rpartition(".")
        slots.setdefault(name, []).append((module.get_submodule(owner), attr))
    return slots


def hold_params(slots: dict[str, list[tuple[torch.nn.Module, str]]], tensors: dict[str, torch.Tensor]) -> None:
    """Put each tensor in every slot of its param, as functional_call does for one call (here until the next)."""
    for name, tensor in tensors.items():
        for owner, attr in slots[name]:
            owner._parameters[attr] = tensor


class _LossOf(torch.nn.Module):
    """loss_fn(model, batch) as a module holding the model: functional_call on it reaches every call the loss makes."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable):
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self, batch):
        return self.loss_fn(self.model, batch)


def register_fit_layers(spec: FitSpec) -> None:
    """Bind the spec to the user layer types of a fit job (in every process)."""
    names = spec.trained_names
    set_run_goals(spec.goals)  # the summary this process may write reports them
    trained = dict(spec.model.named_parameters())
    if spec.optimizer is not None:
        register_torch_optimizer(spec.optimizer, [(n, trained[n]) for n in names], spec.scheduler,
                                 clip_grad_norm=spec.clip_grad_norm, schedule_by_group=spec.scheduler_steps == "group")
    if spec.outer_optimizer is not None:
        register_torch_optimizer(spec.outer_optimizer, [(n, trained[n]) for n in names], user_type=OUTER_OPTIMIZER_UPDATER)
    # the module copy of the worker that computes a batch's first rows (worker 0) in this process:
    # test and validation read its buffers (e.g. batch-norm running statistics), not their own copy's
    trained: dict[str, torch.nn.Module] = {}

    @register_user_layer(DATA_LAYER)
    class DataLayer(Layer):
        """The batch of a torch Dataset, as collated (the runtime's feed reads it: `torch_dataset`)."""

        category = "input"

        def __init__(self, conf, src_shapes):
            super().__init__(conf, src_shapes)
            phase = conf.include[0] if conf.include else job_pb2.kTrain
            self.torch_dataset = spec.datasets[phase]
            self.shuffle, self.shuffle_seed = spec.shuffle and phase == job_pb2.kTrain, spec.seed
            self.micro_batches = spec.grad_accum_steps if phase == job_pb2.kTrain else 1  # read by the worker
            first = first_tensor(first_batch(self.torch_dataset))
            self.shape = tuple(first.shape[1:]) or (1,) if first is not None else (1,)

        def forward(self, xs, params, labels, ctx):
            batch, _ = fed_batch(self, ctx)
            return batch, None

    measured: dict = {}  # the module's costs per sample, counted once for the cost model (`shoal plan --estimate`)

    def loss_of(module: torch.nn.Module, batch) -> torch.Tensor:
        """The job's loss on `batch` through `module`, in either form."""
        if spec.form == "model":
            return scalar_loss(spec.loss_fn(module, batch))
        inputs, target = split_pair(batch)
        return scalar_loss(spec.loss_fn(module(inputs), target))

    class _ModuleCompute(Layer):
        """A layer whose params are the module's (by their named_parameters names)."""

        opaque = True  # the planner cannot cut the module's features or place its layers (planning/partition.py)

        def measured_costs(self):
            if "costs" not in measured:
                from shoal.frontend.module_measure import measure_module

                measured["costs"] = measure_module(spec.model, loss_of, spec.datasets)
            return measured["costs"]

        def __init__(self, conf, src_shapes):
            super().__init__(conf, src_shapes)
            # the module holds the params it computes on, so workers that run at once (threads) each need their own copy
            self.module = copy.deepcopy(spec.model)
            self.slots = param_slots(self.module)
            self.installed: list[torch.Tensor] = []  # the leaves the module holds now (training)

        def param_shapes(self):
            shapes = dict(spec.model.named_parameters())
            return [tuple(shapes[n].shape) for n in names]

        def enter_phase(self, ctx) -> bool:
            """The module in the phase's mode (dropout off and running statistics used outside training); whether training."""
            training = ctx.phase == job_pb2.kTrain
            if self.module.training != training:
                self.module.train(training)
            if training and (ctx.rows is None or ctx.rows[0] == 0):
                trained.setdefault("worker0", self.module)
            return training

        def values(self, params, device, prefix: str = "") -> dict[str, torch.Tensor]:
            """Shoal's params by module name, and worker 0's buffers (outside training)."""
            values = {prefix + n: p for n, p in zip(names, params)}
            if "worker0" in trained:
                values = {**{prefix + n: b.to(device) for n, b in trained["worker0"].named_buffers()}, **values}
            return values

        def call(self, wrapper: torch.nn.Module, params, ctx, args: tuple, prefix: str = ""):
            """wrapper(*args) on shoal's params: in training the module holds the worker's leaves (put there when they
            change: the same objects step after step), so backward accumulates into them; otherwise functional_call."""
            if not self.enter_phase(ctx):
                return torch.func.functional_call(wrapper, self.values(params, ctx.device, prefix), args, strict=False)
            if len(params) != len(self.installed) or any(a is not b for a, b in zip(params, self.installed)):
                if not self.installed:  # its buffers (batch-norm statistics, masks) where this worker computes
                    self.module.to(ctx.device)
                hold_params(self.slots, dict(zip(names, params)))
                self.installed = list(params)
            return wrapper(*args)

    @register_user_layer(MODULE_LAYER)
    class ModuleLayer(_ModuleCompute):
        """output = module(inputs) for (inputs, target) batches; the target travels on as the layer's aux."""

        def __init__(self, conf, src_shapes):
            super().__init__(conf, src_shapes)
            inputs, _ = split_pair(first_batch(spec.datasets[job_pb2.kTrain]))
            inputs = to_device(inputs, module_device(self.module))  # a model given on a GPU is probed there
            self.module.eval()  # the shape probe: one real sample, and no batch-norm statistics moved
            with torch.no_grad():
                output = self.module(inputs)
            # a dict, tuple or dataclass-like output travels to the loss as the model returned it; its first tensor
            # (in structure order) stands for its shape
            self.shape = tuple(output_tensor(output).shape[1:]) or (1,)

        def forward(self, xs, params, labels, ctx):
            inputs, target = split_pair(xs[0])
            with spec.computing(ctx.device):
                return self.call(self.module, params, ctx, (inputs,)), target

    @register_user_layer(LOSS_LAYER)
    class LossLayer(Layer):
        category = "loss"

        def forward(self, xs, params, labels, ctx):
            output, target = xs[0], labels[0]
            with spec.computing(ctx.device):
                loss = scalar_loss(spec.loss_fn(output, target))
            with torch.no_grad():
                rows = batch_rows(output)
                ctx.report("loss", loss.detach(), rows)  # read when shown (MetricWindow): no wait for the device
                if ctx.phase != job_pb2.kTrain and spec.metrics:
                    with spec.computing(ctx.device):
                        report_metrics(spec.metrics, lambda fn: fn(output, target), loss.item(), rows, ctx.report)
                report_accuracy(spec.metrics, output, target, rows, ctx.report)
            return loss

    @register_user_layer(MODULE_LOSS_LAYER)
    class ModuleLossLayer(_ModuleCompute):
        """loss_fn(model, batch), the model computing on shoal's params."""

        category = "loss"

        def __init__(self, conf, src_shapes):
            super().__init__(conf, src_shapes)
            self.wrapper = _LossOf(self.module, spec.loss_fn)
            self.shape = ()

        def forward(self, xs, params, labels, ctx):
            with spec.computing(ctx.device):
                loss = scalar_loss(self.call(self.wrapper, params, ctx, (xs[0],), prefix="model."))
            with torch.no_grad():
                ctx.report("loss", loss.detach(), batch_rows(xs[0]))
                if ctx.phase != job_pb2.kTrain and spec.metrics:
                    values = self.values(params, ctx.device, prefix="model.")
                    def compute(fn):  # fn(model, batch) on shoal's params, as the loss
                        return torch.func.functional_call(_LossOf(self.module, fn), values, (xs[0],), strict=False)

                    with spec.computing(ctx.device):
                        report_metrics(spec.metrics, compute, loss.item(), batch_rows(xs[0]), ctx.report)
            return loss
