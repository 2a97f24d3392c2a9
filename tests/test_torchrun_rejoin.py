"""Under torchrun a dead rank comes back into the running job; the others' processes go on (issue 38, point 1).

`torchrun ... -m shoal run JOB --max-restarts 1`: shoal's own flag grants the restarts, as under `shoal run`. The
process torchrun starts for a rank other than the chief supervises the rank's training process
(shoal.launcher.supervisor); a real SIGKILL of that process (its pid from the job registry) is answered as
`shoal run`'s launcher answers it: the next step goes on without it, a new process rejoins from the chief's state,
torchrun sees nothing fail and restarts nothing.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import shoal
from fault_runs import pids, summary, wait_for
from layouts import LAYOUTS, assert_ran
from test_cli import alive, leftover_processes, tagged
from test_launchers import TORCHRUN, free_port, job_secret, quiet

LAYOUT = "AllReduce, 2 processes"
DIED = ("WARNING: process 1 (worker(group=0, id=1)) died (SIGKILL); the other processes go on without it; restarting it "
        "(restart 1 of 1); it rejoins at the next step, from process 0's state")


def torchrun_in_background(job, workspace, out, err, *args: str, env=None, torchrun_restarts: int = 1,
                           nprocs: int = 2) -> subprocess.Popen:
    """`torchrun --nproc-per-node=N --max-restarts=1 -m shoal run JOB --max-restarts 1 ...`, its own session (the
    test kills it whole if it fails), output to files."""
    command = [str(TORCHRUN), "--nnodes=1", f"--nproc-per-node={nprocs}", "--master-addr=127.0.0.1", f"--master-port={free_port()}",
               f"--max-restarts={torchrun_restarts}", "-m", "shoal", "run", str(job), "--workspace", str(workspace), "--no-progress",
               "--max-restarts", "1", *args]
    environment = {**os.environ, "PYTHONUNBUFFERED": "1", **job_secret(), **tagged(out.parent), **(env or {})}
    with open(out, "w") as stdout, open(err, "w") as stderr:
        return subprocess.Popen(command, stdout=stdout, stderr=stderr, env=environment, start_new_session=True)


def registered(workspace) -> list[dict]:
    """The job registry's records of runs in `workspace` (one per start: torchrun's whole-job restart adds one)."""
    from shoal.launcher import job_registry

    return [r for r in job_registry.all_jobs() if os.path.realpath(r.workspace) == os.path.realpath(workspace)]


@pytest.fixture
def torchruns():
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:  # a failed assertion must not leave torchrun and its processes running
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for pid in leftover_processes(proc.tmp_path, wait=0):
            os.kill(pid, signal.SIGKILL)


def start(torchruns, job, tmp_path, *args: str, env=None, torchrun_restarts: int = 1,
          nprocs: int = 2) -> tuple[subprocess.Popen, Path]:
    """torchrun in the background, once it trains (the chief displayed step 10, every rank registered): (it, its
    workspace)."""
    ws, out, err = tmp_path / "ws", tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    proc = torchrun_in_background(job, ws, out, err, *args, env=env, torchrun_restarts=torchrun_restarts, nprocs=nprocs)
    proc.tmp_path, proc.out, proc.err = tmp_path, out, err
    torchruns.append(proc)

    def training() -> bool:
        assert proc.poll() is None, err.read_text()[-3000:]
        records = registered(ws)
        return "Train @ step 10 " in out.read_text() and bool(records) and len(records[0].processes) == nprocs

    wait_for(training, 120, "never reached step 10", interval=0.05)
    return proc, ws


def training_pids(ws) -> tuple[int, int]:
    """Rank 0's and rank 1's training processes, as the job registry holds them (`shoal jobs view` shows them)."""
    (record,) = registered(ws)
    return tuple(next(p["pid"] for p in record.processes if p["rank"] == r) for r in (0, 1))


def test_a_killed_rank_under_torchrun_rejoins_and_the_chief_never_restarts(blobs_job, tmp_path, torchruns):
    """SIGKILL rank 1's training process mid-run: torchrun restarts nothing, rank 0's process is the same from start
    to end, rank 1 ran as two processes and healed from the chief, the job exits 0 as accurate as the unfaulted run."""
    steps = 160
    job = blobs_job(train_steps=steps, layout=LAYOUT)
    proc, ws = start(torchruns, job, tmp_path, env={"SHOAL_SLOW_WORKER": "0:0+0.01"})
    chief, victim = training_pids(ws)
    os.kill(victim, signal.SIGKILL)
    assert proc.wait(timeout=180) == 0, proc.err.read_text()[-3000:]
    stdout, stderr = proc.out.read_text(), proc.err.read_text()
    assert DIED in stderr.splitlines(), stderr
    assert "restart 1 of 1" not in stdout  # torchrun restarted nothing: one start of the job, one registration
    (record,) = registered(ws)
    assert record.status == "finished"
    assert pids(ws, 0) == [chief]  # the chief's process never restarted
    first, second = pids(ws, 1)
    assert first == victim and second != victim and not alive(second)
    got = assert_ran(ws, LAYOUTS[LAYOUT])
    assert got.get("job_restarts", []) == [] and got["status"] == "finished"
    (rejoined,) = got["rejoins"]
    assert (rejoined["rank"], rejoined["incarnation"]) == (1, 1) and 10 <= rejoined["step"] < steps
    assert any(line.startswith("Process 1 rejoined at step ") for line in stdout.splitlines()), stdout
    unfaulted = tmp_path / "unfaulted"  # one process, the same job (tests/test_allreduce_faults.py's tolerance)
    shoal.train(blobs_job(train_steps=steps), workspace=unfaulted, log=quiet)
    final, baseline = got["final_test"]["accuracy"], summary(unfaulted)["final_test"]["accuracy"]
    assert final >= baseline - 0.05, (final, baseline)
    assert "Traceback" not in stderr and "gloo" not in stderr.lower(), stderr
    assert leftover_processes(tmp_path) == []


@pytest.mark.slow  # a stall timeout to wait out
def test_a_stopped_rank_under_torchrun_is_ended_and_rejoins(blobs_job, tmp_path, torchruns):
    """SIGSTOP rank 1's training process past the stall timeout: the chief goes on without it, its supervisor ends
    it (SIGKILL) and starts a new one, which rejoins; torchrun restarts nothing and the job exits 0."""
    job = blobs_job(train_steps=400, layout=LAYOUT)
    proc, ws = start(torchruns, job, tmp_path, "--set", "cluster.stall_timeout_s=2", env={"SHOAL_SLOW_WORKER": "0:0+0.01"})
    chief, victim = training_pids(ws)
    os.kill(victim, signal.SIGSTOP)
    assert proc.wait(timeout=180) == 0, proc.err.read_text()[-3000:]
    stdout, stderr = proc.out.read_text(), proc.err.read_text()
    assert any(line.startswith("WARNING: process 1 (worker(group=0, id=1)) was stopped past the stall timeout (2 s)")
               and "restarting it (restart 1 of 1)" in line for line in stderr.splitlines()), stderr
    assert "restart 1 of 1;" not in stdout and len(registered(ws)) == 1
    assert pids(ws, 0) == [chief] and pids(ws, 1)[0] == victim and len(pids(ws, 1)) == 2
    assert summary(ws)["rejoins"][0]["rank"] == 1
    assert leftover_processes(tmp_path) == []


@pytest.mark.slow  # one more torchrun run; the kill test covers the supervisor in the default suite
def test_torchrun_stopping_the_job_ends_the_supervised_process_too(blobs_job, tmp_path, torchruns):
    """SIGTERM to torchrun (as Ctrl-C or a scheduler's stop): its agent stops every rank; rank 1's supervisor ends
    its training process with it: nothing is left running."""
    job = blobs_job(train_steps=100000, layout=LAYOUT)
    proc, ws = start(torchruns, job, tmp_path, env={"SHOAL_SLOW_WORKER": "0:0+0.01"})
    _, trainer = training_pids(ws)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    assert not alive(trainer)
    assert leftover_processes(tmp_path) == []


@pytest.mark.slow  # one more torchrun run
def test_shoal_jobs_kill_ends_a_supervised_torchrun_job(blobs_job, tmp_path, torchruns):
    """`shoal jobs kill ID` signals the job's chief (the lock's holder), as before supervision; torchrun (no restart
    left) stops the other ranks, whose supervisor ends its training process: the job is killed, nothing is left."""
    job = blobs_job(train_steps=100000, layout=LAYOUT)
    proc, ws = start(torchruns, job, tmp_path, env={"SHOAL_SLOW_WORKER": "0:0+0.01"}, torchrun_restarts=0)
    chief, trainer = training_pids(ws)
    (record,) = registered(ws)
    killed = subprocess.run([sys.executable, "-m", "shoal", "jobs", "kill", str(record.id)], capture_output=True, text=True,
                            timeout=60)
    assert killed.returncode == 0, killed.stderr
    proc.wait(timeout=60)
    assert not alive(chief) and not alive(trainer)
    assert registered(ws)[0].status == "killed"
    assert leftover_processes(tmp_path) == []


ASYNCHRONOUS = {  # layout, its cluster section's fields, what else it is given: group 1 runs in process 1 in each
    "Downpour": ("Downpour, 2 groups + 1 server, 3 processes", {}, []),
    "Distributed Hogwild": ("Distributed Hogwild, 2 groups", {}, []),
    "DiLoCo": ("single worker", dict(nworker_groups=2, local_steps=5),
               ["--set", "cluster.outer_updater.type=kNesterov", "--set", "cluster.outer_updater.momentum=0.9",
                "--set", "cluster.outer_updater.learning_rate.type=kFixed", "--set", "cluster.outer_updater.learning_rate.base_lr=0.7"]),
}


@pytest.mark.slow  # one torchrun run each
@pytest.mark.parametrize("framework", sorted(ASYNCHRONOUS))
def test_a_killed_group_under_torchrun_rejoins(blobs_job, tmp_path, torchruns, framework):
    """The asynchronous frameworks and DiLoCo under torchrun: worker group 1's process SIGKILLed, restarted into the
    running job by its supervisor (the line `shoal run` prints), the chief's process the same to the end, exit 0."""
    layout, fields, args = ASYNCHRONOUS[framework]
    nprocs = 3 if framework == "Downpour" else 2
    job = blobs_job(train_steps=200, layout=layout, cluster_extra=fields or None)
    proc, ws = start(torchruns, job, tmp_path, *args, env={"SHOAL_SLOW_WORKER": "0:0+0.01"}, nprocs=nprocs)
    chief, victim = training_pids(ws)
    os.kill(victim, signal.SIGKILL)
    assert proc.wait(timeout=180) == 0, proc.err.read_text()[-3000:]
    stdout, stderr = proc.out.read_text(), proc.err.read_text()
    assert any(line.startswith("WARNING: process 1 (worker(group=1, id=0)") and "restarting it (restart 1 of 1)" in line
               for line in stderr.splitlines()), stderr
    assert len(registered(ws)) == 1 and registered(ws)[0].status == "finished"
    assert pids(ws, 0) == [chief] and pids(ws, 1)[0] == victim and len(pids(ws, 1)) == 2
    assert [r["rank"] for r in summary(ws)["rejoins"]] == [1]
    assert "Traceback" not in stderr
    assert leftover_processes(tmp_path) == []
