"""shoal.fit for a language model: gradient accumulation, bf16 autocast, metric callables, time to any target.

The model is the tiny GPT of tests/test_fit_module.py (1 layer, 32 wide, block 16) on its tiny corpus.
"""
from __future__ import annotations

import pytest
import torch

from layouts import LAYOUTS, assert_ran
from shoal.frontend.module_path import FitError
from shoal.runtime.worker import micro_batch_rows
from test_fit_module import assert_same_params, fit, train_losses

ADAM = {"type": "kAdam", "learning_rate": {"base_lr": 0.01}}


def test_micro_batches_tile_the_share():
    assert micro_batch_rows(3, 8, 2) == [(3, 4), (7, 4)]
    assert micro_batch_rows(0, 7, 3) == [(0, 3), (3, 2), (5, 2)]
    assert micro_batch_rows(0, 2, 4) == [(0, 1), (1, 1)]  # never an empty micro-batch


@pytest.mark.parametrize("name", ["one worker", "in-memory Sandblaster, 2 threads"])
def test_accumulated_micro_batches_train_as_one_pass_on_the_whole_batch(tmp_path, name):
    cluster = None if name == "one worker" else LAYOUTS[name].fit_cluster()
    whole, h1 = fit(tmp_path, "whole", steps=10)
    accumulated, h2 = fit(tmp_path, "accum", steps=10, grad_accum_steps=2, cluster=cluster)
    if cluster is not None:
        assert_ran(tmp_path / "accum", name)
    assert train_losses(h2) == pytest.approx(train_losses(h1), rel=1e-5)
    assert_same_params(whole, accumulated)
    uneven, h3 = fit(tmp_path, "uneven", steps=10, grad_accum_steps=3)  # 8 rows as 3 + 3 + 2
    assert_same_params(whole, uneven)


def test_grad_accum_steps_is_checked_in_one_line(tmp_path):
    with pytest.raises(FitError, match="grad_accum_steps must be a whole number from 1 to batch_size \\(8\\), got 9"):
        fit(tmp_path, "bad", grad_accum_steps=9)
    assert not (tmp_path / "bad").exists()


def test_bf16_autocast_trains_the_gpt_on_fp32_params_and_gradients(tmp_path):
    seen = {"logits": set(), "grads": set()}

    def observed_loss(model, batch):  # a single-process run: a closure is fine here
        logits = model(batch["x"])
        seen["logits"].add(logits.dtype)
        if torch.is_grad_enabled():
            model.lm_head.weight.register_hook(lambda g: seen["grads"].add(g.dtype))  # the gradient its leaf receives
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["y"].flatten())

    fp32, h32 = fit(tmp_path, "fp32", steps=30, loss=observed_loss, updater=ADAM)
    assert seen == {"logits": {torch.float32}, "grads": {torch.float32}}
    seen["logits"].clear()
    bf16, h16 = fit(tmp_path, "bf16", steps=30, loss=observed_loss, autocast="bf16", updater=ADAM)
    assert seen == {"logits": {torch.bfloat16}, "grads": {torch.float32}}  # computed in bf16, the exchange sees fp32
    assert all(p.dtype == torch.float32 for p in bf16.parameters())
    l16, l32 = train_losses(h16), train_losses(h32)
    assert sum(l16[-5:]) < 0.8 * sum(l16[:5])  # it trains
    assert l16 != l32 and l16[0] == pytest.approx(l32[0], rel=1e-3)  # bf16 rounding, on the same first batch
    assert sum(l16[-5:]) == pytest.approx(sum(l32[-5:]), rel=0.1)  # the runs drift apart step by step, yet end close
    with pytest.raises(FitError, match="autocast must be 'bf16'"):
        fit(tmp_path, "fp16", autocast="fp16")
