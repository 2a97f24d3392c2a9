"""TensorBoard event files for a run (`tensorboard: true` or `shoal run --tensorboard`).

Every metrics record becomes scalars named PHASE/METRIC (train/loss,
test/accuracy, train/samples_per_sec, ...) at the record's step, stamped with
the wall-clock time it was measured, so TensorBoard's "relative" axis shows the
same seconds as `shoal plot --x time`.
"""
from __future__ import annotations

import time
from pathlib import Path

from shoal.report.errors import ReportError
from shoal.report.writes import narrow_modes, own_folder

EVENTS_DIR = "tensorboard"
INSTALL_HINT = "tensorboard: true needs the tensorboard package: pip install 'shoal[tensorboard]'"


def require_tensorboard() -> None:
    """Fail in one line before training starts when the package is missing."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ReportError(INSTALL_HINT) from None


class TensorBoardLog:
    """A MetricsLog observer writing WORKSPACE/tensorboard/events.out.tfevents.*."""

    def __init__(self, workspace: Path, elapsed_before: float = 0.0):
        require_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        folder = Path(workspace) / EVENTS_DIR
        own_folder(folder)  # a real folder of this user's, never a link; TensorBoard opens its event file itself
        self.writer = SummaryWriter(log_dir=str(folder))
        narrow_modes(folder)  # made under the umask: no other user may write it
        self.wall_start = time.time() - elapsed_before

    def observe(self, record: dict) -> None:
        phase = record.get("phase", "train")
        walltime = self.wall_start + float(record.get("time") or 0.0)
        for key, value in record.items():
            if key in ("step", "time", "phase") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            self.writer.add_scalar(f"{phase}/{key}", value, record["step"], walltime=walltime)
        if phase != "train":
            self.writer.flush()

    def annotate(self, fields: dict) -> None:
        """Scalars only: a run's annotations (histograms of counts) stay in summary.json."""

    def close(self, status: str, elapsed: float) -> None:
        self.writer.close()
