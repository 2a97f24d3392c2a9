"""The single-worker loop: triggers, metrics, checkpoints, resume, test-only mode."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import shoal
from shoal.neuralnet import checkpoint as ckpt_io
from shoal.launcher.run_job import WorkspaceError
from shoal.config.phases import fires


@pytest.mark.parametrize(
    "freq, after, step, expected",
    [(0, 0, 0, False), (10, 0, 0, True), (10, 0, 10, True), (10, 0, 5, False), (10, 5, 5, True), (10, 5, 15, True), (10, 5, 10, False), (10, 5, 3, False)],
)
def test_trigger_rule_is_singas(freq, after, step, expected):
    assert fires(freq, after, step) is expected


def quiet(*_):
    pass


def test_training_learns_and_writes_metrics(blobs_job, tmp_path):
    job = blobs_job(train_steps=60)
    history = shoal.train(job, workspace=tmp_path / "ws", log=quiet)
    tests = history.phase("test")
    assert [r["step"] for r in tests] == [0, 10, 20, 30, 40, 50, 60]
    assert tests[-1]["accuracy"] > 0.9 > tests[0]["accuracy"]
    lines = [json.loads(l) for l in (tmp_path / "ws" / "metrics.jsonl").read_text().splitlines()]
    assert lines == history.records
    train = [r for r in lines if r["phase"] == "train"]
    assert [r["step"] for r in train] == list(range(0, 60, 5))
    for r in train:
        assert {"step", "phase", "time", "loss", "accuracy", "samples_per_sec"} <= set(r)
        assert r["samples_per_sec"] > 0
    assert [r["time"] for r in lines] == sorted(r["time"] for r in lines)


def test_display_lines_are_singa_style(blobs_job, tmp_path):
    lines = []
    shoal.train(blobs_job(train_steps=11), workspace=tmp_path / "ws", log=lines.append)
    train_lines = [l for l in lines if l.startswith("Train @ step")]
    assert train_lines[0].startswith("Train @ step 0  Loss = ")
    assert ", accuracy = " in train_lines[0]
    assert any(l.startswith("Test @ step 10  Loss = ") for l in lines)


def test_final_checkpoint_is_safetensors_with_params_and_updater_state(blobs_job, tmp_path):
    shoal.train(blobs_job(train_steps=12, extra="checkpoint_freq: 5"), workspace=tmp_path / "ws", log=quiet)
    steps = [s for s, _ in ckpt_io.list_checkpoints(tmp_path / "ws")]
    assert steps == [0, 5, 10, 12]
    tensors = load_file(str(ckpt_io.checkpoint_file(tmp_path / "ws", 12)))
    assert {"param/w1", "param/b1", "param/w2", "param/b2"} <= set(tensors)
    assert any(k.startswith("state/w1/") for k in tensors)  # momentum history
    assert not list((tmp_path / "ws" / "checkpoint").glob("*.tmp"))


@pytest.mark.parametrize("stop_at", [7, 10])
def test_resume_equals_uninterrupted_run_bit_for_bit(blobs_job, tmp_path, stop_at):
    """Stop at a checkpoint, resume, and land on exactly the params of one straight run (dropout, momentum, random_skip included)."""
    full = blobs_job(train_steps=20, dropout=True, extra="checkpoint_freq: 1")
    shoal.train(full, workspace=tmp_path / "straight", log=quiet)

    # the same job, killed right after the checkpoint at `stop_at` (simulated by a shorter run whose later checkpoints we drop)
    shoal.train(full, workspace=tmp_path / "resumed", log=quiet)
    for step, path in ckpt_io.list_checkpoints(tmp_path / "resumed"):
        if step > stop_at:
            path.unlink()
    history = shoal.train(full, workspace=tmp_path / "resumed", resume=True, log=quiet)
    assert history.records[0]["step"] >= stop_at

    a = ckpt_io.load(ckpt_io.checkpoint_file(tmp_path / "straight", 20))
    b = ckpt_io.load(ckpt_io.checkpoint_file(tmp_path / "resumed", 20))
    for name in a.params:
        assert torch.equal(a.params[name], b.params[name]), name
    for name in a.updater_state:
        for slot in a.updater_state[name]:
            assert torch.equal(a.updater_state[name][slot], b.updater_state[name][slot])
    straight = [r for r in history_records(tmp_path / "straight") if r["step"] > stop_at]
    resumed = [r for r in history.records if r["step"] > stop_at]
    clocks = ("time", "samples_per_sec", "window_sec", "compute_sec", "exchange_sec", "worker_compute_sec")
    strip = lambda rs: [{k: v for k, v in r.items() if k not in clocks} for r in rs]
    assert strip(resumed) == strip(straight)


def history_records(workspace):
    from shoal.report.metrics import read_metrics

    return read_metrics(workspace / "metrics.jsonl")


def test_workspace_with_checkpoints_is_never_overwritten(blobs_job, tmp_path):
    job = blobs_job(train_steps=3)
    shoal.train(job, workspace=tmp_path / "ws", log=quiet)
    before = ckpt_io.checkpoint_file(tmp_path / "ws", 3).read_bytes()
    with pytest.raises(WorkspaceError, match="--resume"):
        shoal.train(job, workspace=tmp_path / "ws", log=quiet)
    assert ckpt_io.checkpoint_file(tmp_path / "ws", 3).read_bytes() == before


def test_resume_without_checkpoint_is_an_error(blobs_job, tmp_path):
    with pytest.raises(WorkspaceError, match="no checkpoint"):
        shoal.train(blobs_job(), workspace=tmp_path / "empty", resume=True, log=quiet)


def test_test_only_mode_reproduces_the_final_test(blobs_job, tmp_path):
    job = blobs_job(train_steps=20)
    history = shoal.train(job, workspace=tmp_path / "ws", log=quiet)
    # the newest checkpoint is the final test's: a test-only run reads the samples that test read
    values = shoal.evaluate(job, workspace=tmp_path / "ws", log=quiet)
    assert set(values) == {"loss", "accuracy"}
    assert values == {k: history.final_test[k] for k in values}
    assert values["accuracy"] > 0.9
    values_again = shoal.evaluate(job, checkpoint=ckpt_io.checkpoint_file(tmp_path / "ws", 20), log=quiet)
    assert values_again == values


def test_checkpoint_path_initialises_params_by_name(blobs_job, tmp_path):
    job = blobs_job(train_steps=20)
    shoal.train(job, workspace=tmp_path / "a", log=quiet)
    trained = ckpt_io.load(ckpt_io.checkpoint_file(tmp_path / "a", 20)).params
    # SINGA's extension-less name works: .../step20-worker0
    job2 = blobs_job(train_steps=0, extra=f'checkpoint_path: "{tmp_path}/a/checkpoint/step20-worker0"')
    shoal.train(job2, workspace=tmp_path / "b", log=quiet)
    loaded = ckpt_io.load(ckpt_io.checkpoint_file(tmp_path / "b", 0)).params
    for name in trained:
        assert torch.equal(trained[name], loaded[name])


def test_train_a_job_given_as_a_python_dict(blobs_dir, tmp_path):
    from google.protobuf import json_format, text_format

    from conftest import mlp_job_text
    from shoal.config import job_pb2

    as_dict = json_format.MessageToDict(text_format.Parse(mlp_job_text(blobs_dir, train_steps=10), job_pb2.JobProto()), preserving_proto_field_name=True)
    history = shoal.train(as_dict, workspace=tmp_path / "ws", log=quiet)
    assert history.final_test["step"] == 10


def test_user_layer_registered_from_python(blobs_job, tmp_path):
    from shoal.neuralnet.layers import Layer, register_user_layer

    @register_user_layer("Square")
    class Square(Layer):
        def forward(self, xs, params, labels, ctx):
            return xs[0] * xs[0]

    job = blobs_job(train_steps=5)
    job.write_text(job.read_text().replace('type: kReLU', 'type: kUserLayer user_type: "Square"'))
    history = shoal.train(job, workspace=tmp_path / "ws", log=quiet)
    assert history.final_test is not None


def test_gpu_field_is_ignored_with_a_warning_without_cuda(blobs_job, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.warns(UserWarning, match="cuda:0 ignored"):
        shoal.train(blobs_job(train_steps=2, extra="gpu: 0"), workspace=tmp_path / "ws", log=quiet)


def test_num_openblas_threads_sets_the_torch_thread_count(blobs_job, tmp_path):
    before = torch.get_num_threads()
    try:
        shoal.train(blobs_job(train_steps=1, extra="num_openblas_threads: 1"), workspace=tmp_path / "ws", log=quiet)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_mean_and_std_files_equal_training_on_normalised_data(blobs_dir, tmp_path):
    """store_conf.mean_file/std_file (SINGA's per-feature statistics) normalise every batch."""
    from conftest import mlp_job_text, write_store
    from shoal.data.dataset import open_store
    from shoal.config import job_pb2

    def read(name):
        store = open_store(job_pb2.StoreProto(backend="kvfile", path=str(blobs_dir / name), shape=[16]))
        return store.rows(0, len(store))

    train, test = read("train.bin"), read("test.bin")
    mean, std = train[0].mean(0), train[0].std(0)
    write_store(tmp_path / "mean.bin", mean[None], np.zeros(1))
    write_store(tmp_path / "std.bin", std[None], np.zeros(1))
    write_store(tmp_path / "train.bin", (train[0] - mean) / std, train[1])
    write_store(tmp_path / "test.bin", (test[0] - mean) / std, test[1])

    stats = f'mean_file: "{tmp_path}/mean.bin" std_file: "{tmp_path}/std.bin" shape: 16'
    raw = tmp_path / "raw.conf"
    raw.write_text(mlp_job_text(blobs_dir, train_steps=10).replace("shape: 16", stats))
    normalised = tmp_path / "normalised.conf"
    normalised.write_text(mlp_job_text(tmp_path, train_steps=10))

    a = shoal.train(raw, workspace=tmp_path / "a", log=quiet)
    b = shoal.train(normalised, workspace=tmp_path / "b", log=quiet)
    assert a.final_test["loss"] == pytest.approx(b.final_test["loss"], rel=1e-4)
    assert a.final_test["loss"] < 1.0
