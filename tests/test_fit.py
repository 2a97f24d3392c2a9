"""shoal.fit: an existing torch.nn.Module trained under every framework without changing it."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shoal
from layouts import LAYOUTS, SYNCHRONOUS, assert_ran

quiet = lambda *a: None


def blobs(n=1024, seed=0):
    g = np.random.default_rng(seed)
    centers = np.random.default_rng(99).normal(0, 2, (4, 16)).astype(np.float32)
    y = g.integers(0, 4, n)
    return torch.tensor(centers[y] + g.normal(0, 1, (n, 16)).astype(np.float32)), torch.tensor(y)


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def fit(cluster, tmp_path, name, steps=30, **kw):
    model = make_model()
    history = shoal.fit(model, F.cross_entropy, blobs(), test_data=blobs(256, seed=1), steps=steps, test_freq=steps,
                        batch_size=32, cluster=cluster, workspace=tmp_path / name, log=quiet,
                        updater={"type": "kSGD", "momentum": 0.9, "learning_rate": {"base_lr": 0.05}}, **kw)
    return model, history


# every synchronous row of tests/layouts.py; the default suite fits on threads and on one multi-process layout
DEFAULT_SYNC = ("in-memory Sandblaster, 2 threads", "Sandblaster, 2 workers + 1 server, 3 processes")
SYNC = [name if name in DEFAULT_SYNC else pytest.param(name, marks=pytest.mark.slow) for name in SYNCHRONOUS]


@pytest.mark.parametrize("name", SYNC)
def test_synchronous_fit_equals_the_single_worker_fit(tmp_path, name):
    single, _ = fit(shoal.Cluster(), tmp_path, "single")
    model, history = fit(LAYOUTS[name].fit_cluster(), tmp_path, "sync")
    assert_ran(tmp_path / "sync", name)
    for (n, a), b in zip(single.named_parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=n)
    assert history.final_test["accuracy"] >= 0.9


ASYNC = ["in-memory Hogwild, 2 groups", "Downpour, 2 groups + 1 server, 3 processes", "Distributed Hogwild, 2 groups"]


@pytest.mark.parametrize("name", ASYNC)
def test_asynchronous_fit_trains_the_module(tmp_path, name):
    model, history = fit(LAYOUTS[name].fit_cluster(), tmp_path, "async", steps=60)  # async groups: a few more steps
    assert_ran(tmp_path / "async", name)
    assert history.final_test["accuracy"] >= 0.9
    x, y = blobs(256, seed=1)
    with torch.no_grad():  # the caller's module now holds the trained values
        assert (model(x).argmax(1) == y).float().mean() >= 0.9


def test_fit_writes_checkpoints_named_after_the_module_parameters(tmp_path):
    from shoal.neuralnet import checkpoint as ckpt_io

    model, _ = fit(shoal.Cluster(), tmp_path, "ws", steps=10)
    params = ckpt_io.load(ckpt_io.checkpoint_file(tmp_path / "ws", 10)).params
    assert sorted(params) == sorted(n for n, _ in model.named_parameters())
    for n, p in model.named_parameters():
        assert torch.equal(params[n], p.detach())


def test_fit_regresses_float_targets_of_any_shape(tmp_path):
    """Targets are no longer class labels only: an autoencoder's target is its input (16 floats per sample)."""
    x, _ = blobs(256)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 16))
    history = shoal.fit(model, F.mse_loss, (x, x), steps=60, disp_freq=10, batch_size=32, workspace=tmp_path / "ws", log=quiet,
                        updater={"type": "kSGD", "momentum": 0.9, "learning_rate": {"base_lr": 0.02}})
    losses = [r["loss"] for r in history.phase("train")]
    assert losses[-1] < 0.6 * losses[0]
    assert all("accuracy" not in r for r in history.phase("train"))  # no accuracy for regression targets
