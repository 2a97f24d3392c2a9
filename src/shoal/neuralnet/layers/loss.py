"""Loss layers: kSoftmaxLoss / kCudnnSoftmaxLoss and kEuclideanLoss.

A loss layer returns the mean loss over the batch it is given (a 0-d tensor)
and reports its metrics with count = batch size, so a runtime that splits a
batch over workers recovers the batch's metric as the count-weighted mean.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from shoal.neuralnet.layers.base import Layer
from shoal.neuralnet.layers.common import config_error, flat, numel, top_indices
from shoal.neuralnet.layers.registry import register


def labels_of(layer: Layer, labels: list[torch.Tensor | None]) -> torch.Tensor:
    """The labels a layer reads: the aux of its second source when it has two (SINGA's srclayers[1]), else of its first."""
    found = labels[1] if len(labels) > 1 else labels[0]
    if found is None:
        raise config_error(layer.conf, "its sources carry no labels (is store_conf.has_label false, or do the records lack a label?)")
    return found.reshape(-1).long()


def topk_accuracy(scores: torch.Tensor, target: torch.Tensor, k: int) -> torch.Tensor:
    """Fraction of rows whose target is among the k best scores (ties: higher id first, as SINGA), a 0-d tensor where
    the scores are (MetricWindow reads it when it is shown)."""
    return (top_indices(scores, k) == target[:, None]).any(dim=1).float().mean()


def check_topk(layer: Layer, k: int, field: str) -> None:
    classes = numel(layer.src_shapes[0]) if layer.src_shapes else 0
    if not 0 < k <= classes:
        raise config_error(layer.conf, f"{field} {k} must be in 1..{classes} (the scores per sample)")


@register("kSoftmaxLoss", "kCudnnSoftmaxLoss")
class SoftmaxLoss(Layer):
    """loss = scale · (1/B) Σ_n −log softmax(x_n)[label_n]; srclayers: scores, then the layer carrying the labels.

    Reports `loss` (scaled, as SINGA) and `accuracy`: the fraction of samples
    whose label is among the softmaxloss_conf.topk best scores. SINGA also
    multiplied the accuracy by `scale`; shoal reports the plain fraction.
    """

    category = "loss"

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        if len(self.src_shapes) not in (1, 2):
            raise config_error(conf, "needs the scores and (optionally, when the scores carry none) the labels' layer as srclayers")
        check_topk(self, conf.softmaxloss_conf.topk, "softmaxloss_conf.topk")
        self.label_classes = numel(self.src_shapes[0])
        self.shape = ()

    def forward(self, xs, params, labels, ctx):
        c = self.conf.softmaxloss_conf
        scores = flat(xs[0])
        target = labels_of(self, labels)
        loss = F.cross_entropy(scores, target) * c.scale
        with torch.no_grad():
            ctx.report("loss", loss.detach(), len(target))  # read when shown (MetricWindow)
            ctx.report("accuracy", topk_accuracy(scores, target, c.topk), len(target))
        return loss


@register("kEuclideanLoss")
class EuclideanLoss(Layer):
    """loss = (1/2B) Σ ‖x_n − t_n‖², srclayers: the prediction x, then the target t (e.g. the input image).

    The target gets no gradient, and ∂loss/∂x = (x − t)/B is SINGA's gradient.
    The reported `loss` is SINGA's displayed value (1/B) Σ ‖x_n − t_n‖², without
    the ½ (SINGA's ComputeFeature and ComputeGradient disagree by that factor).
    """

    category = "loss"

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        if len(self.src_shapes) != 2:
            raise config_error(conf, f"needs two srclayers (prediction, target), got {len(self.src_shapes)}")
        if numel(self.src_shapes[0]) != numel(self.src_shapes[1]):
            raise config_error(conf, f"prediction {self.src_shapes[0]} and target {self.src_shapes[1]} differ in size")
        self.shape = ()

    def forward(self, xs, params, labels, ctx):
        prediction, target = flat(xs[0]), flat(xs[1]).detach()
        batch = prediction.shape[0]
        squared = (prediction - target).pow(2).sum() / batch
        ctx.report("loss", squared.detach(), batch)
        return 0.5 * squared
