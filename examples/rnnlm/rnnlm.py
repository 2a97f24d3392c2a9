"""SINGA's RNN language model (examples/rnnlm) as a shoal plugin: kData, kEmbedding, kHidden, kLoss.

Mikolov's class-based RNNLM: a word's embedding feeds a sigmoid recurrence, and the next word's
probability is p(class | h) · p(word | class, h), each a softmax (the word softmax only over the
words of the class). The configuration is SINGA's rnnlm.proto ([data_conf], [embedding_conf],
[loss_conf]); the records are its WordRecords, one per word, in a kvfile (prepare.py writes them).

A sample is one window, as SINGA's DataLayer reads it: the last word of the previous window, then
up to max_window words, ending early at a sentence end (</s>, word index 0). Rows of a window are
(word_index, class_index, class_start, class_end); rows past its end are -1. SINGA trains on one
window per step; `store_conf { batchsize: N }` on the data layer (e.g. from the command line) makes
it N windows, which a synchronous group splits among its workers.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import rnnlm_pb2  # SINGA's rnnlm.proto, compiled by shoal when the job names it as a plugin
import shoal
from shoal.data.dataset import Dataset
from shoal.data.kvfile import read_kvfile
from shoal.neuralnet.layers import Layer, LayerConfigError

FIELDS = 4  # word_index, class_index, class_start, class_end


def read_words(path: Path) -> np.ndarray:
    """(N, 4) int64: the WordRecords of a kvfile, in file order."""
    rows = []
    for _, value in read_kvfile(path):
        word = rnnlm_pb2.WordRecord.FromString(value)
        rows.append((word.word_index, word.class_index, word.class_start, word.class_end))
    if not rows:
        raise LayerConfigError(f"{path}: holds no WordRecord")
    return np.asarray(rows, dtype=np.int64)


def windows(words: np.ndarray, max_window: int) -> np.ndarray:
    """(windows, max_window + 1, 4) float32, one pass over the words as SINGA's DataLayer reads them."""
    out, start = [], 0
    while start < len(words) - 1:
        end = start + 1
        while end < len(words) and end - start <= max_window:
            end += 1
            if words[end - 1, 0] == 0:  # a sentence end closes the window
                break
        window = np.full((max_window + 1, FIELDS), -1, dtype=np.float32)
        window[: end - start] = words[start:end]
        out.append(window)
        start = end - 1  # the next window starts with this one's last word
    return np.stack(out)


def extension(conf, field):
    if not conf.HasExtension(field):
        raise LayerConfigError(f"layer {conf.name!r} ({conf.user_type}): [{field.name}] {{ ... }} is required")
    return conf.Extensions[field]


@shoal.register_layer("kData")
class Data(Layer):
    """Windows of word records: [data_conf] { path, max_window, backend: "kvfile" }."""

    category = "input"

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        self.data_conf = extension(conf, rnnlm_pb2.data_conf)
        if self.data_conf.max_window < 1:
            raise LayerConfigError(f"layer {conf.name!r}: [data_conf] max_window must be >= 1")
        if self.data_conf.backend != "kvfile":
            raise LayerConfigError(f"layer {conf.name!r}: [data_conf] backend {self.data_conf.backend!r}: shoal reads kvfile stores")
        self.shape = (self.data_conf.max_window + 1, FIELDS)

    @staticmethod
    def batch_size(conf) -> int:
        """Windows per step: SINGA's one, or store_conf.batchsize."""
        return conf.store_conf.batchsize[0] if conf.store_conf.batchsize else 1

    def open_dataset(self, base_dirs) -> Dataset:
        path = next((Path(d) / self.data_conf.path for d in base_dirs if (Path(d) / self.data_conf.path).is_file()), None)
        if path is None:
            raise LayerConfigError(f"layer {self.name!r}: [data_conf] path {self.data_conf.path!r} is not a file (run examples/rnnlm/prepare.py)")
        return Dataset(windows(read_words(path), self.data_conf.max_window), None, str(path))

    def forward(self, xs, params, labels, ctx):
        data, _ = ctx.feeds[self.name]
        return data, None


@shoal.register_layer("kEmbedding")
class Embedding(Layer):
    """Row word_index of the (vocab_size, word_dim) table for the window's input words (rows 0 .. max_window - 1)."""

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        self.emb = extension(conf, rnnlm_pb2.embedding_conf)
        self.window = self.src_shapes[0][0] - 1
        self.shape = (self.window, self.emb.word_dim)

    def param_shapes(self):
        return [(self.emb.vocab_size, self.emb.word_dim)]

    def forward(self, xs, params, labels, ctx):
        ids = xs[0][:, : self.window, 0].long()
        if int(ids.max()) >= self.emb.vocab_size:
            raise LayerConfigError(f"layer {self.name!r}: word index {int(ids.max())} >= [embedding_conf] vocab_size {self.emb.vocab_size}")
        rows = params[0][ids.clamp(min=0)]
        return rows * (ids >= 0).unsqueeze(-1)  # padding rows embed to zeros


@shoal.register_layer("kHidden")
class Hidden(Layer):
    """h[t] = sigmoid(h[t-1] · W + x[t]), h[0] = sigmoid(x[0]); W is (word_dim, word_dim)."""

    def param_shapes(self):
        return [(self.shape[1], self.shape[1])]

    def forward(self, xs, params, labels, ctx):
        x, weight = xs[0], params[0]
        states = [torch.sigmoid(x[:, 0])]
        for t in range(1, x.shape[1]):
            states.append(torch.sigmoid(states[-1] @ weight + x[:, t]))
        return torch.stack(states, dim=1)


@shoal.register_layer("kLoss")
class Loss(Layer):
    """−log p(class | h) − log p(word | class, h) of each next word; srclayers: the hidden layer, the data layer.

    Params: the word weights (vocab_size, dim) and the class weights (nclass, dim). Reports `loss`
    per word (natural log): SINGA's perplexity per word is exp(Loss) of a Train or Validate line.
    (A per-batch exp would not average to it, so no `ppl` metric is reported.)
    """

    category = "loss"

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        if len(self.src_shapes) != 2:
            raise LayerConfigError(f"layer {conf.name!r}: srclayers are the hidden layer and the data layer")
        self.loss_conf = extension(conf, rnnlm_pb2.loss_conf)
        self.dim = self.src_shapes[0][-1]
        self.shape = ()

    def param_shapes(self):
        return [(self.loss_conf.vocab_size, self.dim), (self.loss_conf.nclass, self.dim)]

    def forward(self, xs, params, labels, ctx):
        hidden, records = xs[0], xs[1][:, 1:]  # the word to predict at t is record t + 1
        word_weight, class_weight = params
        valid = records[..., 0] >= 0
        h, target = hidden[valid], records[valid].long()  # (words, dim), (words, 4)
        word, cls, start, end = target.unbind(-1)
        class_logp = F.log_softmax(h @ class_weight.T, dim=-1).gather(1, cls[:, None]).squeeze(1)
        vocab = torch.arange(self.loss_conf.vocab_size, device=h.device)
        in_class = (vocab >= start[:, None]) & (vocab < end[:, None])
        word_logits = (h @ word_weight.T).masked_fill(~in_class, float("-inf"))
        word_logp = F.log_softmax(word_logits, dim=-1).gather(1, word[:, None]).squeeze(1)
        word_loss = -(class_logp + word_logp)
        with torch.no_grad():  # averaged over the words of a display window or a validation: exp of it is SINGA's ppl
            ctx.report("loss", word_loss.mean().item(), len(word))
        # SINGA's gradient sums over a window's words; over a batch of windows, the mean of those sums
        return word_loss.sum() / hidden.shape[0]
