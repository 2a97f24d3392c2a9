"""Which process a pid is now, from /proc, and a signal only to the process the registry recorded.

A pid alone names whichever process holds it today: the job's process may have ended and its pid gone to
another program. The registry therefore records each process's start time (/proc/PID/stat field 22,
clock ticks since boot) and command line (/proc/PID/cmdline), and `shoal jobs kill` signals a pid only
while both still match and the process is the user's own. The signal goes through a pidfd opened before
the check, so a pid reused between the check and the signal cannot receive it.
"""
from __future__ import annotations

import os
import signal
from typing import Optional

from shoal.errors import ShoalError


class SignalRefused(ShoalError, PermissionError):
    """The process exists and matches, but the system does not let this user signal it."""


def start_time(pid: int) -> Optional[int]:
    """When process `pid` started (clock ticks since boot); None where there is no such process or no /proc."""
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


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


def is_zombie(pid: int) -> bool:
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] == "Z"


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


def terminate(pid: int, start: Optional[int], cmdline: Optional[list[str]]) -> str:
    """SIGTERM `pid` if it is still the recorded process; "" when signalled, else why not (nothing was sent)."""
    try:
        handle = os.pidfd_open(pid) if pid > 1 else None  # pins this very process before it is checked
    except ProcessLookupError:
        return f"pid {pid} has exited"
    except (OSError, AttributeError):  # a kernel or Python without pidfds: check, then signal by pid
        handle = None
    try:
        _, reason = mismatch(pid, start, cmdline)
        if not reason and pid == os.getpid():
            reason = f"pid {pid} is this very command"
        if reason:
            return reason
        try:
            if handle is not None:
                signal.pidfd_send_signal(handle, signal.SIGTERM)
            else:
                os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return f"pid {pid} has exited"
        except PermissionError as err:
            raise SignalRefused(f"pid {pid}: not permitted to signal it ({err.strerror})") from None
        return ""
    finally:
        if handle is not None:
            os.close(handle)
