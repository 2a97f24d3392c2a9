"""Job management: the registry of plain files, `shoal jobs list | view | kill`."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from cli_in_process import run_cli
from layouts import LAYOUTS

from shoal.launcher import job_registry as jobs


def shoal(*args):
    """`shoal ARGS` in the test's process (tests/cli_in_process.py); the job to kill is a real process."""
    return run_cli(*args)


def test_runs_are_registered_and_listed(blobs_job, tmp_path):
    assert shoal("run", blobs_job(train_steps=3), "--workspace", tmp_path / "ws").returncode == 0
    bad = blobs_job(train_steps=3)
    bad.write_text(bad.read_text().replace("train.bin", "missing.bin"))
    assert shoal("run", bad, "--workspace", tmp_path / "ws2").returncode == 2
    records = jobs.all_jobs()
    assert [(r.id, r.name, r.status) for r in records] == [(1, "blobs-mlp", "finished"), (2, "blobs-mlp", "failed")]
    assert "missing.bin" in records[1].message
    assert all(oct(r.path.stat().st_mode & 0o777) == "0o600" for r in records)  # the user's own (docs/cluster.md)
    assert oct(records[0].path.parent.stat().st_mode & 0o777) == "0o700"
    listing = shoal("jobs", "list").stdout
    assert "blobs-mlp" in listing and "finished" in listing
    view = shoal("jobs", "view", "1").stdout
    assert str(tmp_path / "ws") in view and "last test" in view and "pid" in view


def test_kill_stops_a_running_multi_process_job(blobs_job, tmp_path):
    layout = LAYOUTS["AllReduce, 2 processes"]
    job = blobs_job(train_steps=100000)
    proc = subprocess.Popen([sys.executable, "-m", "shoal", "run", str(job), "--workspace", str(tmp_path / "ws"), *layout.cli()],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, SHOAL_SLOW_WORKER="0:0+0.02"))  # paced: its ranks burn no CPU while it waits
    deadline = time.time() + 60
    while time.time() < deadline:
        records = jobs.all_jobs()
        if records and len(records[0].processes) == 1 + layout.processes and (tmp_path / "ws" / "metrics.jsonl").exists():
            break
        time.sleep(0.1)
    record = jobs.all_jobs()[0]
    assert record.live_status() == "running" and len(record.processes) == 1 + layout.processes  # the launcher and its ranks
    assert all(p["start"] and p["cmdline"] for p in record.processes)  # what `jobs kill` checks before it signals
    assert_listens_only_on_loopback([p["pid"] for p in record.processes])
    assert "running" in shoal("jobs", "list").stdout
    # the launcher holds the job's lock (what proves it is the run); its ranks are signalled as processes it started
    assert jobs.process_identity.lock_holder(jobs.lock_path(record.id)) == record.processes[0]["pid"] == proc.pid
    killed = shoal("jobs", "kill", str(record.id))
    assert killed.returncode == 0 and killed.stderr == "", killed.stderr  # no process of it left alone
    proc.wait(timeout=60)
    assert jobs.load(record.id).status == "killed"
    gone = time.time() + 5  # (a rank may take a moment more to be reaped than its launcher)
    while any(jobs._alive(p["pid"]) for p in record.processes) and time.time() < gone:
        time.sleep(0.05)
    assert not any(jobs._alive(p["pid"]) for p in record.processes)
    assert not jobs.lock_path(record.id).exists()  # the run let go of it as it ended


def assert_listens_only_on_loopback(pids: list[int]) -> None:
    """Nothing of a one-host job listens beyond loopback (c10d's store and gloo both)."""
    import shutil

    import pytest

    if not shutil.which("ss"):
        pytest.skip("ss (iproute2) is not installed")
    lines = subprocess.run(["ss", "-ltnp"], capture_output=True, text=True).stdout.splitlines()
    mine = [l for l in lines if any(f"pid={pid}," in l for pid in pids)]
    assert mine, lines
    for line in mine:
        local = line.split()[3]
        assert local.startswith("127.0.0.1:") or local.startswith("[::1]:"), line


def test_unknown_job_is_a_one_line_error():
    out = shoal("jobs", "view", "99")
    assert out.returncode == 2 and "job 99: no such job" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_kill_leaves_a_finished_job_and_a_reused_pid_alone(blobs_job, tmp_path):
    assert shoal("run", blobs_job(train_steps=2), "--workspace", tmp_path / "ws").returncode == 0
    record = jobs.all_jobs()[0]
    out = shoal("jobs", "kill", str(record.id))
    assert out.returncode == 2 and "not running (finished)" in out.stderr
    assert jobs.load(record.id).status == "finished"
    # a record whose pid now belongs to another process (started at another time) is not that process
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        entry = jobs.process_entry(0, sleeper.pid)
        assert jobs._alive(sleeper.pid, entry["start"]) and not jobs._alive(sleeper.pid, entry["start"] - 1)
    finally:
        sleeper.kill()
        sleeper.wait()
