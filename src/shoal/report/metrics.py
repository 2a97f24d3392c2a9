"""Metrics: sample-weighted averages, SINGA-style display lines, JSON lines on disk."""
from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from shoal.report.writes import open_in_workspace, own_folders, write_error


class MetricWindow:
    """Averages of reported metrics since the last reset, weighted by sample count.

    Layers report (name, value, count); a display or test line shows
    sum(value·count) / sum(count) per name, as SINGA's Metric class averages
    the values collected since the last display.

    A value may be a 0-d tensor: one on an accelerator is summed where it lives (in float64, the same
    arithmetic as the host's) and read to the host only when the window is read (averages, state,
    non_finite), so that a training step does not wait for its device to report its loss.
    """

    def __init__(self) -> None:
        self._sums: dict[str, Any] = {}  # a float, or a float64 0-d tensor on the device that reported it
        self._counts: dict[str, int] = {}
        self._finish: dict[str, Callable[[float], float]] = {}  # applied to the mean (perplexity: exp of the mean loss)
        self._lock = threading.Lock()  # the workers of a group report from their threads

    def report(self, name: str, value: Any, count: int = 1, finish: Optional[Callable[[float], float]] = None) -> None:
        """Add `value` (a mean over `count` samples: a number or a 0-d tensor); `finish` maps the window's mean to
        the shown value."""
        on_device = _is_tensor(value) and value.device.type != "cpu"
        if _is_tensor(value) and not on_device:
            value = value.item()  # on the host reading costs nothing
        with self._lock:
            total = self._sums.get(name, 0.0)
            if on_device:
                # float64 where the sum lives (the first reporting device): the host's float(value) * count, added in order
                value = value.detach().to(total.device if _is_tensor(total) else value.device, _float64())
                self._sums[name] = total + value * count
            else:
                self._sums[name] = total + float(value) * count
            self._counts[name] = self._counts.get(name, 0) + count
            if finish is not None:
                self._finish[name] = finish

    def _read(self) -> dict[str, float]:
        """The sums on the host (a device's sum is read here, once)."""
        with self._lock:
            for name, total in self._sums.items():
                if _is_tensor(total):
                    self._sums[name] = float(total)
            return dict(self._sums)

    def averages(self) -> dict[str, float]:
        return self.averages_with([])

    def averages_with(self, others: list[dict]) -> dict[str, float]:
        """The averages over this window and `others` (other processes' windows, as `state()` gives them), weighted by
        their counts: the sums added in the order given, this window's first (every name any of them has)."""
        sums, counts = dict(self._read()), dict(self._counts)
        for other in others:
            for name, total in other["sums"].items():
                sums[name] = sums.get(name, 0.0) + total
                counts[name] = counts.get(name, 0) + other["counts"].get(name, 0)
        means = {k: sums[k] / counts[k] for k in sums if counts.get(k)}
        return {k: _finished(self._finish[k], v) if k in self._finish else v for k, v in means.items()}

    def non_finite(self, read: bool = True) -> dict[str, float]:
        """The metrics whose sum became NaN or infinite (a diverged loss stays so until the window resets).
        read=False: only the sums already on the host (a device's are checked when the window is read)."""
        sums = self._read() if read else {k: v for k, v in self._sums.items() if not _is_tensor(v)}
        return {k: v for k, v in sums.items() if not math.isfinite(v)}

    def reset(self) -> None:
        self._sums.clear()
        self._counts.clear()

    def __bool__(self) -> bool:
        return bool(self._sums)

    # checkpoints carry the open window so a resumed run displays the same numbers
    def state(self) -> dict:
        return {"sums": self._read(), "counts": dict(self._counts)}

    def load_state(self, state: dict) -> None:
        self._sums = {k: float(v) for k, v in state.get("sums", {}).items()}
        self._counts = {k: int(v) for k, v in state.get("counts", {}).items()}


def _is_tensor(value) -> bool:
    torch = sys.modules.get("torch")  # a tensor exists only once torch is imported: `shoal plot` need not import it
    return torch is not None and isinstance(value, torch.Tensor)


def _float64():
    return sys.modules["torch"].float64


def _finished(finish: Callable[[float], float], mean: float) -> float:
    try:
        return float(finish(mean))
    except OverflowError:  # exp of a diverged loss
        return math.inf


# Which way a metric improves: declared by the user (shoal.fit's higher_is_better), else read from its name.
HIGHER_IS_BETTER_WORDS = ("accuracy", "acc", "precision", "recall", "f1", "auc", "bleu", "rouge", "top", "iou", "map", "score")


def higher_is_better(name: str, declared: Optional[dict] = None) -> bool:
    """True when larger values of metric `name` are better: `declared[name]` if given, else from the name
    (accuracy, precision@k, recall, f1, auc, bleu, rouge, top-k, iou, map, score: higher; loss, perplexity,
    error and anything else: lower)."""
    if declared and name in declared:
        return bool(declared[name])
    words = [w for w in name.lower().replace("@", "_").replace("-", "_").split("_") if w]
    return any(w in HIGHER_IS_BETTER_WORDS or w.startswith("top") for w in words)


def _label(name: str) -> str:
    # SINGA prints "Loss = x, accuracy = y": the loss capitalised, the rest as named
    return "Loss" if name == "loss" else name


def format_metrics(values: dict[str, float]) -> str:
    order = sorted(values, key=lambda k: (k != "loss", k))
    return ", ".join(f"{_label(k)} = {values[k]:.6g}" for k in order)


def display_line(phase: str, step: int, values: dict[str, float]) -> str:
    """`Train @ step 30  Loss = 1.96, accuracy = 0.44` (SINGA 0.3's display format)."""
    return f"{phase} @ step {step}  {format_metrics(values)}"


# The metrics.jsonl schema (docs/comparing.md): key -> (phases it appears in, meaning).
# Metric values (loss, accuracy, precision@k, ...) are whatever the net's layers report.
RECORD_KEYS: dict[str, tuple[str, str]] = {
    "step": ("all", "training step the record belongs to (tests at step s run before training step s)"),
    "phase": ("all", "train | test | validate | resume (a resumed run restarts at this step: earlier records from it on are superseded)"),
    "time": ("all", "wall-clock seconds since the run started, carried over across resumes"),
    "loss": ("all", "mean loss over the window (train) or the test/validation batches"),
    "accuracy": ("all", "top-k accuracy, when the net reports it"),
    "perplexity": ("test, validate", "shoal.fit's metrics={'perplexity': shoal.perplexity}: exp of the mean loss over the set "
                   "(any other name a fit metric has is recorded the same way: its sample-weighted mean)"),
    "samples": ("train, test, validate", "train: samples the job processed in the display window (every group's; Distributed Hogwild: the chief "
                "group's times the groups); test/validate: "
                "samples the test ran on (test_steps × batch)"),
    "samples_per_sec": ("train", "samples / window_sec"),
    "window_sec": ("train", "wall seconds of training in the display window (since the previous display, less tests, validation and checkpoints)"),
    "compute_sec": ("train", "seconds of the window the chief's process spent computing gradients (incl. input)"),
    "exchange_sec": ("train", "seconds of the window spent aggregating, updating and communicating"),
    "worker_compute_sec": ("train", "{worker id: compute seconds} for the workers in the chief's process"),
    "batch_shares": ("train", "rows of the batch each worker of the chief's group computed (groups of several workers in one process)"),
    "staleness": ("train", "async runs only: mean version lag of the params the updates used, over the window"),
    "staleness_max": ("train", "async runs only: largest version lag in the window"),
    "pushed_bytes": ("train", "Downpour only: gradient bytes the chief's process pushed to its servers in the window (after cluster.compression)"),
    "sent_bytes": ("train", "bytes the chief's process sent in the window (after cluster.compression): Local SGD / DiLoCo's "
                   "pseudo-gradients handed to the meetings; AllReduce/Sandblaster over processes: gradients to the servers "
                   "of their slices, flags, and (owning slices) the values or encoded sums back (the steps after the last "
                   "display are in summary.json's bytes_sent, every process's)"),
    "sync_bytes": ("train", "Distributed Hogwild only: bytes of the chief group's own syncs in the window, both ways "
                   "(its deltas with their headers and the masters' answers; after cluster.compression)"),
    "meetings": ("train", "Local SGD / DiLoCo only: meetings of the groups so far (one every cluster.local_steps steps)"),
    "groups_met": ("train", "Local SGD / DiLoCo only: worker groups that came to the last meeting (fewer than nworker_groups "
                   "while a group is dead or stalled)"),
    "mode": ("test", "\"test-only\" for `shoal run --test`"),
}
REQUIRED_KEYS = {"all": ("step", "phase", "time"), "train": ("samples", "samples_per_sec", "window_sec", "compute_sec", "exchange_sec")}


def record_problems(record: dict) -> list[str]:
    """How `record` breaks the schema above (empty when it follows it)."""
    required = REQUIRED_KEYS["all"] + (REQUIRED_KEYS["train"] if record.get("phase") == "train" else ())
    problems = [f"missing {k!r}" for k in required if k not in record]
    if record.get("phase") not in (None, "train", "test", "validate", "resume"):
        problems.append(f"phase = {record['phase']!r}")
    for key, value in record.items():
        if key in ("phase", "mode"):
            continue
        if key in ("step", "samples"):
            ok = isinstance(value, int) and value >= 0
        elif key == "batch_shares":  # rows of the batch per worker of the group
            ok = isinstance(value, list) and all(isinstance(v, int) and v >= 0 for v in value)
        elif key == "worker_compute_sec":
            ok = isinstance(value, dict) and all(isinstance(v, (int, float)) for v in value.values())
        else:  # metric values and seconds; a non-finite metric is written as null
            ok = value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))
        if not ok:
            problems.append(f"{key} = {value!r}")
    if isinstance(record.get("time"), (int, float)) and record["time"] < 0:
        problems.append("time is negative")
    return problems


class MetricsLog:
    """Appends one JSON object per line to WORKSPACE/metrics.jsonl.

    Every record has step, phase, time (seconds since the run started, carried
    over across resumes) and the metric values (RECORD_KEYS); lines are written
    as they come so a crashed run's metrics survive. Each line goes out in one
    write; one the disk refuses (full, quota) is cut back off, so the file never
    ends in half a line, and the run stops with WorkspaceWriteError naming the
    file. Observers (the run summary, TensorBoard) see every record as it is
    written and the run's end status.
    """

    def __init__(self, path: Path, elapsed_before: float = 0.0, observers: Sequence = ()):
        self.path = Path(path)
        own_folders(self.path.parent)  # (the workspace: made by its claim already, 0755 whatever the umask)
        self._fd: Optional[int] = open_in_workspace(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT)  # no link followed
        self._lock = threading.Lock()  # the groups of one process run as threads
        self._end_cut_line()
        self._start = time.perf_counter() - elapsed_before
        self.observers = list(observers)

    def elapsed(self) -> float:
        return time.perf_counter() - self._start

    def _end_cut_line(self) -> None:
        """A file an older run left ending in half a line (killed mid-write): end that line, so that the
        next record is a line of its own (readers skip the cut one)."""
        size = os.fstat(self._fd).st_size
        if size == 0:
            return
        if os.pread(self._fd, 1, size - 1) != b"\n":
            self._append(b"\n")

    def _append(self, data: bytes) -> None:
        """`data` at the end of the file, whole or not at all."""
        with self._lock:
            self._append_locked(data)

    def _append_locked(self, data: bytes) -> None:
        start = os.fstat(self._fd).st_size
        try:
            view = memoryview(data)
            while view:  # a short write (the disk filled up mid-line) is followed by the error itself
                view = view[os.write(self._fd, view):]
        except OSError as err:
            try:
                os.ftruncate(self._fd, start)  # no half line left behind
            except OSError:
                pass
            raise write_error(self.path, err) from None

    # a dead chief's successor: the last step of each phase the chief recorded (report/succession.py); an asynchronous
    # group behind the chief reaches those steps again, and their records stay the chief's (one log, each step once)
    recorded_through: dict[str, int] = {}

    def recorded_before(self, step: int, phase: str) -> bool:
        """Whether the dead chief this log's writer succeeded recorded `phase` at `step` already."""
        return step <= self.recorded_through.get(phase, -1)

    def write(self, step: int, phase: str, values: dict[str, float], **extra) -> dict:
        record = {"step": step, "phase": phase, "time": round(self.elapsed(), 4)}
        if self.recorded_before(step, phase):
            return record
        record.update({k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in values.items()})
        record.update(extra)
        if self._fd is not None:
            self._append((json.dumps(record) + "\n").encode())
        for observer in self.observers:
            observer.observe(record)
        return record

    def annotate(self, **fields) -> None:
        """What the run found besides its records (the staleness histogram): the observers keep it with the run."""
        for observer in self.observers:
            observer.annotate(fields)

    def close(self, status: str = "finished", reason: Optional[str] = None) -> None:
        """status: finished | failed | interrupted | killed (what the observers record about the run); reason: why it
        did not finish, in one line. A run that failed still gets its summary where the disk allows (best effort)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        lost = None
        try:
            os.fsync(fd)
        except OSError as err:  # the records may not be on disk: a finished run failed after all
            lost = write_error(self.path, err) if status == "finished" else None
            status, reason = ("failed", str(lost)) if lost else (status, reason)
        finally:
            os.close(fd)
        if reason:
            self.annotate(reason=reason)
        for observer in self.observers:
            observer.close(status, self.elapsed())
        if lost is not None:
            raise lost


def read_metrics(path: Path, start: int = 0) -> list[dict]:
    """Records of a metrics.jsonl from byte `start` (where a resumed run began appending); a line that is not a
    whole JSON object (cut by a crash, or by an older shoal on a full disk) is skipped, and the records after it are kept."""
    records = []
    with open(path, encoding="utf-8", errors="replace") as f:
        f.seek(start)
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                records.append(record)
    return records
