"""shoal.fit's module path under the features each framework brings: a torch optimizer under Distributed Hogwild,
clipping by the global norm with compression over processes, rejoin, bounded lag and torchrun.

The model is test_fit_module's tiny GPT (1 layer, 32 wide, block 16) on its tiny corpus.
"""
from __future__ import annotations

import pytest
import torch

from layouts import LAYOUTS, assert_ran
from shoal.config import job_pb2
from shoal.neuralnet import checkpoint
from test_fit_module import adamw, fit, tiny_gpt, train_losses, windows
from test_fit_optim import plain_sgd, untrained_loss

HOGWILD = "Distributed Hogwild, 2 groups"
ALLREDUCE = "AllReduce, 2 processes, 2 server slices"  # both processes own slices of params


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_distributed_hogwild_groups_train_with_adamw(tmp_path):
    """Each group's server runs AdamW over its whole replica; the chief's checkpoint holds group 0's moments and count."""
    data = windows()
    _, history = fit(tmp_path, "hogwild", steps=16, updater=None, optimizer=adamw, test_data=data,
                     cluster=LAYOUTS[HOGWILD].fit_cluster())
    assert_ran(tmp_path / "hogwild", HOGWILD)
    assert history.final_test["loss"] < 0.85 * untrained_loss(data)
    for name, slots in checkpoint.load(checkpoint.checkpoint_file(tmp_path / "hogwild", 16)).updater_state.items():
        assert set(slots) == {"step", "exp_avg", "exp_avg_sq"} and float(slots["step"]) == 16, name


@pytest.mark.slow  # two runs over processes: the default suite's 5-minute budget
def test_distributed_hogwild_with_adamw_resumes_with_its_state(tmp_path):
    data = windows()
    run = dict(updater=None, optimizer=adamw, cluster=LAYOUTS[HOGWILD].fit_cluster(), test_data=data)
    fit(tmp_path, "hogwild", steps=12, checkpoint_freq=12, **run)
    _, history = fit(tmp_path, "hogwild", steps=24, resume=True, **run)
    assert_ran(tmp_path / "hogwild", HOGWILD)
    assert [r["step"] for r in history.phase("train")] == list(range(24))  # the run's metrics: steps 12.. once, after 0..11
    assert history.final_test["loss"] < 0.8 * untrained_loss(data)
    saved = checkpoint.load(checkpoint.checkpoint_file(tmp_path / "hogwild", 12)).updater_state
    final = checkpoint.load(checkpoint.checkpoint_file(tmp_path / "hogwild", 24)).updater_state
    for name, slots in final.items():
        assert set(slots) == {"step", "exp_avg", "exp_avg_sq"}, name
        assert float(saved[name]["step"]) == 12 and float(slots["step"]) == 24, name  # the resume went on from 12
        assert slots["exp_avg_sq"].abs().sum() > 0, name


@pytest.mark.slow  # two more runs over processes: the default suite's 5-minute budget
def test_a_distributed_hogwild_group_clips_its_own_update(tmp_path):
    """Plain SGD moves a replica by lr·‖clipped g‖ ≤ 0.1 · 0.01 per update (plus what syncs bring from the other)."""
    before = flat(tiny_gpt())
    run = dict(steps=10, updater=None, optimizer=plain_sgd, cluster=LAYOUTS[HOGWILD].fit_cluster())
    clipped, _ = fit(tmp_path, "clipped", clip_grad_norm=0.01, **run)
    free, _ = fit(tmp_path, "free", **run)
    assert_ran(tmp_path / "clipped", HOGWILD)
    assert float((flat(clipped) - before).norm()) <= 2 * 10 * 0.1 * 0.01 * (1 + 1e-4)  # both groups' 10 updates
    assert float((flat(free) - before).norm()) > 20 * 10 * 0.1 * 0.01


def compressed(kind, **extra):
    cluster = LAYOUTS[ALLREDUCE].fit_cluster(**extra)
    cluster.compression = kind
    return cluster


def test_clipping_over_a_compressed_allreduce_bounds_every_applied_update(tmp_path):
    """bf16 sums: each owner scales its dense sums by the global norm's scale before encoding them, so every process
    applies one clipped step: plain SGD moves the params by at most lr · 0.01 per step (bf16 rounds by 2^-8)."""
    before = flat(tiny_gpt())
    clipped, history = fit(tmp_path, "bf16", steps=10, updater=None, optimizer=plain_sgd, clip_grad_norm=0.01,
                           cluster=compressed(job_pb2.kBF16))
    assert_ran(tmp_path / "bf16", ALLREDUCE)
    moved = float((flat(clipped) - before).norm())
    assert 0 < moved <= 10 * 0.1 * 0.01 * (1 + 2 ** -7)  # unclipped, ‖g‖ is about 1: a hundred times more


@pytest.mark.slow  # two more runs over processes: the default suite's 5-minute budget
def test_clipping_keeps_a_top_k_allreduce_at_a_huge_learning_rate_finite(tmp_path):
    """Top-k 10 % with error feedback at lr 50: clipped to norm 1 it stays finite and learns; unclipped it blows up."""
    def huge_sgd(params):
        return torch.optim.SGD(params, lr=50.0)

    data = windows()
    run = dict(steps=20, updater=None, optimizer=huge_sgd, test_data=data, cluster=compressed(job_pb2.kTopK, topk_fraction=0.1))
    clipped, history = fit(tmp_path, "clipped", clip_grad_norm=0.02, **run)
    assert_ran(tmp_path / "clipped", ALLREDUCE)
    assert torch.isfinite(flat(clipped)).all() and history.final_test["loss"] < untrained_loss(data)
    free, unclipped = fit(tmp_path, "free", **run)
    assert unclipped.final_test["loss"] > history.final_test["loss"]
