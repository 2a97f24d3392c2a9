"""shoal.fit's one-worker step does what a plain PyTorch loop does and no more (issue 28's speed goal).

The module of a training layer holds the worker's param leaves: a step calls it directly, as a plain loop
calls its model, instead of reparametrising it through torch.func.functional_call every step; the leaves'
gradients are still shoal's (the result equals the plain loop bit for bit: test_fit_module.py). Test and
validation keep functional_call, with worker 0's buffers.
"""
from __future__ import annotations

import torch

import shoal
from test_fit_module import next_char_loss, quiet, tiny_gpt, windows


def test_training_calls_the_module_directly_and_validation_functionally(tmp_path, monkeypatch):
    calls = []
    functional_call = torch.func.functional_call
    monkeypatch.setattr(torch.func, "functional_call", lambda *a, **kw: calls.append(1) or functional_call(*a, **kw))
    data = windows()
    val = torch.utils.data.Subset(data, range(16))
    model = tiny_gpt()
    history = shoal.fit(model, next_char_loss, data, val_data=val, val_freq=4, val_batch=16, steps=8, batch_size=8,
                        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3), clip_grad_norm=1.0, disp_freq=4,
                        workspace=tmp_path / "ws", log=quiet)
    validations = history.phase("validate")
    assert [r["step"] for r in validations] == [0, 4, 8]  # 8: the trained model
    # the 8 training steps called the module itself: functional_call at most for the validations' batches (the job
    # path's module layer), never on fit's loop over the session, which calls the user's module for both
    assert len(calls) <= len(validations)
    assert [r["step"] for r in history.phase("train")][:2] == [0, 4]  # (the session also records the last window's)
    trained = dict(model.named_parameters())
    untrained = dict(tiny_gpt().named_parameters())
    assert all(not torch.equal(trained[n], untrained[n]) for n in trained)  # every param (tied head included) learned
