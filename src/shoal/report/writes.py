"""A write of one of shoal's files that the machine refused (disk full, quota, read-only, permission): one line.

Every file shoal writes into a workspace (checkpoints, metrics.jsonl, summary.json, the net drawings,
the rank logs) turns the OS's refusal into `WorkspaceWriteError`, which names the file and the cause
(`shoal: cannot write WS/checkpoint/step200-worker0.safetensors: no space left on device`); the CLI
prints it as one line with exit status 2, like every ShoalError.

`open_in_workspace`, `write_file` and `own_folder` follow no link at the file nor at the folder holding it
(O_NOFOLLOW, the file opened relative to that folder's descriptor): a link standing where shoal writes is
refused in one line, never written through (docs/security.md, "The workspace").
"""
from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
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
# what stands at a path instead of the file or folder shoal writes there
NOT_FOLLOWED = "is a symbolic link (shoal follows no link where it writes in a workspace)"
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


def _refusal(path: Path, expected: str) -> "WorkspaceWriteError | None":
    """Why `path` is not the `expected` ("file" or "folder") shoal may write: a link or another kind of file."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return WorkspaceWriteError(path, NOT_FOLLOWED)
    if expected == "file" and not stat.S_ISREG(st.st_mode):
        return WorkspaceWriteError(path, "is not a regular file")
    if expected == "folder" and not stat.S_ISDIR(st.st_mode):
        return WorkspaceWriteError(path, "is not a folder")
    return None


def open_in_workspace(path: Union[str, Path], flags: int, mode: int = 0o644) -> int:
    """os.open(path, flags) following no link: neither `path` nor the folder holding it may be one, and what
    opens must be a regular file (a FIFO planted there is refused, not waited on). WorkspaceWriteError names
    the path otherwise, and for the machine's refusals (full, read-only)."""
    path = Path(path)
    try:
        folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        raise (_refusal(path.parent, "folder") or write_error(path, err)) from None
    try:
        fd = os.open(path.name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, mode, dir_fd=folder)
    except OSError as err:
        raise (_refusal(path, "file") or write_error(path, err)) from None
    finally:
        os.close(folder)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise WorkspaceWriteError(path, "is not a regular file")
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


def write_file(path: Union[str, Path], data: bytes, new: bool = False) -> None:
    """`path` holds `data` (written through no link); new: the file must not exist yet (O_EXCL)."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if new else os.O_TRUNC)
    fd = open_in_workspace(path, flags)
    try:
        with writing(path):
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def own_folder(path: Union[str, Path], mode: int = 0o755) -> None:
    """The folder `path` exists, made here (writable by this user only, whatever the umask allows) or found as a
    real folder: a link or a file there is refused in one line."""
    path = Path(path)
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        refused = _refusal(path, "folder")
        if refused is not None:
            raise refused from None
    except OSError as err:
        raise write_error(path, err) from None


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
