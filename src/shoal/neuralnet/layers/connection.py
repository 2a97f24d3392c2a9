"""Connection layers, mostly inserted by the partitioner: kSplit, kConcate, kSlice, kBridgeSrc/kBridgeDst.

Per-sample shapes leave the batch out, so SINGA's dim 0 (the batch) keeps the
per-sample shape and changes the number of rows, while dim 1 (features) changes
the first entry of the per-sample shape.
"""
from __future__ import annotations

import torch

from shoal.neuralnet.layers.base import Layer
from shoal.neuralnet.layers.common import config_error
from shoal.neuralnet.layers.registry import register


def split_sizes(total: int, parts: int) -> list[int]:
    """`total` split into `parts` sizes differing by at most one, larger ones first (4096 over 3: 1366, 1365, 1365)."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


@register("kSplit")
class Split(Layer):
    """y = x, read by several layers; autograd sums the gradients flowing back, as SINGA's split does."""

    category = "connection"

    def forward(self, xs, params, labels, ctx):
        return xs[0]


@register("kBridgeSrc", "kBridgeDst")
class Bridge(Layer):
    """y = x: within one worker's net a bridge is the identity; the runtime moves the blob between workers."""

    category = "connection"

    def forward(self, xs, params, labels, ctx):
        return xs[0]


@register("kConcate")
class Concate(Layer):
    """y = concatenation of the sources along concate_dim: 0 stacks their rows (batches), 1 their features.

    Labels: dim 0 concatenates the sources' labels too; dim 1 keeps the first source's.
    """

    category = "connection"

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        dim = conf.concate_conf.concate_dim
        if not self.src_shapes:
            raise config_error(conf, "needs at least one srclayer")
        first = self.src_shapes[0]
        if dim == 0:
            if any(s != first for s in self.src_shapes):
                raise config_error(conf, f"concate_dim 0 needs equal per-sample shapes, got {self.src_shapes}")
        elif dim == 1:
            if any(not s or s[1:] != first[1:] for s in self.src_shapes):
                raise config_error(conf, f"concate_dim 1 needs shapes that differ only in their first entry, got {self.src_shapes}")
            self.shape = (sum(s[0] for s in self.src_shapes),) + first[1:]
        else:
            raise config_error(conf, f"concate_conf.concate_dim must be 0 (batch) or 1 (features), got {dim}")

    def forward(self, xs, params, labels, ctx):
        dim = self.conf.concate_conf.concate_dim
        aux = labels[0] if labels else None
        if dim == 0 and labels and all(label is not None for label in labels):
            aux = torch.cat(labels, dim=0)
        return torch.cat(xs, dim=dim), aux


@register("kSlice")
class Slice(Layer):
    """Part `partition_id` of num_slices parts of the source along slice_dim (0: rows, 1: features).

    Near-equal parts, larger first; rows follow the group's batch shares when the runtime gives them (ctx.batch_shares).
    """

    category = "connection"

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        c = conf.slice_conf
        if len(self.src_shapes) != 1:
            raise config_error(conf, f"needs exactly one srclayer, got {len(self.src_shapes)}")
        if c.slice_dim not in (0, 1):
            raise config_error(conf, f"slice_conf.slice_dim must be 0 (batch) or 1 (features), got {c.slice_dim}")
        if c.num_slices <= 0 or not 0 <= conf.partition_id < c.num_slices:
            raise config_error(conf, f"partition_id {conf.partition_id} must index one of slice_conf.num_slices {c.num_slices}")
        if c.slice_dim == 1:
            src = self.src_shapes[0]
            if not src or src[0] < c.num_slices:
                raise config_error(conf, f"cannot cut per-sample shape {src} into {c.num_slices} feature slices")
            self.shape = (split_sizes(src[0], c.num_slices)[conf.partition_id],) + src[1:]

    def forward(self, xs, params, labels, ctx):
        c = self.conf.slice_conf
        x = xs[0]
        shares = ctx.batch_shares
        if c.slice_dim == 0 and shares and len(shares) == c.num_slices and sum(shares) == x.shape[0]:
            sizes = list(shares)
        else:
            sizes = split_sizes(x.shape[c.slice_dim], c.num_slices)
        start, size = sum(sizes[: self.conf.partition_id]), sizes[self.conf.partition_id]
        aux = labels[0] if labels else None
        if c.slice_dim == 0 and aux is not None:
            aux = aux.narrow(0, start, size)
        return x.narrow(c.slice_dim, start, size), aux
