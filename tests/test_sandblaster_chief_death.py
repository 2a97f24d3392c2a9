"""Issue 38: a job file's Sandblaster survives its chief's death. Under `shoal run JOB --max-restarts N` its worker
processes are a quorum of replicas (runtime/exchanges/sandblaster.py); when process 0, the chief, dies, the lowest living
worker process decides the next step in its place (shoal.comm.quorum, `replaceable`), becomes the servers' stub (it
knocks as worker group 0's new incarnation and pushes the step's mean to each server that had not applied the dead
chief's push of it: applied once) and keeps their mirror, and its trainer takes over the chief's duties (tests, run log,
checkpoints: runtime/trainer.py `_take_over`). The dead chief's restarted process rejoins as an ordinary worker process.
Real runs through the CLI on the blobs data, real SIGKILLs, as tests/test_job_chief_death.py's.
"""
from __future__ import annotations

import json
import math
import os
import re
import signal
import textwrap
import threading

import pytest
import torch

from cli_in_process import run_cli
from fault_runs import (SLOW, assert_job_processes_ended, assert_no_library_text, pids, registered_pids, runs, summary, train_records,  # noqa: F401
                         wait_for)
from layouts import LAYOUTS, assert_ran
from test_cli import leftover_processes
from test_local_sgd_faults import params
from test_chief_death import job_store  # noqa: F401 (a fixture)
from test_sandblaster_faults import CLUSTER, SERVED, cli_run
from test_torchrun_rejoin import torchruns  # noqa: F401 (the fixture that stops a torchrun a failed test left running)

from shoal.comm import channels, quorum
from shoal.comm.signed_store import SignedStore
from shoal.config import job_pb2
from shoal.neuralnet import checkpoint as ckpt_io
from shoal.report.metrics import read_metrics

CHIEF = "process 0 (worker(group=0, id=0))"
TOOK = (r"^Process 1 took the chief's place after step (\d+): it decides the steps, tests and validates, writes the run "
        r"log and the checkpoints, pushes to the servers and keeps their mirror$")
STUB = r"^Process 1 connected to the servers as worker group 0 \(restart 1\) at step (\d+): (.*); it asked for their mirror at once$"


def assert_the_chief_missed_steps_or_came_back_at_once(got: dict, took: int) -> None:
    """summary.json names process 0's missed steps, or none: its restart knocked before its successor decided the step
    the dead chief's sum was in, was admitted there and trained from the next (a forkserver restart knocks in ~0.1 s)."""
    if "0" not in got.get("missed_steps", {}):
        assert [(r["rank"], r["step"]) for r in got["rejoins"]] == [(0, took + 1)], got


def test_a_killed_chief_is_replaced_by_process_1_which_pushes_tests_logs_and_checkpoints(blobs_job, tmp_path, runs):
    """Process 0 of 3 worker processes SIGKILLed mid-run (momentum: an updater state at the server): processes 1, 2 and
    the server keep their pids to the end; process 1 says on the terminal that it took the chief's place and became the
    servers' stub, decides the steps, tests on the chief's next samples, writes metrics.jsonl on as one log and the
    final checkpoint (with the servers' updater state); process 0 comes back as an ordinary worker process; exit 0,
    accurate, nothing left behind."""
    steps = 150  # 1.5 s or more (SLOW): time for the restarted process to knock, under load
    job = blobs_job(train_steps=steps, cluster_extra=CLUSTER)
    run = runs.start(job, tmp_path, "--max-restarts", "1", "--set", "updater.momentum=0.9", env=SLOW)
    survivors = {rank: run.pid_once_training(rank) for rank in (1, 2)}
    server = registered_pids(run.ws)[3]
    victim = run.signal(0, signal.SIGKILL)
    stdout, stderr = run.finished()
    assert (f"WARNING: {CHIEF} died (SIGKILL); the other processes go on without it; restarting it (restart 1 of 1); it "
            "rejoins at the next step, from the state of the lowest living process, which decides the steps and pushes to "
            "the servers now") in stderr.splitlines(), stderr
    assert "restarting the whole job" not in stderr, stderr
    took = int(re.search(TOOK, stdout, re.M)[1])  # (on the terminal: the successor's)
    stub = re.search(STUB, stdout, re.M)
    pushed, had = ("pushed the step's mean, which the dead chief had not",
                   "the dead chief had pushed the step's mean to every server already (applied once)")
    # it became the stub at the step it decided first, where the chief died before or after its push, or at the next
    # one, where the chief died after the step's values were summed (process 1 decided that sum: "after step N")
    assert (int(stub[1]), stub[2]) in {(took, pushed), (took, had), (took + 1, pushed)}, stub[0]
    assert 10 <= took < steps
    assert {rank: pids(run.ws, rank) for rank in (1, 2)} == {rank: [pid] for rank, pid in survivors.items()}
    assert registered_pids(run.ws)[3] == server  # the server never restarted
    first, second = pids(run.ws, 0)
    assert first == victim and second != victim
    got = assert_ran(run.ws, SERVED)
    assert got["status"] == "finished" and "job_restarts" not in got, got
    assert_the_chief_missed_steps_or_came_back_at_once(got, took)
    assert got["chief_succession"] == [{"process": 1, "after_step": took}], got
    records = read_metrics(run.ws / "metrics.jsonl")
    assert not [r for r in records if r["phase"] == "resume"]
    shown = [r["step"] for r in train_records(run.ws)]
    assert shown == sorted(set(shown)) and set(range(0, steps, 5)) - set(shown) <= set(range(10, took + 1)), shown
    tests = [r["step"] for r in records if r["phase"] == "test"]
    assert tests[-1] == steps and any(took < s < steps for s in tests), tests  # the successor tested, the final test too
    final = ckpt_io.load(ckpt_io.checkpoint_file(run.ws, steps), parts=False)
    assert final.trainer["cursors"][str(job_pb2.kTest)] == (steps // 10 + 1) * 2 * 64, final.trainer
    assert final.trainer["writer"] == 1
    assert final.updater_state and all("history" in slots for slots in final.updater_state.values())  # (the servers')
    assert got["final_test"]["accuracy"] >= 0.9, got["final_test"]  # (as unfaulted on this data)
    assert_no_library_text(stdout, stderr, *((run.ws / "logs" / f"rank{r}.log").read_text() for r in (1, 3)))
    assert leftover_processes(tmp_path) == []
    assert [r["rank"] for r in got.get("rejoins", [])] in ([0], [])  # (a restart may come after the last step)


@pytest.mark.slow  # three runs
def test_a_chief_that_exits_at_the_last_step_leaves_the_same_bits_each_time(blobs_job, tmp_path):
    """The fault schedule decides the result: process 0 exits before step 39 of 40 (its restart comes back after the
    last step, or rejoins for nothing), so process 1 decides step 39 over its and process 2's rows, pushes it to the
    server as worker group 0's new stub (the dead chief had not) and writes the final checkpoint; the same faulted job
    twice gives the same bits, and the final test's accuracy is the unfaulted run's within 0.02."""
    steps, gone = 40, 39
    job = blobs_job(train_steps=steps, cluster_extra=CLUSTER)
    for i in range(2):
        ws = tmp_path / f"faulted{i}"
        proc = run_cli("run", job, "--workspace", ws, "--no-progress", "--max-restarts", "1", "--set", "updater.momentum=0.9",
                       env={**os.environ, "SHOAL_INJECT_EXIT": f"0:{gone}"}, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert (f"WARNING: {CHIEF} exited with code 3; the other processes go on without it; restarting it (restart 1 of "
                "1)") in proc.stderr, proc.stderr
        log = (ws / "logs" / "rank1.log").read_text()
        assert f"Process 1 took the chief's place after step {gone}: " in log, log
        assert (f"Process 1 connected to the servers as worker group 0 (restart 1) at step {gone}: pushed the step's mean, "
                "which the dead chief had not; it asked for their mirror at once") in log, log
        got = assert_ran(ws, SERVED)
        assert got["missed_steps"]["0"]["why"].startswith(f"missing from step {gone}"), got
        assert got["chief_succession"] == [{"process": 1, "after_step": gone}], got
    a, b = params(tmp_path / "faulted0", steps), params(tmp_path / "faulted1", steps)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    cli_run(job, tmp_path / "unfaulted", "--max-restarts", "1", "--set", "updater.momentum=0.9")
    faulted, unfaulted = (summary(tmp_path / ws)["final_test"]["accuracy"] for ws in ("faulted0", "unfaulted"))
    assert abs(faulted - unfaulted) <= 0.02, (faulted, unfaulted)


@pytest.mark.slow  # a stall timeout to wait out
def test_a_stopped_chief_is_dropped_ended_and_replaced(blobs_job, tmp_path, runs):
    """Process 0 SIGSTOPped past the stall timeout: process 1 takes its place and becomes the servers' stub once the
    launcher ended the stopped process (the server serves group 0's new stub after the old one's channel closed), the
    stopped process is restarted and rejoins as an ordinary worker process; processes 1, 2 and the server keep their pids;
    exit 0, summary.json finished."""
    steps = 400
    job = blobs_job(train_steps=steps, cluster_extra=CLUSTER)
    run = runs.start(job, tmp_path, "--max-restarts", "1", "--set", "cluster.stall_timeout_s=2", env=SLOW)
    survivors = {rank: run.pid_once_training(rank) for rank in (1, 2)}
    server = registered_pids(run.ws)[3]
    stopped = run.signal(0, signal.SIGSTOP)
    stdout, stderr = run.finished()
    assert re.search(rf"^WARNING: {re.escape(CHIEF)} (stopped answering|was stopped past the stall timeout)", stderr, re.M), stderr
    assert "restarting the whole job" not in stderr, stderr
    took = int(re.search(TOOK, stdout, re.M)[1])
    assert int(re.search(STUB, stdout, re.M)[1]) in (took, took + 1), stdout
    assert {rank: pids(run.ws, rank) for rank in (1, 2)} == {rank: [pid] for rank, pid in survivors.items()}
    assert registered_pids(run.ws)[3] == server
    assert pids(run.ws, 0)[0] == stopped and len(set(pids(run.ws, 0))) == 2
    got = assert_ran(run.ws, SERVED)
    assert got["status"] == "finished" and "job_restarts" not in got and [r["rank"] for r in got["rejoins"]] == [0], got
    assert got["final_test"]["accuracy"] >= 0.9, got["final_test"]
    assert_no_library_text(stdout, stderr)
    assert leftover_processes(tmp_path) == []


@pytest.mark.slow  # two kills, a restart and a heal
def test_after_the_chiefs_death_a_killed_server_heals_from_the_successors_mirror(blobs_job, tmp_path, runs):
    """Process 0 SIGKILLed, then, once process 1 became the servers' stub and a few steps passed, the server process:
    it is restarted and heals from process 1's mirror (its updater state: momentum), the launcher's line names the
    successor's mirror, and the job exits 0 without a whole-job restart."""
    steps = 400
    job = blobs_job(train_steps=steps, cluster_extra=CLUSTER)
    run = runs.start(job, tmp_path, "--max-restarts", "1", "--set", "updater.momentum=0.9", env=SLOW)
    run.signal(0, signal.SIGKILL)
    wait_for(lambda: re.search(STUB, run.stdout(), re.M) and "Process 0 rejoined at step " in run.stdout(), 60,
             f"no successor: {run.stderr()}")
    took = int(re.search(STUB, run.stdout(), re.M)[1])
    wait_for(lambda: any(r["step"] >= took + 10 for r in train_records(run.ws)), 60, "no steps after the takeover")
    os.kill(registered_pids(run.ws)[3], signal.SIGKILL)
    stdout, stderr = run.finished()
    assert ("WARNING: process 3 (server(group=0, id=0)) died (SIGKILL); restarting it (restart 1 of 1); it heals from the "
            "mirror of the process that takes the dead chief's place (none, where it has none yet), the other processes "
            "wait for it") in stderr.splitlines(), stderr
    assert "restarting the whole job" not in stderr, stderr
    assert re.search(r"^server\(group=0, id=0\) \(process restart 1\) healed from worker group 0's mirror: its values of "
                     r"version \d+ \(digest [0-9a-f]{16}\) and the updater state of version \d+, ", stdout, re.M), stdout
    got = assert_ran(run.ws, SERVED)
    assert got["status"] == "finished" and "job_restarts" not in got, got
    assert sorted((r["rank"], r.get("server")) for r in got["rejoins"]) == [(0, None), (3, 0)], got["rejoins"]
    assert got["final_test"]["accuracy"] >= 0.9, got["final_test"]
    assert_no_library_text(stdout, stderr)
    assert leftover_processes(tmp_path) == []


@pytest.mark.slow  # one torchrun run of 4 processes
def test_a_killed_chief_under_torchrun_is_replaced_and_nothing_restarts(blobs_job, tmp_path, torchruns):  # noqa: F811
    """`torchrun ... -m shoal run JOB --max-restarts 1`: rank 0's training process SIGKILLed mid-run; torchrun restarts
    nothing (one registration), process 1 takes the chief's place and becomes the servers' stub, rank 0's supervisor
    starts a new process that rejoins as an ordinary worker process, the job exits 0, finished."""
    from test_torchrun_rejoin import registered, start

    steps = 300
    job = blobs_job(train_steps=steps, cluster_extra=CLUSTER)
    proc, ws = start(torchruns, job, tmp_path, env={"SHOAL_SLOW_WORKER": "0:0+0.01"}, nprocs=4)
    (record,) = registered(ws)
    victim, survivor = (next(p["pid"] for p in record.processes if p["rank"] == r) for r in (0, 1))
    os.kill(victim, signal.SIGKILL)
    assert proc.wait(timeout=180) == 0, proc.err.read_text()[-3000:]
    stdout, stderr = proc.out.read_text(), proc.err.read_text()
    assert any(line.startswith(f"WARNING: {CHIEF} died (SIGKILL); the other processes go on without it; restarting it "
                               "(restart 1 of 1)") for line in stderr.splitlines()), stderr
    assert re.search(TOOK, stdout, re.M) and re.search(STUB, stdout, re.M), stdout
    (record,) = registered(ws)  # torchrun restarted nothing
    assert record.status == "finished", record
    assert pids(ws, 1) == [survivor] and pids(ws, 0)[0] == victim and len(pids(ws, 0)) == 2
    got = assert_ran(ws, SERVED)
    assert got["status"] == "finished" and got["final_test"]["step"] == steps, got
    assert_the_chief_missed_steps_or_came_back_at_once(got, int(re.search(TOOK, stdout, re.M)[1]))
    assert [r["rank"] for r in got["rejoins"]] == [0], got
    assert_no_library_text(stderr)
    assert leftover_processes(tmp_path) == []


CHIEF_DIES = textwrap.dedent('''
    import json, os, signal, sys, time
    from pathlib import Path
    import torch, shoal
    out, kill_at, steps = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    run = shoal.session(train_steps=steps, disp_freq=2)
    (out / f"pid{run.rank}.{os.getpid()}").write_text("")
    torch.manual_seed(0)
    model = run.model(torch.nn.Linear(4, 1, bias=False))
    opt = run.optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    first = None
    for step in run.steps():
        first = step if first is None else first
        if run.rank == 0 and step == kill_at and not (out / "killed").exists():
            (out / "killed").write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        if run.rank == 0 and first > 0 and step == first:
            (out / "back").write_text(str(step))
        if run.rank == 1 and step > kill_at:  # the successor goes on slowly until process 0 is back
            deadline = time.time() + 60
            while len(list(out.glob("pid0.*"))) < 2 and time.time() < deadline:
                time.sleep(0.02)
            if not (out / "back").exists():
                time.sleep(0.1)
        target = torch.arange(4.0) * (run.rank + 1) - 0.01 * step  # each process's own gradient: w - target
        loss = 0.5 * ((model.weight[0] - target) ** 2).sum()
        loss.backward()
        opt.step(); opt.zero_grad(); sched.step()
        run.log(step, loss=loss)
    (out / f"rank{run.rank}.json").write_text(json.dumps({"pid": os.getpid(), "first": first, "last": step,
                                                          "weight": model.weight[0].tolist(), "lr": opt.param_groups[0]["lr"]}))
''')


def replayed_without_the_chief(missed: set[int], steps: int) -> torch.Tensor:
    """The loop's values where process 0's gradient is missing from the steps in `missed`: the servers' SGD with momentum
    0.5 over the mean gradient of the processes that came (one row each), its lr halved every 10 steps."""
    torch.manual_seed(0)
    w = torch.nn.Linear(4, 1, bias=False).weight[0].detach().clone().double()
    buf = None
    for step in range(steps):
        came = [1] if step in missed else [0, 1]
        grad = sum(w - (torch.arange(4.0).double() * (r + 1) - 0.01 * step) for r in came) / len(came)
        buf = grad if buf is None else 0.5 * buf + grad
        w -= 0.1 * 0.5 ** (step // 10) * buf
    return w


@pytest.mark.slow  # about 4 s (the default suite holds the job file's: above)
def test_a_users_loop_goes_on_when_its_chief_dies(tmp_path):
    """A user's loop (`shoal.session()`) under Sandblaster with --max-restarts 1: process 0 SIGKILLs itself at step 4;
    process 1 takes its place (the run log, the servers' stub: its push carries the loop's scheduled lr, the server's
    momentum goes on), process 0's restart takes process 1's loop state and rejoins as an ordinary worker process; both
    replicas end on the values a replay of that fault schedule computes: every step's mean applied once."""
    script, out = tmp_path / "chief_dies.py", tmp_path / "out"
    script.write_text(CHIEF_DIES)
    out.mkdir()
    layout = "Sandblaster, 2 workers + 1 server, 3 processes"
    proc = run_cli("run", script, "--workspace", tmp_path / "ws", *LAYOUTS[layout].cli(), "--max-restarts", "1", "--",
                   out, "4", "30", cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert (f"WARNING: {CHIEF} died (SIGKILL); the other processes go on without it; restarting it (restart 1 of 1); it "
            "rejoins at the next step, from the state of the lowest living process, which decides the steps and pushes to "
            "the servers now") in proc.stderr.splitlines(), proc.stderr
    assert "restarting the whole job" not in proc.stderr, proc.stderr
    log = (tmp_path / "ws" / "logs" / "rank1.log").read_text()
    took = int(re.search(r"^Process 1 took the chief's place after step (\d+): it decides the steps, evaluates "
                         r"\(run.evaluate\), writes the run log and the checkpoints, pushes to the servers and keeps their "
                         r"mirror$", log, re.M)[1])
    assert re.search(STUB, log, re.M), log
    ends = {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)}
    killed = int((out / "killed").read_text())
    assert ends[0]["pid"] != killed and ends[1]["first"] == 0 and 4 < ends[0]["first"] < 30, ends
    got = assert_ran(tmp_path / "ws", layout)
    assert got["status"] == "finished" and "job_restarts" not in got
    assert got["chief_succession"] == [{"process": 1, "after_step": took}], got
    back = ends[0]["first"]
    assert [(r["rank"], r["step"]) for r in got["rejoins"]] == [(0, back)], got["rejoins"]
    expected = replayed_without_the_chief(set(range(4, back)), 30)
    for rank in (0, 1):
        assert torch.allclose(torch.tensor(ends[rank]["weight"]).double(), expected, rtol=1e-5, atol=1e-5), (rank, ends)
        assert math.isclose(ends[rank]["lr"], 0.1 * 0.5 ** 3)
    assert_no_library_text(proc.stdout, proc.stderr, log)
    assert_job_processes_ended(tmp_path / "ws")  # (run in this process: its ranks carry no tag for leftover_processes)


def test_a_successor_deciding_a_meeting_that_admits_nobody_admits_nobody(job_store, monkeypatch):  # noqa: F811
    """Sandblaster's values' meeting admits nobody (a joiner admitted there would wait for a handover nobody sends, to
    its timeout): the member that decides it in a dead decider's place keeps that (Quorum._outcome), and admits the
    knocking process at the next meeting that admits."""
    raw, secret = job_store
    door = lambda: channels.Door("step", raw, secret)  # noqa: E731
    members = {r: quorum.Quorum(r, [0, 1, 2], {0: 0, 1: 1, 2: 2}, door(), first=object(), admits=True, replaceable=True)
               for r in (1, 2)}
    door().next_incarnation(0)  # the launcher saw process 0 die and restarts it
    SignedStore(raw, secret).under(quorum.KEYS).set("knock/r0", "1")  # its new process knocks at once
    outcomes, errors = {}, []

    def meetings(rank: int) -> None:
        try:
            for meeting, admit in ((1, False), (2, True)):
                members[rank].meet(meeting, 0, lambda attempt: rank, admit=admit)
                outcomes[rank, meeting] = members[rank]._next
        except Exception as err:  # noqa: BLE001 (the test reports it)
            errors.append(err)

    threads = [threading.Thread(target=meetings, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and all(not t.is_alive() for t in threads), errors
    assert members[1].chief and outcomes[1, 1].decider == 1 and outcomes[1, 1].joiners == ()  # (decided in 0's place)
    assert outcomes[2, 2].joiners == (quorum.Member(0, 1),) and outcomes[2, 2].decider == 1
