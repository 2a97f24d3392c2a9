"""The chief's metrics log with its observers: summary.json always, TensorBoard when asked."""
from __future__ import annotations

from pathlib import Path

from shoal.config import job_pb2
from shoal.metrics import MetricsLog
from shoal.report.summary import SummaryFile, run_info

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


def end_status(error: BaseException | None) -> str:
    """What a run's summary says about how it ended."""
    if error is None:
        return "finished"
    return "interrupted" if isinstance(error, KeyboardInterrupt) else "failed"
