"""Integer ids to vectors: kOneHot and kEmbedding.

Both read one id per sample. A source with several ids per sample (kCharRNN
emits unroll_len + 1 of them) is read at column `unroll_index`: the i-th
unrolled copy of the layer reads the i-th id, as SINGA's data(unroll_index()).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from shoal.config import job_pb2
from shoal.neuralnet.layers.base import Layer
from shoal.neuralnet.layers.common import config_error, flat, numel
from shoal.neuralnet.layers.registry import register


def step_ids(x: torch.Tensor, step: int) -> torch.Tensor:
    """int64 ids (B,) of column `step` of a (B, steps) id tensor; a single column is read whatever the step."""
    ids = flat(x)
    return ids[:, step if ids.shape[1] > 1 else 0].long()


def check_id_source(conf: job_pb2.LayerProto, src_shapes) -> None:
    if len(src_shapes) != 1:
        raise config_error(conf, f"needs exactly one srclayer (the ids), got {len(src_shapes)}")
    steps = numel(src_shapes[0])
    if steps > 1 and conf.unroll_index >= steps:
        raise config_error(conf, f"unroll_index {conf.unroll_index} reads past the {steps} ids per sample of its source")


@register("kOneHot")
class OneHot(Layer):
    """y[i] = 1 for i = id, else 0; vocab_size = onehot_conf.vocab_size values per sample."""

    category = "input"  # as in SINGA: it transforms data, nothing flows back through it

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        check_id_source(conf, self.src_shapes)
        if conf.onehot_conf.vocab_size <= 0:
            raise config_error(conf, "onehot_conf.vocab_size is required and must be > 0")
        self.shape = (conf.onehot_conf.vocab_size,)

    def forward(self, xs, params, labels, ctx):
        ids = step_ids(xs[0], self.conf.unroll_index)
        return F.one_hot(ids, self.shape[0]).to(torch.get_default_dtype())


@register("kEmbedding")
class Embedding(Layer):
    """y = E[id]: row `id` of the table E, a param of shape (vocab_size, feature_dim).

    The gradient of E adds each sample's output gradient to its row (autograd of indexing).
    """

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        check_id_source(conf, self.src_shapes)
        c = conf.embedding_conf
        if c.vocab_size <= 0 or c.feature_dim <= 0:
            raise config_error(conf, "embedding_conf.vocab_size (required) and feature_dim must be > 0")
        self.shape = (c.feature_dim,)

    def param_shapes(self):
        c = self.conf.embedding_conf
        return [(c.vocab_size, c.feature_dim)]

    def forward(self, xs, params, labels, ctx):
        return params[0][step_ids(xs[0], self.conf.unroll_index)]
