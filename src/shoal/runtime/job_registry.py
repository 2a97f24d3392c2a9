"""The job registry: one JSON file per job in a folder, no server (SINGA used ZooKeeper for this).

$SHOAL_HOME/jobs/<id>.json (default ~/.shoal/jobs) holds the job's name, job file, workspace,
processes (rank, host, pid), status and times. `shoal run` registers a job and keeps its status
current; `shoal jobs list | view ID | kill ID` read and act on the files.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from shoal.errors import ShoalError
from shoal.report.metrics import read_metrics


def registry_dir() -> Path:
    return Path(os.environ.get("SHOAL_HOME", Path.home() / ".shoal")) / "jobs"


class JobNotFound(ShoalError, ValueError):
    pass


@dataclass
class JobRecord:
    id: int
    name: str
    job_file: str
    workspace: str
    status: str = "running"  # running | finished | failed | killed
    started: float = field(default_factory=time.time)
    ended: Optional[float] = None
    processes: list[dict] = field(default_factory=list)  # {"rank", "host", "pid", "start"}
    message: str = ""

    @property
    def path(self) -> Path:
        return registry_dir() / f"{self.id}.json"

    def save(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        os.replace(tmp, self.path)

    def live_status(self) -> str:
        """`running` only while one of its processes on this host is alive; else `died`."""
        if self.status != "running":
            return self.status
        here = socket.gethostname()
        local = [p for p in self.processes if p["host"] == here]
        if local and not any(_alive(p["pid"], p.get("start")) for p in local):
            return "died"
        return "running"


def start_time(pid: int) -> Optional[int]:
    """When process `pid` started (clock ticks since boot, /proc/PID/stat field 22); None where unknown."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def process_entry(rank, pid: int) -> dict:
    """How the registry remembers a process: a pid alone could be reused by another program after it ends."""
    return {"rank": rank, "host": socket.gethostname(), "pid": pid, "start": start_time(pid)}


def _alive(pid: int, start: Optional[int] = None) -> bool:
    """Whether `pid` is still the job's process: alive, not a zombie, and started when it did."""
    if start is not None and start_time(pid) not in (None, start):
        return False  # the pid now belongs to another process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped) answers signal 0 but is not running
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def register(name: str, job_file: str, workspace: Path) -> JobRecord:
    """A new job with the next free id (ids are claimed with an exclusive create, race-free)."""
    folder = registry_dir()
    folder.mkdir(parents=True, exist_ok=True)
    ids = [int(p.stem) for p in folder.glob("*.json") if p.stem.isdigit()]
    next_id = max(ids, default=0) + 1
    while True:
        try:
            fd = os.open(folder / f"{next_id}.json", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.close(fd)
            break
        except FileExistsError:
            next_id += 1
    record = JobRecord(next_id, name, job_file, str(Path(workspace).resolve()))
    record.processes = [process_entry(0, os.getpid())]
    record.save()
    return record


def load(job_id: int) -> JobRecord:
    path = registry_dir() / f"{job_id}.json"
    try:
        return JobRecord(**json.loads(path.read_text()))
    except FileNotFoundError:
        raise JobNotFound(f"job {job_id}: no such job in {registry_dir()}") from None


def all_jobs() -> list[JobRecord]:
    folder = registry_dir()
    out = []
    for p in sorted(folder.glob("*.json"), key=lambda p: int(p.stem) if p.stem.isdigit() else 0):
        try:
            out.append(JobRecord(**json.loads(p.read_text())))
        except (json.JSONDecodeError, TypeError):
            continue  # a file being created right now
    return out


def finish(record: JobRecord, status: str, message: str = "") -> None:
    record.status, record.ended, record.message = status, time.time(), message
    record.save()


def kill(job_id: int) -> JobRecord:
    """SIGTERM every live process of the job on this host; mark it killed. A job that already ended is left as it is."""
    record = load(job_id)
    status = record.live_status()
    if status != "running":
        raise JobNotFound(f"job {job_id}: not running ({status}); nothing to kill")
    here = socket.gethostname()
    for proc in record.processes:
        if proc["host"] == here and _alive(proc["pid"], proc.get("start")):
            try:
                os.kill(proc["pid"], signal.SIGTERM)
            except ProcessLookupError:
                pass
    finish(record, "killed")
    return record


def last_metrics(record: JobRecord) -> dict[str, dict]:
    """The newest record of each phase in the job's metrics.jsonl."""
    path = Path(record.workspace) / "metrics.jsonl"
    latest: dict[str, dict] = {}
    if path.exists():
        for r in read_metrics(path):
            latest[r["phase"]] = r
    return latest
