"""The ranks shoal starts sleep in OpenMP's waits (OMP_WAIT_POLICY=PASSIVE) unless the user's environment says otherwise
(issue 40, point 1): spinning threads burn the cores a busy machine's other processes need.

Real `shoal run` interpreters (tests/fault_runs.py), whose environment the test sets: this test process's own
environment has OMP_WAIT_POLICY=PASSIVE (tests/conftest.py), so every run here names the variable's absence or value.
A .py plugin (loaded by every process of the job, a restarted one too) records what each process sees: its
environment (os.environ) and the one it started with (/proc/self/environ). What OpenMP read is what libgomp says as it
loads (OMP_DISPLAY_ENV=VERBOSE, on the run's stderr): under `shoal run JOB` it loads once, in the launching process,
whose server the ranks fork from (launcher.process_server._fork_server), and a forked rank keeps it.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess

import pytest
from fault_runs import SLOW, pids, runs  # noqa: F401 (runs: a fixture)
from test_cli import leftover_processes, tagged
from test_launchers import TORCHRUN, free_port, job_secret

PLUGIN = '''
import json, os

def _at_start(name):
    with open("/proc/self/environ", "rb") as f:
        for item in f.read().split(b"\\0"):
            key, _, value = item.decode(errors="replace").partition("=")
            if key == name:
                return value
    return None

with open({record!r}, "a") as f:
    f.write(json.dumps({{"pid": os.getpid(), "environ": os.environ.get("OMP_WAIT_POLICY"),
                        "at_start": _at_start("OMP_WAIT_POLICY")}}) + "\\n")
'''


def seen(tmp_path, ws) -> dict[int, list[dict]]:
    """{rank: what each of its processes saw, in order of their starts}."""
    records = {r["pid"]: r for r in map(json.loads, (tmp_path / "seen.jsonl").read_text().splitlines())}
    return {rank: [records[pid] for pid in pids(ws, rank)] for rank in (0, 1)}


def plugin(tmp_path):
    path = tmp_path / "rank_environment_probe.py"
    path.write_text(PLUGIN.format(record=str(tmp_path / "seen.jsonl")))
    return path


def test_ranks_and_a_restarted_rank_sleep_in_openmp_waits_unless_the_user_says(blobs_job, tmp_path, runs):
    """The user's environment without OMP_WAIT_POLICY: both ranks, and rank 1's restart after a SIGKILL, have
    OMP_WAIT_POLICY=PASSIVE, in os.environ and in the environment they started with (OpenMP's); the launcher's own
    environment is left as the user gave it. With the user's OMP_WAIT_POLICY=active, every rank keeps it."""
    job = blobs_job(train_steps=150, layout="Distributed Hogwild, 2 groups", cluster_extra=dict(sync_freq=4))
    unset = tmp_path / "unset"
    unset.mkdir()
    run = runs.start(job, unset, "--plugin", plugin(unset), "--max-restarts", "1",
                     env={**SLOW, "OMP_WAIT_POLICY": None, "OMP_DISPLAY_ENV": "VERBOSE"})
    victim = run.signal(1, signal.SIGKILL, step=10)
    run.finished()
    got = seen(unset, run.ws)
    assert pids(run.ws, 1)[0] == victim and len(got[1]) == 2, got  # rank 1 ran in two processes: started, restarted
    for rank, processes in got.items():
        for process in processes:
            assert process["environ"] == "PASSIVE", (rank, got)
    # OpenMP loaded once, with PASSIVE's spin count (libgomp's default is 300000): the ranks, the restarted one too,
    # forked from the server that was forked from the launching process after that load
    assert re.findall(r"GOMP_SPINCOUNT = '(\d+)'", run.stderr()) == ["0"], run.stderr()
    launcher = [r for r in map(json.loads, (unset / "seen.jsonl").read_text().splitlines()) if r["pid"] == run.proc.pid]
    assert launcher == [{"pid": run.proc.pid, "environ": None, "at_start": None}], launcher

    given = tmp_path / "given"
    given.mkdir()
    run = runs.start(job, given, "--plugin", plugin(given), "--set", "train_steps=20",
                     env={"OMP_WAIT_POLICY": "active", "OMP_DISPLAY_ENV": "VERBOSE"})
    run.finished()
    got = seen(given, run.ws)
    assert [len(got[0]), len(got[1])] == [1, 1], got
    assert all((p["environ"], p["at_start"]) == ("active", "active") for processes in got.values() for p in processes), got
    assert re.findall(r"GOMP_SPINCOUNT = '(\d+)'", run.stderr()) == ["30000000000"], run.stderr()  # ACTIVE's
    assert leftover_processes(tmp_path) == []


@pytest.mark.slow  # torchrun's agent and 2 interpreters importing torch: seconds of CPU
def test_ranks_torchrun_starts_sleep_in_openmp_waits_unless_the_user_says(blobs_job, tmp_path):
    """Under torchrun `shoal run` is the rank's own process: it sets OMP_WAIT_POLICY=PASSIVE before torch loads OpenMP,
    which reads it then (OMP_DISPLAY_ENV=VERBOSE: each rank's GOMP_SPINCOUNT is 0; torchrun's own agent spins as the
    user's environment says). The user's value is kept, by the ranks' OpenMP too."""
    job = blobs_job(train_steps=6, layout="AllReduce, 2 processes")
    # libgomp's spin count: its default, PASSIVE's, ACTIVE's
    for name, given, spins in (("unset", None, ["300000", "0", "0"]), ("given", "active", ["30000000000"] * 3)):
        folder = tmp_path / name
        folder.mkdir()
        environment = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_DISPLAY_ENV": "VERBOSE", **job_secret(), **tagged(tmp_path)}
        environment.pop("OMP_WAIT_POLICY")
        if given is not None:
            environment["OMP_WAIT_POLICY"] = given
        run = subprocess.run([str(TORCHRUN), "--nnodes=1", "--nproc-per-node=2", "--master-addr=127.0.0.1",
                              f"--master-port={free_port()}", "-m", "shoal", "run", str(job), "--workspace", str(folder / "ws"),
                              "--no-progress", "--plugin", str(plugin(folder))],
                             capture_output=True, text=True, env=environment, timeout=180)
        assert run.returncode == 0, run.stderr
        ranks = [r for r in map(json.loads, (folder / "seen.jsonl").read_text().splitlines())]
        assert [r["environ"] for r in ranks] == [given or "PASSIVE"] * 2, ranks
        assert re.findall(r"GOMP_SPINCOUNT = '(\d+)'", run.stderr) == spins, run.stderr  # torchrun's agent, the ranks
    assert leftover_processes(tmp_path) == []
