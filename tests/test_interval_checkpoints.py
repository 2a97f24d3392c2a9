"""A job that sets no checkpoint_freq still checkpoints about every checkpoint_interval_s seconds (issue 38, point 4).

The chief chooses the step of each interval checkpoint and every other trainer (threads of its process, other
processes through the job's store) writes its part at that same step (shoal.runtime.checkpoint_schedule). The runs
here are slowed with SHOAL_SLOW_WORKER so that a short job spans several intervals of a fraction of a second.
"""
from __future__ import annotations

import time

import re
import shutil

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shoal
from cli_in_process import one_line_error, run_cli
from layouts import Layout, assert_ran, load, train
from shoal.frontend.module_path import FitError
from shoal.neuralnet import checkpoint as ckpt_io
from shoal.planning.plan import plan_job
from shoal.runtime.checkpoint_schedule import (MOST_STEPS_BETWEEN_READS, CheckpointSchedule, checkpoint_step, lead_steps,
                                               read_every_s, reads_every)
from shoal.runtime.trainer import checkpoint_parts

STEP_S = 0.02  # what SHOAL_SLOW_WORKER adds to each step of worker 0 of every group


def steps_written(workspace) -> list[int]:
    """The steps of the chief's checkpoint files, oldest first."""
    return [step for step, _ in ckpt_io.list_checkpoints(workspace)]


def drop_final(workspace, final: int) -> None:
    """As if the job had died before its final checkpoint (every file of that step, and the process logs, gone)."""
    for path in ckpt_io.checkpoint_dir(workspace).glob(f"step{final}-*.safetensors"):
        path.unlink()
    shutil.rmtree(workspace / "logs", ignore_errors=True)


def assert_same_state(a: ckpt_io.Checkpoint, b: ckpt_io.Checkpoint) -> None:
    for field in ("params", "rng", "exchange"):
        x, y = getattr(a, field), getattr(b, field)
        assert x.keys() == y.keys(), field
        for key in x:
            assert torch.equal(x[key], y[key]), f"{field} {key}"
    for name, slots in a.updater_state.items():
        for slot, value in slots.items():
            assert torch.equal(value, b.updater_state[name][slot]), f"updater state {name}/{slot}"


@pytest.fixture
def slowed(monkeypatch):
    """Every group's worker 0 spends STEP_S more per step (group 1 a half more where `group1_slower`)."""
    def slow(group1_slower: bool = False) -> None:
        spec = f"0:0+{STEP_S}" + (f",1.0:0+{1.5 * STEP_S}" if group1_slower else "")
        monkeypatch.setenv("SHOAL_SLOW_WORKER", spec)
    return slow


# -- the rule ---------------------------------------------------------------------------------------------------
def test_the_lead_covers_how_often_other_processes_read_and_how_far_a_trainer_runs_ahead():
    read_s = read_every_s(600)
    assert read_s == 1.0 and read_every_s(0.4) == 0.05  # an eighth of the interval, at most a second
    assert lead_steps(10.0, read_s, 1) == 2 * 1 + 1 + 2  # slow steps: another process reads at every step
    assert lead_steps(0.1, read_s, 1) == 2 * 10 + 1 + 2
    assert lead_steps(0.1, read_s, 50) == 2 * 10 + 50 + 2  # Local SGD: a group may be a round of local steps ahead
    capped = 2 * MOST_STEPS_BETWEEN_READS + 1 + 2  # very fast steps, or none measured yet
    assert lead_steps(1e-5, read_s, 1) == lead_steps(None, read_s, 1) == capped
    assert reads_every(0.1, read_s) == 10 and reads_every(None, read_s) == reads_every(1e-5, read_s) == MOST_STEPS_BETWEEN_READS
    # the chief alone checkpoints at once; otherwise the lead ahead, and past every required thread's step
    assert checkpoint_step(40, alone=True, fastest_step_s=0.1, read_s=read_s, round_steps=1) == 40
    assert checkpoint_step(40, alone=False, fastest_step_s=0.1, read_s=read_s, round_steps=1) == 40 + 23
    assert checkpoint_step(40, alone=False, fastest_step_s=0.1, read_s=read_s, round_steps=1, required_reached=90) == 91


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def lockstep(durations, ahead: int = 0, interval_s: float = 1.0, round_steps: int = 1, jitter=None):
    """A chief's process and another process through a dict as the store: the chief at step k at the sum of the
    first k durations, the other `ahead` steps ahead of it, `jitter(k)` seconds earlier or later.
    Returns the steps each wrote a checkpoint (part) at."""
    store, clock = {}, Clock()
    train_steps = len(durations)
    chief = CheckpointSchedule(interval_s, train_steps, deciding=True, alone=False, round_steps=round_steps,
                               publish=store.__setitem__, clock=clock)
    other = CheckpointSchedule(interval_s, train_steps, deciding=False, alone=False, round_steps=round_steps,
                               published=store.get, clock=clock)
    starts = np.concatenate([[0.0], np.cumsum(durations)])
    events = [(starts[k], 0, k) for k in range(train_steps)]
    at = 0.0
    for k in range(train_steps):  # in order, whatever the jitter
        at = max(at, starts[max(0, k - ahead)] + (jitter(k) if jitter else 0.0))
        events.append((at, 1, k))
    written = {0: [], 1: []}
    for at, who, step in sorted(events):
        clock.now = at
        if who == 0 and chief.due(0, step, chief=True):
            written[0].append(step)
            chief.written(step)
        elif who == 1 and other.due(0, step):
            written[1].append(step)
    return written


@pytest.mark.parametrize("case", ["even steps", "a slow first step, then fast", "slow steps", "uneven", "20 times faster at once",
                                  "Local SGD ahead"])
def test_every_other_process_learns_the_step_in_time(case):
    rng = np.random.default_rng(0)
    ahead, round_steps = 0, 1
    if case == "even steps":
        durations = np.full(3000, 0.01)
    elif case == "a slow first step, then fast":  # the chief's mean step time would be far too slow a guide
        durations = np.concatenate([[0.9], np.full(4000, 0.001)])
    elif case == "slow steps":
        durations = np.full(60, 0.4)
    elif case == "uneven":
        durations = rng.uniform(0.0005, 0.05, 3000)
    elif case == "20 times faster at once":  # just after the chief decided (at 1 s): read by steps, not by time
        durations = np.concatenate([np.full(52, 0.02), np.full(3000, 0.001)])
    else:
        durations, ahead, round_steps = np.full(3000, 0.01), 20, 20
    # each process starts a step when the collective of the one before ended, give or take a fraction of a step
    jitter = lambda k: float(rng.uniform(-0.3, 0.3)) * durations[min(k, len(durations) - 1)]
    written = lockstep(durations, ahead=ahead, round_steps=round_steps, jitter=jitter)
    assert len(written[0]) >= 2, written
    assert written[1] == written[0]


def test_a_thread_whose_part_is_required_is_never_passed():
    """In-memory Local SGD: group 1 may wait at a meeting far ahead of the chief; the chief's step is past it."""
    clock = Clock()
    schedule = CheckpointSchedule(1.0, 1000, deciding=True, alone=False, required_groups=frozenset({1}), clock=clock)
    assert not schedule.due(1, 500)
    for step in range(10):
        clock.now = step * 0.2
        assert not schedule.due(0, step, chief=True)
    assert schedule.due(1, 501) and not schedule.due(1, 502)


def test_a_successor_decides_after_every_decision_the_dead_chief_published():
    """A job file's replicas (tests/test_job_chief_death.py): process 1 takes a dead chief's place. The checkpoint the
    chief had published and process 1 had not read yet still comes; the successor's own decisions come an interval
    after its takeover and reach the other processes through the store, under the next key."""
    store, clock = {}, Clock()
    chief = CheckpointSchedule(1.0, 10_000, deciding=True, alone=False, publish=store.__setitem__, clock=clock)
    successor = CheckpointSchedule(1.0, 10_000, deciding=False, alone=False, publish=store.__setitem__,
                                   published=store.get, clock=clock)
    other = CheckpointSchedule(1.0, 10_000, deciding=False, alone=False, published=store.get, clock=clock)
    for step in range(120):  # steps of 10 ms: the chief decides once, a little ahead
        clock.now = step * 0.01
        chief.due(0, step, chief=True)
        successor.due(0, step)
        other.due(0, step)
    (decided,) = [int(v) for v in store.values()]
    assert decided > 119  # not yet reached
    clock.now = 1.2  # the chief died; at the step's end process 1 took its place
    successor.take_over()
    due, seen = [], []
    for step in range(120, 300):
        clock.now = step * 0.01
        if successor.due(0, step, chief=True):
            due.append(step)
            successor.written(step)
        if other.due(0, step):
            seen.append(step)
    assert due[0] == decided and len(due) == 2 and due[1] >= decided + 100, due  # the chief's, then its own an interval on
    assert [int(store[k]) for k in sorted(store)] == due and seen == due  # published: the other process writes its part too


def test_the_plan_carries_the_interval_only_without_checkpoint_freq(blobs_job):
    assert plan_job(load(blobs_job(), "single worker")).checkpoint_interval_s == 600  # the default
    assert plan_job(load(blobs_job(extra="checkpoint_interval_s: 2.5"), "single worker")).checkpoint_interval_s == 2.5
    assert plan_job(load(blobs_job(extra="checkpoint_freq: 10"), "single worker")).checkpoint_interval_s == 0
    local_sgd = Layout(dict(nworker_groups=2, local_steps=7), 2, 2, "Local SGD")
    assert plan_job(load(blobs_job(), local_sgd)).round_steps == 7


def test_a_negative_interval_is_refused_in_one_line_naming_it(blobs_job, tmp_path):
    job = blobs_job(extra="checkpoint_interval_s: -1")
    done = run_cli("run", job, "--workspace", tmp_path / "ws")
    assert done.returncode == 2, done.stderr
    lines = job.read_text().splitlines()
    line = next(i for i, text in enumerate(lines, 1) if text.startswith("checkpoint_interval_s"))
    column = lines[line - 1].index("-1") + 1
    assert done.stderr == f"{job}:{line}:{column}: checkpoint_interval_s must be >= 0 (seconds; 0: off), got -1\n"
    with pytest.raises(FitError, match="checkpoint_interval_s must be a number of seconds from 0"):
        shoal.fit(nn.Linear(2, 2), F.cross_entropy, (torch.zeros(4, 2), torch.zeros(4, dtype=torch.long)),
                  checkpoint_interval_s=-1, workspace=tmp_path / "fit")


# -- runs -----------------------------------------------------------------------------------------------------
def test_one_worker_checkpoints_every_interval_resumes_from_the_newest_and_trains_the_same(blobs_job, tmp_path, slowed):
    slowed()
    steps = 60
    job = blobs_job(train_steps=steps, extra="checkpoint_interval_s: 0.3")
    ws = tmp_path / "ws"
    done = run_cli("run", job, "--workspace", ws)
    assert done.returncode == 0, done.stderr
    written = steps_written(ws)
    between = [s for s in written if 0 < s < steps]
    assert len(between) > 1 and written[-1] == steps, written  # >= 60 x 20 ms of training: 3 intervals or more
    logged = re.findall(r"Checkpoint written to \S+step(\d+)-worker0\.safetensors \(every 0\.3 s: checkpoint_interval_s\)",
                        done.stdout)
    assert [int(s) for s in logged] == between

    off = tmp_path / "off"  # the same job, interval checkpoints off: the final one only, the same trained state
    done = run_cli("run", blobs_job(train_steps=steps, extra="checkpoint_interval_s: 0"), "--workspace", off)
    assert done.returncode == 0, done.stderr
    assert steps_written(off) == [steps]
    final = ckpt_io.load(ckpt_io.checkpoint_file(ws, steps))
    assert_same_state(final, ckpt_io.load(ckpt_io.checkpoint_file(off, steps)))

    drop_final(ws, steps)  # the job died after its newest interval checkpoint
    done = run_cli("run", job, "--workspace", ws, "--resume")
    assert done.returncode == 0, done.stderr
    assert f"step{between[-1]}-worker0.safetensors at step {between[-1]}" in done.stdout
    assert_same_state(final, ckpt_io.load(ckpt_io.checkpoint_file(ws, steps)))


def whole_checkpoints(job, layout, ws, steps) -> list[int]:
    """The interval checkpoints of the run in `ws`, each checked to load with every part of its layout."""
    parts = checkpoint_parts(plan_job(load(job, layout)))
    between = [s for s in steps_written(ws) if 0 < s < steps]
    for step in between:
        loaded = ckpt_io.load(ckpt_io.checkpoint_file(ws, step), parts=True)
        assert set(loaded.parts) == {ckpt_io.part_name(step, g, r) for g, r in parts}, step
    return between


def test_allreduce_over_two_processes_checkpoints_every_process_at_one_step(blobs_job, tmp_path, slowed):
    slowed()
    steps, layout = 80, "AllReduce, 2 processes"
    job = blobs_job(train_steps=steps, layout=layout, extra="checkpoint_interval_s: 0.3")
    ws, resumed = tmp_path / "ws", tmp_path / "resumed"
    train(job, layout, ws)
    between = whole_checkpoints(job, layout, ws, steps)
    assert len(between) > 1, steps_written(ws)
    shutil.copytree(ws, resumed)
    drop_final(resumed, steps)
    history = train(job, layout, resumed, resume=True)
    assert min(r["step"] for r in history.records) >= between[-1]
    for name in (ckpt_io.checkpoint_file(ws, steps).name, ckpt_io.part_name(steps, 0, 1)):  # AllReduce is exact
        assert_same_state(ckpt_io.load(ws / "checkpoint" / name), ckpt_io.load(resumed / "checkpoint" / name))


def test_in_memory_hogwild_groups_write_their_parts_at_the_chiefs_step(blobs_job, tmp_path, slowed):
    slowed(group1_slower=True)  # group 1 behind the chief: it writes its part when it gets to the step
    steps, layout = 60, "in-memory Hogwild, 2 groups"
    job = blobs_job(train_steps=steps, layout=layout, extra="checkpoint_interval_s: 0.3")
    ws = tmp_path / "ws"
    train(job, layout, ws)
    between = whole_checkpoints(job, layout, ws, steps)
    assert len(between) > 1, steps_written(ws)
    drop_final(ws, steps)
    history = train(job, layout, ws, resume=True)
    assert min(r["step"] for r in history.records) >= between[-1]
    final = ckpt_io.load(ckpt_io.checkpoint_file(ws, steps), parts=True)
    assert set(final.parts) == {ckpt_io.part_name(steps, 1, 0)}


def slow_cross_entropy(output, target):
    """fit's loss, STEP_S slower per step (fit's loop over the session takes no fault hooks: SHOAL_SLOW_WORKER)."""
    time.sleep(STEP_S)
    return F.cross_entropy(output, target)


def test_fit_checkpoints_every_interval_without_checkpoint_freq(tmp_path):
    g = np.random.default_rng(0)
    x, y = torch.tensor(g.normal(0, 1, (256, 16)).astype(np.float32)), torch.tensor(g.integers(0, 4, 256))
    ws = tmp_path / "fit"
    history = shoal.fit(nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4)), slow_cross_entropy, (x, y), steps=50,
                        batch_size=32, checkpoint_interval_s=0.25, workspace=ws, log=lambda *a: None)
    assert_ran(history.workspace, "single worker")
    written = steps_written(ws)
    assert len([s for s in written if 0 < s < 50]) > 1 and written[-1] == 50, written


INTERVAL_LOOP = '''
import sys, time
import torch, shoal

torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
run = shoal.session(train_steps=80, disp_freq=20, checkpoint_interval_s=0.15)
model = run.model(torch.nn.Linear(8, 1))
opt = run.optimizer(torch.optim.SGD(model.parameters(), lr=0.05))
for step, (x, y) in run.batches(data, batch_size=8):
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step(); opt.zero_grad()
    time.sleep(0.01)
run.checkpoint()
'''


@pytest.mark.parametrize("cluster", [("nworkers_per_group=2", "nworkers_per_procs=1"),  # AllReduce, 2 processes
                                     ("nworker_groups=2", "nworkers_per_procs=1", "local_steps=4")])  # Local SGD
def test_a_users_loop_over_processes_checkpoints_every_interval_at_the_chiefs_step(tmp_path, cluster):
    """shoal.session(checkpoint_interval_s=...) over 2 processes: the chief picks each interval checkpoint's step and
    every process writes its part there (Local SGD's group 1 its required part, in the chief's list); a resume of Local
    SGD from the newest of them ends where the uninterrupted run did (exact; AllReduce's replicas resume from the
    chief's file alone, as tests/test_session.py's resumes do)."""
    script = tmp_path / "loop.py"
    script.write_text(INTERVAL_LOOP)
    sets = [arg for field in cluster for arg in ("--set", f"cluster.{field}")]
    ws, resumed = tmp_path / "ws", tmp_path / "resumed"
    proc = run_cli("run", script, "--workspace", ws, *sets, cwd=tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr
    uninterrupted = ckpt_io.load(ckpt_io.checkpoint_file(ws, 80), parts=True)
    assert len(list((ws / "logs").glob("rank*.log"))) == 2  # the layout ran: 2 processes
    between = [s for s in steps_written(ws) if 0 < s < 80]
    assert len(between) > 1, steps_written(ws)
    for step in between:
        ckpt = ckpt_io.load(ckpt_io.checkpoint_file(ws, step), parts=True)  # (a required part missing: refused)
        assert ckpt.step == step and len(ckpt.parts) == (1 if "local_steps=4" in cluster else 0)  # (replicas: none)
    if "local_steps=4" not in cluster:
        return
    shutil.copytree(ws, resumed)
    drop_final(resumed, 80)
    proc = run_cli("run", script, "--workspace", resumed, "--resume", *sets, cwd=tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr
    again = ckpt_io.load(ckpt_io.checkpoint_file(resumed, 80), parts=True)
    assert all(torch.equal(uninterrupted.params[k], again.params[k]) for k in uninterrupted.params)


def test_a_users_loop_refuses_a_negative_interval_in_one_line(tmp_path):
    """`--set checkpoint_interval_s=-1` on a script's session, as a job file's: one line naming it, exit 2 (it once
    passed through and silently turned the interval off)."""
    script = tmp_path / "loop.py"
    script.write_text("import shoal\nshoal.session(train_steps=3)\n")
    proc = run_cli("run", script, "--workspace", tmp_path / "ws", "--set", "checkpoint_interval_s=-1", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert one_line_error(proc) == ("shoal.session: checkpoint_interval_s must be a number of seconds from 0 (0: off), "
                                    "got -1"), proc.stderr
