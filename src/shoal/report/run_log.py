"""The chief's metrics log with its observers: summary.json always, TensorBoard when asked."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from shoal.report.metrics import MetricsLog
from shoal.report.summary import SummaryFile, mark_ended, run_info
from shoal.report.writes import WorkspaceWriteError

if TYPE_CHECKING:
    from shoal.planning.plan import JobPlan

METRICS_FILE = "metrics.jsonl"


def open_run_log(plan: "JobPlan", workspace: Path, elapsed_before: float, devices: list[str], resumed_at: int | None = None,
                 started: float | None = None) -> MetricsLog:
    """metrics.jsonl, with summary.json (and TensorBoard event files when the job asks) kept from it (`started`:
    summary.json's start, for a run log another process continues; None: now)."""
    workspace, job = Path(workspace), plan.job
    path = workspace / METRICS_FILE
    observers: list = []
    if job.tensorboard:
        from shoal.report.tensorboard import TensorBoardLog

        observers.append(TensorBoardLog(workspace, elapsed_before))
    summary = SummaryFile(workspace, run_info(plan, devices), path, started)
    try:
        log = MetricsLog(path, elapsed_before=elapsed_before, observers=[summary, *observers])
    except WorkspaceWriteError as err:  # the summary just said `running`: it says why not, where it can
        summary.annotate({"reason": str(err)})
        summary.close("failed", elapsed_before)
        raise
    if resumed_at is not None:  # readers drop what the stopped run recorded from here on
        try:
            log.write(resumed_at, "resume", {})
        except WorkspaceWriteError as err:
            log.close("failed", str(err))
            raise
    return log


class Terminated(KeyboardInterrupt):
    """SIGTERM (`shoal jobs kill`) stopped the run: handled as Ctrl-C, recorded as `killed`."""


def end_status(error: BaseException | None) -> str:
    """What a run's summary says about how it ended."""
    if error is None:
        return "finished"
    if isinstance(error, Terminated):
        return "killed"
    return "interrupted" if isinstance(error, KeyboardInterrupt) else "failed"


def failure_reason(error: BaseException | None) -> str | None:
    """Why a failed run failed, in one line for summary.json (None when it finished or was stopped by a signal)."""
    if end_status(error) != "failed":
        return None
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def mark_run_ended(workspace: Path, error: BaseException, reason: str | None = None, root_cause: bool = False) -> None:
    """The launcher's word on how a run ended, for a chief process killed before it could say (root_cause: the
    launcher's reason replaces the chief's, which saw only what the first failure did to it)."""
    mark_ended(workspace, Path(workspace) / METRICS_FILE, end_status(error), reason, root_cause=root_cause)
