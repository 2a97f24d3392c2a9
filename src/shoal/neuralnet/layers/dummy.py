"""kDummy: a test helper layer (random input, random gradient, or a copy)."""
from __future__ import annotations

from shoal.neuralnet.layers.base import Layer
from shoal.neuralnet.layers.common import config_error, uniform
from shoal.neuralnet.layers.registry import register


@register("kDummy")
class Dummy(Layer):
    """dummy_conf {input, output, shape}.

    input: no source; emits U[0, 1) data of `shape` (batch first, as SINGA's blob shape).
    otherwise: copies its one source.
    output: also injects a random gradient U[0, 1) into what it emits, as SINGA's
    dummy output does in ComputeGradient. It does so as a loss layer whose loss
    is Σ y·g with g the random draw (so ∂loss/∂y = g); its output is that scalar.
    """

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        c = conf.dummy_conf
        if c.input:
            if self.src_shapes:
                raise config_error(conf, "dummy_conf.input: true takes no srclayers")
            if len(c.shape) < 1 or min(c.shape) <= 0:
                raise config_error(conf, "dummy_conf.shape is required with input: true (batch size first, then the sample shape)")
            self.category = "input"
            self.batch, self.shape = c.shape[0], tuple(c.shape[1:])
        elif len(self.src_shapes) != 1:
            raise config_error(conf, f"needs exactly one srclayer (or dummy_conf.input: true), got {len(self.src_shapes)}")
        if c.output:
            self.category = "loss"
            self.shape = ()

    def forward(self, xs, params, labels, ctx):
        if self.conf.dummy_conf.input:
            y = uniform((self.batch,) + self.shape, ctx, ctx.device)
        else:
            y = xs[0]
        if self.conf.dummy_conf.output:
            grad = uniform(y.shape, ctx, y.device).to(y.dtype)
            return (y * grad).sum()
        return y
