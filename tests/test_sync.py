"""Synchronous worker groups: any layout gives the single-worker params (same global batch and data).

Every layout comes from tests/layouts.py and every run is checked to have had its layout. The
default suite runs each in-memory layout, every updater on one of them, and one multi-process
layout per kind (servers with the workers, servers apart); the whole product of layouts and
updaters, and the other multi-process variants, run with -m slow.
"""
from __future__ import annotations

import shutil

import pytest
import torch
from conftest import mlp_job_text
from layouts import IN_MEMORY_SYNCHRONOUS, LAYOUTS, SYNCHRONOUS, train

import shoal
from shoal.neuralnet import checkpoint as ckpt_io
from shoal.planning.plan import UnsupportedClusterError

STEPS = 8
UPDATERS = {
    "momentum": "type: kSGD momentum: 0.9",
    "adam": "type: kAdam",
    "nesterov+wd": "type: kNesterov momentum: 0.5 weight_decay: 0.001",
}
# in the default suite: every updater on one layout, Adam (the most updater state) on every in-memory layout
# and on one multi-process layout of each kind (servers with the workers, servers apart)
EVERY_UPDATER_ON = "in-memory Sandblaster, 2 threads, 2 server slices"
DEFAULT_LAUNCHED = ("AllReduce, 3 processes", "Sandblaster, 2 threads + 2 servers, 3 processes")


def slow_unless(fast: bool):
    return () if fast else (pytest.mark.slow,)


def exactness_cases():
    for layout in SYNCHRONOUS:
        default_layout = layout in IN_MEMORY_SYNCHRONOUS or layout in DEFAULT_LAUNCHED
        for updater in UPDATERS:
            fast = layout == EVERY_UPDATER_ON or (updater == "adam" and default_layout)
            yield pytest.param(layout, updater, id=f"{layout}-{updater}", marks=slow_unless(fast))


def final_params(job, layout, workspace, *overrides, steps=STEPS, resume=False):
    train(job, layout, workspace, *overrides, resume=resume)
    return ckpt_io.load(ckpt_io.checkpoint_file(workspace, steps)).params


def assert_same_params(got, expected, names=None):
    for name in names or expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def single_worker(blobs_dir, tmp_path_factory):
    """The single worker's params after STEPS steps, per updater: trained once, compared with every layout."""
    root = tmp_path_factory.mktemp("single-worker")
    done = {}

    def params(updater: str):
        if updater not in done:
            job = root / f"{updater}.conf"
            job.write_text(mlp_job_text(blobs_dir, train_steps=STEPS, updater=UPDATERS[updater]))
            done[updater] = final_params(job, "single worker", root / updater)
        return done[updater]

    return params


@pytest.mark.parametrize("layout, updater", list(exactness_cases()))
def test_every_synchronous_layout_equals_the_single_worker_run(blobs_job, tmp_path, single_worker, layout, updater):
    group = final_params(blobs_job(train_steps=STEPS, updater=UPDATERS[updater]), layout, tmp_path / "group")
    assert_same_params(group, single_worker(updater))


def test_per_partition_batch_sizes_weight_the_gradients(blobs_job, tmp_path, single_worker):
    """Caffe con Troll's split (e.g. 200 on the GPU, 56 on the CPU): shares 24 + 8 of a batch of 32."""
    shares = ["neuralnet.layer[0].store_conf.batchsize=24,8"]
    uneven = final_params(blobs_job(train_steps=STEPS), "in-memory Sandblaster, 2 threads", tmp_path / "uneven", *shares)
    assert_same_params(uneven, single_worker("momentum"))


def test_group_metrics_cover_the_whole_batch(blobs_job, tmp_path):
    job = blobs_job(train_steps=10)
    history = train(job, "in-memory Sandblaster, 2 threads", tmp_path / "ws")
    single = train(job, "single worker", tmp_path / "single")
    for a, b in zip(history.phase("train"), single.phase("train"), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
        assert a["accuracy"] == pytest.approx(b["accuracy"])


def test_layouts_this_runtime_cannot_run_yet_are_refused_clearly(blobs_job, tmp_path):
    """Asynchronous groups over processes with the one server group in the workers' processes."""
    with pytest.raises(UnsupportedClusterError, match="not supported yet"):
        shoal.train(shoal.load_job(blobs_job(train_steps=2), ["cluster.nworker_groups=2"]), workspace=tmp_path / "ws", log=lambda *a: None)


def resume_on(job, first, then, workspace, at=4):
    """Train `job` on layout `first` to the end, drop the checkpoints after step `at`, resume on `then`."""
    train(job, first, workspace)
    drop_checkpoints_after(workspace, at)
    return final_params(job, then, workspace, resume=True)


def drop_checkpoints_after(workspace, step):
    for s, path in ckpt_io.list_checkpoints(workspace):
        if s > step:
            path.unlink()


def test_resume_with_a_different_number_of_workers(blobs_job, tmp_path, single_worker):
    """Checkpoints hold the whole model, so a run can continue on another layout."""
    job = blobs_job(train_steps=STEPS, extra="checkpoint_freq: 4")
    resumed = resume_on(job, "in-memory Sandblaster, 2 threads", "in-memory Sandblaster, 3 threads (uneven 11+11+10)", tmp_path / "ws")
    assert_same_params(resumed, single_worker("momentum"))


@pytest.mark.parametrize("layout", ["AllReduce, 2 processes x 2 threads",
                                    pytest.param("AllReduce, 3 processes", marks=pytest.mark.slow),
                                    pytest.param("Sandblaster, 2 workers + 2 servers, 4 processes", marks=pytest.mark.slow)])
def test_small_buckets_split_params_across_messages_and_stay_exact(blobs_job, tmp_path, monkeypatch, single_worker, layout):
    """A 100-element cap: big slices travel in pieces (no copy), small ones share a message."""
    monkeypatch.setenv("SHOAL_BUCKET_MB", str(100 * 4 / 2**20))
    group = final_params(blobs_job(train_steps=STEPS, updater=UPDATERS["adam"]), layout, tmp_path / "group")
    assert_same_params(group, single_worker("adam"))


@pytest.fixture(scope="module")
def sandblaster_checkpoints(blobs_dir, tmp_path_factory):
    """A Sandblaster run (2 servers apart, so the updater state is gathered from both) checkpointed at step 4: (job, workspace)."""
    root = tmp_path_factory.mktemp("sandblaster")
    job = root / "job.conf"
    job.write_text(mlp_job_text(blobs_dir, train_steps=STEPS, extra="checkpoint_freq: 4"))
    train(job, "Sandblaster, 2 threads + 2 servers, 3 processes", root / "ws")
    drop_checkpoints_after(root / "ws", 4)
    return job, root / "ws"


@pytest.mark.parametrize("resume_on", ["single worker", pytest.param("AllReduce, 3 processes", marks=pytest.mark.slow)])
def test_multi_process_checkpoint_holds_the_whole_updater_state_and_resumes_on_another_layout(
        sandblaster_checkpoints, tmp_path, single_worker, resume_on):
    """A Sandblaster run (servers apart) continues on one process, or as AllReduce over 3 processes."""
    job, checkpointed = sandblaster_checkpoints
    ckpt = ckpt_io.load(ckpt_io.checkpoint_file(checkpointed, 4))
    assert set(ckpt.updater_state) == {"w1", "b1", "w2", "b2"}
    workspace = tmp_path / "ws"
    shutil.copytree(checkpointed, workspace)
    shutil.rmtree(workspace / "logs", ignore_errors=True)  # the first run's process logs
    resumed = final_params(job, resume_on, workspace, resume=True)
    assert_same_params(resumed, single_worker("momentum"))


UNUSED_LAYER = """layer { name: "unused" type: kInnerProduct srclayers: "relu" innerproduct_conf { num_output: 3 }
    param { name: "w_unused" init { type: kGaussian std: 0.1 } } param { name: "b_unused" init { type: kConstant value: 0.5 } } }
  layer { name: "loss" """

NO_GRADIENT_LAYOUTS = [
    "in-memory Sandblaster, 2 threads, 2 server slices",
    pytest.param("AllReduce, 2 processes, 2 server slices", marks=pytest.mark.slow),
    "Sandblaster, 2 workers + 1 server, 3 processes",  # the server knows only what the workers say
    pytest.param("Downpour, 2 groups + 1 server, 3 processes", marks=pytest.mark.slow),  # asynchronous: only the unused params compare
]


@pytest.mark.parametrize("layout", NO_GRADIENT_LAYOUTS)
def test_a_param_without_gradient_is_not_updated_on_any_layout(blobs_job, tmp_path, layout):
    """As SINGA's servers, which update on received gradients only: momentum and weight decay leave it alone."""

    def job():
        path = blobs_job(train_steps=STEPS, updater="type: kSGD momentum: 0.9 weight_decay: 0.01")
        text = path.read_text()
        assert text.count('layer { name: "loss" ') == 1
        path.write_text(text.replace('layer { name: "loss" ', UNUSED_LAYER))  # a layer nothing reads
        return path

    single = final_params(job(), "single worker", tmp_path / "single")
    group = final_params(job(), layout, tmp_path / "group")
    assert single["b_unused"].tolist() == [0.5, 0.5, 0.5]
    assert_same_params(group, single, None if LAYOUTS[layout].synchronous else ("w_unused", "b_unused"))
