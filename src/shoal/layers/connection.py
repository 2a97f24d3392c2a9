"""Connection layers, mostly inserted by the partitioner (SINGA's kSplit, kConcate, kSlice, bridges).

Shapes are per sample, so concate_dim / slice_dim 0 (the batch) leave the
per-sample shape alone and dim 1 (features) changes its first entry.
"""
from __future__ import annotations

import torch

from shoal.layers.base import Layer, LayerConfigError
from shoal.layers.registry import register


@register("kSplit")
class Split(Layer):
    """One output read by several layers; autograd sums their gradients."""

    category = "connection"

    def forward(self, xs, params, labels, ctx):
        return xs[0]


@register("kConcate")
class Concate(Layer):
    """Concatenates its sources on concate_dim (0: batch, 1: features)."""

    category = "connection"

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        dim = conf.concate_conf.concate_dim
        if dim not in (0, 1):
            raise LayerConfigError(f"layer {conf.name!r}: concate_dim must be 0 or 1")
        if dim == 1:
            first = self.src_shapes[0]
            self.shape = (sum(s[0] for s in self.src_shapes),) + tuple(first[1:])

    def forward(self, xs, params, labels, ctx):
        dim = self.conf.concate_conf.concate_dim
        out = torch.cat(xs, dim=dim)
        aux = None
        if dim == 0 and labels and all(l is not None for l in labels):
            aux = torch.cat(labels, dim=0)
        elif labels:
            aux = labels[0]
        return out, aux


@register("kSlice")
class Slice(Layer):
    """Slice `partition_id` of num_slices equal-as-possible parts on slice_dim (0: batch, 1: features)."""

    category = "connection"

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        c = conf.slice_conf
        if c.slice_dim not in (0, 1):
            raise LayerConfigError(f"layer {conf.name!r}: slice_dim must be 0 or 1")
        if c.slice_dim == 1:
            sizes = split_sizes(self.src_shapes[0][0], c.num_slices)
            self.shape = (sizes[conf.partition_id],) + tuple(self.src_shapes[0][1:])

    def forward(self, xs, params, labels, ctx):
        c = self.conf.slice_conf
        x = xs[0]
        sizes = split_sizes(x.shape[c.slice_dim], c.num_slices)
        start = sum(sizes[: self.conf.partition_id])
        part = x.narrow(c.slice_dim, start, sizes[self.conf.partition_id])
        aux = labels[0] if labels else None
        if c.slice_dim == 0 and aux is not None:
            aux = aux.narrow(0, start, sizes[self.conf.partition_id])
        return part, aux


@register("kBridgeSrc", "kBridgeDst")
class Bridge(Layer):
    """Moves a blob between workers; in one worker's net it is the identity (the runtime does the transfer)."""

    category = "connection"

    def forward(self, xs, params, labels, ctx):
        return xs[0]


def split_sizes(total: int, parts: int) -> list[int]:
    """`total` split into `parts` sizes differing by at most one, larger ones first (4096 over 3: 1366, 1365, 1365)."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]
