"""A synchronous group over processes goes on without a dead or stalled process (issue 38, point 1).

With restarts allowed (`shoal run --max-restarts N`) AllReduce over processes runs the replicated exchange: every
process holds the whole params and updater state, one all-reduce a step through the job's quorum. A process other
than the chief's that dies (a real SIGKILL of the pid its log names) or stalls is left out at the next step: that
step's mean is over the rows of the processes that came, the job exits 0, and a restarted process heals from the
chief at the next step. Real runs through the CLI on the blobs data, as the Local SGD fault tests.
"""
from __future__ import annotations

import os
import re
import signal

import pytest
import torch

from cli_in_process import run_cli
from fault_runs import SLOW, assert_no_library_text, pids, runs, summary, train_records  # noqa: F401 (runs: a fixture)
from layouts import LAYOUTS, assert_ran
from test_cli import leftover_processes
from test_local_sgd_faults import params

ROW = "AllReduce, 3 processes, replicated (max_restarts 1)"
REPLICATED = LAYOUTS[ROW]
DIED = ("WARNING: process 2 (worker(group=0, id=2)) died (SIGKILL); the other processes go on without it; restarting it "
        "(restart 1 of 1); it rejoins at the next step, from process 0's state")


def cli_run(job, workspace, *extra, env=None):
    proc = run_cli("run", job, "--workspace", workspace, "--no-progress", *extra, env={**os.environ, **(env or {})}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_a_killed_process_is_left_out_restarted_and_heals_from_the_chief(blobs_job, tmp_path, runs):
    """Process 2 of 3 is SIGKILLed mid-run: the next step goes on over processes 0 and 1 (the chief says which), the
    launcher restarts it, it is admitted at a later step and takes the params and the updater's state from the chief;
    the chief's process is the same from start to end; the job exits 0 as accurate as the unfaulted run."""
    steps = 200  # 2 s or more (SLOW): time for the restarted process to build its net and knock, under load
    job = blobs_job(train_steps=steps, cluster_extra=dict(nworkers_per_group=3))
    unfaulted = cli_run(job, tmp_path / "unfaulted", "--set", "cluster.nworkers_per_group=1")  # one worker: the same numbers
    run = runs.start(job, tmp_path, "--max-restarts", "1", env=SLOW)
    chief = run.pid_once_training(0)
    victim = run.signal(2, signal.SIGKILL)
    stdout, stderr = run.finished()
    assert DIED in stderr.splitlines(), stderr
    (went_on,) = [line for line in stdout.splitlines() if line.startswith("Step ")]
    left = int(re.match(r"Step (\d+) went on without process 2 \(died or stopped answering\): the mean over the gradients of "
                        r"processes 0, 1, weighted by their rows$", went_on)[1])
    (line,) = [line for line in stdout.splitlines() if line.startswith("Process 2 rejoined at step ")]
    back = int(re.match(r"Process 2 rejoined at step (\d+) \(restart 1\): ", line)[1])
    assert 10 <= left < back < steps, (left, back)
    assert line.startswith(f"Process 2 rejoined at step {back} (restart 1): the params and the updater's state from process 0, "
                           f"after step {back - 1}, "), line
    assert pids(run.ws, 0) == [chief]  # the chief never restarted
    first, second = pids(run.ws, 2)
    assert first == victim and second != victim  # process 2 ran as two processes, one after the other
    got = assert_ran(run.ws, REPLICATED)
    (record,) = got["rejoins"]
    assert (record["group"], record["rank"], record["incarnation"], record["step"]) == (0, 2, 1, back)
    assert record["digests"]["received"] != record["digests"]["before"]
    away = f"missing from step {left}" if back == left + 1 else f"missing from steps {left} to {back - 1}"  # a quick restart
    assert got["missed_steps"] == {"2": {"missed": back - left, "of": steps, "why": f"{away}, back at step {back}"}}
    closing = [line for line in stdout.splitlines() if line.startswith("Trained ")][-1]
    missed = back - left
    assert f"; process 2 missed {missed} of {steps} steps ({away}, back at step {back});" in closing, closing
    records = train_records(run.ws)
    assert records[0]["processes"] == 3 and records[-1]["processes"] == 3
    # a display line between the kill and the rejoin counts 2 (none falls there when the restart took one step)
    assert all(r["processes"] == 2 for r in records if left < r["step"] < back - 1), records
    final, baseline = got["final_test"]["accuracy"], summary(tmp_path / "unfaulted")["final_test"]["accuracy"]
    assert unfaulted.returncode == 0 and final >= baseline - 0.05, (final, baseline)
    assert_no_library_text(stdout, stderr, (run.ws / "logs" / "rank0.log").read_text())
    assert leftover_processes(tmp_path) == []


def test_a_step_without_a_process_is_the_mean_of_those_that_came_and_repeats_bit_for_bit(blobs_job, tmp_path):
    """The fault schedule decides the result: process 2 exits before the last step, 39 of 40 (its restart comes after
    it: nothing left to join), so step 39 is the mean over processes 0 and 1's rows; the same faulted job twice gives
    the same bits, and not the unfaulted run's. (It exited before step 36 once: under load the restart came back
    within those 4 steps, and the run's bits depended on when.)"""
    steps, gone = 40, 39
    job = blobs_job(train_steps=steps, cluster_extra=dict(nworkers_per_group=3))
    fault = {"SHOAL_INJECT_EXIT": f"2:{gone}"}
    runs_ = [cli_run(job, tmp_path / f"faulted{i}", "--max-restarts", "1", env=fault) for i in range(2)]
    for i, proc in enumerate(runs_):
        ws = tmp_path / f"faulted{i}"
        assert ("WARNING: process 2 (worker(group=0, id=2)) exited with code 3; the other processes go on without it; restarting "
                "it (restart 1 of 1); it rejoins at the next step, from process 0's state") in proc.stderr, proc.stderr
        assert f"Step {gone} went on without process 2" in (ws / "logs" / "rank0.log").read_text()  # (the chief's line)
        got = assert_ran(ws, REPLICATED)
        assert got["missed_steps"] == {"2": {"missed": steps - gone, "of": steps, "why": f"missing from step {gone}"}}
        assert "rejoins" not in got
        assert "process 2 was restarted after the job's last step: nothing left to join" in (ws / "logs" / "rank2.log").read_text()
    a, b = params(tmp_path / "faulted0", steps), params(tmp_path / "faulted1", steps)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    unfaulted = cli_run(job, tmp_path / "unfaulted", "--max-restarts", "1")
    c = params(tmp_path / "unfaulted", steps)
    assert any(not torch.allclose(a[k], c[k], atol=1e-6) for k in a)  # the missing rows changed the result
    assert "went on without" not in (tmp_path / "unfaulted" / "logs" / "rank0.log").read_text() and unfaulted.returncode == 0


def test_the_replicated_exchange_unfaulted_equals_one_worker(blobs_job, tmp_path):
    """Unfaulted, the replicated layout is a synchronous layout: one worker's params within float tolerance (the
    shared table's row; tests/test_sync.py runs it on every updater with -m slow)."""
    steps = 8  # as tests/test_sync.py: longer, the blobs' loss nears 0 and Adam scales float rounding up to 1e-5
    job = blobs_job(train_steps=steps, updater="type: kAdam")
    cli_run(job, tmp_path / "single", "--set", "cluster.nworkers_per_group=1")
    cli_run(job, tmp_path / "replicated", *REPLICATED.cli())
    assert_ran(tmp_path / "replicated", REPLICATED)
    a, b = params(tmp_path / "single", steps), params(tmp_path / "replicated", steps)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.slow  # a stall timeout to wait out, and a run that outlasts it
def test_a_stalled_process_is_dropped_and_the_others_go_on(blobs_job, tmp_path, runs):
    """Process 2 is SIGSTOPped past the stall timeout: the chief names it, the steps go on over processes 0 and 1; with
    --max-restarts 1 the launcher ends the stopped process (SIGKILL) and restarts it, and it rejoins at a later step."""
    steps = 600
    job = blobs_job(train_steps=steps, cluster_extra=dict(nworkers_per_group=3))
    run = runs.start(job, tmp_path, "--max-restarts", "1", "--set", "cluster.stall_timeout_s=2", env=SLOW)
    stopped = run.signal(2, signal.SIGSTOP)
    stdout, stderr = run.finished()
    assert re.search(r"^WARNING: process 2 \(worker\(group=0, id=2\)\) stopped answering \(no heartbeat for \d+ s[^)]*\); the other "
                     r"processes go on without it", stderr, re.M), stderr
    assert ("WARNING: process 2 (worker(group=0, id=2)) was stopped past the stall timeout (2 s) and dropped; the launcher "
            "ended it (SIGKILL); the other processes go on without it; restarting it (restart 1 of 1); it rejoins at the next "
            "step, from process 0's state") in stderr.splitlines(), stderr
    left = int(re.search(r"^Step (\d+) went on without process 2 ", stdout, re.M)[1])
    back = int(re.search(r"^Process 2 rejoined at step (\d+) \(restart 1\): ", stdout, re.M)[1])
    assert left < back < steps and pids(run.ws, 2)[0] == stopped and len(set(pids(run.ws, 2))) == 2
    got = summary(run.ws)
    assert got["status"] == "finished" and got["missed_steps"] == {
        "2": {"missed": back - left, "of": steps, "why": f"missing from steps {left} to {back - 1}, back at step {back}"}}
    assert train_records(run.ws)[-1]["processes"] == 3
    assert leftover_processes(tmp_path) == []


def test_without_restarts_a_dead_process_still_stops_the_job(blobs_job, tmp_path):
    """--max-restarts 0 keeps the sliced exchange and today's behaviour: the job stops, naming the dead process."""
    job = blobs_job(train_steps=40, cluster_extra=dict(nworkers_per_group=3))
    proc = run_cli("run", job, "--workspace", tmp_path / "ws", "--no-progress", "--max-restarts", "0",
                   env={**os.environ, "SHOAL_INJECT_EXIT": "2:12"}, timeout=120)
    assert proc.returncode != 0
    assert (f"process 2 (worker(group=0, id=2)) exited with code 3; the other processes were stopped; "
            f"see {tmp_path / 'ws'}/logs/rank2.log") in proc.stderr, proc.stderr
    assert "went on without" not in (tmp_path / "ws" / "logs" / "rank0.log").read_text() and "restarting" not in proc.stderr


def test_the_plan_describes_the_exchange_that_runs(blobs_job):
    """`shoal plan` and the cost model: the replicated exchange's one all-reduce and the quorum's word where restarts
    are allowed, the sliced exchange's buckets where not."""
    from shoal.config import job_from_text
    from shoal.planning.estimate import estimate
    from shoal.planning.plan import plan_job
    from test_estimate import SMALL
    from test_fixed_costs import TIMED

    def planned(extra: str):
        return plan_job(job_from_text(SMALL.format(cluster=f"nworkers_per_group: 3 {extra}")), cores=2)

    replicated, sliced = planned("max_restarts: 1"), planned("")
    assert replicated.strategy.goes_on_without_a_process(replicated) and not sliced.strategy.goes_on_without_a_process(sliced)
    assert any(n.startswith("replicated over 3 processes (cluster.max_restarts 1)") for n in replicated.strategy.notes(replicated))
    terms = [(f["kind"], f["count"], f["ranks"]) for f in estimate(replicated, TIMED).fixed_costs]
    assert terms == [("collective", 1, 3), ("message", 2, 2)]
    assert all(f["kind"] == "collective" and "bucket" in f["what"] for f in estimate(sliced, TIMED).fixed_costs)
    compressed = planned("max_restarts: 1 compression: kBF16")  # the replicated exchange all-gathers the encodings
    assert compressed.strategy.goes_on_without_a_process(compressed)
    assert compressed.strategy.notes(compressed)[0].startswith(
        "replicated over 3 processes (cluster.max_restarts 1): each process updates the whole params from one all-gather of "
        "each process's encoded gradients a step")
    assert [(f["kind"], f["count"], f["ranks"]) for f in estimate(compressed, TIMED).fixed_costs] == terms
    # (Sandblaster, servers in processes of their own: tests/test_sandblaster_faults.py)
