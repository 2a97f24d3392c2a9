"""Issue 38: a chief that dies after the last step's commit, before the job's end, is succeeded for the end too.

Until 2026-11-29 nobody noticed such a death: the other processes had nothing more to meet, so they ended without the
job's final test and checkpoint, its restarted process knocked for ever (nobody closed the meetings), and under
Sandblaster the servers waited for group 0 for ever: the job hung. Now every other member waits at its end for the
chief's word that the meetings are over, and the lowest living one takes its place when it died first
(shoal.comm.quorum's `await_close`): it closes the meetings, writes the final test and checkpoint, and under
Sandblaster becomes the servers' stub for their final values and state. Real `shoal run` processes on the blobs data,
the chief ended by SHOAL_INJECT_EXIT_AFTER right after its last step; and a user's loop, whose successor runs the
script's end as the chief, while the restarted process 0 ends its script at run.batches (nothing left to join)."""
from __future__ import annotations

import json
import os

import pytest

from cli_in_process import run_cli
from fault_runs import assert_no_library_text, pids, runs, wait_for  # noqa: F401 (runs: a fixture)
from layouts import LAYOUTS, Layout, assert_ran
from test_cli import alive, leftover_processes

from shoal.neuralnet import checkpoint as ckpt_io

DILOCO = Layout(dict(nworker_groups=2, nworkers_per_procs=1, local_steps=5), 2, 2, "Local SGD")
CASES = {  # layout name in tests/layouts.py (or None), its Layout, the cluster fields added to it
    "AllReduce": ("AllReduce, 3 processes, replicated (max_restarts 1)", {}),
    "Sandblaster": ("Sandblaster, 2 workers + 1 server, 3 processes", {}),
    "Local SGD": ("single worker", DILOCO.cluster),
}
STEPS = 40


@pytest.mark.parametrize("framework", list(CASES))
def test_a_chief_dead_after_the_last_step_is_succeeded_for_the_jobs_end(blobs_job, tmp_path, runs, framework):
    """Process 0 exits right after step 39 of 40: exit 0 (no hang), process 1 says (on the terminal; in its log where
    the launcher runs in the test's process) that it took the chief's place after step 39, writes the final test and
    checkpoint (the servers' momentum in it, under Sandblaster), summary.json says finished and names the succession;
    the restarted process 0 says that it found nothing left to join; no library text, nothing left behind."""
    name, extra = CASES[framework]
    layout = DILOCO if framework == "Local SGD" else LAYOUTS[name]
    job = blobs_job(train_steps=STEPS, layout=name, cluster_extra=extra or None)
    options, inject = ("--max-restarts", "1", "--set", "updater.momentum=0.9"), {"SHOAL_INJECT_EXIT_AFTER": f"0:{STEPS - 1}"}
    ws = tmp_path / "ws"
    if framework == "AllReduce":  # the file's real `python -m shoal` launcher: the ranks' lines on its stdout
        stdout, stderr = runs.start(job, tmp_path, *options, env=inject).finished(timeout=90)
    else:  # in the test process (the ranks fork from its forkserver, warm from earlier tests): their lines in their logs
        proc = run_cli("run", job, "--workspace", ws, "--no-progress", *options, env={**os.environ, **inject}, timeout=90)
        assert proc.returncode == 0, proc.stderr
        stdout = proc.stdout + "".join(log.read_text() for log in sorted((ws / "logs").glob("rank*.log")))
        stderr = proc.stderr
    assert f"Process 1 took the chief's place after step {STEPS - 1}: " in stdout, stdout
    assert "process 0 was restarted after the job's last step: nothing left to join" in stdout or \
        "process 0 knocked after the groups' last meeting: nothing left to join" in stdout, stdout
    got = assert_ran(ws, layout)
    assert got["status"] == "finished" and "job_restarts" not in got, got
    assert got["chief_succession"] == [{"process": 1, "after_step": STEPS - 1}], got
    assert got["final_test"]["step"] == STEPS and got["final_test"]["accuracy"] > 0.9, got
    final = ckpt_io.load(ckpt_io.checkpoint_file(ws, STEPS), parts=True)
    assert final.trainer["writer"] == 1, final.trainer
    if framework == "Sandblaster":  # the servers' final state, which process 1 asked for as their new stub
        assert "Process 1 connected to the servers as worker group 0 (restart 1) after the last step" in stdout, stdout
        assert final.updater_state and all("history" in slots for slots in final.updater_state.values())
    assert_no_library_text(stdout, stderr)
    assert leftover_processes(tmp_path) == []  # the real launcher's processes (tagged with tmp_path)
    # every process that ran a rank (those forked from the test process's forkserver carry no tag) has ended
    started = [pid for rank in range(layout.processes) for pid in pids(ws, rank)]
    wait_for(lambda: not any(map(alive, started)), 5, f"left running: {[pid for pid in started if alive(pid)]}")


LOOP = '''
import json, os, signal, sys
from pathlib import Path
import torch, shoal
out = Path(sys.argv[1])
torch.manual_seed(0)
x = torch.randn(192, 8)
y = (x[:, :4].sum(1, keepdim=True) > x[:, 4:].sum(1, keepdim=True)).float()
run = shoal.session(train_steps=30, disp_freq=5)
model = run.model(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
opt = run.optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
for step, (xb, yb) in run.batches(torch.utils.data.TensorDataset(x, y), batch_size=12):
    loss = torch.nn.functional.binary_cross_entropy_with_logits(model(xb), yb)
    loss.backward(); opt.step(); opt.zero_grad()
    run.log(step, loss=loss)
    if step == 29 and run.rank == 0 and not (out / "killed").exists():  # after the last step's update: its commit
        (out / "killed").write_text(str(os.getpid())); os.kill(os.getpid(), signal.SIGKILL)
run.checkpoint()
(out / f"end{run.rank}.json").write_text(json.dumps({"step": step, "chief": run.chief}))
'''
LOOP_LAYOUTS = {
    "AllReduce": ["--set", "cluster.nworkers_per_group=2", "--set", "cluster.nworkers_per_procs=1"],
    "Sandblaster": LAYOUTS["Sandblaster, 2 workers + 1 server, 3 processes"].cli(),
    "Local SGD": ["--set", "cluster.nworker_groups=2", "--set", "cluster.nworkers_per_procs=1", "--set", "cluster.local_steps=5"],
}


@pytest.mark.parametrize("framework", [pytest.param(name, marks=[] if name == "AllReduce" else [pytest.mark.slow])
                                       for name in LOOP_LAYOUTS])  # (5 s each: the default suite keeps one)
def test_a_loops_chief_dead_after_the_last_step_is_succeeded_for_the_scripts_end(tmp_path, framework):
    """A user's loop: process 0 SIGKILLs itself after its last step's update; process 1 takes its place at the loop's
    end and runs the script's end as the chief (its run.checkpoint() writes the job's file), the restarted process 0
    says in its log that it found nothing left to join and ends its script there (it writes no end file);
    summary.json says finished and names the succession; exit 0."""
    script, out = tmp_path / "loop.py", tmp_path / "out"
    script.write_text(LOOP)
    out.mkdir()
    # `shoal run` in the test process (its forkserver, warm from earlier tests, starts the ranks; the first test keeps
    # a real interpreter): the launcher's lines in proc.stdout/stderr, the ranks' in their logs
    proc = run_cli("run", script, "--workspace", tmp_path / "ws", "--no-progress", "--max-restarts", "1",
                   *LOOP_LAYOUTS[framework], "--", out, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    logs = tmp_path / "ws" / "logs"
    successor, restarted = (logs / "rank1.log").read_text(), (logs / "rank0.log").read_text()
    assert "Process 1 took the chief's place after step 29: " in successor, successor
    assert "process 1 took the chief's place after step 29" in proc.stdout, proc.stdout
    assert "nothing left to join" in restarted, restarted
    assert json.loads((out / "end1.json").read_text()) == {"step": 29, "chief": True}
    assert not (out / "end0.json").exists()  # (the restarted process 0 ended its script at run.batches)
    got = json.loads((tmp_path / "ws" / "summary.json").read_text())
    assert got["status"] == "finished" and got["steps"] == 30, got
    assert got["chief_succession"] == [{"process": 1, "after_step": 29}], got
    assert ckpt_io.load(ckpt_io.checkpoint_file(tmp_path / "ws", 30), parts=True).trainer["writer"] == 1
    assert_no_library_text(proc.stdout + successor + restarted, proc.stderr)
