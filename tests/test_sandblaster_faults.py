"""Sandblaster's worker and server processes survive a fault without a whole-job restart (issue 38, point 1).

Under `shoal run JOB --max-restarts N` a job file's Sandblaster (servers in processes of their own) runs its worker
processes as replicas that meet through the job's quorum and its servers as Downpour's (runtime/exchanges/sandblaster.py):
a killed worker process is left out of the next step (the servers apply the mean over the rows that came), the others
keep their pids, and the launcher restarts it into the running job, where it takes the servers' values at a step
boundary; a killed server process is restarted and heals from the chief's mirror. Real runs through the CLI on the
blobs data, real SIGKILLs, as tests/test_allreduce_faults.py and tests/test_server_restart.py.
"""
from __future__ import annotations

import math
import os
import re
import signal

import pytest
import torch

from cli_in_process import run_cli
from fault_runs import SLOW, assert_no_library_text, pids, registered_pids, runs, summary, train_records, wait_for  # noqa: F401
from layouts import Layout, assert_ran
from test_cli import leftover_processes
from test_local_sgd_faults import params
from test_torchrun_rejoin import torchruns  # noqa: F401 (the fixture that stops a torchrun a failed test left running)

CLUSTER = dict(nworkers_per_group=3, server_worker_separate=True)  # the job file's; `--max-restarts 1` on the command line
SERVED = Layout(dict(CLUSTER, max_restarts=1), 4, 3, "Sandblaster")
SERVER = "process 3 (server(group=0, id=0))"


def cli_run(job, workspace, *extra):
    proc = run_cli("run", job, "--workspace", workspace, "--no-progress", *extra, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_a_killed_worker_process_is_left_out_restarted_and_takes_the_servers_values(blobs_job, tmp_path, runs):
    """Process 2 of the 3 worker processes is SIGKILLed mid-run: the next step's update is the mean over processes 0
    and 1's rows (the chief says so), the launcher restarts process 2, it is admitted at a later step and trains on the
    servers' values from the step after; processes 0, 1 and the server keep their pids; the job exits 0, accurate."""
    steps = 120  # 1.2 s or more (SLOW): time for the restarted process to knock, under load
    job = blobs_job(train_steps=steps, cluster_extra=CLUSTER)
    run = runs.start(job, tmp_path, "--max-restarts", "1", env=SLOW)
    survivors = {rank: run.pid_once_training(rank) for rank in (0, 1)}
    server = registered_pids(run.ws)[3]
    victim = run.signal(2, signal.SIGKILL)
    stdout, stderr = run.finished()
    assert ("WARNING: process 2 (worker(group=0, id=2)) died (SIGKILL); the other processes go on without it; restarting it "
            "(restart 1 of 1); it rejoins at the next step, from process 0's state") in stderr.splitlines(), stderr
    assert "restarting the whole job" not in stderr, stderr
    (went_on,) = [line for line in stdout.splitlines() if line.startswith("Step ")]
    left = int(re.match(r"Step (\d+) went on without process 2 \(died or stopped answering\): the mean over the gradients of "
                        r"processes 0, 1, weighted by their rows$", went_on)[1])
    (line,) = [line for line in stdout.splitlines() if line.startswith("Process 2 rejoined at step ")]
    back = int(re.match(r"Process 2 rejoined at step (\d+) \(restart 1\): the servers' values after step (\d+), through "
                        r"process 0, ", line)[1])
    assert f"the servers' values after step {back - 1}," in line and 10 <= left < back < steps, (left, back, line)
    assert {rank: pids(run.ws, rank) for rank in (0, 1)} == {rank: [pid] for rank, pid in survivors.items()}
    assert registered_pids(run.ws)[3] == server  # the server never restarted
    first, second = pids(run.ws, 2)
    assert first == victim and second != victim
    got = assert_ran(run.ws, SERVED)
    assert "job_restarts" not in got  # nothing was resumed from a checkpoint
    (record,) = got["rejoins"]
    assert (record["group"], record["rank"], record["incarnation"], record["step"]) == (0, 2, 1, back)
    assert record["digests"]["received"] != record["digests"]["before"]
    away = f"missing from step {left}" if back == left + 1 else f"missing from steps {left} to {back - 1}"
    assert got["missed_steps"] == {"2": {"missed": back - left, "of": steps, "why": f"{away}, back at step {back}"}}
    records = train_records(run.ws)
    assert records[0]["processes"] == 3 and records[-1]["processes"] == 3
    assert got["final_test"]["accuracy"] >= 0.9, got["final_test"]  # (as unfaulted on this data)
    assert_no_library_text(stdout, stderr, (run.ws / "logs" / "rank0.log").read_text())
    assert leftover_processes(tmp_path) == []


@pytest.mark.slow  # ~8 s: the default suite's 5-minute budget (the heal is Downpour's: tests/test_server_restart.py)
def test_a_killed_server_process_is_restarted_and_heals_from_the_chiefs_mirror(blobs_job, tmp_path, runs):
    """The server process is SIGKILLed mid-run (momentum: an updater state to mirror): the launcher restarts it into
    the running job, it heals from the chief's mirror, and the worker processes keep their pids; no whole-job restart."""
    steps = 120
    job = blobs_job(train_steps=steps, cluster_extra=CLUSTER)
    run = runs.start(job, tmp_path, "--max-restarts", "1", "--set", "updater.momentum=0.9", env=SLOW)
    workers = {rank: run.pid_once_training(rank) for rank in (0, 1, 2)}
    server = registered_pids(run.ws)[3]
    os.kill(server, signal.SIGKILL)
    stdout, stderr = run.finished()
    deaths = re.findall(rf"^WARNING: {re.escape(SERVER)} died \(SIGKILL\); restarting it \(restart 1 of 1\); it heals from "
                        r"worker group 0's mirror of its state, the other processes wait for it$", stderr, re.M)
    assert len(deaths) == 1 and "restarting the whole job" not in stderr, stderr
    heals = re.findall(r"^server\(group=0, id=0\) \(process restart 1\) healed from worker group 0's mirror: its values of "
                       r"version (\d+) \(digest [0-9a-f]{16}\) and the updater state of version \d+, ", stdout, re.M)
    assert len(heals) == 1, stdout
    assert {rank: pids(run.ws, rank) for rank in (0, 1, 2)} == {rank: [pid] for rank, pid in workers.items()}
    got = assert_ran(run.ws, SERVED)
    assert got["status"] == "finished" and got["steps"] == steps and "job_restarts" not in got
    (record,) = got["rejoins"]
    assert (record["server"], record["rank"], record["incarnation"]) == (0, 3, 1) and record["pid"] != server, record
    assert record["version"] == int(heals[0]) > 0
    assert "missed_steps" not in got  # every worker process came to every step
    assert got["final_test"]["accuracy"] >= 0.9, got["final_test"]
    assert_no_library_text(stdout, stderr)
    assert leftover_processes(tmp_path) == []


def test_unfaulted_it_trains_as_one_worker(blobs_job, tmp_path):
    """Unfaulted, the restartable layout is a synchronous layout (Adam: an updater state at the servers): one worker's
    params within float tolerance, as tests/test_sync.py checks of the sliced exchange's."""
    steps = 8
    job = blobs_job(train_steps=steps, updater="type: kAdam")
    cli_run(job, tmp_path / "single", "--set", "cluster.nworkers_per_group=1")
    cli_run(job, tmp_path / "served", *SERVED.cli())
    assert_ran(tmp_path / "served", SERVED)
    a, b = params(tmp_path / "single", steps), params(tmp_path / "served", steps)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)


def test_the_plan_says_what_runs_and_what_a_death_costs():
    """`shoal plan` and the cost model under cluster.max_restarts: the worker processes' two all-reduces and the chief's
    push and pull with each server; without restarts the sliced exchange's buckets, which cannot go on without a process."""
    from shoal.config import job_from_text
    from shoal.launcher import ranks, rejoin
    from shoal.planning.estimate import estimate
    from shoal.planning.plan import plan_job
    from test_estimate import SMALL
    from test_fixed_costs import TIMED

    def planned(extra: str):
        return plan_job(job_from_text(SMALL.format(cluster=f"nworkers_per_group: 3 server_worker_separate: true {extra}")),
                        cores=2)

    served, sliced = planned("nservers_per_group: 2 max_restarts: 1"), planned("nservers_per_group: 2")
    assert served.strategy.goes_on_without_a_process(served) and served.strategy.servers_heal(served)
    assert not sliced.strategy.goes_on_without_a_process(sliced) and not sliced.strategy.servers_heal(sliced)
    assert served.strategy.notes(served) == [
        "cluster.max_restarts 1: the 3 worker process(es) meet twice a step (the mean gradient, then the servers' values); a "
        "dead or stalled worker process is left out (the mean over the rows that came) and, restarted, rejoins at the next "
        "step; when it is process 0, the chief, the lowest living worker process takes its place and becomes the servers' "
        "stub; a dead server process is restarted and heals from the stub's mirror of its state"]
    # the launcher: every worker process (the chief's too: tests/test_sandblaster_chief_death.py) and the servers (3, 4)
    # come back into the job
    assert [ranks.expendable(served, r) for r in range(5)] == [True, True, True, False, False]
    assert [ranks.heals(served, r) for r in range(5)] == [False, False, False, True, True]
    assert ranks.chief_replaceable(served) and rejoin.why_not(served, 0) is None
    terms = [(f["kind"], f["count"], f["ranks"]) for f in estimate(served, TIMED).fixed_costs]
    assert terms == [("collective", 2, 3), ("message", 4, 2), ("message", 5, 2), ("message", 5, 2)], terms
    assert all(f["kind"] == "collective" and "bucket" in f["what"] for f in estimate(sliced, TIMED).fixed_costs)
    compressed = planned("max_restarts: 1 compression: kBF16")  # what is encoded: the chief's pushes, not the quorum's sum
    assert compressed.strategy.compressed_in(compressed) == (
        "process 0's pushes to the servers (the worker processes' mean is summed in float32)")


@pytest.mark.slow  # three runs
def test_a_step_without_a_worker_process_repeats_bit_for_bit(blobs_job, tmp_path):
    """The fault schedule decides the result: worker process 2 exits before step 39 of 40 (its restart comes after the
    last step: nothing left to join), so the servers apply step 39's mean over processes 0 and 1's rows; the same faulted
    job twice gives the same bits, and not the unfaulted run's."""
    steps, gone = 40, 39
    job = blobs_job(train_steps=steps, cluster_extra=CLUSTER)
    for i in range(2):
        proc = run_cli("run", job, "--workspace", tmp_path / f"faulted{i}", "--no-progress", "--max-restarts", "1",
                       env={**os.environ, "SHOAL_INJECT_EXIT": f"2:{gone}"}, timeout=120)
        assert proc.returncode == 0, proc.stderr
        got = assert_ran(tmp_path / f"faulted{i}", SERVED)
        assert got["missed_steps"] == {"2": {"missed": steps - gone, "of": steps, "why": f"missing from step {gone}"}}
    a, b = params(tmp_path / "faulted0", steps), params(tmp_path / "faulted1", steps)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    cli_run(job, tmp_path / "unfaulted", "--max-restarts", "1")
    c = params(tmp_path / "unfaulted", steps)
    assert any(not torch.allclose(a[k], c[k], atol=1e-6) for k in a)  # the missing rows changed the result


@pytest.mark.slow  # a stall timeout to wait out
def test_a_stalled_worker_process_is_dropped_and_rejoins(blobs_job, tmp_path, runs):
    """Worker process 1 SIGSTOPped past the stall timeout: the others go on, the launcher ends and restarts it, and it
    rejoins at a later step."""
    steps = 400
    job = blobs_job(train_steps=steps, cluster_extra=CLUSTER)
    run = runs.start(job, tmp_path, "--max-restarts", "1", "--set", "cluster.stall_timeout_s=3", env=SLOW)
    stopped = run.signal(1, signal.SIGSTOP)
    stdout, stderr = run.finished()
    assert ("WARNING: process 1 (worker(group=0, id=1)) was stopped past the stall timeout (3 s) and dropped; the launcher "
            "ended it (SIGKILL); the other processes go on without it; restarting it (restart 1 of 1); it rejoins at the next "
            "step, from process 0's state") in stderr.splitlines(), stderr
    left = int(re.search(r"^Step (\d+) went on without process 1 ", stdout, re.M)[1])
    back = int(re.search(r"^Process 1 rejoined at step (\d+) \(restart 1\): ", stdout, re.M)[1])
    assert left < back < steps and pids(run.ws, 1)[0] == stopped and len(set(pids(run.ws, 1))) == 2
    got = assert_ran(run.ws, SERVED)
    assert got["status"] == "finished" and got["missed_steps"]["1"]["why"] == (
        f"missing from steps {left} to {back - 1}, back at step {back}")
    assert leftover_processes(tmp_path) == []


@pytest.mark.slow  # 150 slowed steps of fit, a kill and a heal
def test_fits_sandblaster_server_killed_heals_into_the_running_fit(tmp_path, runs):
    """shoal.fit (its loop on the session) under Sandblaster with --max-restarts 1: the server process, SIGKILLed mid-run,
    is restarted, rebuilds fit's optimizer from the chief's recipe and heals from the chief's mirror of its state; the
    worker processes keep their pids and fit ends trained, without a whole-job restart."""
    from pathlib import Path

    from fault_runs import LayoutRun

    script = Path(__file__).parent / "module_script.py"
    layout = "Sandblaster, 2 workers + 1 server, 3 processes"
    run = LayoutRun(script, tmp_path, layout, "--max-restarts", "1", "--", "--steps", "150", "--lr", "0.1", "--slow", "0.01")
    runs.append(run)
    workers = {rank: run.pid_of(rank) for rank in (0, 1)}
    os.kill(run.pid_of(2), signal.SIGKILL)
    assert run.wait(timeout=240) == 0, run.stderr()
    assert re.search(r"^WARNING: process 2 \(server\(group=0, id=0\)\) died \(SIGKILL\); restarting it \(restart 1 of 1\); "
                     r"it heals from worker group 0's mirror of its state", run.stderr(), re.M), run.stderr()
    assert "restarting the whole job" not in run.stderr()
    got = assert_ran(run.ws, layout)
    assert got["status"] == "finished" and "job_restarts" not in got
    assert [r["rank"] for r in got["rejoins"]] == [2]
    assert registered_pids(run.ws)[0] == workers[0] and registered_pids(run.ws)[1] == workers[1]
    assert got["final_test"]["loss"] < 0.9 * math.log(16)


@pytest.mark.slow  # one torchrun run of 4 processes
def test_under_torchrun_a_killed_worker_and_a_killed_server_come_back_into_the_running_job(blobs_job, tmp_path, torchruns):
    """`torchrun ... -m shoal run JOB --max-restarts 1`: worker process 2's training process SIGKILLed, then the server's:
    each rank's supervisor restarts it into the running job (the worker rejoins, the server heals from the chief's
    mirror), torchrun restarts nothing, the chief's process is the same from start to end, the job exits 0."""
    from test_torchrun_rejoin import registered, start

    job = blobs_job(train_steps=400, cluster_extra=CLUSTER)
    proc, ws = start(torchruns, job, tmp_path, env={"SHOAL_SLOW_WORKER": "0:0+0.01"}, nprocs=4)
    (record,) = registered(ws)
    chief, worker, server = (next(p["pid"] for p in record.processes if p["rank"] == r) for r in (0, 2, 3))
    os.kill(worker, signal.SIGKILL)
    wait_for(lambda: "Process 2 rejoined at step " in proc.out.read_text(), 60, f"no rejoin: {proc.err.read_text()[-3000:]}")
    os.kill(server, signal.SIGKILL)
    assert proc.wait(timeout=180) == 0, proc.err.read_text()[-3000:]
    stderr = proc.err.read_text()
    assert any(line.startswith("WARNING: process 2 (worker(group=0, id=2)) died (SIGKILL); the other processes go on without "
                               "it; restarting it (restart 1 of 1)") for line in stderr.splitlines()), stderr
    assert any(line.startswith("WARNING: process 3 (server(group=0, id=0)) died (SIGKILL); restarting it (restart 1 of 1); "
                               "it heals from worker group 0's mirror") for line in stderr.splitlines()), stderr
    assert len(registered(ws)) == 1 and registered(ws)[0].status == "finished"  # torchrun restarted nothing
    assert pids(ws, 0) == [chief]
    got = assert_ran(ws, SERVED)
    assert sorted((r["rank"], r.get("server")) for r in got["rejoins"]) == [(2, None), (3, 0)], got["rejoins"]
    assert "Traceback" not in stderr and "gloo" not in stderr.lower()
    assert leftover_processes(tmp_path) == []


@pytest.mark.slow  # two runs
def test_a_killed_server_under_plain_sgd_loses_nothing(blobs_job, tmp_path, runs):
    """Plain SGD (no updater state: the heal's values are all a server holds): the server of 2 SIGKILLed mid-run is
    healed with the values the chief's push of that step was computed on, the chief sends that push again, and the run
    ends bit for bit where the unfaulted run ends."""
    steps = 150
    job = blobs_job(train_steps=steps, updater="type: kSGD", cluster_extra=dict(CLUSTER, nworkers_per_group=2, nservers_per_group=2))
    cli_run(job, tmp_path / "unfaulted", "--max-restarts", "1")
    run = runs.start(job, tmp_path, "--max-restarts", "1", env=SLOW)
    run.pid_once_training(0)
    os.kill(registered_pids(run.ws)[3], signal.SIGKILL)
    stdout, _ = run.finished()
    assert re.search(r"^worker group 0: sent the push of step \d+ again to server\(group=0, id=1\) \(restart 1\), healed "
                     r"with the values it was computed on$", stdout, re.M), stdout
    assert [r["server"] for r in summary(run.ws)["rejoins"]] == [1]
    a, b = params(tmp_path / "unfaulted", steps), params(run.ws, steps)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
