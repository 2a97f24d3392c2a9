"""A run folder as the reports see it: its metrics records and its summary, however it ended."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shoal.report.metrics import read_metrics
from shoal.report.errors import ReportError
from shoal.report.run_log import METRICS_FILE
from shoal.report.summary import clean_records, read_summary, summarize
from shoal.report.targets import goals_of


@dataclass
class Run:
    path: Path
    records: list[dict]
    summary: dict | None  # summary.json; None for a run that crashed before writing one

    @property
    def label(self) -> str:
        """Framework and layout from the summary, else the folder name."""
        return (self.summary or {}).get("label") or self.path.name

    def phase(self, name: str) -> list[dict]:
        return [r for r in self.records if r.get("phase") == name and r.get("mode") != "test-only"]

    def derived(self, targets: tuple = ()) -> dict:
        """summarize() of the metrics as they are now (a summary may predate the last records), with the run's
        declared goals and `targets` (shoal compare --target)."""
        return summarize(self.records, goals=goals_of(self.summary), targets=targets)


def load_run(path: Path) -> Run:
    path = Path(path)
    if not path.is_dir():
        raise ReportError(f"{path}: no such run folder")
    metrics = path / METRICS_FILE
    if not metrics.is_file():
        raise ReportError(f"{path}: no {METRICS_FILE} (not a shoal workspace, or the run has not displayed anything yet)")
    try:
        records = read_metrics(metrics)
    except (OSError, UnicodeDecodeError) as err:
        raise ReportError(f"{metrics}: cannot read: {err}") from None
    records = clean_records([r for r in records if isinstance(r, dict)])
    if not records:
        raise ReportError(f"{metrics}: no records")
    return Run(path, records, read_summary(path))


def load_runs(paths: list[Path]) -> list[Run]:
    """Runs with labels made unique (two runs of one layout get their folder names appended)."""
    if not paths:
        raise ReportError("give at least one run folder")
    runs = [load_run(p) for p in paths]
    labels = [r.label for r in runs]
    for run in runs:
        if labels.count(run.label) > 1 and run.summary is not None:
            run.summary = {**run.summary, "label": f"{run.summary['label']} ({run.path.name})"}
    return runs
