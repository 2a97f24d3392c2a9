"""A write of one of shoal's files that the machine refused (disk full, quota, read-only, permission): one line.

Every file shoal writes into a workspace (checkpoints, metrics.jsonl, summary.json, the net drawings,
the rank logs) turns the OS's refusal into `WorkspaceWriteError`, which names the file and the cause
(`shoal: cannot write WS/checkpoint/step200-worker0.safetensors: no space left on device`); the CLI
prints it as one line with exit status 2, like every ShoalError.
"""
from __future__ import annotations

import errno
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Union

from shoal.errors import ShoalError

# the machine's faults, in the words a user searches for (strerror's, lower-cased, for the rest)
CAUSES = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EIO: "input/output error",
}
# errors that say the workspace cannot be written at all (not that one file is wrong)
UNWRITABLE = {errno.EROFS, errno.EACCES, errno.EPERM}


class WorkspaceWriteError(ShoalError):
    """shoal could not write one of its files; `str()` names the file and the OS's reason, in one line."""

    def __init__(self, path: Union[str, Path], cause: str, code: int | None = None):
        self.path = Path(path)
        self.source = str(path)
        self.errno = code
        self.cause = cause
        super().__init__(f"shoal: cannot write {path}: {cause}")


def error_code(err: BaseException) -> int | None:
    """The errno of an OSError, or of a library's error that quotes one (safetensors: "... (os error 28)")."""
    if isinstance(err, OSError) and err.errno is not None:
        return err.errno
    found = re.search(r"os error (\d+)", str(err))
    return int(found.group(1)) if found else None


def cause_of(err: BaseException) -> str:
    code = error_code(err)
    if code in CAUSES:
        return CAUSES[code]
    if code is not None:
        return os.strerror(code).lower()
    return (str(err).splitlines() or [type(err).__name__])[0]


def write_error(path: Union[str, Path], err: BaseException) -> WorkspaceWriteError:
    """The one-line error for `err`, raised while writing `path`."""
    return WorkspaceWriteError(path, cause_of(err), error_code(err))


@contextmanager
def writing(path: Union[str, Path]) -> Iterator[None]:
    """`with writing(path): ...`: an OSError inside becomes WorkspaceWriteError naming `path`."""
    try:
        yield
    except OSError as err:
        raise write_error(path, err) from None


def is_writable(folder: Union[str, Path]) -> bool:
    """Whether this process may create files in `folder` (False on a read-only mount, whoever we are)."""
    folder = Path(folder)
    if not folder.is_dir():
        return True  # made when first written; its parent says no then
    try:
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return False
    except OSError:
        return False
    return os.access(folder, os.W_OK)


def as_write_error(err: BaseException, workspace: Union[str, Path]) -> "WorkspaceWriteError | None":
    """An OSError the machine raised while shoal wrote into `workspace` (any of its files), as one line; else None.

    The backstop for the writes that do not name their file themselves (job.conf, the lock, the logs,
    the net drawings): only a fault of the machine (CAUSES) on a path inside the workspace qualifies.
    """
    if isinstance(err, WorkspaceWriteError):
        return err
    if not isinstance(err, OSError) or err.errno not in CAUSES:
        return None
    if not err.filename:  # a write() or print() to an open file (a rank's log): the workspace's disk, if it is full
        return WorkspaceWriteError(workspace, CAUSES[err.errno], err.errno) if _out_of_space(workspace) else None
    path = Path(os.fsdecode(err.filename))
    try:
        inside = path.resolve().is_relative_to(Path(workspace).resolve())
    except (OSError, RuntimeError):
        return None
    return write_error(path, err) if inside else None


def _out_of_space(workspace: Union[str, Path]) -> bool:
    """The workspace's filesystem is read-only or (next to) full: 64 kB or less left to this process."""
    try:
        st = os.statvfs(workspace)
    except OSError:
        return False
    return bool(st.f_flag & os.ST_RDONLY) or st.f_bavail * st.f_frsize <= 64 * 1024
