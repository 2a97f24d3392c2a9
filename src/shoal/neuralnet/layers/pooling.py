"""kPooling / kCPooling / kCudnnPool."""
from __future__ import annotations

import torch.nn.functional as F

from shoal.config import job_pb2
from shoal.neuralnet.layers.base import Layer
from shoal.neuralnet.layers.common import config_error
from shoal.neuralnet.layers.registry import register
from shoal.neuralnet.layers.spatial import image_shape, output_size


@register("kPooling", "kCPooling", "kCudnnPool")
class Pooling(Layer):
    """MAX or AVG over kernel×kernel windows, per channel, moved by stride over the input padded by pad.

    Output size ⌊(H + 2·pad − kernel) / stride⌋ + 1, as SINGA's PoolingLayer::Setup
    (which every pooling type shares; cuDNN rounds down too). Caffe rounds up, so a
    net ported from Caffe may have smaller pooled maps here. MAX ignores the
    padding; AVG divides by kernel² with the padding counted as zeros (SINGA's
    ForwardAvgPooling: with floor rounding no window passes the padded border).
    """

    feature_local = True  # channels are pooled independently

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        c = conf.pooling_conf
        channels, h, w = image_shape(conf, self.src_shapes)
        self.kernel, self.pad, self.stride = c.kernel, c.pad, c.stride
        if self.kernel <= 0 or self.stride <= 0:
            raise config_error(conf, f"pooling_conf kernel ({self.kernel}) and stride ({self.stride}) must be > 0")
        if 2 * self.pad > self.kernel:
            # a window lying entirely in the padding would pool nothing (torch refuses it too)
            raise config_error(conf, f"pooling_conf.pad {self.pad} must be at most half the kernel {self.kernel}")
        if self.kernel > min(h, w) + 2 * self.pad:
            raise config_error(conf, f"pooling_conf.kernel {self.kernel} does not fit the {h}×{w} input padded by {self.pad}")
        self.channels = channels
        self.shape = (channels, output_size(h, self.kernel, self.pad, self.stride), output_size(w, self.kernel, self.pad, self.stride))

    def forward(self, xs, params, labels, ctx):
        x = xs[0].reshape((xs[0].shape[0], self.channels) + xs[0].shape[-2:])
        if self.conf.pooling_conf.pool == job_pb2.PoolingProto.MAX:
            return F.max_pool2d(x, self.kernel, self.stride, self.pad)
        return F.avg_pool2d(x, self.kernel, self.stride, self.pad, count_include_pad=True)
