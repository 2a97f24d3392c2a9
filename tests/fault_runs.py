"""A `shoal run` in the background for the fault tests: start it, wait until a process trains, signal that process
(SIGKILL, SIGSTOP ...), wait for the job's end and read what it wrote.

    def test_x(blobs_job, tmp_path, runs):
        run = runs.start(blobs_job(train_steps=120), tmp_path, "--max-restarts", "1", env=SLOW)
        victim = run.signal(1, signal.SIGKILL)           # once the chief displayed step 10; returns the pid
        stdout, stderr = run.finished()                  # exit status 0, or the assertion shows stderr
        assert pids(run.ws, 1)[0] == victim and summary(run.ws)["status"] == "finished"

The run is a real interpreter (`python -m shoal run JOB --workspace TMP/ws --no-progress ARGS`) in a session of its
own, its output in files (a pipe nobody reads would block the chief), every process it starts tagged with the
test's tmp_path (tests/test_cli.py: `tagged`, `leftover_processes`). The `runs` fixture kills whatever a failed
test left running, stopped processes included.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from layouts import LAYOUTS
from test_cli import alive, leftover_processes, tagged

SLOW = {"SHOAL_SLOW_WORKER": "0:0+0.01"}  # every step of group 0 takes 10 ms or more: the run outlasts a kill and a restart


class Run:
    """`shoal run JOB ARGS` in the background; `ws`, `out` and `err` are its workspace and output files."""

    def __init__(self, job: Path, tmp_path: Path, *args: str, env: dict | None = None, ignore_sigint: bool = False,
                 workspace: Path | None = None):
        """`env` over this process's environment (a value None removes the variable); `ignore_sigint` starts it as
        nohup or `shoal run ... &` in a script would."""
        self.tmp_path = tmp_path
        self.ws, self.out, self.err = workspace or tmp_path / "ws", tmp_path / "stdout.txt", tmp_path / "stderr.txt"
        environment = dict(os.environ, PYTHONUNBUFFERED="1", **tagged(tmp_path))
        for name, value in (env or {}).items():
            if value is None:
                environment.pop(name, None)
            else:
                environment[name] = value
        sigint = signal.SIG_IGN if ignore_sigint else signal.SIG_DFL
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "shoal", "run", str(job), "--workspace", str(self.ws), "--no-progress", *map(str, args)],
                stdout=out, stderr=err, env=environment, start_new_session=True,
                preexec_fn=lambda: signal.signal(signal.SIGINT, sigint))

    def stdout(self) -> str:
        return self.out.read_text()

    def stderr(self) -> str:
        return self.err.read_text()

    def pid_once_training(self, rank: int, step: int = 10, timeout: float = 90) -> int:
        """Process `rank`'s pid (the latest start's, from its log), once the chief displayed `step`."""
        def found():
            assert self.proc.poll() is None, self.stderr()
            return f"Train @ step {step} " in self.stdout() and pids(self.ws, rank)

        wait_for(found, timeout, f"never reached step {step} with process {rank} started: {self.stderr()}", interval=0.05)
        return pids(self.ws, rank)[-1]

    def registered_pid(self, rank, step: int = 10, timeout: float = 90) -> int:
        """Process `rank`'s pid as the job registry holds it (as `shoal jobs view` shows it), once the chief displayed
        `step`; `rank` may be "launcher"."""
        def found():
            assert self.proc.poll() is None, self.stderr()
            return f"Train @ step {step} " in self.stdout() and rank in registered_pids(self.ws)

        wait_for(found, timeout, f"no pid for rank {rank}: {self.stderr()}", interval=0.1)
        return registered_pids(self.ws)[rank]

    def signal(self, rank: int, sig: int, step: int = 10, registry: bool = False) -> int:
        """Send `sig` to process `rank` once the chief displayed `step`; its pid."""
        pid = self.registered_pid(rank, step) if registry else self.pid_once_training(rank, step)
        os.kill(pid, sig)
        return pid

    def wait(self, timeout: float = 180) -> int:
        return self.proc.wait(timeout=timeout)

    def finished(self, code: int = 0, timeout: float = 180) -> tuple[str, str]:
        """(stdout, stderr) once the job ended with exit status `code`."""
        assert self.wait(timeout) == code, self.stderr()
        return self.stdout(), self.stderr()

    def stop(self) -> None:
        """Kill every process of the run (SIGKILL ends a stopped one too)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in leftover_processes(self.tmp_path, wait=0):  # ranks in sessions of their own
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.proc.wait()


class LayoutRun(Run):
    """`shoal run JOB` with a row of tests/layouts.py and a stall timeout: `shoal run JOB --workspace TMP/ws --no-progress
    LAYOUT'S FLAGS --set cluster.stall_timeout_s=S ARGS` (tests/test_stalls.py's runs)."""

    def __init__(self, job: Path, tmp_path: Path, layout: str, *args: str, env: dict | None = None, stall_timeout_s: float = 3.0,
                 timeout_from_environment: bool = False, **kw):
        """The stall timeout as the job field, or as SHOAL_STALL_TIMEOUT (its documented override) over a job field
        that says otherwise."""
        env = {"SHOAL_STALL_TIMEOUT": str(stall_timeout_s) if timeout_from_environment else None, **(env or {})}
        field = stall_timeout_s * 100 if timeout_from_environment else stall_timeout_s
        super().__init__(job, tmp_path, *LAYOUTS[layout].cli(), "--set", f"cluster.stall_timeout_s={field:g}", *args, env=env, **kw)

    def pid_of(self, rank, timeout: float = 90) -> int:
        """Process `rank`'s pid from the job registry, once the chief displayed step 10."""
        return self.registered_pid(rank, timeout=timeout)


class Runs(list):
    """The fixture's list of started runs; `start` starts one and adds it."""

    def start(self, job: Path, tmp_path: Path, *args: str, **kw) -> Run:
        self.append(Run(job, tmp_path, *args, **kw))
        return self[-1]

    def start_layout(self, job: Path, tmp_path: Path, layout: str, *args: str, **kw) -> LayoutRun:
        self.append(LayoutRun(job, tmp_path, layout, *args, **kw))
        return self[-1]


@pytest.fixture
def runs():
    """Runs started by the test, killed at its end (a failed assertion must not leave a job running or stopped)."""
    started = Runs()
    yield started
    for run in started:
        run.stop()


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1) -> float:
    """Seconds until `predicate()` held (fails with `what` after `timeout`)."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, what
        time.sleep(interval)
    return time.monotonic() - start


def pids(ws: Path, rank: int) -> list[int]:
    """The pid of each process that ran rank `rank`, in order, from the start lines of its log."""
    log = ws / "logs" / f"rank{rank}.log"
    if not log.exists():
        return []
    return [int(p) for p in re.findall(r"start on CPU in process \d+ \(pid = (\d+)\)", log.read_text())]


def registered_pids(ws: Path) -> dict:
    """{rank: pid} of the job's latest start in the job registry ("launcher" too)."""
    from shoal.launcher import job_registry

    for record in job_registry.all_jobs():
        if Path(record.workspace) == ws:
            return {p["rank"]: p["pid"] for p in record.processes}
    return {}


def ranks_ended(ws: Path) -> bool:
    """Every process of the job's last start has ended (run in this test's process, whose forkserver lives on)."""
    ranks = {rank: pid for rank, pid in registered_pids(ws).items() if rank != "launcher"}
    return bool(ranks) and not any(alive(pid) for pid in ranks.values())


def assert_job_processes_ended(ws: Path, wait: float = 5.0) -> None:
    """Every process that ran one of the job's ranks has ended (after up to `wait` s for the last to be reaped): each
    worker process of every incarnation (its log's start lines) and each process of the job's last start (the job
    registry: servers too). For a job run in the test's process (cli_in_process), whose ranks fork from that process's
    forkserver and carry no tag for test_cli.leftover_processes to find (a forked process's /proc/PID/environ is its
    exec's)."""
    logs = sorted((ws / "logs").glob("rank*.log"))
    ran = {pid for log in logs for pid in pids(ws, int(log.stem[len("rank"):]))}
    ran |= {pid for rank, pid in registered_pids(ws).items() if rank != "launcher"}  # (the launcher: this process)
    assert ran, f"no process of the job found in {ws}"
    deadline = time.monotonic() + wait
    while any(alive(pid) for pid in ran) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = sorted(pid for pid in ran if alive(pid))
    assert not left, f"left running: {left} of {sorted(ran)}"


def summary(ws: Path) -> dict:
    return json.loads((ws / "summary.json").read_text())


def train_records(ws: Path) -> list[dict]:
    return [json.loads(line) for line in (ws / "metrics.jsonl").read_text().splitlines() if '"phase": "train"' in line]


def closing_line(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("Trained "))


def assert_one_line(stderr: str, *fragments: str) -> str:
    """The one line a failed run printed, holding each fragment, with no traceback."""
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    for fragment in fragments:
        assert fragment in lines[0], stderr
    return lines[0]


def assert_no_library_text(*texts: str) -> None:
    """No gloo/c10d text and no traceback reached the user."""
    for text in texts:
        assert "gloo" not in text.lower() and "c10d" not in text and "Traceback" not in text, text
