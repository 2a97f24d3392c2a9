"""Loss layers: the mean loss over the batch they are given, plus metrics."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from shoal.layers.base import Layer, LayerConfigError
from shoal.layers.registry import register


def topk_accuracy(scores: torch.Tensor, labels: torch.Tensor, k: int) -> float:
    top = scores.topk(min(k, scores.shape[1]), dim=1).indices
    return (top == labels.reshape(-1, 1)).any(dim=1).float().mean().item()


def labels_of(layer: Layer, labels: list) -> torch.Tensor:
    """The labels a loss reads: those travelling with its second source, else its first."""
    found = labels[1] if len(labels) > 1 else labels[0]
    if found is None:
        raise ValueError(f"layer {layer.name!r}: its sources carry no labels (is store_conf.has_label false?)")
    return found


@register("kSoftmaxLoss", "kCudnnSoftmaxLoss")
class SoftmaxLoss(Layer):
    """Cross-entropy of softmax(scores) against the labels, times softmaxloss_conf.scale.

    Reports `loss` (unscaled cross-entropy) and `accuracy` (top-k, softmaxloss_conf.topk).
    """

    category = "loss"

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        if not src_shapes:
            raise LayerConfigError(f"layer {conf.name!r}: needs the scores (and labels) as srclayers")
        self.shape = ()

    def forward(self, xs, params, labels, ctx):
        scores = xs[0].reshape(xs[0].shape[0], -1)
        target = labels_of(self, labels).reshape(-1).long()
        loss = F.cross_entropy(scores, target)
        with torch.no_grad():
            ctx.report("loss", loss.item(), len(target))
            ctx.report("accuracy", topk_accuracy(scores, target, self.conf.softmaxloss_conf.topk), len(target))
        return loss * self.conf.softmaxloss_conf.scale


@register("kEuclideanLoss")
class EuclideanLoss(Layer):
    """0.5 · Σ (x − target)² / batch, the target being the second source's data (e.g. the input image)."""

    category = "loss"

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        if len(src_shapes) != 2:
            raise LayerConfigError(f"layer {conf.name!r}: needs two srclayers (prediction, target)")
        if src_shapes[0] and src_shapes[1] and torch.Size(src_shapes[0]).numel() != torch.Size(src_shapes[1]).numel():
            raise LayerConfigError(f"layer {conf.name!r}: prediction {src_shapes[0]} and target {src_shapes[1]} differ in size")
        self.shape = ()

    def forward(self, xs, params, labels, ctx):
        prediction = xs[0].reshape(xs[0].shape[0], -1)
        target = xs[1].reshape(xs[1].shape[0], -1).detach()
        loss = 0.5 * (prediction - target).pow(2).sum() / prediction.shape[0]
        ctx.report("loss", loss.item(), prediction.shape[0])
        return loss
