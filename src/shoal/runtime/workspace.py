"""A run's workspace: shoal writes only into folders it owns, and one run at a time.

Ownership: WORKSPACE/.shoal/workspace.json marks a folder shoal created (or found
empty). A folder that holds anything else is refused with one line naming what it
holds, so `--workspace .` next to a user's files never overwrites them. A
workspace written before this marker existed (only shoal's own files in it) is
adopted.

Lock: WORKSPACE/.shoal/lock is held with an OS-level lock (flock) for the whole
run; the kernel releases it when the process dies however it dies, so a killed
run never leaves the workspace stuck. A second run on a workspace in use is
refused with one line naming the job that holds it.
"""
from __future__ import annotations

import fcntl
import json
import os
import platform
import time
from pathlib import Path
from typing import Optional

from shoal.errors import ShoalError, warn
from shoal.report.writes import cause_of, writing

META = ".shoal"
# what shoal writes into a workspace (a folder holding only these, without the marker, is an older shoal workspace)
OWN_ENTRIES = {META, "checkpoint", "metrics.jsonl", "summary.json", "job.conf", "logs", "visualization", "tensorboard", "data"}


class WorkspaceError(ShoalError, ValueError):
    """The workspace cannot be used as asked (not ours, in use, would overwrite, nothing to resume, ...)."""


def _own(name: str) -> bool:
    """One of shoal's files, or a set-aside copy of one (metrics.jsonl.2, visualization.1)."""
    base = name.rsplit(".", 1)[0] if name.rsplit(".", 1)[-1].isdigit() else name
    return name in OWN_ENTRIES or base in OWN_ENTRIES


def check_location(workspace: Path) -> Path:
    """Refuse places no run should write into; return the resolved folder."""
    resolved = Path(workspace).expanduser().resolve()
    if resolved == Path(resolved.anchor):
        raise WorkspaceError(f"workspace {workspace}: is the filesystem root; give a folder of its own")
    if resolved == Path.home().resolve():
        raise WorkspaceError(f"workspace {workspace}: is your home directory itself; give a folder of its own")
    if resolved.exists() and not resolved.is_dir():
        raise WorkspaceError(f"workspace {workspace}: exists and is not a folder")
    return resolved


def claim(workspace: Path) -> None:
    """Create the workspace, or check that shoal owns it; mark it as shoal's."""
    folder = Path(workspace)
    check_location(folder)
    marker = folder / META / "workspace.json"
    if marker.is_file():
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise WorkspaceError(f"workspace {workspace}: cannot be created ({cause_of(err)})") from None
    entries = sorted(p.name for p in folder.iterdir())
    foreign = [name for name in entries if not _own(name)]
    ours = [name for name in entries if name in ("checkpoint", "metrics.jsonl")]
    if foreign or (entries and not ours):
        shown = ", ".join((foreign or entries)[:3]) + (", ..." if len(foreign or entries) > 3 else "")
        raise WorkspaceError(
            f"workspace {workspace} ({folder.resolve()}): holds files shoal did not write ({shown}); "
            "shoal writes only into an empty or new folder: give another --workspace"
        )
    with writing(marker):
        (folder / META).mkdir(exist_ok=True)
        marker.write_text(json.dumps({"created_by": "shoal", "time": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")


class WorkspaceLock:
    """Held for a whole run: `with WorkspaceLock(ws, job_name): ...`."""

    def __init__(self, workspace: Path, job_name: str):
        self.path = Path(workspace) / META / "lock"
        self.job_name = job_name
        self._file = None

    def __enter__(self) -> "WorkspaceLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = _holder(f.read())
            f.close()
            raise WorkspaceError(f"workspace {self.path.parent.parent} is in use by {holder}; "
                                 "wait for it to end or give another --workspace") from None
        try:
            with writing(self.path):
                f.seek(0)
                f.truncate()
                f.write(json.dumps({"job": self.job_name, "pid": os.getpid(), "host": platform.node(),
                                    "started": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
                f.flush()
        except BaseException:
            f.close()
            raise
        self._file = f
        return self

    def __exit__(self, *exc) -> None:
        if self._file is not None:
            self._file.close()  # closing releases the lock
            self._file = None


def _holder(text: str) -> str:
    try:
        info = json.loads(text)
        return f"job {info['job']!r} (pid {info['pid']} on {info['host']}, started {info['started']})"
    except (ValueError, KeyError, TypeError):
        return "another run"


def prepare(workspace: Path, resume: bool, log) -> Optional[Path]:
    """Refuse to clobber an earlier run; clean what a killed run left; return the checkpoint to resume from."""
    from shoal.neuralnet import checkpoint as ckpt_io

    for stale in ckpt_io.remove_stale_temporaries(workspace):
        log(f"Removed {stale}: a checkpoint a stopped run did not finish writing")
    existing = ckpt_io.list_checkpoints(workspace)
    if resume:
        if not existing:
            raise WorkspaceError(f"{workspace}: no checkpoint to resume from")
        return newest_readable(existing)
    if existing:
        raise WorkspaceError(
            f"{workspace} already holds checkpoints (newest: {existing[-1][1].name}); "
            "use --resume to continue that run or --workspace to start a new one"
        )
    metrics = Path(workspace) / "metrics.jsonl"
    if metrics.exists():  # an earlier run that died before its first checkpoint: keep its metrics
        n = 1
        while metrics.with_name(f"metrics.jsonl.{n}").exists():
            n += 1
        metrics.rename(metrics.with_name(f"metrics.jsonl.{n}"))
    return None


def newest_readable(checkpoints: list[tuple[int, Path]]) -> Path:
    """The newest checkpoint that loads and matches its checksum; a warning for each newer one that does not."""
    from shoal.neuralnet import checkpoint as ckpt_io

    unreadable = []
    for _, path in reversed(checkpoints):
        try:
            ckpt_io.load(path)
        except ckpt_io.CheckpointError as err:
            unreadable.append(str(err))
            continue
        for problem in unreadable:
            warn(f"WARNING: {problem}; resuming from the older {path.name}")
        return path
    raise WorkspaceError(f"{checkpoints[-1][1].parent}: no readable checkpoint to resume from (newest: {unreadable[0]})")
