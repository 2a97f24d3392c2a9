"""kInnerProduct: the fully connected layer."""
from __future__ import annotations

from shoal.neuralnet.layers.base import Layer
from shoal.neuralnet.layers.common import config_error, flat, numel
from shoal.neuralnet.layers.registry import register


@register("kInnerProduct")
class InnerProduct(Layer):
    """y = x·Wᵀ + b with W of shape (num_output, vdim), b of shape (num_output,).

    With `transpose: true` W is stored as (vdim, num_output) and y = x·W + b;
    SINGA's autoencoder ties a decoder to an encoder's weight this way.
    The input is flattened per sample (vdim = its size), as SINGA's blob is a matrix.
    """

    one_to_all = True

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        if len(self.src_shapes) != 1:
            raise config_error(conf, f"needs exactly one srclayer, got {len(self.src_shapes)}")
        c = conf.innerproduct_conf
        if c.num_output <= 0:
            raise config_error(conf, "innerproduct_conf.num_output is required and must be > 0")
        self.vdim = numel(self.src_shapes[0])
        self.shape = (c.num_output,)

    def param_shapes(self):
        c = self.conf.innerproduct_conf
        weight = (self.vdim, c.num_output) if c.transpose else (c.num_output, self.vdim)
        return [weight, (c.num_output,)] if c.bias_term else [weight]

    def narrowed(self, features):
        conf = type(self.conf)()
        conf.CopyFrom(self.conf)
        conf.innerproduct_conf.num_output = features
        return conf, [1 if conf.innerproduct_conf.transpose else 0, 0][: len(self.param_shapes())]

    def forward(self, xs, params, labels, ctx):
        c = self.conf.innerproduct_conf
        x, weight = flat(xs[0]), params[0]
        y = x @ weight if c.transpose else x @ weight.t()
        return y + params[1] if c.bias_term else y
