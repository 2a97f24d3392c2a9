"""kLRN / kCudnnLRN: local response normalisation across channels."""
from __future__ import annotations

import torch.nn.functional as F

from shoal.neuralnet.layers.base import Layer
from shoal.neuralnet.layers.common import config_error
from shoal.neuralnet.layers.registry import register
from shoal.neuralnet.layers.spatial import image_shape


@register("kLRN", "kCudnnLRN")
class LRN(Layer):
    """b_c = a_c / (knorm + alpha/local_size · Σ_(c' in window(c)) a_c'²)^beta.

    The window is local_size channels centred on c, cut at the first and last
    channel. SINGA divides alpha by local_size (LRNLayer: salpha = alpha / lsize),
    as cuDNN and torch do.
    """

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        self.channels = image_shape(conf, self.src_shapes)[0]
        if conf.lrn_conf.local_size <= 0:
            raise config_error(conf, "lrn_conf.local_size must be > 0")

    def forward(self, xs, params, labels, ctx):
        c = self.conf.lrn_conf
        x = xs[0].reshape((xs[0].shape[0], self.channels) + xs[0].shape[-2:])
        return F.local_response_norm(x, c.local_size, alpha=c.alpha, beta=c.beta, k=c.knorm).reshape(xs[0].shape)
