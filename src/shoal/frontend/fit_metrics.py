"""shoal.fit's evaluation metrics: callables in the loss's form, averaged by samples over the set.

    metrics={"perplexity": shoal.perplexity, "accuracy": token_accuracy}

Each callable takes what the loss takes — `(model, batch)` or `(output, target)` — and returns a
number (a float or a one-element tensor) for the batch, its mean over the batch's samples. Test and
validation compute every metric on every batch in eval mode; the set's value is the sample-weighted
mean over its batches. `ExpOfMean` metrics are exp of that mean instead (perplexity: exp of the mean
loss, not the mean of per-batch exps).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from shoal.errors import ShoalError
from shoal.report.targets import RunGoals, parse_target

BUILT_IN = ("loss",)  # reported by the loss layer itself


class FitError(ShoalError, ValueError):
    """shoal.fit was given something it cannot train: one line saying what."""


@dataclass(frozen=True)
class ExpOfMean:
    """exp of the sample-weighted mean of `fn` over the set (fn None: of the loss_fn): a perplexity."""

    fn: Optional[Callable] = None


perplexity = ExpOfMean()  # exp(mean loss): shoal.perplexity


def check_metrics(metrics: Optional[dict]) -> dict:
    if metrics is None:
        return {}
    if not isinstance(metrics, dict):
        raise FitError(f"shoal.fit: metrics must be a dict of name -> callable, got {type(metrics).__name__}")
    for name, fn in metrics.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise FitError(f"shoal.fit: metrics: name {name!r} must be a word such as 'perplexity' (letters, digits, _)")
        if name in BUILT_IN:
            raise FitError(f"shoal.fit: metrics[{name!r}]: the loss is always reported; give the metric another name")
        if not (callable(fn) or isinstance(fn, ExpOfMean)):
            raise FitError(f"shoal.fit: metrics[{name!r}] must be a callable or shoal.perplexity, got {type(fn).__name__}")
    return dict(metrics)


def metric_value(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach().float().item())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
    raise FitError(f"shoal.fit: metrics[{name!r}] must return one number for the batch (a float or a one-element tensor), got {shape}")


def report_metrics(metrics: dict, compute: Callable[[Callable], Any], loss: float, rows: int, report) -> None:
    """Report each metric of a batch: compute(fn) calls fn in the loss's form on the batch; `loss` is its loss."""
    for name, fn in metrics.items():
        if isinstance(fn, ExpOfMean):
            mean_of = loss if fn.fn is None else metric_value(name, compute(fn.fn))
            report(name, mean_of, rows, finish=math.exp)
        else:
            report(name, metric_value(name, compute(fn)), rows)


def report_accuracy(metrics: dict, output: Any, target: Any, rows: int, report) -> None:
    """The built-in accuracy of loss_fn(output, target): only for class scores against one class id per sample, and
    only where the user measures no `accuracy` of their own (fit's loss layer and run.evaluate report it alike)."""
    if ("accuracy" not in metrics and isinstance(output, torch.Tensor) and output.dim() == 2
            and isinstance(target, torch.Tensor) and target.dim() == 1 and not target.is_floating_point()):
        report("accuracy", (output.argmax(1) == target).float().mean(), rows)


def run_goals(higher_is_better, targets: Optional[dict]) -> RunGoals:
    """fit's higher_is_better (names, or name -> bool) and targets ({"val_loss": 1.9} or labels "val_loss<=1.9")."""
    if higher_is_better is None:
        declared = {}
    elif isinstance(higher_is_better, dict):
        declared = {str(k): bool(v) for k, v in higher_is_better.items()}
    elif isinstance(higher_is_better, (list, tuple, set, frozenset)):
        declared = {str(k): True for k in higher_is_better}
    else:
        raise FitError("shoal.fit: higher_is_better must be metric names (higher is better) or a dict name -> bool")
    parsed = []
    items = targets.items() if isinstance(targets, dict) else [(t, None) for t in (targets or ())]
    for key, value in items:
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise FitError(f"shoal.fit: targets[{key!r}] must be a number, got {value!r}")
        try:
            parsed.append(parse_target(key, value, declared, where="shoal.fit: targets"))
        except ShoalError as err:
            raise FitError(str(err)) from None
    return RunGoals(declared, tuple(parsed))
