"""The chief's metrics log with its observers: summary.json always, TensorBoard when asked."""
from __future__ import annotations

from pathlib import Path

from shoal.config import job_pb2
from shoal.report.metrics import MetricsLog
from shoal.report.summary import SummaryFile, mark_ended, run_info

METRICS_FILE = "metrics.jsonl"


def open_run_log(job: job_pb2.JobProto, workspace: Path, elapsed_before: float, devices: list[str], threads_per_worker: int) -> MetricsLog:
    workspace = Path(workspace)
    path = workspace / METRICS_FILE
    observers: list = []
    if job.tensorboard:
        from shoal.report.tensorboard import TensorBoardLog

        observers.append(TensorBoardLog(workspace, elapsed_before))
    summary = SummaryFile(workspace, run_info(job, devices, threads_per_worker), path)
    return MetricsLog(path, elapsed_before=elapsed_before, observers=[summary, *observers])


class Terminated(KeyboardInterrupt):
    """SIGTERM (`shoal jobs kill`) stopped the run: handled as Ctrl-C, recorded as `killed`."""


def end_status(error: BaseException | None) -> str:
    """What a run's summary says about how it ended."""
    if error is None:
        return "finished"
    if isinstance(error, Terminated):
        return "killed"
    return "interrupted" if isinstance(error, KeyboardInterrupt) else "failed"


def mark_run_ended(workspace: Path, error: BaseException) -> None:
    """The launcher's word on how a run ended, for a chief process killed before it could say."""
    mark_ended(workspace, Path(workspace) / METRICS_FILE, end_status(error))
