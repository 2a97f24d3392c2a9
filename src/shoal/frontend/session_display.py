"""A user's loop's display window: each step's rows counted, and every disp_freq steps the chief's Train line and
metrics.jsonl's train record (run.log's values averaged over the window, its rows, samples/s, compute and exchange
seconds), as a job file's trainer displays. Which rows and averages a window holds depends on the layout: a synchronous
group's are every process's (the exchange hears the others' windows), in-memory groups' and Downpour's come from the
exchange (group 0's or the chief's losses, every group's rows), elsewhere this process's times the processes. Each
function takes the `Session` (frontend/session.py) whose window it is.
"""
from __future__ import annotations

import time
from pathlib import Path

from shoal.config.phases import fires
from shoal.frontend import session_shares
from shoal.report.metrics import display_line


def count_rows(run, step: int) -> None:
    """This step's rows into the display window, once (a run.checkpoint() in the loop's body closes the window first)."""
    if run._rows_counted != step:
        run._rows_counted = step
        run.window_rows += run._share


def say_interval_checkpoint(run, path: Path) -> None:
    """The chief's line for a checkpoint written at checkpoint_interval_s's step."""
    if run.chief:
        run.say(f"Checkpoint written to {path} (every {run.plan.checkpoint_interval_s:g} s: checkpoint_interval_s)")


def displays(run, step: int) -> bool:
    """Whether step `step` ends a display window (disp_freq's steps, and the last)."""
    return fires(run.job.disp_freq, run.job.disp_after, step) or step + 1 == run.job.train_steps


def display(run, step: int) -> None:
    """The display window's end at step `step`: the chief's Train line and metrics.jsonl's train record (the window's
    averages, its rows and samples/s, its compute and exchange seconds), then a new window."""
    run._displayed = step
    now = time.perf_counter()
    seconds = max(now - run._window_start - run.paused_seconds, 1e-9)
    exchanged = run.exchange_seconds + (run.mean.seconds if run.mean is not None else 0.0)
    if run._group_window:  # every process, at every display: the decider hears the others' windows (replicated.py)
        values = run.exchange.metrics(run.window)
        rows = values.pop("samples")  # the rows of the processes that came to the window's steps
    elif run.groups_in_memory and run.window:  # in-memory groups, as a job file's: group 0's losses, every
        values = run.exchange.metrics(run.window)  # group's rows and the updates' staleness (the board's)
        rows = values.pop("samples", run.window_rows)
    elif run.pushes and not run.plan.strategy.synchronous and run.window:
        # Downpour's groups, as a job file's records: the chief's own losses, the job's rows since its last display
        # (from the servers' version: every group's), its staleness and the bytes it pushed (DownpourExchange.metrics)
        values = run.exchange.metrics(run.window)
        rows = values.pop("samples", run.window_rows * run.plan.nworkers // run.local_workers)
    else:  # every process trained as many rows (window_rows: this process's workers'; tensor-parallel, the group's)
        rows = run.window_rows * (run.plan.nworkers // run.local_workers if run.distributed and
                                  not run.plan.tensor_parallel else 1)
        values = run.window.averages() if run.window else {}
    if run.chief:
        if run.metrics is None or not run.metrics.recorded_before(step, "train"):  # (a successor behind the dead chief)
            run.say(display_line("Train", step, values))
        if run.metrics is not None:
            run.metrics.write(step, "train", values, samples=rows, samples_per_sec=round(rows / seconds, 2),
                              window_sec=round(seconds, 6), compute_sec=round(max(0.0, seconds - exchanged), 6),
                              exchange_sec=round(exchanged, 6),
                              **(session_shares.record_shares(run, run._measured) if run._workers else {}))
    run.window.reset()
    run.window_rows, run.exchange_seconds, run.paused_seconds = 0, 0.0, 0.0
    if run.mean is not None:
        run.mean.seconds = 0.0
    run._window_start = now
