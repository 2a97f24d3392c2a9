"""Updaters and learning-rate schedules against values computed by hand from SINGA 0.3's formulas.

Two kinds of expected values: a few updates worked out on paper (literal numbers),
and numpy re-statements of each SINGA formula run for three steps with every
option (weight decay, grad_scale, lr_scale, wd_scale, clipping) switched on.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from google.protobuf import text_format

from shoal.neuralnet import updaters as updaters_module
from shoal.config import job_pb2
from shoal.neuralnet.updaters import (
    ParamUpdate,
    Updater,
    learning_rate,
    make_updater,
    register_lr_schedule,
    register_updater,
)


def f32(x: float) -> float:
    """A proto `float` field as Python reads it back: rounded to float32."""
    return float(np.float32(x))


def updater_conf(text: str) -> job_pb2.UpdaterProto:
    return text_format.Parse(text, job_pb2.UpdaterProto())


def build(text: str) -> Updater:
    return make_updater(updater_conf(text))


def lr_at(text: str, step: int) -> float:
    return learning_rate(text_format.Parse(text, job_pb2.LRGenProto()), step)


# -- literal, worked-by-hand updates ----------------------------------------------
def test_sgd_momentum_by_hand():
    # m = 0.5, lr = 0.1, w = 1, g = 1 twice:
    #   h = 0.5·0 − 0.1·1 = −0.1;     w = 1 − 0.1 = 0.9
    #   h = 0.5·(−0.1) − 0.1 = −0.15; w = 0.9 − 0.15 = 0.75
    u = build("type: kSGD momentum: 0.5 learning_rate { type: kFixed base_lr: 0.1 }")
    w = torch.tensor([1.0], dtype=torch.float64)
    state = u.init_state(w)
    u.update(0, w, torch.ones(1, dtype=torch.float64), state)
    assert w.item() == pytest.approx(0.9) and state["history"].item() == pytest.approx(-0.1)
    u.update(1, w, torch.ones(1, dtype=torch.float64), state)
    assert w.item() == pytest.approx(0.75) and state["history"].item() == pytest.approx(-0.15)


def test_nesterov_by_hand():
    # m = 0.5, lr = 0.1, w = 1, g = 1 twice:
    #   h' = 0 + 0.1 = 0.1;         w = 1 − (1.5·0.1 − 0.5·0) = 0.85
    #   h' = 0.05 + 0.1 = 0.15;     w = 0.85 − (1.5·0.15 − 0.5·0.1) = 0.675
    u = build("type: kNesterov momentum: 0.5 learning_rate { type: kFixed base_lr: 0.1 }")
    w = torch.tensor([1.0], dtype=torch.float64)
    state = u.init_state(w)
    u.update(0, w, torch.ones(1, dtype=torch.float64), state)
    assert w.item() == pytest.approx(0.85)
    u.update(1, w, torch.ones(1, dtype=torch.float64), state)
    assert w.item() == pytest.approx(0.675) and state["history"].item() == pytest.approx(0.15)


def test_clipping_bounds_the_raw_gradient_before_grad_scale_and_weight_decay():
    # SINGA clips param->grad first: g = clip(3, −1, 1) = 1; g·0.5 = 0.5; + 0.1·2 = 0.7; w = 2 − 0.7.
    # (Clipping last would give g = clip(1.5 + 0.2) = 1 and w = 1.)
    u = build("type: kSGD weight_decay: 0.1 clip_low: -1 clip_high: 1 learning_rate { type: kFixed base_lr: 1 }")
    w = torch.tensor([2.0], dtype=torch.float64)
    u.update(0, w, torch.tensor([3.0], dtype=torch.float64), {}, grad_scale=0.5)
    assert w.item() == pytest.approx(1.3)


@pytest.mark.parametrize("bounds", ["", "clip_low: 1 clip_high: 1", "clip_low: 1 clip_high: -1"])
def test_no_clipping_unless_clip_high_exceeds_clip_low(bounds):
    u = build(f"type: kSGD {bounds} learning_rate {{ type: kFixed base_lr: 1 }}")
    w = torch.zeros(1, dtype=torch.float64)
    u.update(0, w, torch.tensor([5.0], dtype=torch.float64), {})
    assert w.item() == -5.0


def test_adam_first_step_has_no_bias_correction():
    # m = 0.1·g, v = 0.001·g², so the step is lr·0.1/√0.001 ≈ 3.162·lr, not lr as bias-corrected Adam would take.
    u = build("type: kAdam learning_rate { type: kFixed base_lr: 0.01 }")
    w = torch.zeros(1, dtype=torch.float64)
    u.update(0, w, torch.tensor([2.0], dtype=torch.float64), u.init_state(w))
    assert w.item() == pytest.approx(-0.01 * 0.1 / np.sqrt(0.001), rel=1e-5)


def test_adammax_by_hand():
    # β1 = β2 = 0.5, lr = 1, g = 2 then 0:
    #   m = 1,   u = max(0, 2) + δ = 2;   w = −1/2 = −0.5
    #   m = 0.5, u = max(1, 0) + δ = 1;   w = −0.5 − 0.5 = −1
    u = build("type: kAdamMax adammax_conf { beta1: 0.5 beta2: 0.5 } learning_rate { type: kFixed base_lr: 1 }")
    w = torch.zeros(1, dtype=torch.float64)
    state = u.init_state(w)
    u.update(0, w, torch.tensor([2.0], dtype=torch.float64), state)
    assert w.item() == pytest.approx(-0.5)
    u.update(1, w, torch.tensor([0.0], dtype=torch.float64), state)
    assert w.item() == pytest.approx(-1.0) and state["norm"].item() == pytest.approx(1.0)


@pytest.mark.parametrize("weight_decay, wd_scale", [(-0.5, 1.0), (0.5, 0.0)])
def test_non_positive_weight_decay_is_ignored_as_in_singa(weight_decay, wd_scale):
    u = build(f"type: kSGD weight_decay: {weight_decay} learning_rate {{ type: kFixed base_lr: 1 }}")
    w = torch.tensor([2.0], dtype=torch.float64)
    u.update(0, w, torch.zeros(1, dtype=torch.float64), {}, wd_scale=wd_scale)
    assert w.item() == 2.0


# -- numpy re-statements of SINGA's formulas, three steps with every option ---------
W0 = np.array([0.5, -1.0, 2.0, 0.0, 1.5])
GRADS = [
    np.array([0.1, -0.2, 3.0, -4.0, 0.0]),
    np.array([-0.3, 0.5, 0.0, 1.0, 0.0]),
    np.array([0.2, 0.2, -2.0, 0.5, 0.0]),
]  # the last element never sees a gradient: only decay moves it


def prepared(w, grad, wd, grad_scale, clip):
    """SINGA's order: clip the raw gradient, scale it, then add weight decay."""
    g = np.clip(grad, *clip) if clip else grad
    g = g * grad_scale
    return g + wd * w if wd > 0 else g


def reference_sgd(w, g, s, lr, p):
    if p["momentum"] > 0:
        s["history"] = p["momentum"] * s["history"] - lr * g
        return w + s["history"]
    return w - lr * g


def reference_nesterov(w, g, s, lr, p):
    m, old = p["momentum"], s["history"]
    s["history"] = m * old + lr * g
    return w - ((1 + m) * s["history"] - m * old)


def reference_adagrad(w, g, s, lr, p):
    s["history"] = s["history"] + g * g
    return w - lr * g / np.sqrt(s["history"] + p["delta"])


def reference_rmsprop(w, g, s, lr, p):
    s["history"] = p["rho"] * s["history"] + (1 - p["rho"]) * g * g
    return w - lr * g / np.sqrt(s["history"] + p["delta"])


def reference_adadelta(w, g, s, lr, p):
    rho, d = p["rho"], p["delta"]
    s["history"] = rho * s["history"] + (1 - rho) * g * g
    t = g * np.sqrt(s["update"] + d) / np.sqrt(s["history"] + d)
    s["update"] = rho * s["update"] + (1 - rho) * t * t
    return w - lr * t


def reference_adam(w, g, s, lr, p):
    s["mean"] = p["beta1"] * s["mean"] + (1 - p["beta1"]) * g
    s["variance"] = p["beta2"] * s["variance"] + (1 - p["beta2"]) * g * g
    return w - lr * s["mean"] / np.sqrt(s["variance"] + p["delta"])


def reference_adammax(w, g, s, lr, p):
    s["mean"] = p["beta1"] * s["mean"] + (1 - p["beta1"]) * g
    s["norm"] = np.maximum(p["beta2"] * s["norm"], np.abs(g)) + p["delta"]
    return w - lr * s["mean"] / s["norm"]


# type, extra conf text, hyperparameters as the proto stores them, reference, whether SINGA clips
UPDATERS = {
    "sgd": ("kSGD", "", {"momentum": 0.0}, reference_sgd, True),
    "sgd_momentum": ("kSGD", "momentum: 0.9", {"momentum": f32(0.9)}, reference_sgd, True),
    "nesterov": ("kNesterov", "momentum: 0.8", {"momentum": f32(0.8)}, reference_nesterov, True),
    "adagrad": ("kAdaGrad", "delta: 1e-6", {"delta": f32(1e-6)}, reference_adagrad, True),
    "rmsprop": ("kRMSProp", "rmsprop_conf { rho: 0.95 }", {"rho": f32(0.95), "delta": f32(1e-8)}, reference_rmsprop, True),
    "adadelta": ("kAdaDelta", "delta: 1e-6 adadelta_conf { rho: 0.9 }", {"rho": f32(0.9), "delta": f32(1e-6)}, reference_adadelta, False),
    "adam": ("kAdam", "adam_conf { beta1: 0.8 beta2: 0.99 }", {"beta1": f32(0.8), "beta2": f32(0.99), "delta": f32(1e-8)}, reference_adam, False),
    "adammax": ("kAdamMax", "adammax_conf { beta1: 0.8 beta2: 0.99 }", {"beta1": f32(0.8), "beta2": f32(0.99), "delta": f32(1e-8)}, reference_adammax, False),
}
SLOTS = {
    "sgd": set(),
    "sgd_momentum": {"history"},
    "nesterov": {"history"},
    "adagrad": {"history"},
    "rmsprop": {"history"},
    "adadelta": {"history", "update"},
    "adam": {"mean", "variance"},
    "adammax": {"mean", "norm"},
}
# Options: (conf text, weight_decay, clip, lr_scale, wd_scale, grad_scale). The schedule is kStep,
# so the learning rate changes between steps 1 and 2 as well.
OPTIONS = {
    "plain": ("", 0.0, None, 1.0, 1.0, 1.0),
    "decay_and_scales": ("weight_decay: 0.05", f32(0.05), None, 3.0, 2.0, 0.5),
    "clip": ("clip_low: -1 clip_high: 1.5", 0.0, (-1.0, 1.5), 1.0, 1.0, 1.0),
    "everything": ("weight_decay: 0.05 clip_low: -1 clip_high: 1.5", f32(0.05), (-1.0, 1.5), 0.5, 4.0, 2.0),
}
SCHEDULE = "learning_rate { type: kStep base_lr: 0.1 step_conf { change_freq: 2 gamma: 0.5 } }"


def schedule_lr(step):
    return f32(0.1) * 0.5 ** (step // 2)


def conf_text(name: str, option: str) -> str:
    kind, extra, *_ = UPDATERS[name]
    return f"type: {kind} {extra} {OPTIONS[option][0]} {SCHEDULE}"


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("name", UPDATERS)
def test_three_steps_match_singa_formulas(name, option):
    _, _, params, reference, singa_clips = UPDATERS[name]
    _, wd, clip, lr_scale, wd_scale, grad_scale = OPTIONS[option]

    w, state = W0.copy(), {slot: np.zeros_like(W0) for slot in SLOTS[name]}
    for step, grad in enumerate(GRADS):
        g = prepared(w, grad, wd * wd_scale, grad_scale, clip if singa_clips else None)
        w = reference(w, g, state, schedule_lr(step) * lr_scale, params)

    u = build(conf_text(name, option))
    value = torch.tensor(W0)
    got_state = u.init_state(value)
    for step, grad in enumerate(GRADS):
        u.update(step, value, torch.tensor(grad), got_state, lr_scale, wd_scale, grad_scale)

    np.testing.assert_allclose(value.numpy(), w, rtol=1e-10, atol=1e-12)
    assert set(got_state) == SLOTS[name]
    for slot, expected in state.items():
        np.testing.assert_allclose(got_state[slot].numpy(), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", [n for n, spec in UPDATERS.items() if spec[4]])
def test_clipping_updaters_actually_clip(name):
    """The clip option must change the result where a gradient (3.0, −4.0) lies outside [−1, 1.5]."""
    assert not np.allclose(run_three_steps(name, "clip"), run_three_steps(name, "plain"))


@pytest.mark.parametrize("name", [n for n, spec in UPDATERS.items() if not spec[4]])
def test_adadelta_adam_adammax_ignore_clipping(name):
    np.testing.assert_array_equal(run_three_steps(name, "clip"), run_three_steps(name, "plain"))


def run_three_steps(name: str, option: str) -> np.ndarray:
    u = build(conf_text(name, option))
    value = torch.tensor(W0)
    state = u.init_state(value)
    for step, grad in enumerate(GRADS):
        u.update(step, value, torch.tensor(grad), state)
    return value.numpy()


# -- many params in one multi-tensor update ---------------------------------------------
SHAPES = [(3, 4), (4,), (2, 3, 2), (5,), (1,), (4, 3)]
LR_SCALES = [1.0, 2.0, 1.0, 0.5, 2.0, 1.0]  # three groups, each with params of several shapes
WD_SCALES = [1.0, 0.0, 1.0, 3.0, 0.0, 1.0]
NO_GRADIENT = {4, 5}  # e.g. running statistics, or params no loss reached this step


def random_param_states(name: str, gen: torch.Generator) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Random values, and random non-negative slots (so a wrong read or a stray write shows)."""
    values = [torch.randn(shape, generator=gen, dtype=torch.float64) for shape in SHAPES]
    states = [{slot: torch.rand(shape, generator=gen, dtype=torch.float64) for slot in SLOTS[name]} for shape in SHAPES]
    return values, states


@pytest.mark.parametrize("option", ["plain", "everything"])
@pytest.mark.parametrize("name", UPDATERS)
def test_update_many_equals_the_formula_on_each_param(name, option):
    """The multi-tensor path against the numpy formula applied param by param, with per-param
    lr_scale and wd_scale, params without gradient, and non-zero starting state, for three steps."""
    _, _, hyper, reference, singa_clips = UPDATERS[name]
    _, wd, clip, _, _, grad_scale = OPTIONS[option]
    gen = torch.Generator().manual_seed(7)
    values, states = random_param_states(name, gen)
    expected_values = [v.numpy().copy() for v in values]
    expected_states = [{k: t.numpy().copy() for k, t in s.items()} for s in states]
    u = build(conf_text(name, option))

    for step in range(3):
        grads = [None if i in NO_GRADIENT else torch.randn(shape, generator=gen, dtype=torch.float64) * 2 for i, shape in enumerate(SHAPES)]
        for i, grad in enumerate(grads):
            if grad is not None:
                g = prepared(expected_values[i], grad.numpy(), wd * WD_SCALES[i], grad_scale, clip if singa_clips else None)
                expected_values[i] = reference(expected_values[i], g, expected_states[i], schedule_lr(step) * LR_SCALES[i], hyper)
        params = [ParamUpdate(*p) for p in zip(values, grads, states, LR_SCALES, WD_SCALES)]
        u.update_many(step, params, grad_scale)

    for i in range(len(SHAPES)):
        np.testing.assert_allclose(values[i].numpy(), expected_values[i], rtol=1e-10, atol=1e-12, err_msg=f"param {i}")
        for slot, expected in expected_states[i].items():
            np.testing.assert_allclose(states[i][slot].numpy(), expected, rtol=1e-10, atol=1e-12, err_msg=f"param {i} {slot}")
    untouched_gen = torch.Generator().manual_seed(7)
    initial_values, initial_states = random_param_states(name, untouched_gen)
    for i in NO_GRADIENT:  # neither the value nor the slots moved
        assert torch.equal(values[i], initial_values[i])
        assert all(torch.equal(states[i][k], initial_states[i][k]) for k in states[i])


@pytest.mark.parametrize("name", UPDATERS)
def test_update_many_with_mixed_dtypes_equals_updating_each_alone(name):
    u = build(conf_text(name, "everything"))
    gen = torch.Generator().manual_seed(3)
    values = [torch.randn(4, 3, generator=gen, dtype=dtype) for dtype in (torch.float32, torch.float64, torch.float32)]
    grads = [torch.randn(4, 3, generator=gen, dtype=v.dtype) for v in values]
    alone = [v.clone() for v in values]
    states, alone_states = [u.init_state(v) for v in values], [u.init_state(v) for v in values]
    u.update_many(0, [ParamUpdate(v, g, s, 0.5, 2.0) for v, g, s in zip(values, grads, states)], 1.5)
    for v, g, s in zip(alone, grads, alone_states):
        u.update(0, v, g, s, 0.5, 2.0, 1.5)
    for got, want in zip(values, alone):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_update_many_rejects_a_gradient_of_another_shape():
    u = build("type: kSGD learning_rate { type: kFixed }")
    with pytest.raises(ValueError, match="shape"):
        u.update_many(0, [ParamUpdate(torch.zeros(2), torch.zeros(2), {}), ParamUpdate(torch.zeros(3), torch.zeros(1), {})])


# -- state, slices, and the caller's gradient -----------------------------------------
@pytest.mark.parametrize("name", UPDATERS)
def test_init_state_is_zeroed_slots_like_the_value(name):
    value = torch.ones(2, 3, dtype=torch.float64)
    state = build(conf_text(name, "plain")).init_state(value)
    assert set(state) == SLOTS[name]
    for slot in state.values():
        assert slot.shape == value.shape and slot.dtype == value.dtype and slot.device == value.device
        assert not slot.any()
        assert slot.data_ptr() != value.data_ptr()


@pytest.mark.parametrize("name", UPDATERS)
def test_updating_views_equals_updating_separate_tensors(name):
    """A server owning part of a param (and the same part of its slots) computes what it would alone."""
    u = build(conf_text(name, "everything"))
    big = torch.linspace(-1, 1, 24, dtype=torch.float64).reshape(4, 6)
    big_state = {slot: torch.full_like(big, 0.25) for slot in u.init_state(big)}  # non-zero: slices must line up
    views = [(slice(1, 3), slice(2, 5)), (slice(None), 3)]  # a 2-D block, and a strided column

    for rows, cols in views:
        value, state = big.clone(), {k: v.clone() for k, v in big_state.items()}
        alone, alone_state = big[rows, cols].clone(), {k: v[rows, cols].clone() for k, v in big_state.items()}
        for step in range(3):
            grad = torch.sin(torch.arange(24.0, dtype=torch.float64) + step).reshape(4, 6) * 3
            view_state = {k: v[rows, cols] for k, v in state.items()}
            u.update(step, value[rows, cols], grad[rows, cols], view_state, 0.5, 2.0, 1.5)
            u.update(step, alone, grad[rows, cols].clone(), alone_state, 0.5, 2.0, 1.5)

        torch.testing.assert_close(value[rows, cols], alone, rtol=1e-12, atol=1e-15)
        outside = torch.ones_like(big, dtype=torch.bool)
        outside[rows, cols] = False
        assert torch.equal(value[outside], big[outside])
        for slot in state:
            torch.testing.assert_close(state[slot][rows, cols], alone_state[slot], rtol=1e-12, atol=1e-15)
            assert torch.equal(state[slot][outside], big_state[slot][outside])


@pytest.mark.parametrize("option", ["plain", "everything"])
@pytest.mark.parametrize("name", UPDATERS)
def test_the_callers_gradient_is_never_written(name, option):
    u = build(conf_text(name, option))
    value, grad = torch.tensor(W0), torch.tensor(GRADS[0])
    before = grad.clone()
    u.update(0, value, grad, u.init_state(value), 1.0, 2.0, 3.0)
    assert torch.equal(grad, before)


def test_gradient_of_another_shape_is_rejected():
    u = build("type: kSGD learning_rate { type: kFixed }")
    with pytest.raises(ValueError, match="shape"):
        u.update(0, torch.zeros(3), torch.zeros(1), {})


# -- learning-rate schedules ------------------------------------------------------
FIXED_STEP = "type: kFixedStep fixedstep_conf { step: 0 step: 60000 step: 65000 step_lr: 0.001 step_lr: 1e-4 step_lr: 1e-5 }"
LATE_FIXED_STEP = "type: kFixedStep base_lr: 7 fixedstep_conf { step: 100 step: 200 step_lr: 0.5 step_lr: 0.25 }"


@pytest.mark.parametrize(
    "text, step, expected",
    [
        ("type: kFixed base_lr: 0.3", 0, 0.3),
        ("type: kFixed base_lr: 0.3", 12345, 0.3),
        # base / (1 + step / final_lr)
        ("type: kInverseT base_lr: 0.1 inverset_conf { final_lr: 50 }", 0, 0.1),
        ("type: kInverseT base_lr: 0.1 inverset_conf { final_lr: 50 }", 100, 0.1 / 3),
        ("type: kInverseT base_lr: 0.1 inverset_conf { final_lr: 50 }", 25, 0.1 / 1.5),
        # base · (1 + γ·step)^−pow, mnist conv.conf's values
        ("type: kInverse base_lr: 0.01 inverse_conf { gamma: 0.0001 pow: 0.75 }", 0, 0.01),
        ("type: kInverse base_lr: 0.01 inverse_conf { gamma: 0.0001 pow: 0.75 }", 10000, 0.01 * 2**-0.75),
        ("type: kInverse base_lr: 0.5", 1000, 0.5),  # defaults γ = 1, pow = 0
        # base / 2^(step / change_freq), float division
        ("type: kExponential base_lr: 0.4 exponential_conf { change_freq: 10 }", 10, 0.2),
        ("type: kExponential base_lr: 0.4 exponential_conf { change_freq: 10 }", 15, 0.4 / 2**1.5),
        # (1 − r)·base + r·final, r = step / change_freq, not clamped
        ("type: kLinear base_lr: 0.1 linear_conf { change_freq: 10 final_lr: 0.01 }", 0, 0.1),
        ("type: kLinear base_lr: 0.1 linear_conf { change_freq: 10 final_lr: 0.01 }", 5, 0.055),
        ("type: kLinear base_lr: 0.1 linear_conf { change_freq: 10 final_lr: 0.01 }", 10, 0.01),
        ("type: kLinear base_lr: 0.1 linear_conf { change_freq: 10 final_lr: 0.01 }", 20, -0.08),
        # base · γ^(step // change_freq): stairs
        ("type: kStep base_lr: 0.001 step_conf { change_freq: 60 gamma: 0.5 }", 59, 0.001),
        ("type: kStep base_lr: 0.001 step_conf { change_freq: 60 gamma: 0.5 }", 60, 0.0005),
        ("type: kStep base_lr: 0.001 step_conf { change_freq: 60 gamma: 0.5 }", 179, 0.00025),
        ("type: kStep base_lr: 0.001 step_conf { change_freq: 60 }", 1000, 0.001),  # default γ = 1
        # step_lr[i] for the last i with step >= step[i]
        (FIXED_STEP, 0, 0.001),
        (FIXED_STEP, 59999, 0.001),
        (FIXED_STEP, 60000, 1e-4),
        (FIXED_STEP, 64999, 1e-4),
        (FIXED_STEP, 65000, 1e-5),
        (FIXED_STEP, 10**6, 1e-5),
        # before the first boundary SINGA's generator is still at index 0, not at base_lr
        (LATE_FIXED_STEP, 0, 0.5),
        (LATE_FIXED_STEP, 199, 0.5),
        (LATE_FIXED_STEP, 200, 0.25),
    ],
)
def test_schedule_values(text, step, expected):
    assert lr_at(text, step) == pytest.approx(expected, rel=1e-6)


def test_updater_learning_rate_is_the_schedule_before_lr_scale():
    u = build(f"type: kSGD {SCHEDULE}")
    assert [u.learning_rate(s) for s in range(5)] == [schedule_lr(s) for s in range(5)]


# -- configuration errors ---------------------------------------------------------
@pytest.mark.parametrize(
    "text, field",
    [
        ("type: kSGD learning_rate { type: kStep step_conf { change_freq: 0 } }", "updater.learning_rate.step_conf.change_freq"),
        ("type: kSGD learning_rate { type: kExponential }", "updater.learning_rate.exponential_conf.change_freq"),
        ("type: kSGD learning_rate { type: kLinear linear_conf { change_freq: -1 final_lr: 0 } }", "updater.learning_rate.linear_conf.change_freq"),
        ("type: kSGD learning_rate { type: kLinear linear_conf { change_freq: 5 } }", "updater.learning_rate.linear_conf.final_lr"),
        ("type: kSGD learning_rate { type: kInverseT }", "updater.learning_rate.inverset_conf.final_lr"),
        ("type: kSGD learning_rate { type: kFixedStep }", "updater.learning_rate.fixedstep_conf"),
        ("type: kSGD learning_rate { type: kFixedStep fixedstep_conf { step: 0 step_lr: 0.1 step_lr: 0.2 } }", "updater.learning_rate.fixedstep_conf"),
        ("type: kSGD learning_rate { type: kFixedStep fixedstep_conf { step: 9 step: 3 step_lr: 0.1 step_lr: 0.2 } }", "updater.learning_rate.fixedstep_conf.step"),
        ("type: kSGD", "updater.learning_rate.type"),  # no learning_rate: the default kUserChange
        ('type: kSGD learning_rate { type: kUserChange user_type: "nope" }', "updater.learning_rate.user_type"),
        ("type: kRMSProp rmsprop_conf { rho: 1.5 } learning_rate { type: kFixed }", "updater.rmsprop_conf.rho"),
        ("type: kRMSProp rmsprop_conf { rho: 0 } learning_rate { type: kFixed }", "updater.rmsprop_conf.rho"),
        ("type: kAdaDelta adadelta_conf { rho: 1 } learning_rate { type: kFixed }", "updater.adadelta_conf.rho"),
        ("type: kAdam adam_conf { beta1: 1 } learning_rate { type: kFixed }", "updater.adam_conf.beta1"),
        ("type: kAdamMax adammax_conf { beta2: -0.1 } learning_rate { type: kFixed }", "updater.adammax_conf.beta2"),
        ("type: kAdaGrad delta: 0 learning_rate { type: kFixed }", "updater.delta"),
        ("type: kAdaDelta delta: -1e-6 learning_rate { type: kFixed }", "updater.delta"),
        ("learning_rate { type: kFixed }", "updater.type"),  # the default kUserUpdater without user_type
        ('type: kUserUpdater user_type: "nope" learning_rate { type: kFixed }', "updater.user_type"),
    ],
)
def test_bad_configurations_name_the_field(text, field):
    with pytest.raises(ValueError, match="^" + re.escape(field) + ":"):
        build(text)


# -- user registration ----------------------------------------------------------------
@pytest.fixture
def clean_registries(monkeypatch):
    """Registrations made by a test disappear after it."""
    monkeypatch.setattr(updaters_module, "_USER_SCHEDULES", dict(updaters_module._USER_SCHEDULES))
    monkeypatch.setattr(updaters_module, "_USER_UPDATERS", dict(updaters_module._USER_UPDATERS))


def test_user_updater_and_schedule(clean_registries):
    @register_lr_schedule("halving")
    def halving(conf, step):
        return conf.base_lr / 2**step

    @register_updater("signsgd")
    class SignSGD(Updater):
        def apply(self, value, g, state, lr):
            value.sub_(g.sign(), alpha=lr)

    u = build('type: kUserUpdater user_type: "signsgd" learning_rate { type: kUserChange user_type: "halving" base_lr: 1 }')
    assert isinstance(u, SignSGD)
    w = torch.zeros(2)
    u.update(1, w, torch.tensor([3.0, -3.0]), u.init_state(w))
    assert w.tolist() == [-0.5, 0.5]


def test_user_type_wins_over_type_as_in_singa(clean_registries):
    """SINGA's factories pick the user class whenever user_type is set."""

    @register_lr_schedule("constant_two")
    def constant_two(conf, step):
        return 2.0

    @register_updater("noop")
    class NoOp(Updater):
        def apply(self, value, g, state, lr):
            pass

    assert lr_at('type: kFixed base_lr: 0.1 user_type: "constant_two"', 5) == 2.0
    assert isinstance(build('type: kSGD user_type: "noop" learning_rate { type: kFixed }'), NoOp)


def test_user_updater_without_a_formula_is_refused(clean_registries):
    @register_updater("nothing")
    class Nothing(Updater):
        pass

    u = build('type: kUserUpdater user_type: "nothing" learning_rate { type: kFixed base_lr: 1 }')
    with pytest.raises(NotImplementedError, match="Nothing must implement apply"):
        u.update(0, torch.zeros(2), torch.ones(2), {})


def test_user_updater_gets_singa_gradient_preparation(clean_registries):
    @register_updater("plain")
    class Plain(Updater):
        def apply(self, value, g, state, lr):
            value.sub_(g, alpha=lr)

    u = build('type: kUserUpdater user_type: "plain" weight_decay: 0.5 learning_rate { type: kFixed base_lr: 1 }')
    w = torch.tensor([2.0])
    u.update(0, w, torch.tensor([1.0]), {}, grad_scale=3.0)  # g = 1·3 + 0.5·2 = 4
    assert w.item() == pytest.approx(-2.0)
