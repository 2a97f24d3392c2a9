"""kDropout."""
from __future__ import annotations

from shoal.config import job_pb2
from shoal.neuralnet.layers.base import Layer
from shoal.neuralnet.layers.common import config_error, uniform
from shoal.neuralnet.layers.registry import register


@register("kDropout")
class Dropout(Layer):
    """Training: y = x · m / (1 − p) with m_i = 1 [u_i ≥ p], u_i ~ U[0, 1) from ctx.generator, p = dropout_ratio.
    Other phases: y = x (the 1/(1 − p) scaling at training time keeps expectations equal, as in SINGA).
    """

    draws_random = True

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        ratio = conf.dropout_conf.dropout_ratio
        if not 0 <= ratio < 1:
            raise config_error(conf, f"dropout_conf.dropout_ratio must be in [0, 1), got {ratio}")

    def forward(self, xs, params, labels, ctx):
        x, ratio = xs[0], self.conf.dropout_conf.dropout_ratio
        if ctx.phase != job_pb2.kTrain or ratio == 0:
            return x
        keep = uniform(x.shape, ctx, x.device, per_sample=True) >= ratio
        return x * keep / (1 - ratio)
