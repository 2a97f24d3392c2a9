"""Param init methods with SINGA's formulas, share_from, and the store."""
from __future__ import annotations

import math

import pytest
import torch
from google.protobuf import text_format

from shoal.config import job_pb2
from shoal.neuralnet.params import ParamStore, init_value, register_param_init


def gen(conf_text: str) -> job_pb2.ParamGenProto:
    return text_format.Parse(conf_text, job_pb2.ParamGenProto())


def draw(conf_text: str, shape, seed=0):
    return init_value(gen(conf_text), shape, torch.Generator().manual_seed(seed))


def reference_uniform(shape, low, high, seed=0):
    return torch.empty(shape).uniform_(low, high, generator=torch.Generator().manual_seed(seed))


def reference_normal(shape, mean, std, seed=0):
    return torch.empty(shape).normal_(mean, std, generator=torch.Generator().manual_seed(seed))


def test_constant():
    assert torch.equal(draw("type: kConstant value: 0.25", (3, 2)), torch.full((3, 2), 0.25))


def test_gaussian_times_value():
    got = draw("type: kGaussian mean: 1 std: 0.5 value: 2", (50, 40))
    assert torch.allclose(got, reference_normal((50, 40), 1, 0.5) * 2)


def test_uniform_times_value():
    got = draw("type: kUniform low: -0.2 high: 0.3 value: 3", (7, 9))
    assert torch.allclose(got, reference_uniform((7, 9), -0.2, 0.3) * 3)


def test_gaussian_sqrt_fan_in_divides_by_sqrt_cols():
    got = draw("type: kGaussianSqrtFanIn std: 1", (20, 64))
    assert torch.allclose(got, reference_normal((20, 64), 0, 1) / 8)


def test_uniform_sqrt_fan_in_divides_by_sqrt_cols_over_3():
    got = draw("type: kUniformSqrtFanIn", (10, 12))
    assert torch.allclose(got, reference_uniform((10, 12), -1, 1) / math.sqrt(12 / 3))


def test_uniform_sqrt_fan_in_out_divides_by_sqrt_rows_plus_cols():
    got = draw("type: kUniformSqrtFanInOut", (10, 15))
    assert torch.allclose(got, reference_uniform((10, 15), -1, 1) / 5)


def test_fan_in_of_conv_filters_counts_channels_times_kernel():
    got = draw("type: kGaussianSqrtFanIn", (8, 3, 5, 5))
    assert torch.allclose(got, reference_normal((8, 3, 5, 5), 0, 1) / math.sqrt(75))


def test_fan_in_methods_leave_vectors_undivided():
    assert torch.allclose(draw("type: kUniformSqrtFanIn", (10,)), reference_uniform((10,), -1, 1))


def test_defaults_are_singas():
    conf = job_pb2.ParamGenProto()
    assert (conf.value, conf.mean, conf.std, conf.low, conf.high) == (1, 0, 1, -1, 1)
    # a param without init gets SINGA's base generator: every entry = value (1)
    assert torch.equal(init_value(None, (2,), torch.Generator()), torch.ones(2))


def test_user_init():
    @register_param_init("halves")
    def halves(conf, shape, generator):
        return torch.full(shape, 0.5)

    assert torch.equal(draw('type: kUserInit user_type: "halves"', (2, 2)), torch.full((2, 2), 0.5))
    with pytest.raises(ValueError, match="nope"):
        draw('type: kUserInit user_type: "nope"', (2,))


def param(text: str) -> job_pb2.ParamProto:
    return text_format.Parse(text, job_pb2.ParamProto())


def test_share_from_aliases_the_owner():
    store = ParamStore()
    g = torch.Generator().manual_seed(0)
    assert store.declare(param('name: "w" init { type: kGaussian }'), (4, 3), g) == "w"
    assert store.declare(param('name: "w_" share_from: "w"'), (4, 3), g) == "w"
    assert store.names() == ["w"]
    with pytest.raises(ValueError, match="shape"):
        store.declare(param('name: "w2" share_from: "w"'), (3, 4), g)
    with pytest.raises(KeyError, match="names no param"):
        store.declare(param('name: "v" share_from: "missing"'), (3, 4), g)


def test_load_checks_shapes_and_reports_what_it_loaded():
    store = ParamStore()
    store.declare(param('name: "w"'), (2, 2), torch.Generator())
    assert store.load({"w": torch.zeros(2, 2), "other": torch.ones(1)}) == ["w"]
    with pytest.raises(ValueError, match="shape"):
        store.load({"w": torch.zeros(3)})
