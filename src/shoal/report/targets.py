"""Time to a target on any metric ("validation loss <= 1.9") and the goals a run declares.

A target names a phase and a metric, `val_loss<=1.9`, `test_accuracy>=0.97`, `train_loss<=2`: the
phase prefix is val_ (or validate_), test_ or train_; without `<=`/`>=` (shoal.fit's
`targets={"val_loss": 1.9}`) the comparison follows the metric's direction (metrics.higher_is_better).
A run's declared goals (shoal.fit's targets and higher_is_better) reach its summary through
`set_run_goals` in the process that writes the summary; `shoal compare --target` adds its own.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Optional

from shoal.report.errors import ReportError
from shoal.report.metrics import higher_is_better

PHASES = {"val": "validate", "validate": "validate", "test": "test", "train": "train"}
_TARGET = re.compile(r"^\s*(val|validate|test|train)_([A-Za-z0-9_@.\-]+)\s*(?:(<=|>=)\s*(\S+))?\s*$")


@dataclass(frozen=True)
class Target:
    phase: str  # train | test | validate
    metric: str
    at_most: bool  # reached when the value is <= threshold (else >=)
    threshold: float

    @property
    def label(self) -> str:
        prefix = "val" if self.phase == "validate" else self.phase
        return f"{prefix}_{self.metric}{'<=' if self.at_most else '>='}{self.threshold:g}"

    def reached_by(self, value) -> bool:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            return False
        return value <= self.threshold if self.at_most else value >= self.threshold


def parse_target(text: str, threshold: Optional[float] = None, declared: Optional[dict] = None, where: str = "--target") -> Target:
    """`val_loss<=1.9` (or `val_loss` with `threshold` given apart); ReportError naming `where` otherwise."""
    match = _TARGET.match(str(text))
    if match is None or (match.group(4) is None) == (threshold is None):
        form = "PHASE_METRIC<=VALUE or >=VALUE, PHASE one of val, test, train (e.g. val_loss<=1.9)" if threshold is None \
            else "PHASE_METRIC (e.g. val_loss), PHASE one of val, test, train"
        raise ReportError(f"{where} {text!r}: expected {form}")
    prefix, metric, op, value = match.groups()
    try:
        limit = float(value) if threshold is None else float(threshold)
    except (TypeError, ValueError):
        raise ReportError(f"{where} {text!r}: {value if threshold is None else threshold!r} is not a number") from None
    if math.isnan(limit):
        raise ReportError(f"{where} {text!r}: the value is NaN")
    at_most = op == "<=" if op else not higher_is_better(metric, declared)
    return Target(PHASES[prefix], metric, at_most, limit)


def time_to_targets(records: list[dict], targets) -> dict[str, Optional[dict]]:
    """{target label: {"step", "time"} of the first record that reached it, or None}."""
    reached = {}
    for target in targets:
        first = next((r for r in records if r.get("phase") == target.phase and r.get("mode") != "test-only"
                      and target.reached_by(r.get(target.metric))), None)
        reached[target.label] = None if first is None else {"step": first["step"], "time": first.get("time")}
    return reached


@dataclass
class RunGoals:
    """What the run's user declared: metric directions (name -> higher is better) and targets."""

    higher_is_better: dict = field(default_factory=dict)
    targets: tuple = ()


_goals = RunGoals()


def set_run_goals(goals: Optional[RunGoals]) -> None:
    """The goals of the run this process trains (None: none declared)."""
    global _goals
    _goals = goals or RunGoals()


def run_goals() -> RunGoals:
    return _goals


def goals_of(summary: Optional[dict]) -> RunGoals:
    """The goals a summary.json recorded (none for older summaries)."""
    declared = (summary or {}).get("goals") or {}
    directions = {k: bool(v) for k, v in (declared.get("higher_is_better") or {}).items()}
    targets = []
    for label in declared.get("targets") or ():
        try:
            targets.append(parse_target(label, declared=directions, where="summary.json goals.targets"))
        except ReportError:
            continue  # a summary edited by hand: its other numbers still count
    return RunGoals(directions, tuple(targets))
