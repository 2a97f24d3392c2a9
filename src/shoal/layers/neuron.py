"""Neuron layers: inner product, activations, softmax, dropout, batch normalisation."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from shoal.config import job_pb2
from shoal.layers.base import Layer, LayerConfigError
from shoal.layers.registry import register

STANH_A, STANH_B = 1.7159047, 0.6666667


def stanh(x: torch.Tensor) -> torch.Tensor:
    """SINGA's scaled tanh: 1.7159047 · tanh(0.6666667 · x)."""
    return STANH_A * torch.tanh(STANH_B * x)


@register("kInnerProduct")
class InnerProduct(Layer):
    """y = x·Wᵀ + b with W of shape (num_output, vdim); with `transpose`, W is (vdim, num_output) and y = x·W + b.

    The input is flattened per sample (vdim = its size), as SINGA's blob is a matrix.
    """

    one_to_all = True

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        c = conf.innerproduct_conf
        if c.num_output <= 0:
            raise LayerConfigError(f"layer {conf.name!r}: innerproduct_conf.num_output must be > 0")
        self.vdim = math.prod(self.src_shapes[0]) if self.src_shapes and self.src_shapes[0] else 1
        self.shape = (c.num_output,)

    def param_shapes(self):
        c = self.conf.innerproduct_conf
        weight = (self.vdim, c.num_output) if c.transpose else (c.num_output, self.vdim)
        return [weight, (c.num_output,)] if c.bias_term else [weight]

    def forward(self, xs, params, labels, ctx):
        x = xs[0].reshape(xs[0].shape[0], -1)
        w = params[0]
        y = x @ w if self.conf.innerproduct_conf.transpose else x @ w.t()
        if self.conf.innerproduct_conf.bias_term:
            y = y + params[1]
        return y


def _activation(kind: int, slope: float = 0.0):
    if kind == job_pb2.RELU:
        return (lambda x: F.leaky_relu(x, slope)) if slope else F.relu
    if kind == job_pb2.SIGMOID:
        return torch.sigmoid
    if kind == job_pb2.TANH:
        return torch.tanh
    if kind == job_pb2.STANH:
        return stanh
    raise LayerConfigError(f"activation type {kind} is not supported")


@register("kReLU")
class ReLU(Layer):
    """max(x, 0), or x·negative_slope for x < 0 (relu_conf.negative_slope)."""

    def forward(self, xs, params, labels, ctx):
        return _activation(job_pb2.RELU, self.conf.relu_conf.negative_slope)(xs[0])


@register("kSTanh")
class STanh(Layer):
    def forward(self, xs, params, labels, ctx):
        return stanh(xs[0])


@register("kSigmoid")
class Sigmoid(Layer):
    def forward(self, xs, params, labels, ctx):
        return torch.sigmoid(xs[0])


@register("kActivation", "kCudnnActivation")
class Activation(Layer):
    """activation_conf.type: RELU, SIGMOID, TANH or STANH."""

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        self.fn = _activation(conf.activation_conf.type)

    def forward(self, xs, params, labels, ctx):
        return self.fn(xs[0])


@register("kSoftmax", "kCudnnSoftmax")
class Softmax(Layer):
    """Softmax over each of num_softmax_per_instance equal groups of a sample's features."""

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        self.groups = conf.softmax_conf.num_softmax_per_instance
        size = math.prod(self.shape) if self.shape else 1
        if size % self.groups:
            raise LayerConfigError(f"layer {conf.name!r}: {size} features do not split into {self.groups} softmax groups")

    def forward(self, xs, params, labels, ctx):
        x = xs[0]
        grouped = x.reshape(x.shape[0], self.groups, -1)
        return torch.softmax(grouped, dim=-1).reshape(x.shape)


@register("kDropout")
class Dropout(Layer):
    """Training: zero each unit with probability dropout_ratio and scale the rest by 1/(1 − ratio). Test: identity."""

    def forward(self, xs, params, labels, ctx):
        x, ratio = xs[0], self.conf.dropout_conf.dropout_ratio
        if ctx.phase != job_pb2.kTrain or ratio <= 0:
            return x
        keep = torch.rand(x.shape, generator=ctx.generator, device=x.device) >= ratio
        return x * keep / (1 - ratio)


@register("kBM", "kCudnnBM")
class BatchNorm(Layer):
    """Batch normalisation with SINGA's four params: scale, bias, running mean, running variance.

    Training normalises with the batch's statistics (per channel for C×H×W
    inputs, per feature otherwise) and moves the running statistics by
    bm_conf.momentum; other phases use the running statistics. The running
    statistics are params without gradients: servers skip them, checkpoints
    keep them.
    """

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        if not self.shape:
            raise LayerConfigError(f"layer {conf.name!r}: batch norm needs a source with features")
        self.channels = self.shape[0]

    def param_shapes(self):
        return [(self.channels,)] * 4

    def param_trainable(self):
        return [True, True, False, False]  # running mean and variance move by momentum, not by gradient

    def forward(self, xs, params, labels, ctx):
        scale, bias, running_mean, running_var = params
        training = ctx.phase == job_pb2.kTrain
        c = self.conf.bm_conf
        # running stats are updated in place on detached views (no autograd history)
        return F.batch_norm(
            xs[0], running_mean.detach(), running_var.detach(), scale, bias, training=training, momentum=1 - c.momentum, eps=c.epsilon
        )
