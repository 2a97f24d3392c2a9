"""A run's workspace: shoal writes only under its own names, and one run at a time.

Layout: a workspace may hold the user's own files (SINGA's examples use the
example's folder, with its job.conf and data, as the workspace). shoal writes
only under OUTPUT_NAMES at the top (checkpoint/, logs/, metrics.jsonl, ...) and
under .shoal/, where it keeps its marker, its lock and its copy of the job, so
a user's job.conf is never touched. It refuses in one line when one of those
names is the user's: a file or folder of that name was there when shoal first
claimed the folder (WORKSPACE/.shoal/workspace.json records which), or a file
stands where shoal needs a folder. A workspace written by an older shoal (only
shoal's files in it, its job copy at the top as job.conf) is adopted and its
job copy still read.

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
from shoal.report.job_copy import JOB_COPY, META
from shoal.report.writes import cause_of, writing

# what a run writes at a workspace's top level (and set-aside copies of them: metrics.jsonl.2, visualization.1)
OUTPUT_NAMES = ("checkpoint", "logs", "visualization", "tensorboard", "metrics.jsonl", "summary.json")
FOLDERS = {META, "checkpoint", "logs", "visualization", "tensorboard", "data"}
FIT_DATA = "data"  # shoal.fit writes the arrays it is given here
LEGACY_JOB_COPY = "job.conf"  # where shoal kept that copy before workspaces could hold the user's files
# what older shoals wrote at the top: a folder holding only these, without the marker, is an older shoal workspace
LEGACY_ENTRIES = {META, *OUTPUT_NAMES, LEGACY_JOB_COPY, FIT_DATA}
# names the marker records when they were the user's at the claim: shoal never writes or reads them as its own
RECORDED = (*OUTPUT_NAMES, FIT_DATA, LEGACY_JOB_COPY)


class WorkspaceError(ShoalError, ValueError):
    """The workspace cannot be used as asked (a name of shoal's is the user's, in use, would overwrite, ...)."""


def _legacy(name: str) -> bool:
    """One of the files older shoals wrote, or a set-aside copy of one (metrics.jsonl.2, visualization.1)."""
    base = name.rsplit(".", 1)[0] if name.rsplit(".", 1)[-1].isdigit() else name
    return name in LEGACY_ENTRIES or base in LEGACY_ENTRIES


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


def claim(workspace: Path, writes: tuple[str, ...] = ()) -> None:
    """Create the workspace, or check that none of the names shoal writes (OUTPUT_NAMES and `writes`) is the user's.

    The first claim of a folder records which of shoal's names were already the
    user's (so a later shoal.fit never writes into the user's data/); nothing is
    written when a name is refused.
    """
    folder = Path(workspace)
    resolved = check_location(folder)
    marker = folder / META / "workspace.json"
    fresh = not marker.is_file()
    if fresh:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise WorkspaceError(f"workspace {workspace}: cannot be created ({cause_of(err)})") from None
        entries = {p.name for p in folder.iterdir()}
        older_shoal = all(map(_legacy, entries)) and _holds_shoals_run(folder)
        users = set() if older_shoal else entries & set(RECORDED)
    else:
        users = set(user_entries(folder))
    names = (*OUTPUT_NAMES, *writes) + ((META,) if fresh else ())
    taken = [n for n in names if os.path.lexists(folder / n) and (n in users or is_users(folder, n))]
    if taken:
        shown = ", ".join(str(resolved / n) for n in taken[:2]) + (", ..." if len(taken) > 2 else "")
        raise WorkspaceError(
            f"workspace {workspace}: {shown} {'is' if len(taken) == 1 else 'are'} not shoal's but shoal writes "
            f"its own {', '.join(taken[:2])} there; move {'it' if len(taken) == 1 else 'them'} or give another --workspace"
        )
    if fresh:
        with writing(marker):
            (folder / META).mkdir(exist_ok=True)
            marker.write_text(json.dumps({"created_by": "shoal", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                          "user_entries": sorted(users)}) + "\n")


def _holds_shoals_run(folder: Path) -> bool:
    """shoal's checkpoints or summary are there (a user's file merely named metrics.jsonl is not enough)."""
    from shoal.neuralnet import checkpoint as ckpt_io
    from shoal.report.summary import read_summary

    summary = read_summary(folder) if (folder / "summary.json").is_file() else None
    return bool(ckpt_io.list_checkpoints(folder)) or (isinstance(summary, dict) and {"schema", "status"} <= summary.keys())


def user_entries(workspace: Path) -> list[str]:
    """Which of shoal's names were the user's when shoal claimed the workspace (none for an older shoal's marker)."""
    try:
        recorded = json.loads((Path(workspace) / META / "workspace.json").read_text()).get("user_entries", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [n for n in recorded if isinstance(n, str)] if isinstance(recorded, list) else []


def is_users(workspace: Path, name: str) -> bool:
    """WORKSPACE/name is the user's, not shoal's (recorded so at the claim, or a file where shoal keeps a folder)."""
    path = Path(workspace) / name
    if not os.path.lexists(path):
        return False
    return name in user_entries(workspace) or (name in FOLDERS and not path.is_dir())


def job_copy(workspace: Path) -> Optional[Path]:
    """The workspace's copy of its job: .shoal/job.conf, or an older shoal's job.conf at the top (never the user's)."""
    current = Path(workspace) / JOB_COPY
    if current.is_file():
        return current
    legacy = Path(workspace) / LEGACY_JOB_COPY
    if legacy.is_file() and LEGACY_JOB_COPY not in user_entries(workspace):
        return legacy
    return None


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
            ckpt_io.load(path, parts=True)  # a resume needs every part
        except ckpt_io.CheckpointError as err:
            unreadable.append(str(err))
            continue
        for problem in unreadable:
            warn(f"WARNING: {problem}; resuming from the older {path.name}")
        return path
    raise WorkspaceError(f"{checkpoints[-1][1].parent}: no readable checkpoint to resume from (newest: {unreadable[0]})")
