"""kBM / kCudnnBM: batch normalisation."""
from __future__ import annotations

import torch.nn.functional as F

from shoal.config import job_pb2
from shoal.neuralnet.layers.base import Layer
from shoal.neuralnet.layers.common import config_error
from shoal.neuralnet.layers.registry import register


@register("kBM", "kCudnnBM")
class BatchNorm(Layer):
    """y = scale · (x − μ) / √(σ² + ε) + bias, per channel (C×H×W input) or per feature (flat input).

    Params, in SINGA's order: scale (C,), bias (C,), running mean (C,), running variance (C,).
    kTrain uses the batch's μ and (biased) σ² and then moves the running statistics in
    place: r ← m·r + (1 − m)·batch statistic, m = bm_conf.momentum, the variance
    statistic being unbiased (as cuDNN and torch). Other phases use the running
    statistics. The running statistics are params without gradients
    (`param_trainable` is False for them): updaters skip them, checkpoints keep them.
    SINGA's cuDNN layer names the 4th param a running *inverse* variance; shoal stores
    the variance. SINGA's kBM (CPU) was a stub; here both types are this layer.
    """

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        if len(self.src_shapes) != 1 or not self.shape:
            raise config_error(conf, "needs one srclayer with per-sample features (C×H×W or flat)")
        if not 0 <= conf.bm_conf.momentum <= 1:
            raise config_error(conf, f"bm_conf.momentum must be in [0, 1], got {conf.bm_conf.momentum}")
        self.channels = self.shape[0]

    def param_shapes(self):
        return [(self.channels,)] * 4

    def param_trainable(self):
        return [True, True, False, False]

    def forward(self, xs, params, labels, ctx):
        scale, bias, running_mean, running_var = params
        c = self.conf.bm_conf
        # torch's momentum weighs the new batch: ours weighs the old running value.
        # The running stats are updated in place through detached aliases: no autograd history.
        return F.batch_norm(
            xs[0],
            running_mean.detach(),
            running_var.detach(),
            scale,
            bias,
            training=ctx.phase == job_pb2.kTrain,
            momentum=1 - c.momentum,
            eps=c.epsilon,
        )
