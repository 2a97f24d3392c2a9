"""Issue 38: a job file's chief dies and the job goes on. Under AllReduce's replicas (`shoal run JOB --max-restarts N`)
process 0 is dropped like any other process: the lowest living process decides the next step in its place
(shoal.comm.quorum, `replaceable`), and its trainer takes over the chief's duties (runtime/trainer.py `_take_over`,
report/succession.py): the tests and validations (on the samples the chief would have read next), the run log, the
checkpoints and the terminal; the dead chief's restarted process rejoins as a non-chief, healing from it. Real runs
through the CLI on the blobs data, as tests/test_allreduce_faults.py's."""
from __future__ import annotations

import os
import re
import signal

import pytest

from cli_in_process import run_cli
from fault_runs import SLOW, assert_no_library_text, pids, runs, summary, train_records  # noqa: F401 (runs: a fixture)
from layouts import LAYOUTS, assert_ran
from test_cli import leftover_processes
from test_local_sgd_faults import params

from shoal.config import job_pb2
from shoal.neuralnet import checkpoint as ckpt_io
from shoal.report.metrics import read_metrics

REPLICATED = LAYOUTS["AllReduce, 3 processes, replicated (max_restarts 1)"]


def test_a_killed_chief_is_dropped_and_its_successor_tests_logs_and_checkpoints(blobs_job, tmp_path, runs):
    """Process 0 of 3 is SIGKILLed mid-run: no whole-job restart (processes 1 and 2 keep their pids to the end),
    process 1 says on the terminal that it took the chief's place, decides the steps, tests on the chief's next samples
    (the final checkpoint's test cursor is the unfaulted run's), writes metrics.jsonl on as one log (no `resume`
    record, every display step once) and the final checkpoint; process 0 comes back as a non-chief; exit 0."""
    steps = 200  # 2 s or more (SLOW): time for the restarted process to build its net and knock, under load
    job = blobs_job(train_steps=steps, cluster_extra=dict(nworkers_per_group=3))
    run = runs.start(job, tmp_path, "--max-restarts", "1", env=SLOW)
    survivors = {rank: run.pid_once_training(rank) for rank in (1, 2)}
    victim = run.signal(0, signal.SIGKILL)
    stdout, stderr = run.finished()
    assert ("WARNING: process 0 (worker(group=0, id=0), server(group=0, id=0)) died (SIGKILL); the other processes go on "
            "without it; restarting it (restart 1 of 1); it rejoins at the next step, from the state of the lowest living "
            "process, which decides the steps now") in stderr.splitlines(), stderr
    took = int(re.search(r"^Process 1 took the chief's place after step (\d+): it decides the steps, tests and validates, "
                         r"writes the run log and the checkpoints$", stdout, re.M)[1])  # (on the terminal: the successor's)
    assert 10 <= took < steps
    assert pids(run.ws, 1) == [survivors[1]] and pids(run.ws, 2) == [survivors[2]]  # nobody else restarted
    first, second = pids(run.ws, 0)
    assert first == victim and second != victim
    got = assert_ran(run.ws, REPLICATED)
    assert got["status"] == "finished", got
    went_on = re.search(rf"^Step {took} went on without process 0 \(died or stopped answering\)", stdout, re.M)
    if "0" in got.get("missed_steps", {}):
        # the step it decided without process 0, said on the terminal once it speaks for the job (not only in its log)
        assert went_on, stdout
    else:  # (its restart knocked before process 1 decided the step the dead chief's sum was in: admitted there)
        assert [(r["rank"], r["step"]) for r in got["rejoins"]] == [(0, took + 1)] and not went_on, (got, stdout)
    records = read_metrics(run.ws / "metrics.jsonl")
    assert not [r for r in records if r["phase"] == "resume"]
    shown = [r["step"] for r in train_records(run.ws)]
    # every display once, but those between the chief's death and the takeover (nobody spoke for the job then)
    assert shown == sorted(set(shown)) and set(range(0, steps, 5)) - set(shown) <= set(range(10, took + 1)), shown
    tests = [r["step"] for r in records if r["phase"] == "test"]
    assert tests[-1] == steps and any(took < s < steps for s in tests), tests  # the successor tested, the final test too
    final = ckpt_io.load(ckpt_io.checkpoint_file(run.ws, steps), parts=False)
    # every test read the chief's next batches: as many as in an unfaulted run (steps 0, 10 ... 190 and the final one,
    # 2 batches of 64 each), whoever ran it
    assert final.trainer["cursors"][str(job_pb2.kTest)] == (steps // 10 + 1) * 2 * 64, final.trainer
    assert final.trainer["writer"] == 1 and final.trainer["last_test"] == {"step": steps, "cursor": steps // 10 * 2 * 64}
    assert got["final_test"]["accuracy"] > 0.8, got["final_test"]
    assert got["chief_succession"] == [{"process": 1, "after_step": took}], got
    closing = [line for line in stdout.splitlines() if line.startswith("Trained ")][-1]
    assert f"; process 1 took the chief's place after step {took}; process 0 missed " in closing, closing
    assert_no_library_text(stdout, stderr, (run.ws / "logs" / "rank1.log").read_text())
    assert leftover_processes(tmp_path) == []


def test_a_chief_that_exits_before_the_end_leaves_the_same_bits_each_time(blobs_job, tmp_path):
    """The fault schedule decides the result: process 0 exits at step 39 of 40 (its restart comes back after the last
    step, or rejoins for nothing: either way step 39 is named as missed), process 1 finishes the run and writes the
    final checkpoint; the same faulted job twice gives the same params."""
    steps, gone = 40, 39
    job = blobs_job(train_steps=steps, cluster_extra=dict(nworkers_per_group=3))
    for i in range(2):
        ws = tmp_path / f"faulted{i}"
        proc = run_cli("run", job, "--workspace", ws, "--no-progress", "--max-restarts", "1",
                       env={**os.environ, "SHOAL_INJECT_EXIT": f"0:{gone}"}, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert ("WARNING: process 0 (worker(group=0, id=0), server(group=0, id=0)) exited with code 3; the other processes go on without it; "
                "restarting it (restart 1 of 1)") in proc.stderr, proc.stderr
        assert f"Process 1 took the chief's place after step {gone}" in (ws / "logs" / "rank1.log").read_text()
        got = assert_ran(ws, REPLICATED)
        missed = got["missed_steps"]["0"]
        assert missed["missed"] == 1 and missed["why"].startswith(f"missing from step {gone}"), got
    a, b = params(tmp_path / "faulted0", steps), params(tmp_path / "faulted1", steps)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_a_killed_diloco_chief_is_dropped_and_a_resume_from_its_successors_checkpoint_goes_on(blobs_job, tmp_path, runs):
    """DiLoCo's group 0 in a job file (groups of one process each): its process SIGKILLed mid-run is left out of the
    meetings like any other group; process 1 takes the chief's place (the meetings, tests, run log and checkpoints),
    group 0's restarted process rejoins at a meeting as a non-chief; summary.json names the meetings group 0 missed. The
    successor's final checkpoint names it as its writer and lists group 0's part (once it rejoined) as the one beside
    the file; `--resume` with more steps goes on from it to the new last step (each process from its own state:
    runtime/trainer.py `restore`)."""
    from test_local_sgd_faults import DILOCO

    steps = 150
    job = blobs_job(train_steps=steps, cluster_extra=dict(nworker_groups=2, local_steps=5))
    run = runs.start(job, tmp_path, "--max-restarts", "1", "--set", "checkpoint_freq=50", *DILOCO, env=SLOW)
    survivor = run.pid_once_training(1)
    victim = run.signal(0, signal.SIGKILL)
    stdout, stderr = run.finished()
    assert re.search(r"^WARNING: process 0 \(worker\(group=0, id=0\), server\(group=0, id=0\)\) (died \(SIGKILL\)|exited "
                     r"with code -9); restarting it \(restart 1 of 1\); it rejoins at the groups' next meeting", stderr, re.M), stderr
    assert re.search(r"^Process 1 took the chief's place after step \d+: it decides the steps, tests and validates", stdout,
                     re.M), stdout
    assert pids(run.ws, 1) == [survivor] and pids(run.ws, 0)[0] == victim and len(set(pids(run.ws, 0))) == 2
    got = summary(run.ws)
    assert got["status"] == "finished" and got["framework"] == "DiLoCo" and got["processes"] == 2, got
    assert "0" in got["missed_updates"] and got["final_test"]["step"] == steps, got
    assert [r["group"] for r in got.get("rejoins", [])] in ([0], []), got  # (a restart may come after the last meeting)
    final = ckpt_io.load(ckpt_io.checkpoint_file(run.ws, steps), parts=True)
    assert (final.trainer["writer"], final.trainer["writer_group"]) == (1, 1)
    assert set(final.parts) == ({ckpt_io.part_name(steps, 0, 0)} if got.get("rejoins") else set()), final.parts
    resumed = run_cli("run", job, "--workspace", run.ws, "--no-progress", "--resume", "--set", f"train_steps={steps + 20}",
                      "--set", "checkpoint_freq=50", *DILOCO, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert summary(run.ws)["final_test"]["step"] == steps + 20
    assert leftover_processes(tmp_path) == []


@pytest.mark.slow  # a stall timeout to wait out
def test_a_stopped_chief_is_dropped_ended_and_replaced(blobs_job, tmp_path, runs):
    """Process 0 of AllReduce's replicas SIGSTOPped past the stall timeout: process 1 takes its place (the stalled
    chief's successor warns on the terminal), the launcher ends the stopped process (SIGKILL) and restarts it, and it
    rejoins as a non-chief; processes 1 and 2 keep their pids; exit 0, summary.json finished."""
    steps = 600
    job = blobs_job(train_steps=steps, cluster_extra=dict(nworkers_per_group=3))
    run = runs.start(job, tmp_path, "--max-restarts", "1", "--set", "cluster.stall_timeout_s=2", env=SLOW)
    survivors = {rank: run.pid_once_training(rank) for rank in (1, 2)}
    stopped = run.signal(0, signal.SIGSTOP)
    stdout, stderr = run.finished()
    assert re.search(r"^WARNING: process 0 \(worker\(group=0, id=0\), server\(group=0, id=0\)\) stopped answering", stderr,
                     re.M), stderr
    assert re.search(r"^Process 1 took the chief's place after step \d+", stdout, re.M), stdout
    assert pids(run.ws, 1) == [survivors[1]] and pids(run.ws, 2) == [survivors[2]]
    assert pids(run.ws, 0)[0] == stopped and len(set(pids(run.ws, 0))) == 2
    got = summary(run.ws)
    assert got["status"] == "finished" and [r["rank"] for r in got["rejoins"]] == [0], got
    assert leftover_processes(tmp_path) == []



@pytest.mark.parametrize("cluster, layout", [(dict(nworkers_per_group=3), REPLICATED), ("sandblaster", "sandblaster")],
                         ids=["AllReduce", "Sandblaster"])
def test_a_successor_in_a_resumed_run_counts_the_jobs_bytes_from_the_first_step(blobs_job, tmp_path, cluster, layout):
    """summary.json's bytes_sent is the whole job's, from step 0, whoever writes it: a run checkpointed at step 20 and
    resumed to 40, whose chief exits at step 30, ends with the successor's count, which went on from the checkpoint's
    (every worker process restores the job's counts from the chief's file: any of them may take its place; Sandblaster's
    successor's stub counts the servers' bytes on too), not from the resume."""
    if cluster == "sandblaster":
        from test_sandblaster_faults import CLUSTER, SERVED
        cluster, layout = CLUSTER, SERVED
    job = blobs_job(train_steps=20, cluster_extra=cluster)
    ws = tmp_path / "ws"
    first = run_cli("run", job, "--workspace", ws, "--no-progress", "--max-restarts", "1", "--set", "checkpoint_freq=20",
                    timeout=120)
    assert first.returncode == 0, first.stderr
    before = summary(ws)["bytes_sent"]  # 20 steps of 3 worker processes (and Sandblaster's pushes and pulls)
    resumed = run_cli("run", job, "--workspace", ws, "--no-progress", "--resume", "--max-restarts", "1",
                      "--set", "train_steps=40", "--set", "checkpoint_freq=20", env={**os.environ, "SHOAL_INJECT_EXIT": "0:30"},
                      timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert "Process 1 took the chief's place after step " in (ws / "logs" / "rank1.log").read_text()
    got = assert_ran(ws, layout)
    assert got["final_test"]["step"] == 40 and got["chief_succession"][0]["process"] == 1, got
    # 20 more steps, each moving at least 2 of the 3 worker processes' bytes: at least two thirds of the first 20's
    assert got["bytes_sent"] >= before * 5 // 3, (got["bytes_sent"], before)
