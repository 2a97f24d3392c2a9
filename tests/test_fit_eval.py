"""shoal.fit tests the module in eval mode (dropout off) under every layout, and trains it in train mode."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shoal
from test_fit import blobs

quiet = lambda *a: None


def dropout_model():
    torch.manual_seed(0)
    # heavy dropout on a narrow layer: a test in train mode scores far from the eval-mode score
    return nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Dropout(0.6), nn.Linear(24, 4))


LAYOUTS = {
    "single worker": shoal.Cluster(),
    "in-memory Sandblaster": shoal.Cluster(nworkers_per_group=2, nworkers_per_procs=2),
    "AllReduce 2 processes": shoal.Cluster(nworkers_per_group=2, nservers_per_group=2),
    "in-memory Hogwild": shoal.Cluster(nworker_groups=2, nworkers_per_procs=2),
    "Distributed Hogwild": pytest.param(shoal.Cluster(nworker_groups=2, nserver_groups=2), marks=pytest.mark.slow),
}


@pytest.mark.parametrize("cluster", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_fit_tests_the_module_in_eval_mode(tmp_path, cluster):
    """The reported test accuracy is the eval-mode accuracy of the trained weights, computed by hand."""
    model = dropout_model()
    model.train()
    x_test, y_test = blobs(500, seed=1)  # 5 test batches of 100: each test reads every sample once
    history = shoal.fit(model, F.cross_entropy, blobs(), test_data=(x_test, y_test), steps=40, test_freq=20,
                        batch_size=32, cluster=cluster, workspace=tmp_path / "ws", log=quiet,
                        updater={"type": "kSGD", "momentum": 0.9, "learning_rate": {"base_lr": 0.05}})
    assert model.training  # the caller's module keeps its mode
    with torch.no_grad():
        eval_accuracy = (model.eval()(x_test).argmax(1) == y_test).float().mean().item()
        model.train()
        torch.manual_seed(1)
        train_mode_accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    assert abs(eval_accuracy - train_mode_accuracy) > 0.02  # the check below can tell the modes apart
    assert history.final_test["accuracy"] == pytest.approx(eval_accuracy, abs=1e-6)


def test_fit_trains_in_train_mode_after_a_test(tmp_path):
    """A module handed over in eval mode still trains with dropout on (its loss differs from dropout off)."""
    def final_train_loss(p):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Dropout(p), nn.Linear(24, 4)).eval()
        history = shoal.fit(model, F.cross_entropy, blobs(), test_data=blobs(128, seed=1), steps=20, test_freq=10,
                            disp_freq=5, batch_size=32, workspace=tmp_path / f"p{p}", log=quiet)
        assert not model.training
        return [r["loss"] for r in history.records if r["phase"] == "train"]

    assert final_train_loss(0.6) != pytest.approx(final_train_loss(0.0), rel=1e-3)


@pytest.mark.parametrize("cluster", [shoal.Cluster(), shoal.Cluster(nworkers_per_group=2, nworkers_per_procs=2)],
                         ids=["single worker", "in-memory Sandblaster"])
def test_fit_tests_batch_norm_on_the_running_statistics_of_training(tmp_path, cluster):
    """Inputs far from mean 0 / variance 1: eval mode on a fresh copy's statistics would score about 0.5."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    (x, y), (tx, ty) = blobs(), blobs(500, seed=1)
    history = shoal.fit(model, F.cross_entropy, (x * 3 + 10, y), test_data=(tx * 3 + 10, ty), steps=60, test_freq=30,
                        batch_size=32, cluster=cluster, workspace=tmp_path / "ws", log=quiet)
    assert history.final_test["accuracy"] >= 0.95
