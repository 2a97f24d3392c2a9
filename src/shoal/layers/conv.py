"""Convolution, pooling and local response normalisation (Caffe/SINGA semantics)."""
from __future__ import annotations

import math

import torch.nn.functional as F

from shoal.config import job_pb2
from shoal.layers.base import Layer, LayerConfigError
from shoal.layers.registry import register


def _pair(conf, name: str) -> tuple[int, int]:
    """(y, x) of kernel/pad/stride: `name_y`/`name_x` override `name` when given."""
    base = getattr(conf, name)
    y = getattr(conf, f"{name}_y") if conf.HasField(f"{name}_y") else base
    x = getattr(conf, f"{name}_x") if conf.HasField(f"{name}_x") else base
    return int(y), int(x)


def _image_shape(layer: Layer) -> tuple[int, int, int]:
    shape = layer.src_shapes[0] if layer.src_shapes else ()
    if len(shape) != 3:
        raise LayerConfigError(f"layer {layer.name!r}: expects C×H×W input, got shape {shape} (give store_conf.shape: C, H, W)")
    return shape


@register("kConvolution", "kCConvolution", "kCudnnConv")
class Convolution(Layer):
    """2-D convolution; weight (num_filters, C, kh, kw), bias (num_filters,)."""

    one_to_all = True

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        c = conf.convolution_conf
        channels, h, w = _image_shape(self)
        if c.num_filters <= 0:
            raise LayerConfigError(f"layer {conf.name!r}: convolution_conf.num_filters must be > 0")
        self.kernel, self.pad, self.stride = _pair(c, "kernel"), _pair(c, "pad"), _pair(c, "stride")
        out_h = (h + 2 * self.pad[0] - self.kernel[0]) // self.stride[0] + 1
        out_w = (w + 2 * self.pad[1] - self.kernel[1]) // self.stride[1] + 1
        if out_h <= 0 or out_w <= 0:
            raise LayerConfigError(f"layer {conf.name!r}: kernel {self.kernel} does not fit a {h}×{w} input with pad {self.pad}")
        self.channels = channels
        self.shape = (c.num_filters, out_h, out_w)

    def param_shapes(self):
        c = self.conf.convolution_conf
        weight = (c.num_filters, self.channels) + self.kernel
        return [weight, (c.num_filters,)] if c.bias_term else [weight]

    def forward(self, xs, params, labels, ctx):
        bias = params[1] if self.conf.convolution_conf.bias_term else None
        return F.conv2d(xs[0], params[0], bias, stride=self.stride, padding=self.pad)


@register("kPooling", "kCPooling", "kCudnnPool")
class Pooling(Layer):
    """MAX or AVG pooling with Caffe's output size: ceil((in + 2·pad − kernel) / stride) + 1,
    minus one when the last window would start in the padding."""

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        c = conf.pooling_conf
        channels, h, w = _image_shape(self)
        self.kernel, self.pad, self.stride = c.kernel, c.pad, c.stride
        if self.stride <= 0 or self.kernel <= 0:
            raise LayerConfigError(f"layer {conf.name!r}: pooling kernel and stride must be > 0")
        if self.pad * 2 > self.kernel:
            raise LayerConfigError(f"layer {conf.name!r}: pad {self.pad} must be at most half the kernel {self.kernel}")
        if self.kernel > min(h, w) + 2 * self.pad:
            raise LayerConfigError(f"layer {conf.name!r}: kernel {self.kernel} exceeds the {h}×{w} input")
        self.shape = (channels, self._out(h), self._out(w))

    def _out(self, size: int) -> int:
        out = math.ceil((size + 2 * self.pad - self.kernel) / self.stride) + 1
        if self.pad and (out - 1) * self.stride >= size + self.pad:
            out -= 1
        return out

    def forward(self, xs, params, labels, ctx):
        if self.conf.pooling_conf.pool == job_pb2.PoolingProto.MAX:
            return F.max_pool2d(xs[0], self.kernel, self.stride, self.pad, ceil_mode=True)
        return F.avg_pool2d(xs[0], self.kernel, self.stride, self.pad, ceil_mode=True, count_include_pad=True)


@register("kLRN", "kCudnnLRN")
class LRN(Layer):
    """Across-channel LRN: b = a / (knorm + alpha/local_size · Σ a²)^beta over local_size channels."""

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        _image_shape(self)
        if conf.lrn_conf.local_size <= 0:
            raise LayerConfigError(f"layer {conf.name!r}: lrn_conf.local_size must be > 0")

    def forward(self, xs, params, labels, ctx):
        c = self.conf.lrn_conf
        return F.local_response_norm(xs[0], c.local_size, alpha=c.alpha, beta=c.beta, k=c.knorm)
