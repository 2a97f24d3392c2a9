"""kConvolution / kCConvolution / kCudnnConv."""
from __future__ import annotations

import torch.nn.functional as F

from shoal.neuralnet.layers.base import Layer
from shoal.neuralnet.layers.common import config_error
from shoal.neuralnet.layers.registry import register
from shoal.neuralnet.layers.spatial import image_shape, output_size, yx_pair


@register("kConvolution", "kCConvolution", "kCudnnConv")
class Convolution(Layer):
    """2-D cross-correlation: y[f] = Σ_c W[f, c] ⋆ pad(x[c]) + b[f], with strides.

    W is (num_filters, C, kernel_y, kernel_x) (torch's layout; SINGA's is the same
    memory viewed as num_filters × C·kh·kw), b is (num_filters,) when bias_term.
    Output H' = ⌊(H + 2·pad_y − kernel_y) / stride_y⌋ + 1, likewise W'.
    kernel_x/_y, pad_x/_y and stride_x/_y override kernel, pad and stride when set.
    """

    one_to_all = True

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        c = conf.convolution_conf
        self.channels, h, w = image_shape(conf, self.src_shapes)
        if c.num_filters <= 0:
            raise config_error(conf, "convolution_conf.num_filters is required and must be > 0")
        self.kernel, self.pad, self.stride = yx_pair(c, "kernel"), yx_pair(c, "pad"), yx_pair(c, "stride")
        if min(self.kernel) <= 0 or min(self.stride) <= 0 or min(self.pad) < 0:
            raise config_error(conf, f"convolution_conf kernel {self.kernel} and stride {self.stride} must be > 0, pad {self.pad} ≥ 0")
        if self.kernel[0] > h + 2 * self.pad[0] or self.kernel[1] > w + 2 * self.pad[1]:
            raise config_error(conf, f"convolution_conf kernel {self.kernel} does not fit the {h}×{w} input padded by {self.pad}")
        out = (output_size(h, self.kernel[0], self.pad[0], self.stride[0]), output_size(w, self.kernel[1], self.pad[1], self.stride[1]))
        self.shape = (c.num_filters,) + out

    def param_shapes(self):
        c = self.conf.convolution_conf
        weight = (c.num_filters, self.channels) + self.kernel
        return [weight, (c.num_filters,)] if c.bias_term else [weight]

    def narrowed(self, features):
        conf = type(self.conf)()
        conf.CopyFrom(self.conf)
        conf.convolution_conf.num_filters = features
        return conf, [0] * len(self.param_shapes())

    def forward(self, xs, params, labels, ctx):
        x = xs[0].reshape((xs[0].shape[0], self.channels) + xs[0].shape[-2:])
        bias = params[1] if self.conf.convolution_conf.bias_term else None
        return F.conv2d(x, params[0], bias, stride=self.stride, padding=self.pad)
