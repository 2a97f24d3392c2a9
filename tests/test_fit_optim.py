"""shoal.fit's torch optimizers wherever each framework updates: owner-sharded over processes (ZeRO-1's shape).

The model is test_fit_module's tiny GPT (1 layer, 32 wide, block 16) on its tiny corpus.
"""
from __future__ import annotations

import pytest
import torch

from layouts import LAYOUTS, assert_ran
from shoal.neuralnet.torch_optimizer import OptimizerError
from test_fit_module import adamw, fit, tiny_gpt, train_losses

ALLREDUCE = "AllReduce, 2 processes, 2 server slices"  # both processes own slices of params


def assert_close_params(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        # the key bias's gradient is 0 in exact arithmetic: Adam normalises its rounding noise into steps
        # (test_fit_module measured 7e-5 for a 2-share sum)
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-3 if name.endswith("attn.c_attn.bias") else 1e-6, msg=name)


def test_adamw_with_decay_groups_over_two_processes_equals_one_worker_and_resumes_exactly(tmp_path):
    single, h1 = fit(tmp_path, "single", steps=16, updater=None, optimizer=adamw)
    cluster = LAYOUTS[ALLREDUCE].fit_cluster()
    sharded, h2 = fit(tmp_path, "sharded", steps=16, updater=None, optimizer=adamw, cluster=cluster)
    assert_ran(tmp_path / "sharded", ALLREDUCE)
    assert train_losses(h2) == pytest.approx(train_losses(h1), rel=1e-5)  # every step
    assert_close_params(single, sharded)
    fit(tmp_path, "parts", steps=9, updater=None, optimizer=adamw, cluster=cluster, checkpoint_freq=9)
    resumed, h3 = fit(tmp_path, "parts", steps=16, updater=None, optimizer=adamw, cluster=cluster, resume=True)
    assert (tmp_path / "parts" / "checkpoint" / "step9-worker0.safetensors").exists()
    for (name, a), b in zip(sharded.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name  # the same layout: the sharded moments and steps restored bit for bit


class NormScaled(torch.optim.SGD):
    """SGD whose step reads a whole-tensor norm: a slice's update differs from the whole's."""


class DeclaredElementwise(torch.optim.SGD):
    shoal_elementwise = True


def declared_sgd(params):  # a module-level factory: spawned processes unpickle it by name
    return DeclaredElementwise(params, lr=0.1)


def test_an_optimizer_not_known_element_wise_is_refused_over_slices_unless_declared(tmp_path):
    cluster = LAYOUTS[ALLREDUCE].fit_cluster()
    with pytest.raises(OptimizerError, match="NormScaled is not known to be element-wise"):
        fit(tmp_path, "norms", steps=2, updater=None, optimizer=lambda p: NormScaled(p, lr=0.1), cluster=cluster)
    assert not (tmp_path / "norms").exists()
    fit(tmp_path, "whole", steps=2, updater=None, optimizer=lambda p: NormScaled(p, lr=0.1))  # one owner: whole params
    _, history = fit(tmp_path, "declared", steps=2, updater=None, optimizer=declared_sgd, cluster=cluster)
    assert len(train_losses(history)) == 2
