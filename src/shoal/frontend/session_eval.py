"""`run.evaluate(...)`: the user's module on a held-out set, recorded as shoal.fit's validation and test are.

    values = run.evaluate(val_set, loss_fn, batch_size=100)              # {"loss": ...}, a `validate` record
    run.evaluate(test_set, loss_fn, phase="test", metrics={"perplexity": shoal.perplexity})

The loss and metrics take fit's forms (`loss_fn(model, batch)` or `loss_fn(output, target)`, frontend/module_path.py's
`loss_form`; metrics in the loss's form and shoal.perplexity, frontend/fit_metrics.py), the batch size is fit's
(`_eval_batches`: the largest divisor of the set's size up to `batch_size`, so every sample is read once), each value
is averaged by samples over the set, and the record (phase `validate` or `test`, `samples`) and the display line are the
ones fit's trainer writes, so `shoal compare`, `shoal plot`, summary.json and TensorBoard read them alike.

Which model is evaluated, and where: the chief's (process 0's), in the chief alone, as fit's trainer does (its
`run_phase` runs on the chief only). Under AllReduce the replicas are equal, so the chief's model is the group's, and
one process reading the set once needs no collective: a dead or restarting process never holds an evaluation up, and
on the same params the values are fit's to the bit (a split evaluation would sum per-process means in another order).
Under Local SGD / DiLoCo it is worker group 0's model as it is at the call (between meetings each group's differs; right
after a meeting it is the new anchor), as fit's validation is. The other processes evaluate nothing and return {}.
Unlike fit's `val_steps` (the next batches, a cursor kept between validations), `steps=N` reads the set's first N
batches at every call, so successive evaluations compare the same rows.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any, Callable, Optional

import torch

from shoal.data.in_place import batch_rows, reader_for, to_device
from shoal.errors import ShoalError
from shoal.frontend.fit_inputs import _eval_batches, as_dataset, autocast_dtype
from shoal.frontend.fit_metrics import check_metrics, report_accuracy, report_metrics
from shoal.frontend.module_path import loss_form, scalar_loss, split_pair
from shoal.report.metrics import MetricWindow, display_line

PHASES = {"val": ("validate", "Validate"), "validate": ("validate", "Validate"), "test": ("test", "Test")}


class EvaluateError(ShoalError, ValueError):
    """run.evaluate was given something it cannot evaluate: one line saying what."""


def evaluate(run, dataset, loss_fn: Callable, *, batch_size: int = 100, steps: Optional[int] = None,
             metrics: Optional[dict] = None, phase: str = "val", loss_takes: Optional[str] = None, autocast=None,
             model: Optional[torch.nn.Module] = None) -> dict[str, float]:
    """The values of `run`'s module (or `model`) on `dataset`, recorded by the chief at the updates done so far."""
    if phase not in PHASES:
        raise EvaluateError(f"run.evaluate: phase must be 'val' or 'test', got {phase!r}")
    for name, value in (("batch_size", batch_size), ("steps", 1 if steps is None else steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise EvaluateError(f"run.evaluate: {name} must be a whole number from 1, got {value!r}")
    module = model if model is not None else run.module
    if not isinstance(module, torch.nn.Module):
        raise EvaluateError("run.evaluate: give the module to run.model(...) first (or pass model=)")
    try:  # fit's checks, in fit's words: named as run.evaluate's here
        form = loss_form(loss_fn, loss_takes)
        metrics = check_metrics(metrics)
        dtype = autocast_dtype(autocast)
        data = as_dataset(dataset, "run.evaluate")
    except ShoalError as err:
        raise EvaluateError(_named(err)) from None
    batch, whole = _eval_batches(data, batch_size)
    count = whole if steps is None else min(steps, whole)
    if not run.chief and not run.plan.tensor_parallel:  # (a cut module computes with every process of its group)
        return {}
    started = time.perf_counter()
    try:
        values = _values(module, data, loss_fn, form, metrics, dtype, batch, count, run.device, run.job.seed)
    except ShoalError as err:
        raise EvaluateError(_named(err)) from None
    if not run.chief:
        return {}
    at = run.updates_done
    name, label = PHASES[phase]
    if run.metrics is None or not run.metrics.recorded_before(at, name):  # (a dead chief's successor behind it: said once)
        run.say(display_line(label, at, values))
    if run.metrics is not None:
        run.metrics.write(at, name, values, samples=count * batch)
    run.paused_seconds += time.perf_counter() - started  # not training time: the next train record's samples/s leaves it out
    return values


def _values(module: torch.nn.Module, data, loss_fn: Callable, form: str, metrics: dict, dtype, batch: int, count: int,
            device: torch.device, seed: int) -> dict[str, float]:
    """The sample-weighted means over `count` batches of `batch` rows from the set's first, in eval mode and no_grad;
    every submodule's own mode is restored after."""
    modes = [(m, m.training) for m in module.modules()]
    window = MetricWindow()
    reader = reader_for(data, seed, False, batch)
    computing = (lambda: torch.autocast(device_type=device.type, dtype=dtype)) if dtype is not None else nullcontext
    module.eval()
    try:
        with torch.no_grad():
            for k in range(count):
                _batch_values(module, to_device(reader.batch(k * batch, batch), device), loss_fn, form, metrics, computing,
                              window.report)
    finally:
        for m, training in modes:
            m.training = training
    return window.averages()


def _batch_values(module, batch: Any, loss_fn: Callable, form: str, metrics: dict, computing, report) -> None:
    """One batch's loss and metrics, reported in the order fit's loss layers report them (module_path.py)."""
    if form == "model":
        with computing():
            loss = scalar_loss(loss_fn(module, batch))
        rows = batch_rows(batch)
        report("loss", loss.detach(), rows)
        if metrics:
            with computing():
                report_metrics(metrics, lambda fn: fn(module, batch), loss.item(), rows, report)
        return
    inputs, target = split_pair(batch)
    with computing():
        output = module(inputs)
        loss = scalar_loss(loss_fn(output, target))
    rows = batch_rows(output)
    report("loss", loss.detach(), rows)
    if metrics:
        with computing():
            report_metrics(metrics, lambda fn: fn(output, target), loss.item(), rows, report)
    report_accuracy(metrics, output, target, rows, report)


def _named(err: ShoalError) -> str:
    """fit's one-line message, naming run.evaluate instead of shoal.fit."""
    text = str(err)
    for prefix in ("shoal.fit: run.evaluate: ", "shoal.fit: "):
        if text.startswith(prefix):
            return "run.evaluate: " + text[len(prefix):]
    return text
