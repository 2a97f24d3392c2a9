"""Local SGD / DiLoCo goes on without a dead group (issue 38, point 2).

A group whose process dies (a real SIGKILL of the pid its log names) or whose thread fails is left out of the
meetings: the others train on, each meeting's mean over the groups that came; the job exits 0 and its closing line
and summary.json name the group and the meetings it missed. With --max-restarts the launcher restarts the process,
which joins at the groups' next meeting from the chief's group's state. Real runs through the CLI on the blobs data.
"""
from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cli_in_process import run_cli
from fault_runs import SLOW, assert_no_library_text, closing_line, pids, runs, summary, train_records  # noqa: F401 (runs: a fixture)
from test_cli import leftover_processes

from shoal.neuralnet import checkpoint as ckpt_io

STEPS = 120
DILOCO = ["--set", "cluster.outer_updater.type=kNesterov", "--set", "cluster.outer_updater.momentum=0.9",
          "--set", "cluster.outer_updater.learning_rate.type=kFixed", "--set", "cluster.outer_updater.learning_rate.base_lr=0.7"]
PROCESSES = dict(nworker_groups=2, local_steps=5)  # each group in a process of its own
THREADS = dict(PROCESSES, nworkers_per_procs=2)


def params(ws: Path, step: int) -> dict[str, torch.Tensor]:
    return {k: v for k, v in load_file(str(ws / "checkpoint" / f"step{step}-worker0.safetensors")).items() if k.startswith("param/")}


def assert_left_out_after(ws: Path, killed_before: int) -> list[dict]:
    """Every meeting after the one the dead group last came to counts one group; those before, two."""
    records = train_records(ws)
    assert records[0]["groups_met"] == 2 and records[-1]["groups_met"] == 1, records
    assert all(r["groups_met"] == (2 if r["step"] < killed_before else 1) for r in records if r["step"] < killed_before or
               r["step"] >= killed_before + 5), records
    return records


def test_a_killed_diloco_group_is_left_out_and_the_others_go_on(blobs_job, tmp_path, runs):
    """Group 1's process is SIGKILLed mid-run: the job exits 0, group 0's process (the same pid from start to end) trains
    every step, the meetings after the kill count one group, and the closing line names group 1 and where it left."""
    run = runs.start(blobs_job(train_steps=STEPS, cluster_extra=PROCESSES), tmp_path, *DILOCO, env=SLOW)
    chief = run.pid_once_training(0)
    victim = run.signal(1, signal.SIGKILL)
    stdout, stderr = run.finished()
    assert (f"WARNING: process 1 (worker(group=1, id=0)) exited with code -9; the other worker groups go on "
            f"(see {run.ws}/logs/rank1.log)") in stderr, stderr
    assert pids(run.ws, 0) == [chief] and pids(run.ws, 1) == [victim]  # nobody restarted, the survivor never replaced
    assert f"Test @ step {STEPS}" in stdout and f"step{STEPS}-worker0" in stdout
    got = summary(run.ws)
    assert (got["framework"], got["status"], got["steps"]) == ("DiLoCo", "finished", STEPS)
    missed = got["missed_updates"]["1"]
    first = int(re.search(r"missing from the meetings after steps (\d+) to " + str(STEPS - 1) + "$", missed["why"])[1])
    assert missed["why"].startswith("process 1 exited with code -9; ") and missed["of"] == STEPS // 5
    assert missed["meetings"] == (first + 1) // 5 - 1  # it came to every meeting before the first it missed
    assert_left_out_after(run.ws, first)
    assert f"worker group 1 came to {missed['meetings']} of {STEPS // 5} meetings ({missed['why']})" in closing_line(stdout)
    assert all(torch.isfinite(v).all() for v in params(run.ws, STEPS).values())
    # the checkpoints written without group 1 do not wait for its part: the final one is whole, a resume's start
    ckpt_io.load(run.ws / "checkpoint" / f"step{STEPS}-worker0.safetensors", parts=True)
    assert_no_library_text(stdout, stderr, (run.ws / "logs" / "rank0.log").read_text())
    assert leftover_processes(tmp_path) == []


@pytest.mark.slow  # a stall timeout to wait out
def test_a_stalled_group_of_three_is_dropped_and_the_other_two_meet_on(blobs_job, tmp_path, runs):
    """Three groups over processes; group 2's process is SIGSTOPped past the stall timeout: the heartbeat names it, the
    meetings go on between groups 0 and 1 (a group re-formed over their two processes), and the launcher kills the
    stopped process at the end."""
    run = runs.start(blobs_job(train_steps=2 * STEPS, cluster_extra=dict(PROCESSES, nworker_groups=3)), tmp_path, *DILOCO,
                     "--set", "cluster.stall_timeout_s=3", env=SLOW)
    run.signal(2, signal.SIGSTOP)
    _, stderr = run.finished()
    assert re.search(r"^WARNING: worker group 2 dropped: process 2 \(worker\(group=2, id=0\)\) stopped answering \(no heartbeat "
                     r"for \d+ s[^)]*\); the other worker groups go on", stderr, re.M), stderr
    records = train_records(run.ws)
    assert records[0]["groups_met"] == 3 and records[-1]["groups_met"] == 2
    missed = summary(run.ws)["missed_updates"]
    assert list(missed) == ["2"] and missed["2"]["why"].startswith("dropped: process 2 stopped answering; missing from the meetings after")
    assert leftover_processes(tmp_path) == []


def test_a_stalled_group_is_ended_restarted_and_rejoins(blobs_job, tmp_path, runs):
    """--max-restarts 1: group 1's process SIGSTOPped and never continued is dropped past the stall timeout, then ended
    by the launcher (SIGKILL) and restarted as a killed one is, one line saying so; it rejoins at a meeting and the job
    exits 0 with both groups at the last meeting (before: it stayed stopped, missing to the end)."""
    # outlasts the 2 s stall timeout (group 0 waits it out at a meeting, its steps stand still), a beat and a restart,
    # under load: rejoined at step 60 when idle (steps of ~13 ms), so about 4 s of steps are left for a slower restart
    steps = 3 * STEPS
    run = runs.start(blobs_job(train_steps=steps, cluster_extra=PROCESSES), tmp_path, "--max-restarts", "1", *DILOCO,
                     "--set", "cluster.stall_timeout_s=2", env=SLOW)
    chief = run.pid_once_training(0)
    stopped = run.signal(1, signal.SIGSTOP)
    stdout, stderr = run.finished()
    assert re.search(r"^WARNING: process 1 \(worker\(group=1, id=0\)\) was stopped past the stall timeout \(2 s\) and dropped; "
                     r"the launcher ended it \(SIGKILL\); restarting it \(restart 1 of 1\); it rejoins at the groups' next "
                     r"meeting, from a live group's state$", stderr, re.M), stderr
    assert re.search(r"^Worker group 1 rejoined at step \d+ \(process 1, restart 1\): ", stdout, re.M), stdout
    assert pids(run.ws, 0) == [chief] and pids(run.ws, 1)[0] == stopped and len(set(pids(run.ws, 1))) == 2
    missed = summary(run.ws)["missed_updates"]["1"]
    assert missed["why"].startswith("process 1 was restarted after the job dropped it for a stall; missing from the meeting"), missed
    assert train_records(run.ws)[-1]["groups_met"] == 2
    assert_no_library_text(stderr)
    assert leftover_processes(tmp_path) == []


def test_threads_and_processes_without_the_same_group_compute_the_same(blobs_job, tmp_path):
    """The fault schedule decides the result: group 1 gone at step 12, in memory (its thread fails) or over processes
    (its process exits), gives the same params; and the in-memory run, repeated, the same bits."""
    job = blobs_job(train_steps=40)
    threads = [run_cli("run", job, "--workspace", tmp_path / f"threads{i}", "--no-progress", *_sets(THREADS), *DILOCO,
                       env={**os.environ, "SHOAL_INJECT_GROUP_ERROR": "1:12"}, timeout=120) for i in range(2)]
    processes = run_cli("run", job, "--workspace", tmp_path / "processes", "--no-progress", *_sets(PROCESSES), *DILOCO,
                        env={**os.environ, "SHOAL_INJECT_EXIT": "1:12"}, timeout=120)
    for proc in (*threads, processes):
        assert proc.returncode == 0, proc.stderr
    assert ("WARNING: worker group 1 died at step 12: injected failure (SHOAL_INJECT_GROUP_ERROR) at step 12; the other groups "
            "go on") in threads[0].stderr
    a, b, c = params(tmp_path / "threads0", 40), params(tmp_path / "threads1", 40), params(tmp_path / "processes", 40)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.allclose(a[k], c[k], atol=1e-6) for k in a)
    for ws, why in ((tmp_path / "threads0", "missing from the meetings after steps 14 to 39"),
                    (tmp_path / "processes", "process 1 exited with code 3; missing from the meetings after steps 14 to 39")):
        assert summary(ws)["missed_updates"] == {"1": {"meetings": 2, "of": 8, "why": why}}
        assert [r["groups_met"] for r in train_records(ws)] == [2, 2, 2, 1, 1, 1, 1, 1]  # displays at 0, 5, ..., 35
    assert f"worker group 1 came to 2 of 8 meetings (missing from the meetings after steps 14 to 39)" in closing_line(threads[0].stdout)


def _sets(cluster: dict) -> list[str]:
    return [arg for name, value in cluster.items() for arg in ("--set", f"cluster.{name}={value}")]


SPARSE = ["--set", "cluster.sparse_outer_step.chunk_size=64", "--set", "cluster.sparse_outer_step.topk_per_chunk=4"]
TOOK = {"DiLoCo": "the anchor, the outer updater's state and worker group 0's inner updater state",
        "SparseLoCo": "the anchor and worker group 0's inner updater state (its error feedback starts at zero)"}


@pytest.mark.parametrize("framework, outer", [("DiLoCo", DILOCO), pytest.param("SparseLoCo", SPARSE, marks=pytest.mark.slow)])
def test_a_killed_group_is_restarted_and_rejoins_at_the_next_meeting(blobs_job, tmp_path, runs, framework, outer):
    """--max-restarts 1: the launcher restarts group 1's killed process, which knocks and is admitted at the groups'
    next meeting (the line names it), takes the anchor and updater state from group 0's (its part of the checkpoint at
    its first step holds exactly group 0's; SparseLoCo's error feedback at zero) and trains to the end; the job exits 0
    with a test accuracy as the unfaulted run's."""
    steps = 3 * STEPS // 2  # time for the restarted process to build its net and knock before the last meeting, under load
    job = blobs_job(train_steps=steps, cluster_extra=PROCESSES)
    # the unfaulted run with its groups as threads: the same numbers as over processes, in a fraction of the time
    unfaulted = run_cli("run", job, "--workspace", tmp_path / "unfaulted", "--no-progress", *_sets(THREADS), *outer, timeout=120)
    assert unfaulted.returncode == 0, unfaulted.stderr
    run = runs.start(job, tmp_path, "--max-restarts", "1", "--set", "checkpoint_freq=5", *outer, env=SLOW)
    chief = run.pid_once_training(0)
    run.signal(1, signal.SIGKILL)
    stdout, stderr = run.finished()
    assert re.search(r"^WARNING: process 1 \(worker\(group=1, id=0\)\) exited with code -9; restarting it \(restart 1 of 1\); "
                     r"it rejoins at the groups' next meeting, from a live group's state$", stderr, re.M), stderr
    (line,) = [line for line in stdout.splitlines() if line.startswith("Worker group 1 rejoined at step ")]
    step = int(re.match(r"Worker group 1 rejoined at step (\d+) \(process 1, restart 1\): ", line)[1])
    assert step % 5 == 0 and 0 < step < steps, line
    assert line.startswith(f"Worker group 1 rejoined at step {step} (process 1, restart 1): {TOOK[framework]}, after the "
                           f"meeting after step {step - 1}, "), line
    assert pids(run.ws, 0) == [chief] and len(set(pids(run.ws, 1))) == 2  # group 1 ran in two processes, one after the other
    got = summary(run.ws)
    assert got["framework"] == framework
    (record,) = got["rejoins"]
    assert (record["group"], record["rank"], record["incarnation"], record["step"]) == (1, 1, 1, step)
    assert record["digests"]["received"] != record["digests"]["before"]
    # at its first step group 1 holds what group 0 holds (no step since the meeting): values, inner and outer state
    mine = load_file(str(run.ws / "checkpoint" / f"step{step}-group1-rank1.safetensors"))
    chiefs = load_file(str(run.ws / "checkpoint" / f"step{step}-worker0.safetensors"))
    state = {k[len("exchange/"):]: v for k, v in mine.items() if k.startswith("exchange/state/")}
    assert state and any(k.endswith("/history") for k in state)
    for key, value in state.items():
        if key.endswith("/outer.error_feedback"):  # SparseLoCo's accumulator: the group's own, from zero
            assert not value.any() and chiefs[key].any(), key
        else:
            assert torch.equal(value, chiefs[key]), key
    values = {k[len("exchange/value/"):]: v for k, v in mine.items() if k.startswith("exchange/value/")}
    assert values and all(torch.equal(v, chiefs[f"param/{k}"]) for k, v in values.items())
    missed = got["missed_updates"]["1"]
    assert missed["why"].startswith("process 1 was restarted after it exited with code -9; missing from the meeting")
    assert missed["why"].endswith(", back after it") or missed["why"].endswith(", back after the last"), missed
    if framework == "DiLoCo":  # summary.json's bytes: each meeting's message (float32) times the groups that came, and
        # the handover the restarted process took: the state its part holds at its first step (anchor, outer and inner)
        numel = sum(v.numel() for k, v in chiefs.items() if k.startswith("param/"))
        handover = sum(v.numel() * v.element_size() for v in state.values())
        assert got["bytes_sent"] == (missed["of"] + missed["meetings"]) * 4 * numel + handover, (got["bytes_sent"], missed)
    records = train_records(run.ws)
    # the meetings without it (a display may or may not fall while it was away: how long a restart takes decides)
    assert records[-1]["groups_met"] == 2 and missed["meetings"] < missed["of"], (records, missed)
    assert f"Test @ step {steps}" in (run.ws / "logs" / "rank0.log").read_text()
    final, baseline = got["final_test"]["accuracy"], summary(tmp_path / "unfaulted")["final_test"]["accuracy"]
    assert final >= baseline - 0.05, (final, baseline)
    assert leftover_processes(tmp_path) == []


def test_a_local_sgd_group_is_not_rejoined_by_hand(blobs_job, tmp_path, capsys):
    from shoal.frontend.cli import main

    job = blobs_job(train_steps=10, cluster_extra=PROCESSES)
    assert main(["run", str(job), "--workspace", str(tmp_path / "ws"), "--rejoin", "1"]) == 2
    assert capsys.readouterr().err.strip() == ("--rejoin 1: Local SGD's worker groups rejoin only when the launcher restarts "
                                               "them (shoal run --max-restarts N)")
