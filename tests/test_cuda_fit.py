"""shoal.fit with the module on a GPU (device=, or a model already moved there), under one worker, a synchronous
group and an asynchronous one; each test skips without CUDA. The CPU run is the reference: a synchronous layout
on the GPU equals it (to float tolerance: GPU kernels sum in another order), and the caller's module ends on the
device it was given on, holding the trained values."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shoal
from layouts import LAYOUTS, assert_ran, summary
from test_fit import blobs, make_model, quiet

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

STEPS = 20


def adamw(params):  # a module-level factory: a layout of several processes pickles it to each of them
    return torch.optim.AdamW(params, lr=0.01)


SGD = {"type": "kSGD", "momentum": 0.9, "learning_rate": {"base_lr": 0.05}}


def fitted(tmp_path, name, layout=None, device=None, move=False, make=make_model, updater=SGD, **kw):
    model = make()
    if move:
        model = model.to("cuda:0")
    cluster = LAYOUTS[layout].fit_cluster() if layout else shoal.Cluster()
    history = shoal.fit(model, F.cross_entropy, blobs(), test_data=blobs(256, seed=1), steps=STEPS, batch_size=32,
                        cluster=cluster, workspace=tmp_path / name, log=quiet, device=device,
                        updater=updater, **kw)
    if layout:
        assert_ran(tmp_path / name, layout)
    return model, history


@pytest.mark.parametrize("layout", [None, "in-memory Sandblaster, 2 threads", "AllReduce, 2 processes"])
def test_fit_on_a_gpu_equals_fit_on_the_cpu(tmp_path, layout):
    cpu, _ = fitted(tmp_path, "cpu", layout)
    gpu, history = fitted(tmp_path, "gpu", layout, device="cuda:0")
    for (name, a), b in zip(cpu.named_parameters(), gpu.parameters()):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-4, atol=1e-5, msg=name)
    assert history.final_test["accuracy"] >= 0.9


def test_a_model_moved_to_the_gpu_trains_there_and_stays_there(tmp_path):
    model, history = fitted(tmp_path, "moved", move=True)
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    assert summary(tmp_path / "moved")["devices"] == ["cuda:0"], "the workers ran where the model was"
    assert history.final_test["accuracy"] >= 0.9


@pytest.mark.parametrize("layout", ["Downpour, 2 groups + 1 server, 3 processes", "Distributed Hogwild, 2 groups"])
def test_asynchronous_fit_on_a_gpu_learns(tmp_path, layout):
    _, history = fitted(tmp_path, "async", layout, device="cuda:0", updater=None, optimizer=adamw)
    assert history.final_test["accuracy"] >= 0.9


def test_bf16_autocast_and_adamw_with_clipping_on_a_gpu(tmp_path):
    _, history = fitted(tmp_path, "bf16", "AllReduce, 2 processes", device="cuda:0", autocast="bf16", clip_grad_norm=1.0,
                        updater=None, optimizer=adamw)
    assert history.final_test["accuracy"] >= 0.9


def batch_normed():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def test_a_module_with_buffers_given_on_the_cpu_trains_on_the_gpu(tmp_path):
    """Batch-norm statistics are buffers, not params: they must reach the worker's device with the module."""
    cpu, _ = fitted(tmp_path, "cpu", make=batch_normed)
    gpu, history = fitted(tmp_path, "gpu", make=batch_normed, device="cuda:0")
    assert summary(tmp_path / "gpu")["devices"] == ["cuda:0"]
    for (name, a), b in zip(cpu.state_dict().items(), gpu.state_dict().values()):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-4, atol=1e-4, msg=name)


def test_a_cpu_gpu_split_with_measured_shares_runs_on_the_session_and_equals_the_cpu(tmp_path, monkeypatch):
    """Caffe con Troll's split on the session: worker 0 on the GPU, worker 1 on the CPU, the group's batch re-split by
    their measured speeds (cluster.auto_batch_shares). fit runs its loop on the session, each worker on its device, and
    ends where the CPU run does (to float tolerance: the replicas on the CPU take the GPU's values after each step); the
    module ends on the CPU, where it was given."""
    from shoal.frontend import fit_loop

    calls = []
    monkeypatch.setattr(fit_loop, "fit_on_session", lambda *a, _on=fit_loop.fit_on_session, **k: calls.append(1) or _on(*a, **k))
    cpu, _ = fitted(tmp_path, "cpu", "in-memory Sandblaster, 2 threads")
    split = make_model()
    cluster = LAYOUTS["in-memory Sandblaster, 2 threads"].fit_cluster(auto_batch_shares=True, auto_batch_freq=2)
    history = shoal.fit(split, F.cross_entropy, blobs(), test_data=blobs(256, seed=1), steps=STEPS, batch_size=32,
                        cluster=cluster, workspace=tmp_path / "split", log=quiet, device=["cuda:0", "cpu"], updater=SGD)
    assert calls == [1, 1]
    assert assert_ran(tmp_path / "split", "in-memory Sandblaster, 2 threads")["devices"] == ["cuda:0", "cpu"]
    assert {p.device.type for p in split.parameters()} == {"cpu"}
    assert all(sum(r["batch_shares"]) == 32 and min(r["batch_shares"]) >= 1 for r in history.phase("train"))
    for (name, a), b in zip(cpu.named_parameters(), split.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=name)
    assert history.final_test["accuracy"] >= 0.9
