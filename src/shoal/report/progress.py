"""What a run shows the person at the terminal: a progress bar while it trains, one line when it ends.

The bar (rich) draws on stderr only when stderr is a terminal: steps done, elapsed and remaining
time, and the latest training loss. Piped or captured output never sees it, so logs and pipes hold
exactly the SINGA-style lines.
"""
from __future__ import annotations

import atexit
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from shoal.report.metrics import MetricWindow
from shoal.report.summary import SUMMARY_FILE, read_summary

REDRAW_SECONDS = 0.25
ERASE = "\r\x1b[2K"  # to the line's start, then clear it


class TrainingBar:
    """A one-line step bar on stderr; log lines passed through `above` print above it, not through it.

    rich renders the line (at most every REDRAW_SECONDS: rendering costs milliseconds); the bar
    writes it itself, so a logged line only erases it and puts the last rendering back. Nothing
    redraws in the background: a run stopped by an exception leaves the bar still, and
    `close_open_bars` erases it before the error is printed.
    """

    open_bars: set["TrainingBar"] = set()

    def __init__(self, total: int, initial: int = 0):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self.console = Console(stderr=True)
        self.shown = self.console.is_terminal
        self.loss: Optional[float] = None
        self.line, self.rendered = "", 0.0
        if not self.shown:
            return
        # never started: only its rendering is used
        self.progress = Progress(
            TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
            TimeElapsedColumn(), TextColumn("elapsed,"), TimeRemainingColumn(), TextColumn("left"),
            TextColumn("{task.fields[loss]}"), console=self.console, auto_refresh=False,
        )
        self.task = self.progress.add_task("train", total=total, completed=initial, loss="")
        TrainingBar.open_bars.add(self)
        self._draw(render=True)

    def advance(self, window: Optional[MetricWindow] = None) -> None:
        """One step done; `window`: the open display window, whose loss average is the latest loss."""
        if not self.shown:
            return
        redraw = time.monotonic() - self.rendered >= REDRAW_SECONDS  # tiny models take thousands of steps a second
        # read only when drawn: a loss on a device is read to the host (a wait for the device), not every step
        loss = window.averages().get("loss") if window and redraw else None
        if loss is not None:
            self.loss = loss
        self.progress.update(self.task, advance=1, loss="" if self.loss is None else f"loss {self.loss:.4g}")
        if redraw:
            self._draw(render=True)

    def above(self, log: Callable[[str], None]) -> Callable[[str], None]:
        """`log` that erases the bar while it prints (both usually share the terminal), then puts it back."""
        if not self.shown:
            return log

        def log_above(line: str) -> None:
            if not self.shown:
                return log(line)
            self._write(ERASE)
            try:
                log(line)
                sys.stdout.flush()
            finally:
                self._draw()

        return log_above

    def close(self) -> None:
        if self.shown:
            self._write(ERASE)
            self.shown = False
        TrainingBar.open_bars.discard(self)

    def _draw(self, render: bool = False) -> None:
        if render:
            with self.console.capture() as captured:
                self.console.print(self.progress.get_renderable(), width=max(20, self.console.size.width - 1),
                                   no_wrap=True, crop=True, end="")
            self.line, self.rendered = captured.get().split("\n")[0], time.monotonic()
        self._write(ERASE + self.line)

    def _write(self, text: str) -> None:
        self.console.file.write(text)
        self.console.file.flush()


def close_open_bars() -> None:
    """Take down every bar still drawn (a run that ended by an exception), before anything else prints."""
    for bar in list(TrainingBar.open_bars):
        bar.close()


atexit.register(close_open_bars)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def _at(point: dict, metric: str) -> str:
    return f"{point[metric]:.4g} (step {point['step']})"


def _tested(point: dict, metric: str) -> str:
    """`0.8906 on 1000 test samples (step 300)`: what a test measured, and on how many samples."""
    on = f" on {point['samples']} test samples" if isinstance(point.get("samples"), int) else ""
    return f"{point[metric]:.4g}{on} (step {point['step']})"


def _missed(summary: dict) -> list[str]:
    """`worker group 1 applied 1,034 of 6,000 updates (dropped: process 1 stopped answering)`: every group that did
    not train all its steps (summary.json's missed_updates), and why where the launcher knows."""
    said = []
    for group, missed in sorted((summary.get("missed_updates") or {}).items(), key=lambda item: int(item[0])):
        why = f" ({missed['why']})" if missed.get("why") else ""
        if isinstance(missed.get("applied"), int) and isinstance(missed.get("expected"), int):
            said.append(f"worker group {group} applied {missed['applied']:,} of {missed['expected']:,} updates{why}")
        elif isinstance(missed.get("meetings"), int) and isinstance(missed.get("of"), int):  # Local SGD: the groups' meetings
            said.append(f"worker group {group} came to {missed['meetings']:,} of {missed['of']:,} meetings{why}")
        elif missed.get("rejoined_at"):  # Distributed Hogwild: restarted, it rejoined from the other groups' values
            steps = missed["rejoined_at"]
            skipped = ((summary.get("missed_steps") or {}).get(group) or {}).get("missed")  # the steps it skipped to its peers'
            skipping = f", skipping {skipped:,} step{'s' if skipped != 1 else ''}" if isinstance(skipped, int) else ""
            said.append(f"worker group {group} was restarted and rejoined at step{'s' if len(steps) > 1 else ''} "
                        f"{', '.join(f'{s:,}' for s in steps)}{skipping}{why}")
        else:
            said.append(f"worker group {group} stopped before the end{why}")
    return said


def _reshared(summary: dict) -> list[str]:
    """`the 11 skipped steps were re-trained beyond step 240: 6 by worker group 0 and 5 by worker group 1`: Distributed
    Hogwild's groups re-train the steps a restarted group skipped at their end (summary.json's reshared_steps)."""
    reshared = summary.get("reshared_steps") or {}
    by_group = {g: n for g, n in (reshared.get("by_group") or {}).items() if isinstance(n, int) and n > 0}
    if not isinstance(reshared.get("skipped"), int) or not reshared["skipped"]:
        return []
    who = " and ".join(f"{n:,} by worker group {g}" for g, n in sorted(by_group.items(), key=lambda item: int(item[0])))
    text = f"the {reshared['skipped']:,} skipped step{'s' if reshared['skipped'] != 1 else ''} "
    text += (f"{'were' if reshared['skipped'] != 1 else 'was'} re-trained beyond step {summary.get('train_steps'):,}: {who}"
             if who else "were not re-trained")
    retrained = reshared.get("retrained")
    if isinstance(retrained, int) and 0 < retrained < reshared["skipped"]:
        text += f" ({reshared['skipped'] - retrained:,} not: their groups had finished or died)"
    return [text]


def _succeeded(summary: dict) -> list[str]:
    """`process 1 took the chief's place after step 13`: summary.json's chief_succession (report/succession.py)."""
    said = []
    for taken in summary.get("chief_succession") or []:
        if isinstance(taken, dict) and isinstance(taken.get("process"), int) and isinstance(taken.get("after_step"), int):
            said.append(f"process {taken['process']} took the chief's place after step {taken['after_step']:,}")
    return said


def _missed_steps(summary: dict) -> list[str]:
    """`process 2 missed 12 of 200 steps (missing from steps 37 to 48, back at step 49)`: a synchronous group's
    processes that some steps went on without (summary.json's missed_steps; a group's own, Distributed Hogwild's, is
    said with its missed_updates)."""
    groups = summary.get("missed_updates") or {}
    said = []
    for rank, missed in sorted((summary.get("missed_steps") or {}).items(), key=lambda item: int(item[0])):
        if rank in groups or not isinstance(missed, dict) or not isinstance(missed.get("missed"), int):
            continue
        of = f" of {missed['of']:,}" if isinstance(missed.get("of"), int) else ""
        why = f" ({missed['why']})" if missed.get("why") else ""
        counted = missed["of"] if of else missed["missed"]  # "missed 1 of 40 steps", "missed 1 step"
        said.append(f"process {rank} missed {missed['missed']:,}{of} step{'s' if counted != 1 else ''}{why}")
    return said


def _restarted(summary: dict) -> list[str]:
    """`the whole job restarted 2 times (35 steps re-done)`: summary.json's job_restarts (--max-restarts)."""
    restarts = summary.get("job_restarts") or []
    if not restarts:
        return []
    times = "once" if len(restarts) == 1 else f"{len(restarts)} times"
    redone = summary.get("steps_redone")
    return [f"the whole job restarted {times}" + (f" ({redone:,} step{'s' if redone != 1 else ''} re-done)"
                                                 if isinstance(redone, int) else "")]


def _trained(summary: dict) -> str:
    """`Trained 700 steps (300 → 1000) in 1 min 02 s (900 samples/s)`: this run's part, and the whole when it resumed."""
    latest = summary.get("latest_run") or {}
    steps, wall, rate = summary.get("steps", 0), summary.get("wall_time") or 0.0, summary.get("samples_per_sec")
    resumed_at = latest.get("from_step") or 0
    if resumed_at:  # a resumed run: its own steps, time and speed first
        text = f"Trained {latest.get('steps', 0)} steps ({resumed_at} → {steps}) in {_duration(latest.get('wall_time') or 0.0)}"
        rate = latest.get("samples_per_sec")
    else:
        text = f"Trained {steps} steps in {_duration(wall)}"
    if rate:
        text += f" ({rate:.0f} samples/s)"
    if resumed_at:
        text += f"; {steps} steps in {_duration(wall)} in all"
    return text


def closing_line(workspace: Path) -> str:
    """One line saying what a finished run did, from its summary.json (and where its checkpoint is)."""
    from shoal.neuralnet import checkpoint as ckpt_io

    workspace = Path(workspace)
    summary = read_summary(workspace)
    if summary is None:
        return f"Run ended; {workspace / SUMMARY_FILE} is missing or unreadable"
    parts = [_trained(summary), *_restarted(summary), *_succeeded(summary), *_missed(summary), *_missed_steps(summary),
             *_reshared(summary)]
    final, best = summary.get("final_test") or {}, summary.get("best_test") or {}
    metric = next((m for m in ("accuracy", "loss") if isinstance(final.get(m), (int, float))), None)
    if metric is not None:
        parts.append(f"final test {metric} {_tested(final, metric)}, best {_at(best, metric)}" if metric in best else f"final test {metric} {_tested(final, metric)}")
    checkpoint = ckpt_io.latest(workspace)
    if checkpoint is not None:
        parts.append(f"checkpoint {checkpoint}")
    parts.append(f"summary {workspace / SUMMARY_FILE}")
    return "; ".join(parts)
