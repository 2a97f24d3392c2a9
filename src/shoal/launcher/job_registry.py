"""The job registry: one JSON file per job in a folder, no server (SINGA used ZooKeeper for this).

$SHOAL_HOME/jobs/<id>.json (default ~/.shoal/jobs) holds the job's name, job file, workspace,
processes (rank, host, pid, start time, command line), status and times. `shoal run` registers a job
and keeps its status current; `shoal jobs list | view ID | kill ID` read and act on the files.

The folder (0700) and its files (0600) are the user's own. Whatever else lies there is read as untrusted:
only regular files of the user's, at most MAX_RECORD_BYTES, every field type-checked; anything else is one
line naming the file and what is wrong.

A record names processes, but it is a file: copied, edited or downloaded, it can name any process of the user's
with its start time and command line. So the process that registers a job holds a POSIX write lock on
<id>.lock (0600, made afresh) until it finishes, and `kill` signals only a process of the record that still
matches it and is that lock's holder, as the kernel names it, or was started by the holder (its ranks):
provably this job's run (launcher/process_identity.py). The lock goes with the process: a run that ended,
a reboot or a record of another machine leaves nothing to prove. The lock file of a run killed with SIGKILL
stays; the next `shoal jobs list` or registration removes it (`remove_stale_locks`).
"""
from __future__ import annotations

import fcntl
import json
import math
import os
import re
import socket
import stat
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Optional

from shoal.errors import ShoalError
from shoal.report.metrics import read_metrics
from shoal.launcher import process_identity
from shoal.launcher.process_identity import SignalRefused, start_time  # noqa: F401 (start_time: part of this module's API)

MAX_RECORD_BYTES = 1 << 20  # a record of thousands of processes is far smaller
STATUSES = ("running", "finished", "failed", "killed")
_RECORD_NAME = re.compile(r"[1-9][0-9]{0,17}\.json")
_LOCK_NAME = re.compile(r"[1-9][0-9]{0,17}\.lock")
_LATEST_TIME = 1e11  # seconds since 1970 (year 5138): beyond it a time is not one shoal wrote

_held: dict[int, int] = {}  # job id -> the descriptor of its lock file, for each job this process runs


def registry_dir() -> Path:
    return Path(os.environ.get("SHOAL_HOME", Path.home() / ".shoal")) / "jobs"


def lock_path(job_id: int) -> Path:
    """The file whose POSIX lock the process running job `job_id` holds: what proves a process is the job's run."""
    return registry_dir() / f"{job_id}.lock"


class JobNotFound(ShoalError, ValueError):
    pass


class BadRecord(ShoalError, ValueError):
    """A file in the registry that is not a record shoal wrote for this user: `str()` names the file and why."""


class RegistryError(ShoalError, OSError):
    """The registry folder itself cannot be used (not the user's own, not a folder, not writable)."""


class StaleRecord(ShoalError, ValueError):
    """`jobs kill` found no process of the job that provably is its run: nothing was signalled."""


@dataclass
class JobRecord:
    id: int
    name: str
    job_file: str
    workspace: str
    status: str = "running"  # running | finished | failed | killed
    started: float = field(default_factory=time.time)
    ended: Optional[float] = None
    processes: list[dict] = field(default_factory=list)  # {"rank", "host", "pid", "start", "cmdline"}
    message: str = ""

    @property
    def path(self) -> Path:
        return registry_dir() / f"{self.id}.json"

    def save(self) -> None:
        _write_new(self.path.parent, json.dumps(asdict(self), indent=1), lambda tmp: os.replace(tmp, self.path))

    def live_status(self) -> str:
        """`running` only while one of its processes on this host is alive; else `died`."""
        if self.status != "running":
            return self.status
        here = socket.gethostname()
        local = [p for p in self.processes if p["host"] == here]
        if local and not any(_alive(p["pid"], p.get("start")) for p in local):
            return "died"
        return "running"


def process_entry(rank, pid: int) -> dict:
    """How the registry remembers a process: a pid alone could be reused by another program after it ends."""
    return {"rank": rank, "host": socket.gethostname(), "pid": pid, "start": start_time(pid),
            "cmdline": process_identity.command_line(pid)}


def identified(entry: dict) -> dict:
    """A process entry another process published (rank, host, pid), with start time and command line where it runs here."""
    if entry.get("host") == socket.gethostname() and "start" not in entry:
        return process_entry(entry["rank"], entry["pid"])
    return entry


def _alive(pid: int, start: Optional[int] = None) -> bool:
    """Whether `pid` is still the job's process: alive, not a zombie, and started when it did."""
    still_running, _ = process_identity.mismatch(pid, start, None)
    return still_running


# --- writing -------------------------------------------------------------------------------------------------

def _private_folder() -> Path:
    """The registry folder, created 0700; one that another user owns is refused rather than written into."""
    folder = registry_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        info = os.stat(folder)
        if info.st_uid != os.geteuid():
            raise RegistryError(f"{folder}: the job registry belongs to uid {info.st_uid}, not to you; "
                                f"set SHOAL_HOME to a folder of your own")
        if stat.S_IMODE(info.st_mode) & 0o077:  # made by an older shoal under the umask: others could plant records
            os.chmod(folder, 0o700)
    except FileExistsError:
        raise RegistryError(f"{folder}: not a folder; the job registry needs it (or set SHOAL_HOME)") from None
    except RegistryError:
        raise
    except OSError as err:
        raise RegistryError(f"{folder}: cannot use it as the job registry ({err.strerror})") from None
    return folder


def _write_new(folder: Path, text: str, put_in_place) -> None:
    """Write `text` to a fresh 0600 file in `folder`, then `put_in_place(tmp_path)` it (rename or link) whole."""
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".record-", suffix=".tmp")  # mkstemp creates 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        put_in_place(tmp)
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass  # renamed into place


def register(name: str, job_file: str, workspace: Path) -> JobRecord:
    """A new job with the next free id (claimed by linking the written record to its name: exclusive and whole)."""
    folder = _private_folder()
    ids = [int(entry.name[:-5]) for entry in os.scandir(folder) if _RECORD_NAME.fullmatch(entry.name)]
    record = JobRecord(max(ids, default=0) + 1, name, job_file, str(Path(workspace).resolve()))
    record.processes = [process_entry(0, os.getpid())]
    while True:
        try:
            _write_new(folder, json.dumps(asdict(record), indent=1), lambda tmp: os.link(tmp, record.path))
            break
        except FileExistsError:
            record.id += 1
    try:
        _hold_lock(record.id)
    except RegistryError as err:
        finish(record, "failed", str(err))
        raise
    remove_stale_locks()
    return record


def take_over(record: JobRecord, rank: int) -> None:
    """This process (rank `rank`'s supervisor under torchrun) stands for a running job whose registering process died and
    whose place another took (launcher/supervisor.py): it holds the job's lock from now on and is the rank's entry, so
    that `jobs kill` signals it (it stops its child) and `finish` closes the record."""
    _hold_lock(record.id)
    record.processes = [p for p in record.processes if p["rank"] != rank] + [process_entry(rank, os.getpid())]
    record.save()


def running_record(workspace: Path) -> Optional[JobRecord]:
    """The newest running record of a job in `workspace` (None: none)."""
    here = os.path.realpath(workspace)
    found = [r for r in all_jobs() if r.status == "running" and os.path.realpath(r.workspace) == here]
    return max(found, key=lambda r: r.id, default=None)


def finish(record: JobRecord, status: str, message: str = "") -> None:
    record.status, record.ended, record.message = status, time.time(), message
    try:
        record.save()
    finally:
        _release_lock(record.id)


def _hold_lock(job_id: int) -> None:
    """Make the job's lock file afresh and hold a POSIX write lock on it until `finish` (or this process ends)."""
    path = lock_path(job_id)
    try:
        try:
            os.unlink(path)  # left by a run of an earlier job with this id (the id was free: nothing runs it)
        except FileNotFoundError:
            pass
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as err:
        raise RegistryError(f"{path}: cannot make the job's lock ({err.strerror})") from None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(fd)
        raise RegistryError(f"{path}: cannot lock it ({err.strerror})") from None
    _held[job_id] = fd


def _release_lock(job_id: int) -> None:
    fd = _held.pop(job_id, None)
    if fd is None:  # a job this process did not register (or finished already)
        return
    try:
        os.unlink(lock_path(job_id))
    except OSError:
        pass
    os.close(fd)  # the lock goes with it


def remove_stale_locks() -> list[Path]:
    """The lock files that runs killed with SIGKILL (or a reboot) left behind: removed, and returned.

    Only a regular file of this user's with one name (never through a link), that nobody holds a lock on, of a job
    whose record says it is no longer running (it ended, or its processes here are gone). Its id stays taken by that
    record, so no new run can be making a lock of that name meanwhile. A lock without a record is left alone, and
    so are the locks this process holds (looking at one would release it)."""
    folder = registry_dir()
    try:
        names = [entry.name for entry in os.scandir(folder) if _LOCK_NAME.fullmatch(entry.name)]
    except OSError:
        return []
    removed = []
    for name in names:
        job_id, path = int(name[:-5]), folder / name
        if job_id in _held:
            continue
        try:
            if process_identity.lock_holder(path) is not None:  # (opened with O_NOFOLLOW; NotALock: not shoal's)
                continue
            if _read_record(folder / f"{job_id}.json", job_id).live_status() == "running":
                continue
            os.unlink(path)  # removes the name; follows no link
        except (OSError, process_identity.NotALock, BadRecord):
            continue
        removed.append(path)
    return removed


# --- reading -------------------------------------------------------------------------------------------------

class Registry(NamedTuple):
    records: list[JobRecord]
    problems: list[str]  # one line per file that is not a usable record


def load(job_id: int) -> JobRecord:
    path = registry_dir() / f"{job_id}.json"
    try:
        return _read_record(path, job_id)
    except FileNotFoundError:
        raise JobNotFound(f"job {job_id}: no such job in {registry_dir()}") from None


def read_all() -> Registry:
    """Every record in the registry, by id, and one line for each file there that is not a good record."""
    folder = registry_dir()
    try:
        names = [entry.name for entry in os.scandir(folder) if _RECORD_NAME.fullmatch(entry.name)]
    except FileNotFoundError:
        return Registry([], [])
    except OSError as err:
        raise RegistryError(f"{folder}: cannot read the job registry ({err.strerror})") from None
    records, problems = [], []
    for name in sorted(names, key=lambda n: int(n[:-5])):
        try:
            records.append(_read_record(folder / name, int(name[:-5])))
        except FileNotFoundError:
            continue  # removed while we looked
        except BadRecord as err:
            problems.append(f"{err}; skipped")
    return Registry(records, problems)


def all_jobs() -> list[JobRecord]:
    return read_all().records


def _read_record(path: Path, job_id: int) -> JobRecord:
    """The record in `path`, read as hostile input: no blocking open, no symlink, no file of another user, size-limited."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise
    except OSError as err:
        raise BadRecord(f"{path}: cannot look at it ({err.strerror})") from None
    kind = _kind(info.st_mode)
    if kind:
        raise BadRecord(f"{path}: {kind}, not a job record")
    _check_owner(path, info)
    try:  # the lstat above and this open may see different files: check again on what was opened
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as err:
        if isinstance(err, FileNotFoundError):
            raise
        raise BadRecord(f"{path}: cannot open it ({err.strerror})") from None
    try:
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (info.st_dev, info.st_ino) or _kind(opened.st_mode):
            raise BadRecord(f"{path}: replaced while being read")
        _check_owner(path, opened)
        data = _read_at_most(fd, MAX_RECORD_BYTES + 1)
    except OSError as err:
        raise BadRecord(f"{path}: cannot read it ({err.strerror})") from None
    finally:
        os.close(fd)
    if len(data) > MAX_RECORD_BYTES:
        raise BadRecord(f"{path}: larger than {MAX_RECORD_BYTES >> 20} MiB, not a job record")
    try:
        parsed = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError as err:
        raise BadRecord(f"{path}: not text (byte {err.start} is not UTF-8), not a job record") from None
    except json.JSONDecodeError as err:
        raise BadRecord(f"{path}:{err.lineno}:{err.colno}: not JSON ({err.msg})") from None
    except RecursionError:
        raise BadRecord(f"{path}: not a job record (nested too deeply)") from None
    except ValueError as err:  # NaN, Infinity; an integer of thousands of digits
        raise BadRecord(f"{path}: not a job record ({str(err)[:80]})") from None
    return _record_from(parsed, path, job_id)


def _kind(mode: int) -> str:
    """What a non-regular file is, in words; "" for a regular file."""
    for test, words in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
                        (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return words
    return "" if stat.S_ISREG(mode) else "not a regular file"


def _check_owner(path: Path, info: os.stat_result) -> None:
    if info.st_uid != os.geteuid():
        raise BadRecord(f"{path}: owned by uid {info.st_uid}, not by you")
    if stat.S_IMODE(info.st_mode) & 0o022:
        raise BadRecord(f"{path}: other users may write it (mode {stat.S_IMODE(info.st_mode):o})")


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks, size = [], 0
    while size < limit:
        chunk = os.read(fd, min(1 << 16, limit - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number a record holds")


# --- what a record must hold ---------------------------------------------------------------------------------

def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_time(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value) and 0 <= value <= _LATEST_TIME


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_pid(value: Any) -> bool:
    return _is_int(value) and 1 < value < 1 << 22  # the kernel's PID_MAX_LIMIT; 1 is init, 0 and below are groups


_RECORD_FIELDS = {  # name: (check, what it must be, default when absent or ... when required)
    "id": (lambda v: _is_int(v) and v >= 1, "a job id (an integer of 1 or more)", ...),
    "name": (_is_str, "a string", ...),
    "job_file": (_is_str, "a string", ...),
    "workspace": (_is_str, "a string", ...),
    "status": (lambda v: v in STATUSES, "one of " + ", ".join(STATUSES), ...),
    "started": (_is_time, "a time (seconds since 1970)", ...),
    "ended": (lambda v: v is None or _is_time(v), "a time (seconds since 1970) or null", None),
    "processes": (lambda v: isinstance(v, list), "a list", ...),
    "message": (_is_str, "a string", ""),
}
_PROCESS_FIELDS = {
    "rank": (lambda v: v == "launcher" or (_is_int(v) and 0 <= v < 1 << 31), "a rank (an integer of 0 or more) or \"launcher\"", ...),
    "host": (_is_str, "a string", ...),
    "pid": (_is_pid, "a process id (an integer above 1)", ...),
    "start": (lambda v: v is None or (_is_int(v) and v >= 0), "a start time (clock ticks since boot) or null", None),
    "cmdline": (lambda v: v is None or (isinstance(v, list) and all(_is_str(a) for a in v)), "a list of strings or null", None),
}


def _fields(data: Any, spec: dict, path: Path, where: str) -> dict:
    """`data`'s known fields, each checked; unknown fields are ignored (a newer shoal may add some)."""
    if not isinstance(data, dict):
        raise BadRecord(f"{path}: {where or 'the record'} is not a JSON object")
    out = {}
    for name, (check, expected, default) in spec.items():
        if name not in data:
            if default is ...:
                raise BadRecord(f"{path}: {where}{name} is missing")
            out[name] = default
            continue
        value = data[name]
        if not check(value):
            shown = json.dumps(value)
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            raise BadRecord(f"{path}: {where}{name} is {shown}, expected {expected}")
        out[name] = value
    return out


def _record_from(data: Any, path: Path, job_id: int) -> JobRecord:
    values = _fields(data, _RECORD_FIELDS, path, "")
    if values["id"] != job_id:
        raise BadRecord(f"{path}: id is {values['id']}, but the file is named for job {job_id}")
    values["processes"] = [_fields(p, _PROCESS_FIELDS, path, f"processes[{i}].") for i, p in enumerate(values["processes"])]
    return JobRecord(**values)


# --- acting on a record --------------------------------------------------------------------------------------

def kill(job_id: int) -> tuple[JobRecord, list[str]]:
    """SIGTERM each process of the job on this host that provably is its run; mark the job killed.

    A process is signalled when it still matches its record (pid, start time, owner, command line) and holds the
    job's lock or was started by the process that does. Returns the record and one line for each process left
    alone. Nothing is signalled (StaleRecord) when no process qualifies; a job that already ended is left as it is.
    """
    record = load(job_id)
    if record.status != "running":
        raise JobNotFound(f"job {job_id}: not running ({record.status}); nothing to kill")
    here = socket.gethostname()
    local = [p for p in record.processes if p["host"] == here]
    if not local:
        hosts = sorted({p["host"] for p in record.processes})
        raise StaleRecord(f"job {job_id}: no process of it runs on this host ({here}); "
                          f"run `shoal jobs kill` where it runs ({', '.join(hosts) or 'no host recorded'})")
    if record.live_status() == "died":
        gone = [f"rank {p['rank']}: {process_identity.mismatch(p['pid'], p['start'], None)[1]}" for p in local]
        raise StaleRecord(f"job {job_id}: not running (died); its record is stale ({_some(gone)}), nothing signalled")
    if job_id in _held:  # (asking the kernel who holds the lock would open and close the file: ours would go)
        raise StaleRecord(f"job {job_id}: run by this very process; nothing signalled")
    pinned = [process_identity.Pinned(p["pid"]) for p in local]  # before any check: no pid reused in between
    try:
        holder, unproven = _lock_holder(job_id)
        reasons = [pin.mismatch(p["start"], p["cmdline"]) or _not_the_run(pin.pid, holder, unproven)
                   for p, pin in zip(local, pinned)]
        signalled, left = 0, []
        for proc, pin, reason in zip(local, pinned, reasons):
            if not reason:
                try:
                    reason = pin.terminate()
                except SignalRefused as err:
                    reason = str(err)
                if reason and pin.exited:  # it ended since its check (the launcher, signalled first, ends its ranks)
                    continue
            if reason:
                left.append(f"rank {proc['rank']}: {reason}")
            else:
                signalled += 1
    finally:
        for pin in pinned:
            pin.close()
    if not signalled:
        raise StaleRecord(f"job {job_id}: no process of it is provably its run ({_some(left)}); nothing signalled")
    finish(record, "killed")
    return record, left


def _lock_holder(job_id: int) -> tuple[Optional[int], str]:
    """The pid holding the job's lock, or None and why nothing proves a process is the job's run."""
    path = lock_path(job_id)
    try:
        holder = process_identity.lock_holder(path)
    except FileNotFoundError:
        return None, f"its lock {path} is gone (a record of an older shoal, or of a run that ended)"
    except OSError as err:
        return None, f"its lock {path} cannot be read ({err.strerror})"
    except process_identity.NotALock as err:
        return None, f"its lock {path} is {err}"
    if not holder:  # None: nobody; 0: a process the kernel cannot name in this PID namespace
        return None, f"nothing here holds its lock {path}"
    return holder, ""


def _not_the_run(pid: int, holder: Optional[int], unproven: str) -> str:
    """Why process `pid` is not provably the job's run: "" when it holds the job's lock or the holder started it."""
    if holder is None:
        return f"pid {pid} is not shown to be this job's run: {unproven}"
    if pid == holder or process_identity.descends_from(pid, holder):
        return ""
    return (f"pid {pid} is not shown to be this job's run: it neither holds the job's lock nor was started by its holder "
            f"(pid {holder})")


def _some(reasons: list[str]) -> str:
    return "; ".join(reasons[:3]) + ("; ..." if len(reasons) > 3 else "")


def last_metrics(record: JobRecord) -> dict[str, dict]:
    """The newest record of each phase in the job's metrics.jsonl; none where that is not a readable regular file
    of metrics (the record names the path: a FIFO there must not hang `jobs view`, nor a binary file break it)."""
    path = Path(record.workspace) / "metrics.jsonl"
    latest: dict[str, dict] = {}
    try:
        found = read_metrics(path) if path.is_file() else []
    except (OSError, UnicodeDecodeError):
        return latest
    for r in found:
        if isinstance(r, dict) and isinstance(r.get("phase"), str):
            latest[r["phase"]] = r
    return latest
