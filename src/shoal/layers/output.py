"""Output layers: accuracy, top-k ids, and writers of features to stores."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from shoal.data.kvfile import KVFileWriter
from shoal.data.records import encode_floats
from shoal.data.textfile import append_textfile
from shoal.layers.base import Layer
from shoal.layers.loss import labels_of, topk_accuracy
from shoal.layers.registry import register


@register("kAccuracy")
class Accuracy(Layer):
    """Reports top-k `accuracy` of its first source's scores (softmaxloss_conf.topk, default 1); passes them on."""

    category = "output"

    def forward(self, xs, params, labels, ctx):
        scores = xs[0].reshape(xs[0].shape[0], -1)
        target = labels_of(self, labels).reshape(-1).long()
        ctx.report("accuracy", topk_accuracy(scores, target, self.conf.softmaxloss_conf.topk), len(target))
        return xs[0]


@register("kArgSort")
class ArgSort(Layer):
    """The ids of the top-k scores of each sample (argsort_conf.topk), best first, as floats."""

    category = "output"

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        self.shape = (conf.argsort_conf.topk,)

    def forward(self, xs, params, labels, ctx):
        scores = xs[0].reshape(xs[0].shape[0], -1)
        return scores.topk(self.conf.argsort_conf.topk, dim=1).indices.to(torch.float32)


class _StoreOutput(Layer):
    category = "output"

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        self.path = Path(conf.store_conf.path or f"{conf.name}.out")
        self.written = 0

    def forward(self, xs, params, labels, ctx):
        data = xs[0].detach().cpu().numpy()
        target = labels[0].detach().cpu().numpy() if labels and labels[0] is not None else None
        self.write(data.reshape(len(data), -1), target)
        self.written += len(data)
        return xs[0]


@register("kCSVOutput")
class CSVOutput(_StoreOutput):
    """Appends one CSV line per sample (label first when known) to store_conf.path."""

    def write(self, data: np.ndarray, labels):
        append_textfile(self.path, data, labels, self.conf.store_conf.separator)


@register("kRecordOutput")
class RecordOutput(_StoreOutput):
    """Appends one RecordProto per sample to the kvfile at store_conf.path."""

    def write(self, data: np.ndarray, labels):
        with KVFileWriter.appending(self.path) as w:
            for i, row in enumerate(data):
                w.write(f"{self.written + i:08d}", encode_floats(row, None if labels is None else int(labels[i])))
