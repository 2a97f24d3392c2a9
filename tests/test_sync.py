"""Synchronous worker groups: any layout gives the single-worker params (same global batch and data)."""
from __future__ import annotations

import pytest
import torch

import shoal
from shoal.neuralnet import checkpoint as ckpt_io
from shoal.planning.plan import UnsupportedClusterError

UPDATERS = {
    "momentum": "type: kSGD momentum: 0.9",
    "adam": "type: kAdam",
    "nesterov+wd": "type: kNesterov momentum: 0.5 weight_decay: 0.001",
}
LAYOUTS = {
    "2 threads": "nworkers_per_group: 2 nworkers_per_procs: 2",
    "3 threads (uneven 11+11+10)": "nworkers_per_group: 3 nworkers_per_procs: 3",
    "2 threads, 2 server slices": "nworkers_per_group: 2 nworkers_per_procs: 2 nservers_per_group: 2 nservers_per_procs: 2",
}


def final_params(job_path, workspace, cluster: str = "", batchsize=None):
    text = job_path.read_text().replace("cluster { }", f"cluster {{ {cluster} }}")
    if batchsize:
        text = text.replace("batchsize: 32", " ".join(f"batchsize: {b}" for b in batchsize), 1)
    job_path.write_text(text)
    shoal.train(job_path, workspace=workspace, log=lambda *a: None)
    return ckpt_io.load(ckpt_io.checkpoint_file(workspace, 8)).params


@pytest.mark.parametrize("updater", UPDATERS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_synchronous_layout_equals_the_single_worker_run(blobs_job, tmp_path, layout, updater):
    single = final_params(blobs_job(train_steps=8, updater=UPDATERS[updater]), tmp_path / "single")
    group = final_params(blobs_job(train_steps=8, updater=UPDATERS[updater]), tmp_path / "group", LAYOUTS[layout])
    for name in single:
        torch.testing.assert_close(group[name], single[name], rtol=1e-5, atol=1e-6)


def test_per_partition_batch_sizes_weight_the_gradients(blobs_job, tmp_path):
    """Caffe con Troll's split (e.g. 200 on the GPU, 56 on the CPU): shares 24 + 8 of a batch of 32."""
    single = final_params(blobs_job(train_steps=8), tmp_path / "single")
    uneven = final_params(blobs_job(train_steps=8), tmp_path / "uneven", LAYOUTS["2 threads"], batchsize=[24, 8])
    for name in single:
        torch.testing.assert_close(uneven[name], single[name], rtol=1e-5, atol=1e-6)


def test_group_metrics_cover_the_whole_batch(blobs_job, tmp_path):
    job = blobs_job(train_steps=10)
    job.write_text(job.read_text().replace("cluster { }", "cluster { nworkers_per_group: 2 nworkers_per_procs: 2 }"))
    history = shoal.train(job, workspace=tmp_path / "ws", log=lambda *a: None)
    single = shoal.train(blobs_job(train_steps=10), workspace=tmp_path / "single", log=lambda *a: None)
    for a, b in zip(history.phase("train"), single.phase("train")):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
        assert a["accuracy"] == pytest.approx(b["accuracy"])


def test_layouts_this_runtime_cannot_run_yet_are_refused_clearly(blobs_job, tmp_path):
    job = blobs_job(train_steps=2)
    job.write_text(job.read_text().replace("cluster { }", "cluster { nworker_groups: 2 nworkers_per_procs: 1 }"))
    with pytest.raises(UnsupportedClusterError, match="not supported yet"):
        shoal.train(job, workspace=tmp_path / "ws", log=lambda *a: None)


def test_resume_with_a_different_number_of_workers(blobs_job, tmp_path):
    """Checkpoints hold the whole model, so a run can continue on another layout."""
    straight = final_params(blobs_job(train_steps=8), tmp_path / "straight")
    job = blobs_job(train_steps=8, extra="checkpoint_freq: 4")
    text = job.read_text()
    job.write_text(text.replace("cluster { }", "cluster { nworkers_per_group: 2 nworkers_per_procs: 2 }"))
    shoal.train(job, workspace=tmp_path / "mixed", log=lambda *a: None)
    for step, path in ckpt_io.list_checkpoints(tmp_path / "mixed"):
        if step > 4:
            path.unlink()
    job.write_text(text.replace("cluster { }", "cluster { nworkers_per_group: 3 nworkers_per_procs: 3 }"))
    shoal.train(job, workspace=tmp_path / "mixed", resume=True, log=lambda *a: None)
    resumed = ckpt_io.load(ckpt_io.checkpoint_file(tmp_path / "mixed", 8)).params
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], rtol=1e-5, atol=1e-6)


PROCESS_LAYOUTS = {
    "2 workers / 2 processes": "nworkers_per_group: 2",
    "AllReduce 3 co-located": "nworkers_per_group: 3 nservers_per_group: 3",
    "Sandblaster 2+2 separate": "nworkers_per_group: 2 nservers_per_group: 2 server_worker_separate: true",
    "2 processes x 2 threads": "nworkers_per_group: 4 nworkers_per_procs: 2 nservers_per_group: 2",
}


@pytest.mark.parametrize("updater", ["momentum", "adam"])
@pytest.mark.parametrize("layout", PROCESS_LAYOUTS)
def test_multi_process_layouts_equal_the_single_worker_run(blobs_job, tmp_path, layout, updater):
    single = final_params(blobs_job(train_steps=8, updater=UPDATERS[updater]), tmp_path / "single")
    group = final_params(blobs_job(train_steps=8, updater=UPDATERS[updater]), tmp_path / "group", PROCESS_LAYOUTS[layout])
    for name in single:
        torch.testing.assert_close(group[name], single[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", ["AllReduce 3 co-located", "Sandblaster 2+2 separate", "2 processes x 2 threads"])
def test_small_buckets_split_params_across_messages_and_stay_exact(blobs_job, tmp_path, monkeypatch, layout):
    """A 100-element cap: big slices travel in pieces (no copy), small ones share a message."""
    monkeypatch.setenv("SHOAL_BUCKET_MB", str(100 * 4 / 2**20))
    single = final_params(blobs_job(train_steps=8, updater=UPDATERS["adam"]), tmp_path / "single")
    group = final_params(blobs_job(train_steps=8, updater=UPDATERS["adam"]), tmp_path / "group", PROCESS_LAYOUTS[layout])
    for name in single:
        torch.testing.assert_close(group[name], single[name], rtol=1e-5, atol=1e-6)


RESUME_LAYOUTS = {"1 process": "", "AllReduce 3 co-located": PROCESS_LAYOUTS["AllReduce 3 co-located"]}


@pytest.mark.parametrize("resume_on", RESUME_LAYOUTS)
def test_multi_process_checkpoint_holds_the_whole_updater_state_and_resumes_on_another_layout(blobs_job, tmp_path, resume_on):
    """A Sandblaster run (servers apart) continues on one process, or as AllReduce over 3 processes."""
    straight = final_params(blobs_job(train_steps=8), tmp_path / "straight")
    job = blobs_job(train_steps=8, extra="checkpoint_freq: 4")
    text = job.read_text()
    job.write_text(text.replace("cluster { }", "cluster { " + PROCESS_LAYOUTS["Sandblaster 2+2 separate"] + " }"))
    shoal.train(job, workspace=tmp_path / "ws", log=lambda *a: None)
    ckpt = ckpt_io.load(ckpt_io.checkpoint_file(tmp_path / "ws", 4))
    assert set(ckpt.updater_state) == {"w1", "b1", "w2", "b2"}
    for step, path in ckpt_io.list_checkpoints(tmp_path / "ws"):
        if step > 4:
            path.unlink()
    job.write_text(text.replace("cluster { }", "cluster { " + RESUME_LAYOUTS[resume_on] + " }"))
    shoal.train(job, workspace=tmp_path / "ws", resume=True, log=lambda *a: None)
    resumed = ckpt_io.load(ckpt_io.checkpoint_file(tmp_path / "ws", 8)).params
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], rtol=1e-5, atol=1e-6)


UNUSED_LAYER = """layer { name: "unused" type: kInnerProduct srclayers: "relu" innerproduct_conf { num_output: 3 }
    param { name: "w_unused" init { type: kGaussian std: 0.1 } } param { name: "b_unused" init { type: kConstant value: 0.5 } } }
  layer { name: "loss" """


NO_GRADIENT_LAYOUTS = {
    "AllReduce 2 processes": "nworkers_per_group: 2 nservers_per_group: 2",
    "Sandblaster: the server knows only what the workers say": "nworkers_per_group: 2 server_worker_separate: true",
    "Downpour (asynchronous: only the unused params compare)": "nworker_groups: 2 server_worker_separate: true",
}


@pytest.mark.parametrize("layout", NO_GRADIENT_LAYOUTS)
def test_a_param_without_gradient_is_not_updated_on_any_layout(blobs_job, tmp_path, layout):
    """As SINGA's servers, which update on received gradients only: momentum and weight decay leave it alone."""
    cluster = NO_GRADIENT_LAYOUTS[layout]

    def job():
        path = blobs_job(train_steps=8, updater="type: kSGD momentum: 0.9 weight_decay: 0.01")
        path.write_text(path.read_text().replace('layer { name: "loss" ', UNUSED_LAYER, 1))  # a layer nothing reads
        return path

    single = final_params(job(), tmp_path / "single")
    group = final_params(job(), tmp_path / "group", cluster)
    assert single["b_unused"].tolist() == [0.5, 0.5, 0.5]
    for name in single if "Downpour" not in layout else ("w_unused", "b_unused"):
        torch.testing.assert_close(group[name], single[name], rtol=1e-5, atol=1e-6)
