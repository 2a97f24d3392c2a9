"""Issue 38 for asynchronous groups: a Downpour or Distributed Hogwild job file's chief dies and the job goes on.

With one process per group and `--max-restarts N`, group 0's process is dropped like any other group's: the lowest
living worker process takes the chief's duties (shoal.comm.succession, runtime/trainer.py `_take_over`): the tests and
validations, the run log, the checkpoints (from its replica, or the servers' state), Downpour's mirror of the servers
and their last request; the dead chief's restarted process rejoins as an ordinary group. Real runs through the CLI on
the blobs data, the chief SIGKILLed from its pid in its log, as tests/test_job_chief_death.py's.
"""
from __future__ import annotations

import os
import re
import signal

import pytest

from fault_runs import (SLOW, assert_no_library_text, pids, registered_pids, runs, summary,  # noqa: F401 (fixtures)
                        train_records, wait_for)
from layouts import assert_ran
from test_cli import leftover_processes
from test_diloco_chief_death import plan_of
from test_torchrun_rejoin import registered, start, torchruns, training_pids  # noqa: F401 (torchruns: a fixture)

from shoal.launcher import ranks, rejoin

from shoal.neuralnet import checkpoint as ckpt_io
from shoal.report.metrics import read_metrics

HOGWILD = "Distributed Hogwild, 2 groups"
DOWNPOUR = "Downpour, 2 groups + 1 server, 3 processes"


@pytest.mark.parametrize("layout, rejoins_from", [
    (HOGWILD, "from the other groups' live values"),
    (DOWNPOUR, "from the servers' live params"),
])
def test_a_killed_async_chief_is_dropped_and_the_lowest_living_group_takes_its_place(blobs_job, tmp_path, runs, layout,
                                                                                     rejoins_from):
    """Process 0 (group 0, the chief) SIGKILLed mid-run: no whole-job restart, process 1 keeps its pid and says on the
    terminal that it took the chief's place; it tests after the death, appends to metrics.jsonl as one log, writes the
    checkpoints and the final one (naming it as the writer); process 0 comes back under a new pid as an ordinary group;
    summary.json says finished, names the succession; exit 0, no library text."""
    steps = 200
    job = blobs_job(train_steps=steps, layout=layout, cluster_extra=dict(sync_freq=4) if layout == HOGWILD else None)
    run = runs.start(job, tmp_path, "--max-restarts", "1", "--set", "checkpoint_freq=50", env=SLOW)
    survivor = run.pid_once_training(1)
    victim = run.signal(0, signal.SIGKILL)
    stdout, stderr = run.finished()
    assert re.search(r"^WARNING: process 0 \(worker\(group=0, id=0\)(, server\(group=0, id=0\))?\) (died \(SIGKILL\)|exited "
                     r"with code -9); the other worker groups go on, the lowest living one taking the chief's place; "
                     rf"restarting it \(restart 1 of 1\); it rejoins as an ordinary group, {rejoins_from}$", stderr, re.M), stderr
    assert "restarting the whole job" not in stderr, stderr
    took = int(re.search(r"^Process 1 took the chief's place after step (\d+): it tests and validates, writes the run log "
                         r"and the checkpoints", stdout, re.M)[1])  # (on the terminal: the successor's line)
    # (an asynchronous group keeps its own pace: under load process 1 may still be in its first step when the chief,
    # killed after its step 10, dies)
    assert 0 <= took < steps, took
    assert pids(run.ws, 1) == [survivor]
    first, second = pids(run.ws, 0)
    assert first == victim and second != victim
    got = assert_ran(run.ws, layout)
    assert got["status"] == "finished" and "job_restarts" not in got, got
    assert got["chief_succession"] == [{"process": 1, "after_step": took}], got
    last = got["steps"]
    assert last >= steps and got["final_test"]["step"] == last, got
    records = read_metrics(run.ws / "metrics.jsonl")
    assert not [r for r in records if r["phase"] == "resume"]
    shown = [r["step"] for r in train_records(run.ws)]
    assert shown == sorted(set(shown)) and any(s > took for s in shown), shown  # one log, continued by the successor
    tests = [r["step"] for r in records if r["phase"] == "test"]
    assert any(took < s < steps for s in tests) and tests[-1] == last, tests  # the successor tested
    final = ckpt_io.load(ckpt_io.checkpoint_file(run.ws, last), parts=True)
    assert (final.trainer["writer"], final.trainer["writer_group"]) == (1, 1), final.trainer
    assert got["final_test"]["accuracy"] > 0.8, got["final_test"]
    if layout == HOGWILD:  # (Downpour's group 0 rejoins where the servers say it was: short only by a push in flight)
        assert "0" in got["missed_updates"], got
    closing = [line for line in stdout.splitlines() if line.startswith("Trained ")][-1]
    assert f"process 1 took the chief's place after step {took}" in closing, closing
    assert_no_library_text(stdout, stderr, (run.ws / "logs" / "rank1.log").read_text(),
                           (run.ws / "logs" / "rank0.log").read_text())
    assert leftover_processes(tmp_path) == []


def test_group_0s_process_is_replaceable_with_restarts_and_one_process_per_group():
    """Downpour and Distributed Hogwild under cluster.max_restarts, in a job file or a user's loop
    (tests/test_session_async_chief_death.py): the chief's process is dropped like any group's and may rejoin; without
    restarts, or with a user's loop's group over two processes, its death restarts the whole job as before. A job
    file's Downpour group 0 over two processes is replaceable too: the launcher restarts its processes together
    (tests/test_spanning_group_rejoin.py), never one alone (--rejoin, a rank's supervisor)."""
    downpour = dict(nworker_groups=2, nworkers_per_procs=1, nserver_groups=1, server_worker_separate=True)
    hogwild = dict(nworker_groups=2, nworkers_per_procs=1, nserver_groups=2)
    for cluster in downpour, hogwild:
        for plan in plan_of(False, **cluster, max_restarts=1), plan_of(True, **cluster, max_restarts=1):
            assert ranks.chief_replaceable(plan) and ranks.expendable(plan, 0) and rejoin.why_not(plan, 0) is None
        for other in plan_of(False, **cluster), plan_of(True, **cluster):
            assert not ranks.chief_replaceable(other) and not ranks.expendable(other, 0)
    spread = plan_of(False, **dict(downpour, nworkers_per_group=2), max_restarts=1)  # a group over 2 processes
    assert ranks.chief_replaceable(spread) and ranks.expendable(spread, 0)
    assert rejoin.why_not(spread, 0, whole_group=True) is None and "spans processes 0, 1" in rejoin.why_not(spread, 0)
    assert not ranks.chief_replaceable(plan_of(True, **dict(downpour, nworkers_per_group=2), max_restarts=1))


# slow: under load it once waited 60 s for the successor's first display and failed (2026-11-29, not understood yet);
# the default suite keeps the chief's death (above) and a server's heal from the chief's mirror (test_server_restart.py)
@pytest.mark.slow
def test_a_server_killed_after_the_chief_heals_from_the_successors_mirror(blobs_job, tmp_path, runs):
    """Downpour: the chief's process SIGKILLed, then, once process 1 took its place, the server's: the server is
    restarted and healed from process 1's mirror (the updater state it asked the server for after taking over), the
    groups go on, exit 0."""
    job = blobs_job(train_steps=300, layout=DOWNPOUR)
    run = runs.start(job, tmp_path, "--max-restarts", "1", env=SLOW)
    run.signal(0, signal.SIGKILL)
    wait_for(lambda: "Process 1 took the chief's place" in run.stdout(), 60, run.stderr())
    wait_for(lambda: re.search(r"Train @ step \d+", run.stdout().split("took the chief's place")[1]), 60, run.stdout())
    os.kill(registered_pids(run.ws)[2], signal.SIGKILL)  # (a server's log names no pid)
    stdout, stderr = run.finished()
    assert re.search(r"^server\(group=0, id=0\) \(process restart 1\) healed from worker group 1's mirror: its values of "
                     r"version \d+ \(digest \w+\) and the updater state of version \d+", stdout, re.M), stdout
    assert re.search(r"^WARNING: process 2 \(server\(group=0, id=0\)\) died \(SIGKILL\); restarting it \(restart 1 of 1\); it "
                     r"heals from the mirror of the process that takes the dead chief's place", stderr, re.M), stderr
    got = summary(run.ws)
    assert got["status"] == "finished" and [r["healed_from_group"] for r in got["rejoins"] if r["group"] is None] == [1], got
    assert "restarting the whole job" not in stderr
    assert_no_library_text(stdout, stderr)
    assert leftover_processes(tmp_path) == []


@pytest.mark.slow  # a stall timeout to wait out
@pytest.mark.parametrize("layout", [HOGWILD, DOWNPOUR])
def test_a_stopped_async_chief_is_dropped_ended_and_replaced(blobs_job, tmp_path, runs, layout):
    """Group 0's process SIGSTOPped past the stall timeout: process 1 takes the chief's place, the launcher ends the
    stopped process and restarts it as an ordinary group; process 1 keeps its pid; exit 0, summary.json finished."""
    job = blobs_job(train_steps=600, layout=layout)
    run = runs.start(job, tmp_path, "--max-restarts", "1", "--set", "cluster.stall_timeout_s=2", env=SLOW)
    stopped_chief_is_replaced(run, tmp_path, layout)


def stopped_chief_is_replaced(run, tmp_path, layout) -> None:
    """Process 0 SIGSTOPped once process 1 trains: dropped past the stall timeout, process 1 took the chief's place and
    kept its pid, process 0 came back under a new one; the layout ran and finished, no library text, nothing left."""
    survivor = run.pid_once_training(1)
    stopped = run.signal(0, signal.SIGSTOP)
    stdout, stderr = run.finished()
    assert re.search(r"^WARNING: worker group 0 dropped: process 0 \(.*\) stopped answering", stderr, re.M), stderr
    assert re.search(r"^Process 1 took the chief's place after step \d+", stdout, re.M), stdout
    assert pids(run.ws, 1) == [survivor] and pids(run.ws, 0)[0] == stopped and len(set(pids(run.ws, 0))) == 2
    got = assert_ran(run.ws, layout)
    assert got["status"] == "finished" and got["chief_succession"][0]["process"] == 1, got
    assert_no_library_text(stdout, stderr)
    assert leftover_processes(tmp_path) == []


@pytest.mark.slow  # about 15 s on the loaded 2-core machine
def test_a_server_killed_with_the_chief_heals_without_a_mirror_and_no_count_is_claimed(blobs_job, tmp_path, runs):
    """Downpour: the chief's and the server's processes SIGKILLed at once (the chief's first): the successor waits for the
    launcher's word on the chief rather than pull from the unhealed server, and heals the new server from its
    newest values and the updater's first state (it has no mirror yet), the server says its counts restart there, and
    neither summary.json nor the closing line claims a count of the job's updates or bytes from before it."""
    job = blobs_job(train_steps=400, layout=DOWNPOUR)
    # (2 restarts: process 0's rejoin may meet the dead server first, a group's known limit: it fails and comes back)
    run = runs.start(job, tmp_path, "--max-restarts", "2", env=SLOW)
    chief, server = run.pid_once_training(0), registered_pids(run.ws)[2]
    os.kill(chief, signal.SIGKILL)
    os.kill(server, signal.SIGKILL)
    stdout, stderr = run.finished()
    healed = re.search(r"^server\(group=0, id=0\) \(process restart 1\) healed from worker group 1's mirror: its values of "
                       r"version (\d+) \(digest \w+\) and the updater's first state \(no mirror yet; its counts of updates "
                       r"and bytes restart here\)", stdout, re.M)
    assert healed, stdout
    got = summary(run.ws)
    assert got["status"] == "finished" and "bytes_sent" not in got and "missed_updates" not in got, got
    assert got["staleness_histogram"]["counted_from_version"] == int(healed[1])
    assert f"updates since version {healed[1]} (a server's counts restarted there)" in stdout, stdout
    assert_no_library_text(stdout, stderr)
    assert leftover_processes(tmp_path) == []


@pytest.mark.slow  # two faults, one after the other, and a whole-job restart: about 8 s each
@pytest.mark.parametrize("layout", [HOGWILD, DOWNPOUR])
def test_a_chief_nobody_is_left_to_replace_restarts_the_whole_job(blobs_job, tmp_path, runs, layout):
    """Two groups: group 1's process SIGKILLed and restarted first, then the chief's: no process that started with the
    job is left to take the chief's place (a restarted one never does), so the launcher restarts the whole job from its
    newest checkpoint, in one line, and the job finishes."""
    job = blobs_job(train_steps=300, layout=layout)
    run = runs.start(job, tmp_path, "--max-restarts", "1", "--set", "checkpoint_freq=50", env=SLOW)
    run.signal(1, signal.SIGKILL)
    wait_for(lambda: "rejoined at step" in (run.ws / "logs" / "rank1.log").read_text(), 60, run.stderr())
    os.kill(pids(run.ws, 0)[-1], signal.SIGKILL)
    stdout, stderr = run.finished()
    assert re.search(r"^WARNING: process 0 \(worker\(group=0, id=0\)(, server\(group=0, id=0\))?\) died \(SIGKILL\)"
                     r"( after step \d+)?: the job cannot go on without it; restarting the whole job from", stderr, re.M), stderr
    assert "taking the chief's place" not in stderr and "took the chief's place" not in stdout, stdout
    got = summary(run.ws)
    assert got["status"] == "finished" and len(got["job_restarts"]) == 1, got
    assert_no_library_text(stdout)
    assert leftover_processes(tmp_path) == []


@pytest.mark.slow  # a torchrun run: about 10 s on the busy machine
@pytest.mark.parametrize("layout, nprocs", [(HOGWILD, 2), (DOWNPOUR, 3)])
def test_a_killed_async_chief_under_torchrun_is_replaced_and_torchrun_restarts_nothing(blobs_job, tmp_path, torchruns,
                                                                                     layout, nprocs):
    """`torchrun ... -m shoal run JOB --max-restarts 1`: rank 0's training process SIGKILLed mid-run; its supervisor
    restarts it into the job as an ordinary group, process 1 takes the chief's place and finishes the run log; torchrun
    restarts nothing (one registration), the record ends finished."""
    job = blobs_job(train_steps=300, layout=layout)
    proc, ws = start(torchruns, job, tmp_path, env={"SHOAL_SLOW_WORKER": "0:0+0.01"}, nprocs=nprocs)
    killed_chief_is_replaced_under_torchrun(proc, ws, tmp_path, layout)


def killed_chief_is_replaced_under_torchrun(proc, ws, tmp_path, layout) -> None:
    """Rank 0's training process SIGKILLed under torchrun: its supervisor restarted it as an ordinary group, process 1
    took the chief's place (pids, the lines, summary.json), torchrun restarted nothing (one registration, finished),
    no library text, nothing left running."""
    victim, survivor = training_pids(ws)
    os.kill(victim, signal.SIGKILL)
    assert proc.wait(timeout=180) == 0, proc.err.read_text()[-3000:]
    stdout, stderr = proc.out.read_text(), proc.err.read_text()
    assert "the lowest living one taking the chief's place; restarting it (restart 1 of 1)" in stderr, stderr
    assert "Process 1 took the chief's place after step " in stdout, stdout
    (record,) = registered(ws)
    assert record.status == "finished", record
    assert pids(ws, 1) == [survivor] and pids(ws, 0)[0] == victim and len(pids(ws, 0)) == 2
    got = assert_ran(ws, layout)
    assert got["status"] == "finished" and got["chief_succession"][0]["process"] == 1, got
    assert_no_library_text(stdout, stderr)
    assert leftover_processes(tmp_path) == []
