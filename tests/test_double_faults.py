"""Two faults at once (issue 38): two processes dead at the same step, and a second death while the first heals.

Real runs through the CLI (`shoal run JOB --max-restarts N`) on the blobs data, with faults injected by the
environment (SHOAL_INJECT_EXIT="0:12,1:12": processes 0 and 1 exit at step 12; shoal.launcher.faults). Under
AllReduce's replicas the lowest living process decides the steps in the dead chief's place (shoal.comm.quorum) even
when the next in line died with it, and both restarted processes heal from it.
"""
from __future__ import annotations

import os
import re

import pytest
import torch

from cli_in_process import run_cli
from fault_runs import SLOW, assert_no_library_text, closing_line, pids, runs, summary, wait_for  # noqa: F401 (runs: a fixture)
from layouts import LAYOUTS, assert_ran, process_logs
from test_cli import alive, leftover_processes
from test_local_sgd_faults import params

from shoal.launcher import faults
from shoal.neuralnet import checkpoint as ckpt_io

REPLICATED = LAYOUTS["AllReduce, 3 processes, replicated (max_restarts 1)"]


def test_a_fault_variable_takes_several_pairs_and_a_restart_skips_its_predecessors(monkeypatch):
    """"0:12,1:12" names two processes; the old one-pair form still works; a restarted process never fires at the step
    it starts at (its predecessor's), but does at a later pair of its rank."""
    monkeypatch.setenv("SHOAL_INJECT_EXIT", "0:12, 1:12,1:30")
    monkeypatch.setenv("SHOAL_INJECT_STALL", "2:7")
    injected = faults.from_environment()
    assert [(f.step, f.action) for f in injected.process_hooks(0)] == [(12, "exit")]
    assert [(f.step, f.action) for f in injected.process_hooks(1)] == [(12, "exit"), (30, "exit")]
    assert [(f.step, f.action) for f in injected.process_hooks(2)] == [(7, "stall")] and injected.process_hooks(3) == []
    restarted = faults.from_environment(restarted=True).process_hooks(1)
    for step in (12, 13, 29):  # rejoined exactly at step 12: its predecessor's fault is not met again
        for hook in restarted:
            hook.before_step(step)
            hook.after_step(step)
    assert faults.from_environment(restarted=True).server_update_hook(1) is None
    monkeypatch.setenv("SHOAL_INJECT_EXIT", "12")
    with pytest.raises(ValueError, match="SHOAL_INJECT_EXIT: RANK:STEP pairs"):
        faults.from_environment().process_hooks(0)


def test_a_restarted_process_meets_its_next_fault(tmp_path):
    """A rejoined process fires a pair past its first step (a second death of the same rank)."""
    import subprocess
    import sys

    code = ("from shoal.launcher import faults\n(hook,) = faults.from_environment(restarted=True).process_hooks(1)\n"
            "hook.before_step(12)\nprint('skipped', flush=True)\nhook.before_step(13)\nhook.before_step(30)\nprint('not reached')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "SHOAL_INJECT_EXIT": "1:30"})
    assert (proc.returncode, proc.stdout) == (3, "skipped\n"), proc.stderr


def faulted_run(job, ws, env, restarts=2):
    """`shoal run JOB --max-restarts RESTARTS` in this process (its forkserver starts the ranks), which must exit 0."""
    proc = run_cli("run", job, "--workspace", ws, "--no-progress", "--max-restarts", str(restarts),
                   env={**os.environ, **env}, timeout=180)
    assert proc.returncode == 0, proc.stderr + process_logs(ws)
    return proc


def assert_nothing_left(ws) -> None:
    """Every process that ran a rank of the job in `ws` (each start its logs name) has ended."""
    ran = [pid for rank in range(3) for pid in pids(ws, rank)]
    wait_for(lambda: not any(alive(pid) for pid in ran), 10, f"processes of the job still running: {ran}")


def exited(rank: int, donor: str = "the state of the lowest living process, which decides the steps now", also: str = "") -> str:
    who = "worker(group=0, id=0), server(group=0, id=0)" if rank == 0 else f"worker(group=0, id={rank})"
    return (f"WARNING: process {rank} ({who}) exited with code 3; the other processes go on without it; restarting it "
            f"(restart 1 of 2); it rejoins at the next step, from {donor}{also}")


def assert_both_exits_said(stderr: str) -> None:
    """The launcher's lines on processes 0 and 1, dead at the same step, true in either order it saw them: process 1
    seen first heals from the chief's state as far as it knows then, and the chief's line says it will not."""
    said = stderr.splitlines()
    if exited(1) in said:  # the chief's death seen first
        assert exited(0) in said, stderr
    else:
        assert exited(1, donor="process 0's state") in said, stderr
        assert exited(0, also=" (so does process 1, restarted before it and not admitted yet)") in said, stderr


def test_the_chief_and_the_next_in_line_exit_at_once_and_the_last_process_decides(blobs_job, tmp_path, runs):
    """Processes 0 and 1 of AllReduce's 3 replicas exit at step 12: process 2 alone decides step 12 on in the chief's
    place (the next in line died with it) and says so on the terminal, both dead processes are restarted and rejoin
    from process 2's state, and process 2 (the same pid from start to end) writes the final test and checkpoint."""
    steps, gone = 300, 12  # 3 s or more (SLOW): time for both restarts to rejoin, under load
    job = blobs_job(train_steps=steps, cluster_extra=dict(nworkers_per_group=3))
    run = runs.start(job, tmp_path, "--max-restarts", "2", env={"SHOAL_INJECT_EXIT": f"0:{gone},1:{gone}", **SLOW})
    survivor = run.pid_once_training(2)
    stdout, stderr = run.finished()
    assert_both_exits_said(stderr)
    assert (f"Process 2 took the chief's place after step {gone}: it decides the steps, tests and validates, writes the run "
            f"log and the checkpoints") in stdout.splitlines(), stdout
    assert (f"Step {gone} went on without processes 0, 1 (died or stopped answering): the mean over the gradients of process 2 "
            f"alone") in stdout.splitlines(), stdout
    got = assert_ran(run.ws, REPLICATED)
    assert got["status"] == "finished" and got["chief_succession"] == [{"process": 2, "after_step": gone}], got
    back = {r["rank"]: r["step"] for r in got["rejoins"]}
    assert sorted(back) == [0, 1] and all(gone < step < steps for step in back.values()), got["rejoins"]
    for rank, step in back.items():
        assert re.search(rf"^Process {rank} rejoined at step {step} \(restart 1\): the params and the updater's state from "
                         rf"process 2, after step {step - 1}, ", stdout, re.M), stdout
        away = f"missing from step {gone}" if step == gone + 1 else f"missing from steps {gone} to {step - 1}"
        assert got["missed_steps"][str(rank)] == {"missed": step - gone, "of": steps, "why": f"{away}, back at step {step}"}
    assert all(r["digests"]["from_process"] == 2 for r in got["rejoins"]), got["rejoins"]
    assert pids(run.ws, 2) == [survivor] and [len(set(pids(run.ws, rank))) for rank in (0, 1)] == [2, 2]
    assert f"process 2 took the chief's place after step {gone}; " in closing_line(stdout)
    final = ckpt_io.load(ckpt_io.checkpoint_file(run.ws, steps), parts=False)
    assert final.trainer["writer"] == 2 and got["final_test"]["step"] == steps and got["final_test"]["accuracy"] > 0.8, got
    assert_no_library_text(stdout, stderr, (run.ws / "logs" / "rank2.log").read_text())
    assert leftover_processes(tmp_path) == []


def test_two_processes_dead_at_the_same_step_give_the_same_bits_each_time(blobs_job, tmp_path):
    """The fault schedule decides the result: processes 0 and 1 exit at step 39 of 40, so step 39 is process 2's
    gradients alone (their restarts come back after it: nothing left to train); the same faulted job twice gives the
    same params, and not the unfaulted run's."""
    steps, gone = 40, 39
    job = blobs_job(train_steps=steps, cluster_extra=dict(nworkers_per_group=3))
    for i in range(2):
        ws = tmp_path / f"faulted{i}"
        proc = faulted_run(job, ws, {"SHOAL_INJECT_EXIT": f"0:{gone},1:{gone}"})
        assert_both_exits_said(proc.stderr)
        got = assert_ran(ws, REPLICATED)
        assert got["chief_succession"] == [{"process": 2, "after_step": gone}], got
        assert ckpt_io.load(ckpt_io.checkpoint_file(ws, steps), parts=False).trainer["writer"] == 2
        assert_no_library_text(proc.stdout, proc.stderr)
        assert_nothing_left(ws)
    a, b = params(tmp_path / "faulted0", steps), params(tmp_path / "faulted1", steps)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    faulted_run(job, tmp_path / "unfaulted", {})
    c = params(tmp_path / "unfaulted", steps)
    assert any(not torch.allclose(a[k], c[k], atol=1e-6) for k in a)  # the missing rows changed the result
