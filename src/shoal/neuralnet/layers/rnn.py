"""kGRU: one time step of SINGA's gated recurrent unit."""
from __future__ import annotations

import torch

from shoal.neuralnet.layers.base import Layer
from shoal.neuralnet.layers.common import config_error, flat, numel
from shoal.neuralnet.layers.registry import register

GRU_PARAMS = ("z_hx", "r_hx", "c_hx", "z_hh", "r_hh", "c_hh", "z_b", "r_b", "c_b")


@register("kGRU")
class GRU(Layer):
    """h' = (1 − z) ⊙ c + z ⊙ h, with
        z = σ(x·W_zxᵀ + h·W_zhᵀ + b_z)          update gate
        r = σ(x·W_rxᵀ + h·W_rhᵀ + b_r)          reset gate
        c = tanh(x·W_cxᵀ + b_c + r ⊙ (h·W_chᵀ))  new memory (reset applied after the product, as SINGA)

    srclayers: the input x (flattened per sample, vdim values), then optionally
    the previous step's hidden state h (an unrolled GRU copy); without it h is
    this layer's output of the previous pass when sampling (ctx.carry), else 0.
    Params in SINGA's order (the names of its char-rnn example):
    z_hx, r_hx, c_hx of shape (dim_hidden, vdim); z_hh, r_hh, c_hh of shape
    (dim_hidden, dim_hidden); z_b, r_b, c_b of shape (dim_hidden,) when bias_term.
    Gradients come from autograd (SINGA's hand-written backward added z instead
    of ∂L/∂h' ⊙ z to the previous state's gradient; shoal does not copy that).
    """

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        self.hidden = conf.gru_conf.dim_hidden
        if self.hidden <= 0:
            raise config_error(conf, "gru_conf.dim_hidden is required and must be > 0")
        if len(self.src_shapes) not in (1, 2):
            raise config_error(conf, f"needs the input and optionally the previous hidden state as srclayers, got {len(self.src_shapes)}")
        if len(self.src_shapes) == 2 and numel(self.src_shapes[1]) != self.hidden:
            raise config_error(conf, f"the previous state {self.src_shapes[1]} must have dim_hidden = {self.hidden} values")
        self.vdim = numel(self.src_shapes[0])
        self.shape = (self.hidden,)

    def param_shapes(self):
        h, v = self.hidden, self.vdim
        shapes = [(h, v)] * 3 + [(h, h)] * 3
        return shapes + [(h,)] * 3 if self.conf.gru_conf.bias_term else shapes

    def forward(self, xs, params, labels, ctx):
        x = flat(xs[0])
        if len(xs) > 1:
            h = flat(xs[1])
        elif ctx.carry and self.name in ctx.carry:  # sampling: this layer's state from the previous pass
            h = flat(ctx.carry[self.name])
        else:
            h = x.new_zeros(x.shape[0], self.hidden)
        w_zx, w_rx, w_cx, w_zh, w_rh, w_ch = params[:6]
        # one matmul per operand for all three gates, then split
        from_x = (x @ torch.cat([w_zx, w_rx, w_cx]).t()).split(self.hidden, dim=1)
        from_h = (h @ torch.cat([w_zh, w_rh, w_ch]).t()).split(self.hidden, dim=1)
        b_z, b_r, b_c = params[6:9] if self.conf.gru_conf.bias_term else (0, 0, 0)
        z = torch.sigmoid(from_x[0] + from_h[0] + b_z)
        r = torch.sigmoid(from_x[1] + from_h[1] + b_r)
        c = torch.tanh(from_x[2] + b_c + r * from_h[2])
        return (1 - z) * c + z * h
