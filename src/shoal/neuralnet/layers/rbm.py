"""kRBMVis / kRBMHid: a restricted Boltzmann machine, trained by contrastive divergence (kCD).

SINGA's confs connect the two layers both ways (RBMVis reads the data and
RBMHid; RBMHid reads RBMVis) and share the weight W (hdim, vdim) between them
(RBMHid's weight has `share_from` the visible one). The CD update does not come
from autograd: `contrastive_divergence` runs SINGA's Gibbs chain and returns
the gradients, which a kCD algorithm stores as the params' grads.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.neuralnet.layers.base import Context, Layer
from shoal.neuralnet.layers.common import config_error, flat, normal, numel, uniform
from shoal.neuralnet.layers.registry import register


def _check_hdim(conf) -> int:
    if conf.rbm_conf.hdim <= 0:
        raise config_error(conf, "rbm_conf.hdim is required and must be > 0")
    return conf.rbm_conf.hdim


SQUARED_ERROR = "Squared Error"  # the metric's name, as SINGA displays it


@register("kRBMVis")
class RBMVis(Layer):
    """Visible units. Params: W (hdim, vdim), visible bias b_v (vdim,).

    srclayers: the data, then (SINGA's back edge) the RBMHid layer, which may be
    left out. forward emits the data: the positive phase v₀.
    reconstruct(h) = σ(h·W + b_v): the visible probabilities given hidden states h.
    Outside training, close_loop reports "Squared Error" ‖v₀ − reconstruct(E[h|v₀])‖²
    per sample (in training kCD reports it for its Gibbs chain).
    """

    forward_sources = 1  # the RBMHid edge is feedback

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        self.hdim = _check_hdim(conf)
        if len(self.src_shapes) not in (1, 2):
            raise config_error(conf, "needs the data and (optionally) the RBMHid layer as srclayers")
        self.vdim = numel(self.src_shapes[0])

    def param_shapes(self):
        return [(self.hdim, self.vdim), (self.vdim,)]

    def forward(self, xs, params, labels, ctx):
        return xs[0]

    def reconstruct(self, hidden: torch.Tensor, params) -> torch.Tensor:
        weight, bias = params
        return torch.sigmoid(hidden @ weight + bias)

    def close_loop(self, xs, feedback, params, ctx):
        if not feedback:
            return
        v0 = flat(xs[0])
        error = ((v0 - self.reconstruct(flat(feedback[0]), params)) ** 2).sum() / len(v0)
        ctx.report(SQUARED_ERROR, error.item(), len(v0))


@register("kRBMHid")
class RBMHid(Layer):
    """Hidden units. Params: W (hdim, vdim) (shared with the RBMVis layer), hidden bias b_h (hdim,).

    forward(v) = E[h | v]: σ(v·Wᵀ + b_h) for binary units; v·Wᵀ + b_h for
    Gaussian ones (rbm_conf.gaussian, unit variance). sample(E[h|v]) draws h.
    """

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        self.hdim = _check_hdim(conf)
        if len(self.src_shapes) != 1:
            raise config_error(conf, f"needs exactly one srclayer (the RBMVis layer), got {len(self.src_shapes)}")
        self.vdim = numel(self.src_shapes[0])
        self.gaussian = conf.rbm_conf.gaussian
        self.shape = (self.hdim,)

    def param_shapes(self):
        return [(self.hdim, self.vdim), (self.hdim,)]

    def forward(self, xs, params, labels, ctx):
        weight, bias = params
        mean = flat(xs[0]) @ weight.t() + bias
        return mean if self.gaussian else torch.sigmoid(mean)

    def sample(self, mean: torch.Tensor, ctx: Context) -> torch.Tensor:
        """h ~ Bernoulli(mean) for binary units (h = 1 where u < mean, u ~ U[0, 1)); mean + N(0, 1) for Gaussian ones."""
        if self.gaussian:
            return mean + normal(mean.shape, ctx, mean.device, per_sample=True).to(mean.dtype)
        return (uniform(mean.shape, ctx, mean.device, per_sample=True) < mean).to(mean.dtype)


@dataclass
class CDResult:
    """One CD-k step: gradients in each layer's param order, and the chain's ends."""

    vis_grads: list[torch.Tensor]  # (∂W, ∂b_v) for the RBMVis layer's params
    hid_grads: list[torch.Tensor | None]  # (None, ∂b_h): the shared W's gradient is the visible layer's
    squared_error: float  # Σ ‖v₀ − v₁‖² / B for the first reconstruction v₁ (SINGA's "Squared Error")
    visible: torch.Tensor  # v_k, the last reconstruction
    hidden: torch.Tensor  # E[h | v_k]


@torch.no_grad()
def contrastive_divergence(vis: RBMVis, hid: RBMHid, v0: torch.Tensor, vis_params, hid_params, ctx: Context, k: int = 1) -> CDResult:
    """SINGA's CD-k (CDWorker with RBMVis/RBMHid):

    positive phase  h₀ = E[h | v₀]
    k Gibbs rounds  h̃ ~ sample(h_(i−1)); v_i = σ(h̃·W + b_v) (probabilities, not sampled: Hinton 2006); h_i = E[h | v_i]
    gradients       ∂W = (h_kᵀ·v_k − h₀ᵀ·v₀) / B,  ∂b_v = Σ(v_k − v₀) / B,  ∂b_h = Σ(h_k − h₀) / B
    These are the gradients of the free-energy difference (F(v₀) − F(v_k)) / B with v_k held fixed.
    """
    if k < 1:
        raise ValueError(f"cd_k must be ≥ 1, got {k}")
    v0 = flat(v0)
    h0 = hid.forward([v0], hid_params, [None], ctx)
    h, squared_error = h0, 0.0
    for round_ in range(k):
        v = vis.reconstruct(hid.sample(h, ctx), vis_params)
        h = hid.forward([v], hid_params, [None], ctx)
        if round_ == 0:
            squared_error = ((v0 - v) ** 2).sum().item() / len(v0)
    batch = len(v0)
    grad_weight = (h.t() @ v - h0.t() @ v0) / batch
    return CDResult(
        vis_grads=[grad_weight, (v - v0).sum(0) / batch],
        hid_grads=[None, (h - h0).sum(0) / batch],
        squared_error=squared_error,
        visible=v,
        hidden=h,
    )
