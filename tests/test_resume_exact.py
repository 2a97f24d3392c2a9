"""Resuming at a checkpoint equals the uninterrupted run, on every layout of tests/layouts.py and Local SGD / DiLoCo
(with and without compression): every group's state is in the checkpoint (issue 27, point 4).

Each case trains N steps writing checkpoints, copies the workspace, drops what came after step K and resumes the
copy to N. Where the uninterrupted run is deterministic (one group, or Local SGD's groups, threads or processes)
the final checkpoint (params, updater state, RNG, exchange state, every group's part) must be the same bytes.
Asynchronous groups (Hogwild, Downpour) are not deterministic: there the resumed run must finish with every part
written, and (Hogwild, in memory and over processes) every trainer of every process, assembled from the checkpoint,
must hold exactly the state the checkpoint holds. Downpour's processes cannot be assembled outside a running job
(they connect to the servers): their resume is checked end to end only.
"""
from __future__ import annotations

import shutil

import pytest
import torch

from layouts import ASYNCHRONOUS, LAYOUTS, Layout, assert_ran, load, train
from shoal.neuralnet import checkpoint as ckpt_io
from shoal.planning.plan import plan_job
from shoal.report.metrics import read_metrics
from shoal.runtime.assemble import RunSpec, assemble
from shoal.runtime.trainer import checkpoint_parts

STEPS, AT = 12, 7  # checkpoints at 0, 7 and 12; Local SGD with local_steps 3 meets after steps 2, 5, 8, 11: 7 is mid-round

LOCAL_SGD_THREADS = dict(nworker_groups=2, nworkers_per_procs=2, local_steps=3)
LOCAL_SGD_PROCESSES = dict(nworker_groups=2, local_steps=3)
DILOCO = {"outer_updater.type": "kNesterov", "outer_updater.momentum": 0.9, "outer_updater.learning_rate.type": "kFixed",
          "outer_updater.learning_rate.base_lr": 0.7}
TOPK = dict(compression="kTopK", topk_fraction=0.1)

CASES: dict[str, Layout] = {
    **LAYOUTS,
    "Local SGD, 2 groups as threads": Layout(LOCAL_SGD_THREADS, 1, 2, "Local SGD"),
    "DiLoCo, 2 groups as threads": Layout({**LOCAL_SGD_THREADS, **DILOCO}, 1, 2, "DiLoCo"),
    "Local SGD, 2 processes": Layout(LOCAL_SGD_PROCESSES, 2, 2, "Local SGD"),
    "Local SGD, 2 processes, top-k": Layout({**LOCAL_SGD_PROCESSES, **TOPK}, 2, 2, "Local SGD"),
    "DiLoCo, 2 processes, top-k": Layout({**LOCAL_SGD_PROCESSES, **DILOCO, **TOPK}, 2, 2, "DiLoCo"),
    "DiLoCo, 2 processes, bf16": Layout({**LOCAL_SGD_PROCESSES, **DILOCO, "compression": "kBF16"}, 2, 2, "DiLoCo"),
    "AllReduce, 2 processes, top-k": Layout({**LAYOUTS["AllReduce, 2 processes"].cluster, **TOPK}, 2, 2, "AllReduce"),
    # restarts allowed: the worker processes' quorum and Downpour's servers (runtime/exchanges/sandblaster.py)
    "Sandblaster, 2 workers + 2 servers, max_restarts 1": Layout(
        {**LAYOUTS["Sandblaster, 2 workers + 2 servers, 4 processes"].cluster, "max_restarts": 1}, 4, 2, "Sandblaster"),
    "Distributed Hogwild, 2 groups, top-k": Layout({**LAYOUTS["Distributed Hogwild, 2 groups"].cluster, **TOPK}, 2, 2,
                                                   "Distributed Hogwild"),
}
NOT_DETERMINISTIC = set(ASYNCHRONOUS) | {"Distributed Hogwild, 2 groups, top-k"}
ASSEMBLED_HERE = {name for name in NOT_DETERMINISTIC if not name.startswith("Downpour")}
# found while writing this test, also on main before it: a 3-thread group of uneven shares resumed lands 1 ulp
# (1.5e-8) away from its uninterrupted run, with or without dropout (an even 4-thread split is exact)
UNEVEN = "in-memory Sandblaster, 3 threads (uneven 11+11+10)"
# a few seconds each on 2 cores; every other row runs with -m slow
FAST = {"in-memory Sandblaster, 2 threads", "AllReduce, 2 processes, top-k", "Local SGD, 2 groups as threads",
        "DiLoCo, 2 groups as threads", "DiLoCo, 2 processes, top-k", "in-memory Hogwild, 2 groups",
        "in-memory Downpour, 2 groups", "Distributed Hogwild, 2 groups, top-k"}


def checkpoint_files(workspace, step):
    """The chief's file and every part of the checkpoint at `step`, by name."""
    return {p.name: p for p in ckpt_io.checkpoint_dir(workspace).glob(f"step{step}-*.safetensors")}


def drop_after(workspace, step):
    for path in ckpt_io.checkpoint_dir(workspace).glob("step*.safetensors"):
        if int(path.name[4:].split("-")[0]) > step:
            path.unlink()
    shutil.rmtree(workspace / "logs", ignore_errors=True)  # the first run's process logs


def assert_same(a: ckpt_io.Checkpoint, b: ckpt_io.Checkpoint, where: str):
    for field in ("params", "rng", "exchange"):
        x, y = getattr(a, field), getattr(b, field)
        assert x.keys() == y.keys(), f"{where} {field}: {sorted(x)} != {sorted(y)}"
        for key in x:
            assert x[key].dtype == y[key].dtype and torch.equal(x[key], y[key]), f"{where} {field} {key}"
    assert a.updater_state.keys() == b.updater_state.keys(), where
    for name, slots in a.updater_state.items():
        assert slots.keys() == b.updater_state[name].keys(), f"{where} {name}"
        for slot in slots:
            assert torch.equal(slots[slot], b.updater_state[name][slot]), f"{where} updater state {name}/{slot}"


@pytest.fixture
def job(blobs_job):
    # dropout and momentum: RNG and updater state matter; random_skip: each group's data position matters
    return blobs_job(train_steps=STEPS, dropout=True, extra=f"checkpoint_freq: {AT}")


def marks(name):
    if name == UNEVEN:
        return [pytest.mark.slow, pytest.mark.xfail(reason="uneven shares resume 1 ulp away (not checkpoint state)", strict=True)]
    return [] if name in FAST else [pytest.mark.slow]


@pytest.mark.parametrize("case", [pytest.param(name, marks=marks(name)) for name in CASES])
def test_resume_at_a_checkpoint_equals_the_uninterrupted_run(job, tmp_path, case):
    layout = CASES[case]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    train(job, layout, whole)
    shutil.copytree(whole, resumed)
    drop_after(resumed, AT)
    parts = checkpoint_parts(plan_job(load(job, layout)))
    assert set(checkpoint_files(resumed, AT)) == {"step7-worker0.safetensors"} | {f"step7-group{g}-rank{r}.safetensors" for g, r in parts}
    if case in ASSEMBLED_HERE:
        assert_every_trainer_restores_its_state(job, layout, resumed)
    history = train(job, layout, resumed, resume=True)
    # what the resumed run recorded, in one process or over several: the copied records of steps 0-12 are not its
    assert history.records and min(r["step"] for r in history.records) >= AT
    assert history.records == read_metrics(resumed / "metrics.jsonl")[-len(history.records):]
    final = ckpt_io.load(ckpt_io.checkpoint_file(resumed, STEPS), parts=True)
    assert final.step == STEPS and set(final.parts) == {ckpt_io.part_name(STEPS, g, r) for g, r in parts}
    if case in NOT_DETERMINISTIC:
        return
    assert checkpoint_files(whole, STEPS).keys() == checkpoint_files(resumed, STEPS).keys()
    for name, path in checkpoint_files(whole, STEPS).items():
        assert_same(ckpt_io.load(path, parts=False), ckpt_io.load(checkpoint_files(resumed, STEPS)[name], parts=False), name)


def assert_every_trainer_restores_its_state(job, layout, workspace):
    """Each process's trainers, assembled from the checkpoint at AT, would write back exactly what it holds.
    (Distributed Hogwild's processes assemble here one at a time: nothing of theirs talks before training.)"""
    plan = plan_job(load(job, layout))
    written = ckpt_io.load(ckpt_io.checkpoint_file(workspace, AT), parts=True)
    for rank in range(plan.nprocs):
        run = assemble(plan, rank, RunSpec(workspace, resume_from=ckpt_io.checkpoint_file(workspace, AT), log=lambda *a: None))
        for trainer in run.trainers:
            expected = written if trainer.chief else written.parts[ckpt_io.part_name(AT, trainer.group, rank)]
            where = f"group {trainer.group} in process {rank}"
            again = trainer.checkpoint_state(AT)
            assert_same(expected, again, where)
            assert again.trainer.get("skips") == expected.trainer["skips"], where
            assert trainer.start_step == AT, where


def test_a_checkpoint_missing_a_required_part_is_incomplete_and_resume_falls_back(job, tmp_path):
    """A Local SGD group's part lost (its process killed while writing): the checkpoint is refused as a whole, with
    one line naming the part, and --resume goes on from the newest complete one."""
    layout = CASES["Local SGD, 2 groups as threads"]
    ws = tmp_path / "ws"
    train(job, layout, ws)
    ckpt_io.part_file(ws, STEPS, 1, 0).unlink()
    with pytest.raises(ckpt_io.CheckpointError, match=r"step12-worker0.safetensors: incomplete checkpoint: its part "
                                                      r"step12-group1-rank0.safetensors is missing"):
        ckpt_io.load(ckpt_io.checkpoint_file(ws, STEPS), parts=True)
    damaged = ckpt_io.part_file(ws, AT, 1, 0)
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    with pytest.raises(ckpt_io.CheckpointError, match="step7-group1-rank0.safetensors: damaged checkpoint"):
        ckpt_io.load(ckpt_io.checkpoint_file(ws, AT), parts=True)
    history = train(job, layout, ws, resume=True)  # from step 0: the newest complete checkpoint
    assert history.records[0]["step"] == 0
    assert_ran(ws, layout)


def test_a_checkpoint_naming_a_part_outside_its_step_is_refused_in_one_line(job, tmp_path):
    """A downloaded checkpoint's metadata names the files loaded with it: only parts of its own step, in its folder."""
    path = tmp_path / "checkpoint" / "step3-worker0.safetensors"
    for name in ("../../secret.safetensors", "step4-group1-rank0.safetensors"):
        ckpt_io.save(path, ckpt_io.Checkpoint(step=3, params={"w": torch.zeros(2)}, part_names={name: True}))
        with pytest.raises(ckpt_io.CheckpointError, match=rf"step3-worker0.safetensors: metadata names '{name}', not a part of step 3$"):
            ckpt_io.load(path, parts=True)
    assert ckpt_io.load(path).params["w"].tolist() == [0.0, 0.0]  # checkpoint_path reads params only
