"""Element-wise activations and softmax: kReLU, kSTanh, kSigmoid, kActivation, kSoftmax."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from shoal.config import job_pb2
from shoal.neuralnet.layers.base import Layer
from shoal.neuralnet.layers.common import config_error, numel
from shoal.neuralnet.layers.registry import register

# SINGA's scaled tanh constants (LeCun's "efficient backprop" values)
STANH_A, STANH_B = 1.7159047, 0.6666667


def stanh(x: torch.Tensor) -> torch.Tensor:
    """1.7159047 · tanh(0.6666667 · x)."""
    return STANH_A * torch.tanh(STANH_B * x)


ACTIVATIONS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    job_pb2.RELU: F.relu,
    job_pb2.SIGMOID: torch.sigmoid,
    job_pb2.TANH: torch.tanh,
    job_pb2.STANH: stanh,
}


class _Elementwise(Layer):
    """Same shape out as in; one source."""

    feature_local = True

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        if len(self.src_shapes) != 1:
            raise config_error(conf, f"needs exactly one srclayer, got {len(self.src_shapes)}")


@register("kReLU")
class ReLU(_Elementwise):
    """max(x, 0); x · relu_conf.negative_slope for x < 0 when the slope is set."""

    def forward(self, xs, params, labels, ctx):
        slope = self.conf.relu_conf.negative_slope
        return F.leaky_relu(xs[0], slope) if slope else F.relu(xs[0])


@register("kSTanh")
class STanh(_Elementwise):
    """1.7159047 · tanh(0.6666667 · x)."""

    def forward(self, xs, params, labels, ctx):
        return stanh(xs[0])


@register("kSigmoid")
class Sigmoid(_Elementwise):
    """1 / (1 + e^(−x))."""

    def forward(self, xs, params, labels, ctx):
        return torch.sigmoid(xs[0])


@register("kActivation", "kCudnnActivation")
class Activation(_Elementwise):
    """activation_conf.type: RELU, SIGMOID, TANH or STANH (the cuDNN variant has no STANH; shoal allows it)."""

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        kind = conf.activation_conf.type
        if kind not in ACTIVATIONS:
            raise config_error(conf, f"activation_conf.type {kind} is not RELU, SIGMOID, TANH or STANH")
        self.fn = ACTIVATIONS[kind]

    def forward(self, xs, params, labels, ctx):
        return self.fn(xs[0])


@register("kSoftmax", "kCudnnSoftmax")
class Softmax(_Elementwise):
    """Each sample's values split into num_softmax_per_instance equal groups; softmax within each:
    y_i = e^(x_i) / Σ_(j in i's group) e^(x_j)."""

    feature_local = False  # each output reads its whole group

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        self.groups = conf.softmax_conf.num_softmax_per_instance
        size = numel(self.shape)
        if self.groups <= 0 or size % self.groups:
            raise config_error(conf, f"softmax_conf.num_softmax_per_instance {self.groups} does not divide the {size} values of a sample")

    def forward(self, xs, params, labels, ctx):
        x = xs[0]
        grouped = x.reshape(x.shape[0], self.groups, -1)
        return torch.softmax(grouped, dim=-1).reshape(x.shape)
