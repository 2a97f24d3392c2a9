"""Which process a pid is now, from /proc, and a signal only to a process that provably is a job's run.

A pid alone names whichever process holds it today: the job's process may have ended and its pid gone to
another program. The registry therefore records each process's start time (/proc/PID/stat field 22,
clock ticks since boot) and command line (/proc/PID/cmdline), and `shoal jobs kill` signals a pid only
while both still match and the process is the user's own. Those can be copied into a record, though, for
any process (a `sleep` started at the right moment): what proves a process is the job's run is the lock
the run holds, which no other process can hold. The process that registered a job holds a POSIX write
lock on the job's lock file for as long as it runs; the kernel names its holder (`lock_holder`, F_GETLK)
and the job's other processes descend from it (`descends_from`: the ranks it forked). The signal goes
through a pidfd opened before the checks (`Pinned`), so a pid reused in between cannot receive it.
"""
from __future__ import annotations

import fcntl
import os
import signal
import stat
import struct
from pathlib import Path
from typing import Optional

from shoal.errors import ShoalError


class SignalRefused(ShoalError, PermissionError):
    """The process exists and matches, but the system does not let this user signal it."""


class NotALock(ShoalError, ValueError):
    """A file named as a job's lock that shoal did not make: its lockers prove nothing."""


def start_time(pid: int) -> Optional[int]:
    """When process `pid` started (clock ticks since boot); None where there is no such process or no /proc."""
    return _stat_number(pid, 19)


def command_line(pid: int) -> Optional[list[str]]:
    """Process `pid`'s argv as the kernel shows it; None where unknown (gone, no /proc, or a kernel thread)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read(1 << 20)
    except OSError:
        return None
    if not raw:
        return None
    return [os.fsdecode(arg) for arg in raw.rstrip(b"\0").split(b"\0")]


def owner(pid: int) -> Optional[int]:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def parent(pid: int) -> Optional[int]:
    """Process `pid`'s parent (/proc/PID/stat field 4); None where unknown."""
    return _stat_number(pid, 1)


def descends_from(pid: int, ancestor: int) -> bool:
    """Whether `ancestor` started `pid`, directly or through its children (a rank forked by the launcher's forkserver)."""
    for _ in range(64):  # deeper than any chain shoal makes; a loop in a racing /proc ends here too
        pid = parent(pid)
        if pid is None or pid <= 1:
            return False
        if pid == ancestor:
            return True
    return False


def is_zombie(pid: int) -> bool:
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] == "Z"


def _stat_number(pid: int, index: int) -> Optional[int]:
    """The number at `index` of _stat_fields (0 is /proc/PID/stat's field 3); None where unknown."""
    fields = _stat_fields(pid)
    try:
        return int(fields[index]) if fields else None
    except (IndexError, ValueError):
        return None


def _stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat after the command name (which may hold spaces and parentheses): field 3 onwards."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read(4096).decode("ascii", "replace")
        return text.rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def mismatch(pid: int, start: Optional[int], cmdline: Optional[list[str]]) -> tuple[bool, str]:
    """Why `pid` is not the recorded process: (still_running, reason), or (True, "") when it is.

    still_running is False where the recorded process has plainly ended (no such pid, a zombie, or a pid
    now held by a process started at another time): then the record is merely stale.
    """
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 1:
        return False, f"pid {pid!r} is not a single process (a pid must be above 1)"
    now = start_time(pid)
    if now is None or is_zombie(pid):
        return False, f"pid {pid} has exited"
    if start is None:
        return True, f"pid {pid}: the record has no start time to check it against"
    if now != start:
        return False, f"pid {pid} is another process now (started at another time)"
    uid = owner(pid)
    if uid != os.geteuid():
        return True, f"pid {pid} belongs to uid {uid}, not to you"
    if cmdline is None:
        return True, f"pid {pid}: the record has no command line to check it against (written by an older shoal)"
    if command_line(pid) != cmdline:
        return True, f"pid {pid} runs another command than the record names"
    return True, ""


# struct flock as F_GETLK fills it (short l_type, l_whence; off_t l_start, l_len; pid_t l_pid), native layout, with
# room to spare for the padding a platform adds after it
_FLOCK = "hhqqi"


def lock_holder(path: Path) -> Optional[int]:
    """The pid of the process holding a POSIX write lock on the file `path` (0: one outside this PID namespace);
    None when nobody holds one. OSError when the file cannot be opened (never through a symbolic link), NotALock when
    it is not a regular file of this user's with one name.

    The kernel records which process took a POSIX lock, and F_GETLK names it. Its holder must not call this: a
    process's close of any descriptor of the file releases its POSIX locks on it.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_nlink != 1:
            # a hard link would name whoever locks the file it shares (a program's database): not a lock shoal made
            raise NotALock("not a lock file shoal made (a regular file of yours with one name)")
        asked = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0) + bytes(32)
        kind, _, _, _, pid = struct.unpack_from(_FLOCK, fcntl.fcntl(fd, fcntl.F_GETLK, asked))
    finally:
        os.close(fd)
    return None if kind == fcntl.F_UNLCK else pid


class Pinned:
    """Process `pid` held through a pidfd from before it is checked until it is signalled: if it ends and its pid is
    reused meanwhile, the signal finds the ended process, not the new one. Close it when done."""

    def __init__(self, pid: int):
        self.pid, self.exited, self._handle = pid, False, None
        try:
            self._handle = os.pidfd_open(pid) if pid > 1 else None
        except ProcessLookupError:
            self.exited = True
        except (OSError, AttributeError):  # a kernel or Python without pidfds: check, then signal by pid
            pass

    def close(self) -> None:
        if self._handle is not None:
            os.close(self._handle)
            self._handle = None

    def mismatch(self, start: Optional[int], cmdline: Optional[list[str]]) -> str:
        """Why this is not the recorded process ("" when it is): `mismatch`'s reason, or this very command."""
        if self.exited:
            return f"pid {self.pid} has exited"
        _, reason = mismatch(self.pid, start, cmdline)
        if not reason and self.pid == os.getpid():
            reason = f"pid {self.pid} is this very command"
        return reason

    def terminate(self) -> str:
        """SIGTERM it; "" when signalled, else why not."""
        try:
            if self._handle is not None:
                signal.pidfd_send_signal(self._handle, signal.SIGTERM)
            else:
                os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            self.exited = True
            return f"pid {self.pid} has exited"
        except PermissionError as err:
            raise SignalRefused(f"pid {self.pid}: not permitted to signal it ({err.strerror})") from None
        return ""
