"""A dead chief's place taken in a user's loop (issue 38): AllReduce's replicas under `shoal run script.py`.

The chief (process 0) has duties no other process has: it decides each step's quorum, writes the run log
(metrics.jsonl, summary.json, TensorBoard) and the checkpoints, and hands its state to a restarted process. In a
user's loop of replicas (launcher/ranks.py's `chief_replaceable`) its death drops it like any other process: the
lowest living process decides the next step in its place (shoal.comm.quorum, `replaceable`), and its session, seeing
that after the step's heal, takes over the rest here: it opens the same metrics.jsonl for appending (one continuous
log: no `resume` record, the time carried on from the last record), keeps summary.json's `started`, and writes the
checkpoints from then on. Its replica is the chief's (the replicas are equal after every step), so nothing of the
state moves. The dead chief's restarted process rejoins as a non-chief, healing from the decider.

What it does not take: the terminal. The new chief's display lines go to its own log (logs/rank<R>.log), as every
other process's output does; the launcher's lines on the terminal say what happened.
"""
from __future__ import annotations

import datetime
import sys
import time
from pathlib import Path
from typing import Callable

from shoal.planning.plan import JobPlan
from shoal.report.metrics import MetricsLog, read_metrics
from shoal.report.run_log import METRICS_FILE, open_run_log
from shoal.report.summary import read_summary
from shoal.runtime.replicas import usable_device_names


def take_over_run_log(plan: JobPlan, workspace: Path) -> MetricsLog:
    """The dead chief's run log, continued by this process: metrics.jsonl appended to (a line the chief was killed
    writing is ended first, and readers skip it), summary.json kept current from it, the run's clock carried on."""
    workspace = Path(workspace)
    path = workspace / METRICS_FILE
    records = read_metrics(path) if path.exists() else []
    times = [r["time"] for r in records if isinstance(r.get("time"), (int, float))]
    # the run's clock at the last record, and the time since it was written (the chief's death, its detection)
    elapsed = max(times, default=0.0) + (max(0.0, time.time() - path.stat().st_mtime) if times else 0.0)
    before = read_summary(workspace) or {}
    return open_run_log(plan, workspace, elapsed, usable_device_names(plan.all_devices()),
                        started=_epoch(before.get("started")))  # the run's start, not the takeover's


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
        if sys.__stdout__ is not None and sys.stdout is not sys.__stdout__:
            print(line, file=sys.__stdout__, flush=True)
    return both
