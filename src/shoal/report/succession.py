"""A dead chief's place taken (issue 38): the run log continued by its successor, whose lines reach the terminal.

The chief (process 0) has duties no other process has: it decides each step's quorum, writes the run log
(metrics.jsonl, summary.json, TensorBoard) and the checkpoints, tests and validates, and hands its state to a
restarted process. Where its death drops it like any other process (launcher/ranks.py's `chief_replaceable`: a group
of replicas, in a user's loop or a job file; Local SGD / DiLoCo's groups in a user's loop) the lowest living process
decides the next step in its place (shoal.comm.quorum, `replaceable`), and its loop (frontend/session.py's Session, or
runtime/trainer.py's Trainer for a job file), seeing that after the step's heal, takes over the rest through the two
calls here: it opens the same metrics.jsonl for appending (one continuous log: no `resume` record, the time carried on
from the last record), keeps summary.json's `started`, and writes the checkpoints from then on. Its replica is the
chief's (the replicas are equal after every step), so nothing of the state moves. The dead chief's restarted process
rejoins as a non-chief, healing from the decider.

The successor's stdout is its own log (logs/rank<R>.log, launcher/ranks.py's `rank_output`); its lines go to the
terminal the job was started from too, as the chief's did.
"""
from __future__ import annotations

import datetime
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from shoal.report.metrics import MetricsLog, read_metrics
from shoal.report.run_log import METRICS_FILE, open_run_log
from shoal.report.summary import read_summary
from shoal.report.terminal import also_on_the_terminal

if TYPE_CHECKING:
    from shoal.planning.plan import JobPlan


_took_over = False  # this process took a dead chief's place (its stall warnings then reach the terminal)


def took_over_here() -> bool:
    """Whether this process took a dead chief's place (launcher/stalls.py: it warns of stalled peers, as the chief did)."""
    return _took_over


def take_over_run_log(plan: "JobPlan", workspace: Path, devices: list[str], rank: int, step: int) -> MetricsLog:
    """The dead chief's run log, continued by process `rank` after step `step`: metrics.jsonl appended to (a line the
    chief was killed writing is ended first, and readers skip it), summary.json kept current from it, the run's clock
    carried on, and its `chief_succession` saying who took the chief's place when (the closing line says it); a step
    of a phase the chief recorded already is not recorded again (an asynchronous successor may be behind the chief).
    `devices`: the job's usable devices, as the chief opened the log with."""
    global _took_over
    _took_over = True
    workspace = Path(workspace)
    path = workspace / METRICS_FILE
    records = read_metrics(path) if path.exists() else []
    times = [r["time"] for r in records if isinstance(r.get("time"), (int, float))]
    # the run's clock at the last record, and the time since it was written (the chief's death, its detection)
    elapsed = max(times, default=0.0) + (max(0.0, time.time() - path.stat().st_mtime) if times else 0.0)
    before = read_summary(workspace) or {}
    log = open_run_log(plan, workspace, elapsed, devices, started=_epoch(before.get("started")))  # the run's start
    earlier = before.get("chief_succession") if isinstance(before.get("chief_succession"), list) else []
    log.annotate(chief_succession=earlier + [{"process": rank, "after_step": step}])
    log.recorded_through = {}
    for record in records:
        if isinstance(record.get("step"), int) and isinstance(record.get("phase"), str):
            log.recorded_through[record["phase"]] = max(record["step"], log.recorded_through.get(record["phase"], -1))
    return log


def _epoch(text) -> float | None:
    """summary.json's `started` (report/summary.py's `_iso`: local time with its offset) as seconds since the epoch;
    None when unreadable."""
    try:
        return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S%z").timestamp()
    except (TypeError, ValueError):
        return None


def on_the_terminal_too(say: Callable[[str], None]) -> Callable[[str], None]:
    """A rank's way of saying a line (to its log file, its stdout under shoal's launcher) that also reaches the
    terminal the launcher started it from (the process's original stdout), as the chief's lines do."""
    def both(line: str) -> None:
        say(line)
        also_on_the_terminal(line)
    return both
