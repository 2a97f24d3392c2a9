"""Output layers: kAccuracy, kArgSort, and the store writers kCSVOutput and kRecordOutput."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from shoal.neuralnet.layers.base import Layer
from shoal.neuralnet.layers.common import config_error, flat, numel, top_indices
from shoal.neuralnet.layers.loss import check_topk, labels_of, topk_accuracy
from shoal.neuralnet.layers.registry import register


@register("kAccuracy")
class Accuracy(Layer):
    """Reports `accuracy`: the fraction of samples whose label is among the argsort_conf.topk best scores.

    srclayers: the scores, then the layer carrying the labels. Passes the scores on.
    """

    category = "output"

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        if len(self.src_shapes) not in (1, 2):
            raise config_error(conf, "needs the scores and (optionally) the labels' layer as srclayers")
        check_topk(self, conf.argsort_conf.topk, "argsort_conf.topk")
        self.label_classes = numel(self.src_shapes[0])

    def forward(self, xs, params, labels, ctx):
        target = labels_of(self, labels)
        ctx.report("accuracy", topk_accuracy(flat(xs[0]).detach(), target, self.conf.argsort_conf.topk), len(target))
        return xs[0]


@register("kArgSort")
class ArgSort(Layer):
    """The ids of each sample's argsort_conf.topk best scores, best first, as floats (ties: higher id first).

    With argsort_conf.sample the topk ids are drawn at random instead, the scores
    (a softmax's output) being their probabilities: char-rnn sampling.
    """

    category = "output"

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        if len(self.src_shapes) != 1:
            raise config_error(conf, f"needs exactly one srclayer, got {len(self.src_shapes)}")
        check_topk(self, conf.argsort_conf.topk, "argsort_conf.topk")
        self.shape = (conf.argsort_conf.topk,)

    def forward(self, xs, params, labels, ctx):
        scores, c = flat(xs[0]).detach(), self.conf.argsort_conf
        if c.sample:  # draw from the distribution instead of taking its mode
            generator = ctx.generator if ctx.generator is not None and ctx.generator.device == scores.device else None
            return torch.multinomial(scores.clamp_min(0), c.topk, generator=generator).to(torch.float32)
        return top_indices(scores, c.topk).to(torch.float32)


class StoreOutput(Layer):
    """Writes each sample of its source (flattened, with its label when the source carries labels) to store_conf.path.

    As SINGA, the store is created (emptied) by the first batch this layer
    writes and appended to by the following ones; keys count samples: "0", "1", ...
    Passes its input on.
    """

    category = "output"

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        if len(self.src_shapes) != 1:
            raise config_error(conf, f"needs exactly one srclayer, got {len(self.src_shapes)}")
        if not conf.store_conf.path:
            raise config_error(conf, "store_conf.path is required")
        self.path = Path(conf.store_conf.path)
        self.written = 0  # samples written so far; the next key

    def forward(self, xs, params, labels, ctx):
        data = flat(xs[0]).detach().cpu().numpy()
        label = labels[0] if labels else None
        label = None if label is None else label.reshape(-1).cpu().numpy()
        self.write(data, label, first=self.written == 0)
        self.written += len(data)
        return xs[0]

    def write(self, data: np.ndarray, labels, first: bool) -> None:
        # subclasses import the store writers when they first write: `import shoal.neuralnet.layers` stays independent of shoal.data
        raise NotImplementedError


@register("kCSVOutput")
class CSVOutput(StoreOutput):
    """One line per sample, `label,v1,v2,...` (no label field when none), separated by store_conf.separator."""

    def write(self, data, labels, first):
        from shoal.data.textfile import append_textfile, write_textfile

        (write_textfile if first else append_textfile)(self.path, data, labels, self.conf.store_conf.separator)


@register("kRecordOutput")
class RecordOutput(StoreOutput):
    """One RecordProto {shape, label, data} per sample in the kvfile store_conf.path."""

    def write(self, data, labels, first):
        from shoal.data.kvfile import KVFileWriter
        from shoal.data.records import encode_floats

        with KVFileWriter(self.path, append=not first) as w:
            for i, row in enumerate(data):
                w.write(str(self.written + i), encode_floats(row, None if labels is None else int(labels[i])))
