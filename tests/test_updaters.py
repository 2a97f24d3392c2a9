"""Every updater and schedule against values computed by hand (numpy, from SINGA's formulas)."""
from __future__ import annotations


import numpy as np
import pytest
import torch
from google.protobuf import text_format

from shoal.config import job_pb2
from shoal.updaters import learning_rate, make_updater, register_lr_schedule, register_updater, Updater

W0 = np.array([0.5, -1.0, 2.0, 0.0], dtype=np.float64)
GRADS = [np.array([0.1, -0.2, 3.0, -4.0]), np.array([-0.3, 0.5, 0.0, 1.0]), np.array([0.2, 0.2, -2.0, 0.5])]


def updater(text: str):
    return make_updater(text_format.Parse(text, job_pb2.UpdaterProto()))


def run(text: str, lr_scale=1.0, wd_scale=1.0, grad_scale=1.0):
    u = updater(text)
    w = torch.tensor(W0, dtype=torch.float64)
    state = u.init_state(w)
    for step, g in enumerate(GRADS):
        u.update(step, w, torch.tensor(g), state, lr_scale, wd_scale, grad_scale)
    return w.numpy()


def prepared(w, g, wd=0.0, grad_scale=1.0, clip=None):
    g = g * grad_scale
    if wd > 0:
        g = g + wd * w
    if clip:
        g = np.clip(g, *clip)
    return g


def test_sgd_plain_with_weight_decay_and_scales():
    w = W0.copy()
    for g in GRADS:
        g = prepared(w, g, wd=0.01 * 2, grad_scale=0.5)
        w = w - 0.1 * 3 * g
    got = run("type: kSGD weight_decay: 0.01 learning_rate { type: kFixed base_lr: 0.1 }", lr_scale=3, wd_scale=2, grad_scale=0.5)
    np.testing.assert_allclose(got, w, rtol=1e-6)


def test_sgd_momentum_and_clipping():
    w, h = W0.copy(), np.zeros(4)
    for g in GRADS:
        g = prepared(w, g, clip=(-1, 1))
        h = 0.9 * h - 0.1 * g
        w = w + h
    got = run("type: kSGD momentum: 0.9 clip_low: -1 clip_high: 1 learning_rate { type: kFixed base_lr: 0.1 }")
    np.testing.assert_allclose(got, w, rtol=1e-6)


def test_nesterov():
    w, h = W0.copy(), np.zeros(4)
    for g in GRADS:
        g = prepared(w, g, wd=0.1)
        h_new = 0.8 * h + 0.05 * g
        w = w - ((1 + 0.8) * h_new - 0.8 * h)
        h = h_new
    got = run("type: kNesterov momentum: 0.8 weight_decay: 0.1 learning_rate { type: kFixed base_lr: 0.05 }")
    np.testing.assert_allclose(got, w, rtol=1e-6)


def test_adagrad():
    w, h = W0.copy(), np.zeros(4)
    for g in GRADS:
        h = h + g * g
        w = w - 0.1 * g / np.sqrt(h + 1e-8)
    np.testing.assert_allclose(run("type: kAdaGrad learning_rate { type: kFixed base_lr: 0.1 }"), w, rtol=1e-6)


def test_rmsprop_clips():
    w, h = W0.copy(), np.zeros(4)
    for g in GRADS:
        g = prepared(w, g, clip=(-2, 2))
        h = 0.95 * h + 0.05 * g * g
        w = w - 0.01 * g / np.sqrt(h + 1e-6)
    got = run("type: kRMSProp delta: 1e-6 clip_low: -2 clip_high: 2 rmsprop_conf { rho: 0.95 } learning_rate { type: kFixed base_lr: 0.01 }")
    np.testing.assert_allclose(got, w, rtol=1e-6)


def test_adadelta_never_clips():
    w, h, u = W0.copy(), np.zeros(4), np.zeros(4)
    d = 1e-6
    for g in GRADS:
        h = 0.9 * h + 0.1 * g * g
        t = g * np.sqrt(u + d) / np.sqrt(h + d)
        u = 0.9 * u + 0.1 * t * t
        w = w - 1.0 * t
    got = run("type: kAdaDelta delta: 1e-6 clip_low: -0.1 clip_high: 0.1 learning_rate { type: kFixed base_lr: 1 }")
    np.testing.assert_allclose(got, w, rtol=1e-6)


def test_adam_has_no_bias_correction():
    w, m, v = W0.copy(), np.zeros(4), np.zeros(4)
    for g in GRADS:
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        w = w - 0.01 * m / np.sqrt(v + 1e-8)
    got = run("type: kAdam clip_low: -0.1 clip_high: 0.1 learning_rate { type: kFixed base_lr: 0.01 }")
    np.testing.assert_allclose(got, w, rtol=2e-5)  # beta2 is a float32 in the proto: 0.99900001


def test_adammax():
    w, m, u = W0.copy(), np.zeros(4), np.zeros(4)
    for g in GRADS:
        m = 0.8 * m + 0.2 * g
        u = np.maximum(0.99 * u, np.abs(g)) + 1e-8
        w = w - 0.002 * m / u
    got = run("type: kAdamMax adammax_conf { beta1: 0.8 beta2: 0.99 } learning_rate { type: kFixed base_lr: 0.002 }")
    np.testing.assert_allclose(got, w, rtol=1e-6)


def lr(text: str, step: int) -> float:
    return learning_rate(text_format.Parse(text, job_pb2.LRGenProto()), step)


@pytest.mark.parametrize(
    "text, step, expected",
    [
        ("type: kFixed base_lr: 0.3", 999, 0.3),
        ("type: kInverseT base_lr: 0.1 inverset_conf { final_lr: 50 }", 100, 0.1 / (1 + 100 / 50)),
        ("type: kInverse base_lr: 0.01 inverse_conf { gamma: 0.0001 pow: 0.75 }", 5000, 0.01 * (1 + 0.0001 * 5000) ** -0.75),
        ("type: kExponential base_lr: 0.4 exponential_conf { change_freq: 10 }", 15, 0.4 / 2 ** 1.5),
        ("type: kLinear base_lr: 0.1 linear_conf { change_freq: 10 final_lr: 0.01 }", 5, 0.5 * 0.1 + 0.5 * 0.01),
        ("type: kLinear base_lr: 0.1 linear_conf { change_freq: 10 final_lr: 0.01 }", 20, -1 * 0.1 + 2 * 0.01),  # no clamp
        ("type: kStep base_lr: 0.001 step_conf { change_freq: 60 gamma: 0.997 }", 59, 0.001),
        ("type: kStep base_lr: 0.001 step_conf { change_freq: 60 gamma: 0.997 }", 125, 0.001 * 0.997**2),  # stairs
        ("type: kFixedStep fixedstep_conf { step: 0 step: 60000 step: 65000 step_lr: 0.001 step_lr: 1e-4 step_lr: 1e-5 }", 59999, 0.001),
        ("type: kFixedStep fixedstep_conf { step: 0 step: 60000 step: 65000 step_lr: 0.001 step_lr: 1e-4 step_lr: 1e-5 }", 60000, 1e-4),
        ("type: kFixedStep fixedstep_conf { step: 0 step: 60000 step: 65000 step_lr: 0.001 step_lr: 1e-4 step_lr: 1e-5 }", 10**6, 1e-5),
    ],
)
def test_schedules(text, step, expected):
    assert lr(text, step) == pytest.approx(expected, rel=1e-6)


def test_updating_a_slice_equals_updating_a_whole_tensor():
    """A server owning value[2:5] (and the matching state slice) computes what the whole update computes there."""
    u = updater("type: kAdam weight_decay: 0.01 learning_rate { type: kFixed base_lr: 0.01 }")
    whole = torch.linspace(-1, 1, 8)
    sliced = whole.clone()
    whole_state, sliced_state = u.init_state(whole), u.init_state(sliced)
    for step in range(3):
        grad = torch.sin(torch.arange(8.0) + step)
        u.update(step, whole, grad, whole_state)
        view_state = {k: v[2:5] for k, v in sliced_state.items()}
        u.update(step, sliced[2:5], grad[2:5], view_state)
    torch.testing.assert_close(sliced[2:5], whole[2:5], rtol=0, atol=0)
    for slot in whole_state:
        torch.testing.assert_close(sliced_state[slot][2:5], whole_state[slot][2:5], rtol=0, atol=0)


def test_grad_is_never_modified():
    u = updater("type: kSGD momentum: 0.9 weight_decay: 0.1 clip_low: -0.1 clip_high: 0.1 learning_rate { type: kFixed base_lr: 0.1 }")
    w, g = torch.ones(3), torch.tensor([5.0, -5.0, 0.05])
    before = g.clone()
    u.update(0, w, g, u.init_state(w), grad_scale=2.0)
    assert torch.equal(g, before)


@pytest.mark.parametrize(
    "text, field",
    [
        ("type: kSGD learning_rate { type: kStep step_conf { change_freq: 0 } }", "step_conf.change_freq"),
        ("type: kSGD learning_rate { type: kFixedStep fixedstep_conf { step: 0 step_lr: 0.1 step_lr: 0.2 } }", "fixedstep_conf"),
        ("type: kRMSProp rmsprop_conf { rho: 1.5 } learning_rate { type: kFixed }", "rmsprop_conf.rho"),
        ('type: kUserUpdater user_type: "nope" learning_rate { type: kFixed }', "user_type"),
    ],
)
def test_bad_configurations_name_the_field(text, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        updater(text)


def test_user_updater_and_schedule():
    @register_lr_schedule("halving")
    def halving(conf, step):
        return conf.base_lr / 2**step

    @register_updater("signsgd")
    class SignSGD(Updater):
        def apply(self, value, g, state, lr):
            value.sub_(lr * g.sign())

    u = updater('type: kUserUpdater user_type: "signsgd" learning_rate { type: kUserChange user_type: "halving" base_lr: 1 }')
    w = torch.zeros(2)
    u.update(1, w, torch.tensor([3.0, -3.0]), {})
    assert w.tolist() == [-0.5, 0.5]
