"""A write of one of shoal's files that the machine refused (disk full, quota, read-only, permission): one line.

Every file shoal writes into a workspace (checkpoints, metrics.jsonl, summary.json, the net drawings,
the rank logs) turns the OS's refusal into `WorkspaceWriteError`, which names the file and the cause
(`shoal: cannot write WS/checkpoint/step200-worker0.safetensors: no space left on device`); the CLI
prints it as one line with exit status 2, like every ShoalError.

`open_in_workspace`, `write_file`, `replace_file`, `open_for_append` and `own_folder` follow no link at the
file nor at the folder holding it (O_NOFOLLOW, the file opened, and a replacement renamed, relative to that
folder's descriptor): a link standing where shoal writes is refused in one line, never written through
(docs/security.md, "The workspace"). What they create has a mode of its own (folders 0755, files 0644),
which a umask can narrow but never widen: shoal's own output passes its own workspace check.
"""
from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
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
    the path otherwise, and for the machine's refusals (full, read-only). A file it creates has `mode` (0644:
    a umask can narrow it, never widen it)."""
    path = Path(path)
    folder = open_folder(path.parent, named=path)
    try:
        return _open_at(folder, path, flags, mode)
    finally:
        os.close(folder)


def open_folder(folder: Union[str, Path], named: Union[str, Path, None] = None) -> int:
    """A descriptor of `folder`, opened following no link at its own name (the names above it are the workspace's,
    which shoal.launcher.workspace checked), for at-style calls inside it. WorkspaceWriteError names the folder when
    it is a link or no folder, and `named` (the file to be written there) for the machine's refusals."""
    folder = Path(folder)
    try:
        return os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        raise (_refusal(folder, "folder") or write_error(named or folder, err)) from None


def _open_at(folder: int, path: Path, flags: int, mode: int) -> int:
    """os.open of `path`'s name inside the folder descriptor `folder`, as open_in_workspace opens it."""
    try:
        fd = os.open(path.name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, mode, dir_fd=folder)
    except OSError as err:
        raise (_refusal(path, "file") or write_error(path, err)) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise WorkspaceWriteError(path, "is not a regular file")
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_file(path: Union[str, Path], data: bytes, new: bool = False) -> None:
    """`path` holds `data` (written through no link); new: the file must not exist yet (O_EXCL)."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if new else os.O_TRUNC)
    fd = open_in_workspace(path, flags)
    try:
        with writing(path):
            _write_all(fd, data)
    finally:
        os.close(fd)


def replace_file(path: Union[str, Path], data: bytes, temp_name: str | None = None, durable: bool = False) -> None:
    """`path` holds `data`, whole or not at all: written to a temp file beside it, then renamed over `path`, every
    step relative to the folder's descriptor and through no link. A link (or anything but a regular file) at the
    temp's name or at `path` is refused in one line, never followed nor replaced. durable: the file and the rename
    are fsync'd (a checkpoint). temp_name: the temp's name (one a killed run left there is removed first: the temp
    is always made afresh, 0644); else a fresh random one. The temp is removed when the write fails; the machine's
    refusals name `path`."""
    path = Path(path)
    temp = path.with_name(temp_name or f".{path.name}.{secrets.token_hex(6)}.tmp")
    folder = open_folder(path.parent, named=path)
    try:
        if temp_name:
            _check_replaceable(folder, temp)
            try:
                os.unlink(temp.name, dir_fd=folder)
            except FileNotFoundError:
                pass
            except OSError as err:
                raise write_error(path, err) from None
        fd = _open_at(folder, temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                _write_all(fd, data)
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            _check_replaceable(folder, path)
            os.rename(temp.name, path.name, src_dir_fd=folder, dst_dir_fd=folder)  # a rename follows no link
            if durable:
                os.fsync(folder)  # the new entry survives a power loss
        except BaseException as err:
            try:
                os.unlink(temp.name, dir_fd=folder)
            except OSError:
                pass
            if isinstance(err, OSError):
                raise write_error(path, err) from None
            raise
    finally:
        os.close(folder)


def _check_replaceable(folder: int, path: Path) -> None:
    """What stands at `path` (inside the folder descriptor `folder`) is a regular file, or nothing."""
    try:
        st = os.stat(path.name, dir_fd=folder, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise WorkspaceWriteError(path, NOT_FOLLOWED)
    if not stat.S_ISREG(st.st_mode):
        raise WorkspaceWriteError(path, "is not a regular file")


def open_for_append(path: Union[str, Path]):
    """`path` opened to append lines to (a log), line-buffered, through no link; its folder made by own_folder."""
    path = Path(path)
    own_folder(path.parent)
    return os.fdopen(open_in_workspace(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a", buffering=1)


def own_folder(path: Union[str, Path], mode: int = 0o755) -> None:
    """The folder `path` exists, made here with `mode` (0755: writable by this user only, as a umask can narrow a
    mode but never widen it) or found as a real folder: a link or a file there is refused in one line."""
    path = Path(path)
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        refused = _refusal(path, "folder")
        if refused is not None:
            raise refused from None
    except OSError as err:
        raise write_error(path, err) from None


def own_folders(path: Union[str, Path], mode: int = 0o755) -> None:
    """`path` and every missing folder above it made with `mode` (as `mkdir -p -m`, the parents too: under a umask
    of 000 `mkdir -p` would leave them writable by every user); what exists is left as it is."""
    path = Path(path)
    missing = []
    while not os.path.lexists(path) and path != path.parent:
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        own_folder(folder, mode)


def narrow_modes(folder: Union[str, Path]) -> None:
    """The regular files of this user's in `folder` that its group or others may write lose those bits: for the
    files a library creates itself under the umask (TensorBoard's event files). Follows no link; what cannot be
    changed is left."""
    try:
        fd = open_folder(folder)
    except WorkspaceWriteError:
        return
    try:
        for name in os.listdir(fd):
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o022:
                    entry = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=fd)
                    try:
                        opened = os.fstat(entry)
                        if (opened.st_dev, opened.st_ino) == (st.st_dev, st.st_ino):
                            os.fchmod(entry, stat.S_IMODE(opened.st_mode) & ~0o022)
                    finally:
                        os.close(entry)
            except OSError:
                continue
    finally:
        os.close(fd)


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
