"""Whole-job restarts (issue 38): `shoal run JOB --max-restarts N`, when a process dies that the job cannot go on
without (a partitioned group's server process or chief, any process of a framework with no quorum), starts every process again from
the newest checkpoint, up to N times, with one true line per restart; the summary and the closing line count the
restarts and the steps re-done.

Real processes, real kills: the killed process's pid from the job registry (as `shoal jobs view` shows it), SIGKILLed
once the job has written a checkpoint; or an injected exit (SHOAL_INJECT_EXIT), which a restarted job meets again
at the same step (so its restarts run out).
"""
from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
from cli_in_process import run_cli
from layouts import assert_ran
from fault_runs import ranks_ended, registered_pids, summary
from test_cli import leftover_processes
from test_stalls import Run, runs  # noqa: F401 - the fixture that stops what a failed test left running

import shoal

# partitioned (SINGA's sliced exchange), its chief is no replica of the others: its death restarts the whole job (an
# unpartitioned Sandblaster's, Downpour's and Hogwild's chief is replaced under --max-restarts:
# tests/test_sandblaster_chief_death.py, tests/test_async_chief_death.py)
SANDBLASTER = "Sandblaster, 2 workers + 1 server, 3 processes"
PARTITIONED = ("--set", "neuralnet.partition_dim=1")
ALLREDUCE = "AllReduce, 2 processes"
SLOW = {"SHOAL_SLOW_WORKER": "0:0+0.01"}  # steps of 10 ms or more: the run outlasts a kill and a restart
RAW = ("gloo", "c10d", ".cpp", "GLHF", "Traceback")


def metrics(workspace: Path) -> list[dict]:
    return [json.loads(line) for line in (workspace / "metrics.jsonl").read_text().splitlines() if line.strip()]


def checkpoint_written(workspace: Path, run=None, at_least: int = 20, timeout: float = 90) -> int:
    """The step of the first checkpoint of step >= at_least, once the chief has written it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert run is None or run.proc.poll() is None, run.stderr()
        steps = [int(m[1]) for p in (workspace / "checkpoint").glob("step*-worker0.safetensors")
                 if (m := re.match(r"step(\d+)-worker0", p.name))]
        if any(s >= at_least for s in steps):
            return max(steps)
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint of step >= {at_least} in {workspace}")


def restart_line(stderr: str, who: str) -> re.Match:
    found = re.findall(rf"^WARNING: {re.escape(who)} died \(SIGKILL\) after step (\d+): the job cannot go on without it; "
                       r"restarting the whole job from the checkpoint of step (\d+) \(restart 1 of 1\)$", stderr, re.M)
    assert len(found) == 1, stderr
    return tuple(map(int, found[0]))


def assert_resumed(workspace: Path, after: int, from_step: int, steps: int) -> dict:
    """summary.json and metrics.jsonl say one restart, from the checkpoint of `from_step`, re-doing the steps to `after`."""
    ended = summary(workspace)
    assert ended["status"] == "finished" and ended["steps"] == steps, ended
    (restart,) = ended["job_restarts"]
    assert (restart["from_step"], restart["after_step"], restart["steps_redone"]) == (from_step, after, after + 1 - from_step)
    assert restart["checkpoint"] == f"step{from_step}-worker0.safetensors"
    assert ended["steps_redone"] == after + 1 - from_step
    assert ended["latest_run"]["from_step"] == 0 and ended["latest_run"]["steps"] == steps  # this `shoal run`, not its last restart
    records = metrics(workspace)
    resumes = [i for i, r in enumerate(records) if r["phase"] == "resume"]
    assert [records[i]["step"] for i in resumes] == [from_step]
    before, since = records[:resumes[0]], records[resumes[0] + 1:]
    # the stopped processes had trained to the checkpoint (their last display at most disp_freq steps before it); the
    # restarted ones went on from it to the end
    assert max(r["step"] for r in before if r["phase"] == "train") >= from_step - 5
    assert min(r["step"] for r in since if r["phase"] == "train") == from_step
    assert max(r["step"] for r in since) == steps
    return ended


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["Sandblaster, 2 workers + 1 server, 3 processes"])
def test_a_killed_server_restarts_the_whole_job_from_its_checkpoint(blobs_job, tmp_path, runs, layout):
    """(a) The server process of a partitioned Sandblaster group (the sliced exchange) SIGKILLed after the checkpoint of
    step 20: the job cannot go on without it; the launcher stops the others and starts every process again from the
    newest checkpoint; the job finishes. (Downpour's server, and an unpartitioned Sandblaster's, is restarted into the
    running job instead: tests/test_server_restart.py, tests/test_sandblaster_faults.py.)"""
    steps = 150
    run = Run(blobs_job(train_steps=steps), tmp_path, layout, "--max-restarts", "1", "--set", "checkpoint_freq=20",
              "--set", "test_freq=50", "--set", "neuralnet.partition_dim=1", env=SLOW)
    runs.append(run)
    server = run.pid_of(2)
    checkpoint_written(run.ws, run)
    os.kill(server, signal.SIGKILL)
    assert run.wait(timeout=180) == 0, run.stderr()
    after, from_step = restart_line(run.stderr(), "process 2 (server(group=0, id=0))")
    assert from_step >= 20 and after >= from_step - 1
    out = run.out.read_text()
    assert f"Resume from checkpoint file {run.ws}/checkpoint/step{from_step}-worker0.safetensors at step {from_step}" in out, out
    ended = assert_resumed(run.ws, after, from_step, steps)
    assert_ran(run.ws, layout)
    assert ended["final_test"]["accuracy"] >= 0.9
    assert registered_pids(run.ws)[2] != server  # the job's processes were started again
    closing = out.strip().splitlines()[-1]
    assert f"; the whole job restarted once ({after + 1 - from_step} step" in closing, closing
    for mark in RAW:
        assert mark.lower() not in run.stderr().lower()
    assert leftover_processes(tmp_path) == []


def test_a_killed_chief_of_sandblaster_restarts_the_whole_job(blobs_job, tmp_path, runs):
    """(b) A partitioned Sandblaster group's chief holds its layers alone (AllReduce's and an unpartitioned Sandblaster's
    replicas, Local SGD's, Downpour's and Hogwild's groups go on without their chief: tests/test_job_chief_death.py,
    tests/test_sandblaster_chief_death.py, tests/test_async_chief_death.py): process 0 SIGKILLed after a checkpoint; the
    whole job starts again from it, as torchrun's agent restarts its workers."""
    steps = 120
    run = Run(blobs_job(train_steps=steps), tmp_path, SANDBLASTER, "--max-restarts", "1", *PARTITIONED,
              "--set", "checkpoint_freq=20", "--set", "test_freq=60", env=SLOW)
    runs.append(run)
    chief = run.pid_of(0)
    checkpoint_written(run.ws, run)
    os.kill(chief, signal.SIGKILL)
    assert run.wait(timeout=180) == 0, run.stderr()
    after, from_step = restart_line(run.stderr(), "process 0 (worker(group=0, id=0))")
    assert from_step >= 20
    ended = assert_resumed(run.ws, after, from_step, steps)
    assert ended["processes"] == 3 and ended["framework"] == "Sandblaster", ended
    assert ended["final_test"]["accuracy"] >= 0.9
    assert registered_pids(run.ws)[0] != chief
    assert leftover_processes(tmp_path) == []


def test_when_the_restarts_run_out_the_job_fails_naming_the_death(blobs_job, tmp_path):
    """(c) The chief of a partitioned Sandblaster job dies at the same step in every start (an injected exit), no
    checkpoint written yet: the one restart starts over from step 0 and says so; the second death fails the job in one
    line."""
    job = blobs_job(train_steps=200, layout=SANDBLASTER)
    ws = tmp_path / "ws"
    proc = run_cli("run", job, "--workspace", ws, "--no-progress", "--max-restarts", "1", *PARTITIONED,
                   env={**os.environ, "SHOAL_INJECT_EXIT": "0:15"}, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2, proc.stderr
    server = "process 0 (worker(group=0, id=0)) exited with code 3"
    # (the step where the chief had a display or a heartbeat before the death: a loaded machine may start it late)
    assert re.fullmatch(rf"WARNING: {re.escape(server)}( after step \d+)?: the job cannot go on without it; restarting the "
                        r"whole job from step 0 \(no checkpoint was written yet\) \(restart 1 of 1\)", lines[0]), lines[0]
    assert re.fullmatch(rf"{re.escape(server)}( after step \d+)?: the job cannot go on without it; no restarts left "
                        rf"\(--max-restarts 1, restarted once\); see {re.escape(str(ws))}/logs/rank0.log", lines[1]), lines[1]
    ended = summary(ws)
    assert ended["status"] == "failed" and ended["reason"] == lines[1]
    (restart,) = ended["job_restarts"]
    assert restart["from_step"] == 0 and restart["checkpoint"] is None
    assert (ws / "metrics.jsonl.1").exists()  # the first start's records, kept aside as a new start keeps them
    assert not any(r["phase"] == "resume" for r in metrics(ws))
    assert ranks_ended(ws)


def test_without_restarts_a_dead_chief_stops_the_job_as_before(blobs_job, tmp_path):
    """(d) --max-restarts 0: today's line, nothing restarted, nothing about restarts in the summary."""
    job = blobs_job(train_steps=60, layout=ALLREDUCE, extra="checkpoint_freq: 10")
    ws = tmp_path / "ws"
    proc = run_cli("run", job, "--workspace", ws, "--no-progress", "--max-restarts", "0",
                   env={**os.environ, "SHOAL_INJECT_EXIT": "0:25"}, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("process 0 (worker(group=0, id=0), server(group=0, id=0)) exited with code 3; the other "
                                   f"processes were stopped; see {ws}/logs/rank0.log"), proc.stderr
    ended = summary(ws)
    assert ended["status"] == "failed" and "job_restarts" not in ended
    assert not any(r["phase"] == "resume" for r in metrics(ws))
    assert ranks_ended(ws)


def test_the_history_of_a_restarted_job_is_one_run(blobs_job, tmp_path, monkeypatch):
    """shoal.train with cluster.max_restarts: the chief SIGKILLed after a checkpoint; the History it returns holds the
    run as one run: each step's train record once, the restart's resume record, and the last test."""
    steps = 100
    ws = tmp_path / "ws"
    for name, value in SLOW.items():
        monkeypatch.setenv(name, value)
    job = shoal.load_job(blobs_job(train_steps=steps, layout=SANDBLASTER),  # (partitioned: its chief's death restarts the job)
                         ["cluster.max_restarts=1", "checkpoint_freq=20", "test_freq=50", "disp_freq=5",
                          "neuralnet.partition_dim=1"])
    killed = []

    def kill_the_chief_after_a_checkpoint():
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not killed:
            if any(ws.glob("checkpoint/step2*-worker0.safetensors")) and 0 in registered_pids(ws):
                os.kill(registered_pids(ws)[0], signal.SIGKILL)
                killed.append(True)
            time.sleep(0.02)

    killer = threading.Thread(target=kill_the_chief_after_a_checkpoint, daemon=True)
    killer.start()
    history = shoal.train(job, ws, log=lambda line: None)
    killer.join()
    assert killed
    train_steps = [r["step"] for r in history.phase("train")]
    assert train_steps == sorted(set(train_steps)) and train_steps[0] == 0 and train_steps[-1] == steps - 5, train_steps
    assert [r["step"] for r in history.phase("resume")] == [summary(ws)["job_restarts"][0]["from_step"]]
    assert history.final_test["step"] == steps
    assert ranks_ended(ws)


@pytest.mark.slow  # a stall timeout to wait out (3 s) and a second start
def test_a_stalled_sandblaster_chief_restarts_the_whole_job(blobs_job, tmp_path, runs):
    """The chief of a partitioned Sandblaster job SIGSTOPped after a checkpoint: another process finds it stalled (the
    job cannot go on without it: a job file's Local SGD, Downpour, Hogwild or unpartitioned Sandblaster chief is replaced
    instead, tests/test_job_chief_death.py, tests/test_async_chief_death.py, tests/test_sandblaster_chief_death.py); the
    launcher SIGKILLs the stopped chief and restarts the whole job, rather than waiting on the stopped chief for ever."""
    steps = 120
    run = Run(blobs_job(train_steps=steps), tmp_path, SANDBLASTER, *PARTITIONED,
              "--max-restarts", "1", "--set", "checkpoint_freq=20", "--set", "test_freq=60", env={"SHOAL_SLOW_WORKER": "0:0+0.02"})
    runs.append(run)
    chief = run.pid_of(0)
    checkpoint_written(run.ws, run)
    os.kill(chief, signal.SIGSTOP)
    assert run.wait(timeout=120) == 0, run.stderr()
    found = re.findall(r"^WARNING: process 0 \(worker\(group=0, id=0\)\) stopped answering \(no heartbeat "
                       r"for \d+ s[^)]*\); restarting the whole job from the checkpoint of step (\d+) \(restart 1 of 1\)$", run.stderr(), re.M)
    assert len(found) == 1 and "exited with code" not in run.stderr(), run.stderr()
    ended = summary(run.ws)
    assert ended["status"] == "finished" and ended["steps"] == steps and len(ended["job_restarts"]) == 1
    assert ended["job_restarts"][0]["from_step"] == int(found[0]) >= 20
    assert registered_pids(run.ws)[0] != chief
    assert leftover_processes(tmp_path) == []
