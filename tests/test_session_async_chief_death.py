"""Issues 38 and 39: a Downpour or Distributed Hogwild chief dies inside a user's loop (shoal.session()) and the job goes on.

With one process per group and `--max-restarts N`, group 0's process is dropped like any other group's: the lowest
living worker process's exchange sees the chief gone (shoal.comm.succession) and its session takes the chief's place
(frontend/session.py `_take_over`): the run log (metrics.jsonl, summary.json's `chief_succession`), the display lines,
run.evaluate's records and the checkpoints (as their writer); Downpour's mirror of the servers and their last request,
Hogwild's finish. The dead chief's restarted process runs the script from the top and rejoins as an ordinary group.
Driven as a user would: `shoal run script.py --max-restarts 1 --set cluster.…`, the chief SIGKILLed from its pid in
its log once the chief displayed step 10 (tests/fault_runs.py), as tests/test_async_chief_death.py does a job file's;
a chief dead before its first step restarts the whole job; under `-m slow` a stopped chief, torchrun, and a Downpour
server killed after the takeover.
"""
from __future__ import annotations

import json
import os
import re
import signal
import textwrap

import pytest

from cli_in_process import run_cli
from fault_runs import (assert_no_library_text, pids, registered_pids, runs, train_records,  # noqa: F401 (runs)
                        wait_for)
from layouts import LAYOUTS, assert_ran
from test_async_chief_death import killed_chief_is_replaced_under_torchrun, stopped_chief_is_replaced
from test_cli import leftover_processes
from test_torchrun_rejoin import start, torchruns  # noqa: F401 (torchruns: a fixture)

from shoal.neuralnet import checkpoint as ckpt_io

HOGWILD = "Distributed Hogwild, 2 groups"
DOWNPOUR = "Downpour, 2 groups + 1 server, 3 processes"
STEPS = 60

# A user's loop that outlasts a kill and a restart (STEP_PAUSE_S a step): it evaluates every 10 steps and at the end
# (recorded by whoever is run.chief then), checkpoints every 20 steps and at the end, and says where each process ended.
LOOP = textwrap.dedent(f'''
    import json, os, sys, time
    from pathlib import Path
    import torch, shoal

    out = Path(sys.argv[1])
    torch.manual_seed(0)
    x = torch.randn(192, 8)
    y = (x[:, :4].sum(1, keepdim=True) > x[:, 4:].sum(1, keepdim=True)).float()
    data = torch.utils.data.TensorDataset(x, y)
    loss_fn = torch.nn.functional.binary_cross_entropy_with_logits
    run = shoal.session(train_steps={STEPS}, disp_freq=5, checkpoint_freq=20)
    model = run.model(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
    opt = run.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    if sys.argv[2:] == ["die-before-the-loop"] and run.rank == 0 and not (out / "killed").exists():
        (out / "killed").write_text("")
        os.kill(os.getpid(), 9)
    for step, (xb, yb) in run.batches(data, batch_size=12):
        if step % 10 == 0:
            run.evaluate(data, loss_fn, batch_size=96)
        time.sleep(0.04)
        loss = loss_fn(model(xb), yb)
        loss.backward()
        opt.step(); opt.zero_grad()
        run.log(step, loss=loss)
    run.evaluate(data, loss_fn, batch_size=96)
    run.checkpoint()
    (out / f"end{{run.rank}}.{{os.getpid()}}.json").write_text(json.dumps({{"step": step, "chief": run.chief}}))
''')


@pytest.mark.parametrize("layout, rejoins_from", [
    (HOGWILD, "from the other groups' live values"),
    (DOWNPOUR, "from the servers' live params"),
])
def test_a_killed_loop_chief_is_dropped_and_the_lowest_living_group_takes_its_place(tmp_path, runs, layout, rejoins_from):
    """Process 0 SIGKILLed mid-loop: no whole-job restart; process 1 keeps its pid, says on the terminal that it took the
    chief's place, continues metrics.jsonl as one log, evaluates (run.evaluate records there) and writes the checkpoints,
    the final one naming it as the writer; process 0 runs the script again under a new pid as an ordinary group;
    summary.json says finished and names the succession; exit 0, one line on stderr, no library text."""
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    out = tmp_path / "out"
    out.mkdir()
    run = runs.start(script, tmp_path, *LAYOUTS[layout].cli(), "--max-restarts", "1", "--", str(out))
    survivor = run.pid_once_training(1)
    victim = run.signal(0, signal.SIGKILL)
    stdout, stderr = run.finished()
    assert re.fullmatch(r"WARNING: process 0 \(worker\(group=0, id=0\)(, server\(group=0, id=0\))?\) (died \(SIGKILL\)|exited "
                        r"with code -9)( after step \d+)?; the other worker groups go on, the lowest living one taking the "
                        rf"chief's place; restarting it \(restart 1 of 1\); it rejoins as an ordinary group, {rejoins_from}",
                        stderr.strip()), stderr
    took = int(re.search(r"^Process 1 took the chief's place after step (\d+): it evaluates \(run.evaluate\), writes the "
                         r"run log and the checkpoints", stdout, re.M)[1])  # (on the terminal: the successor's line)
    assert took < STEPS, took  # (process 1 may be a step or two behind the chief, killed after its step 10)
    assert pids(run.ws, 1) == [survivor]
    first, second = pids(run.ws, 0)
    assert first == victim and second != victim  # the script ran again in process 0's place
    ends = {path.name.split(".")[0]: json.loads(path.read_text()) for path in out.glob("end*.json")}
    assert ends["end1"]["chief"] and not ends["end0"]["chief"] and ends["end0"]["step"] >= STEPS - 1, ends
    got = assert_ran(run.ws, layout)
    assert got["status"] == "finished" and "job_restarts" not in got, got
    assert got["chief_succession"] == [{"process": 1, "after_step": took}], got
    shown = [r["step"] for r in train_records(run.ws)]
    assert shown == sorted(set(shown)) and shown[-1] >= STEPS - 1 and any(s > took for s in shown), shown  # one log
    records = [json.loads(line) for line in (run.ws / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r["step"] for r in records if r["phase"] == "validate"]
    assert any(s > took for s in evaluated) and not [r for r in records if r["phase"] == "resume"], evaluated
    last = max(int(m[1]) for p in ckpt_io.checkpoint_dir(run.ws).iterdir()
               if (m := re.fullmatch(r"step(\d+)-worker0\.safetensors", p.name)))  # (Hogwild's groups train past STEPS)
    final = ckpt_io.load(ckpt_io.checkpoint_file(run.ws, last), parts=True)
    assert last >= STEPS and final.trainer["writer"] == 1 and final.params, (last, final.trainer)
    assert_no_library_text(stdout, stderr, (run.ws / "logs" / "rank1.log").read_text(),
                           (run.ws / "logs" / "rank0.log").read_text())
    assert leftover_processes(tmp_path) == []


def test_a_loop_chief_dead_before_its_first_step_restarts_the_whole_job(tmp_path):
    """Downpour's servers take their first values from the loop's chief (FIRST): a chief SIGKILLed before its first
    step leaves the others nothing to start from, so its death restarts the whole job (shoal.comm.succession's
    `chief_started`), in one line, and the run finishes."""
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    out = tmp_path / "out"
    out.mkdir()
    # `shoal run` in the test process (the ranks fork from its forkserver; the file's other cases keep a real
    # interpreter): the launcher's lines in proc.stdout/stderr, the ranks' in their logs
    proc = run_cli("run", script, "--workspace", tmp_path / "ws", "--no-progress", *LAYOUTS[DOWNPOUR].cli(), "--max-restarts",
                   "1", "--set", "train_steps=10", "--", out, "die-before-the-loop", timeout=180)
    assert proc.returncode == 0, proc.stderr
    stdout = proc.stdout + "".join(log.read_text() for log in sorted((tmp_path / "ws" / "logs").glob("rank*.log")))
    stderr = proc.stderr
    assert re.fullmatch(r"WARNING: process 0 \(worker\(group=0, id=0\)\) (died \(SIGKILL\)|exited with code -9): the job "
                        r"cannot go on without it; restarting the whole job from step 0 \(no checkpoint was written yet\) "
                        r"\(restart 1 of 1\)", stderr.strip()), stderr
    got = assert_ran(tmp_path / "ws", DOWNPOUR)
    assert got["status"] == "finished" and "chief_succession" not in got and len(got["job_restarts"]) == 1, got
    assert (out / "killed").exists() and "took the chief's place" not in stdout


@pytest.mark.slow  # (a torchrun run: about 20 s on the busy machine)
@pytest.mark.parametrize("layout, nprocs", [(HOGWILD, 2), (DOWNPOUR, 3)])
def test_a_killed_loop_chief_under_torchrun_is_replaced_and_torchrun_restarts_nothing(tmp_path, torchruns, layout, nprocs):
    """`torchrun ... -m shoal run script.py --max-restarts 1`: rank 0's process SIGKILLed mid-loop; its supervisor
    restarts it into the loop as an ordinary group, process 1 takes the chief's place; torchrun restarts nothing (one
    registration), the record ends finished."""
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    out = tmp_path / "out"
    out.mkdir()
    proc, ws = start(torchruns, script, tmp_path, *LAYOUTS[layout].cli(), "--set", "train_steps=150", "--", str(out),
                     nprocs=nprocs)
    killed_chief_is_replaced_under_torchrun(proc, ws, tmp_path, layout)


@pytest.mark.slow  # (a stall timeout to wait out: about 15 s on the busy machine)
@pytest.mark.parametrize("layout", [HOGWILD, DOWNPOUR])
def test_a_stopped_loop_chief_is_dropped_ended_and_replaced(tmp_path, runs, layout):
    """Process 0 SIGSTOPped past the stall timeout: process 1 takes the chief's place, the launcher ends the stopped
    process and restarts it as an ordinary group; process 1 keeps its pid; exit 0, summary.json finished."""
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    out = tmp_path / "out"
    out.mkdir()
    run = runs.start(script, tmp_path, *LAYOUTS[layout].cli(), "--max-restarts", "1", "--set", "cluster.stall_timeout_s=2",
                     "--set", "train_steps=150", "--", str(out))
    stopped_chief_is_replaced(run, tmp_path, layout)


@pytest.mark.slow  # (about 15 s on the busy machine)
def test_a_loop_server_killed_after_the_chief_heals_from_the_successors_mirror(tmp_path, runs):
    """Downpour in a loop: the chief SIGKILLed, then, once process 1 took its place, the server: the server process is
    restarted, runs the script from the top and is healed from process 1's mirror; the groups go on, exit 0."""
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    out = tmp_path / "out"
    out.mkdir()
    run = runs.start(script, tmp_path, *LAYOUTS[DOWNPOUR].cli(), "--max-restarts", "1", "--set", "train_steps=150", "--",
                     str(out))
    run.signal(0, signal.SIGKILL)
    wait_for(lambda: "Process 1 took the chief's place" in run.stdout(), 60, run.stderr())
    wait_for(lambda: re.search(r"Train @ step \d+", run.stdout().split("took the chief's place")[1]), 60, run.stdout())
    os.kill(registered_pids(run.ws)[2], signal.SIGKILL)  # (a server's log names no pid)
    stdout, stderr = run.finished()
    assert re.search(r"^server\(group=0, id=0\) \(process restart 1\) healed from worker group 1's mirror", stdout, re.M), stdout
    assert re.search(r"^WARNING: process 2 \(server\(group=0, id=0\)\) died \(SIGKILL\); restarting it \(restart 1 of 1\); it "
                     r"heals from the mirror of the process that takes the dead chief's place", stderr, re.M), stderr
    got = assert_ran(run.ws, DOWNPOUR)
    assert got["status"] == "finished" and got["chief_succession"][0]["process"] == 1 and "job_restarts" not in got, got
    assert_no_library_text(stdout, stderr)
    assert leftover_processes(tmp_path) == []
