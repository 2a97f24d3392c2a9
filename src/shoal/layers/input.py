"""Input layers: they take their batch from ctx.feeds and normalise it as SINGA's do."""
from __future__ import annotations

import math
from typing import Optional

import torch

from shoal.config import job_pb2
from shoal.layers.base import Context, Layer, LayerConfigError
from shoal.layers.registry import register


@register("kRecordInput", "kCSVInput")
class StoreInput(Layer):
    """Rows of a record store (kvfile) or CSV store, as x = (x − mean) / std.

    mean is the mean image of `store_conf.mean_file` when given (the runtime
    sets `self.mean`), else `mean_value` (default 0); std is `std_value`
    (default 1). Labels travel with the data as the layer's aux.
    """

    category = "input"

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        store = conf.store_conf
        if not conf.HasField("store_conf") or not store.path:
            raise LayerConfigError(f"layer {conf.name!r}: store_conf.path is required")
        if not store.shape:
            raise LayerConfigError(f"layer {conf.name!r}: store_conf.shape is required (e.g. shape: 784)")
        self.shape = tuple(store.shape)
        self.mean: Optional[torch.Tensor] = None
        self.mean_value = store.mean_value if store.HasField("mean_value") else 0.0
        self.std_value = store.std_value if store.HasField("std_value") else 1.0

    def forward(self, xs, params, labels, ctx: Context):
        data, label = ctx.feeds[self.name]
        data = data.reshape((data.shape[0],) + self.shape)
        mean = self.mean.reshape(self.shape) if self.mean is not None else self.mean_value
        return (data - mean) / self.std_value, (label if self.conf.store_conf.has_label else None)


@register("kImagePreprocess")
class ImagePreprocess(Layer):
    """Subtract the mean image, crop (random in training, centred otherwise), mirror (random in training), scale.

    `rgbimage_conf` {scale, cropsize, mirror, meanfile}.
    """

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        c = conf.rgbimage_conf
        self.mean: Optional[torch.Tensor] = None  # the mean image of rgbimage_conf.meanfile, set by the runtime
        if len(self.src_shapes[0]) != 3:
            raise LayerConfigError(f"layer {conf.name!r}: expects C×H×W images, got shape {self.src_shapes[0]}")
        ch, h, w = self.src_shapes[0]
        self.crop = c.cropsize
        if self.crop > min(h, w):
            raise LayerConfigError(f"layer {conf.name!r}: cropsize {self.crop} exceeds the image ({h}×{w})")
        self.shape = (ch, self.crop, self.crop) if self.crop else (ch, h, w)

    def forward(self, xs, params, labels, ctx):
        x = xs[0]
        c = self.conf.rgbimage_conf
        if self.mean is not None:
            x = x - self.mean.reshape(x.shape[1:])
        training = ctx.phase == job_pb2.kTrain
        if self.crop:
            h, w = x.shape[-2:]
            if training:
                top = int(torch.randint(0, h - self.crop + 1, (1,), generator=ctx.generator, device=ctx.generator.device))
                left = int(torch.randint(0, w - self.crop + 1, (1,), generator=ctx.generator, device=ctx.generator.device))
            else:
                top, left = (h - self.crop) // 2, (w - self.crop) // 2
            x = x[..., top : top + self.crop, left : left + self.crop]
        if c.mirror and training and bool(torch.rand((), generator=ctx.generator, device=ctx.generator.device) < 0.5):
            x = x.flip(-1)
        if c.scale != 1:
            x = x * c.scale
        return x


@register("kDummy")
class Dummy(Layer):
    """Tests only: as input, random data of `dummy_conf.shape`; otherwise a copy of its source."""

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        c = conf.dummy_conf
        if c.input:
            self.category = "input"
            if len(c.shape) < 2:
                raise LayerConfigError(f"layer {conf.name!r}: dummy_conf.shape needs the batch size and the sample shape")
            self.batch = c.shape[0]
            self.shape = tuple(c.shape[1:])

    def forward(self, xs, params, labels, ctx):
        if self.conf.dummy_conf.input:
            shape = (self.batch,) + self.shape
            return torch.rand(shape, generator=ctx.generator, device=ctx.generator.device if ctx.generator else ctx.device)
        return xs[0]


@register("kOneHot")
class OneHot(Layer):
    """Integer ids (B,) or (B, 1) → one-hot float vectors of onehot_conf.vocab_size."""

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        if conf.onehot_conf.vocab_size <= 0:
            raise LayerConfigError(f"layer {conf.name!r}: onehot_conf.vocab_size must be > 0")
        self.shape = (conf.onehot_conf.vocab_size,)

    def forward(self, xs, params, labels, ctx):
        ids = xs[0].reshape(xs[0].shape[0]).long()
        return torch.nn.functional.one_hot(ids, self.shape[0]).to(torch.float32)


@register("kEmbedding")
class Embedding(Layer):
    """Integer ids → rows of a (vocab_size × feature_dim) table."""

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        c = conf.embedding_conf
        if c.vocab_size <= 0:
            raise LayerConfigError(f"layer {conf.name!r}: embedding_conf.vocab_size must be > 0")
        self.shape = (c.feature_dim,)

    def param_shapes(self):
        return [(self.conf.embedding_conf.vocab_size, self.conf.embedding_conf.feature_dim)]

    def forward(self, xs, params, labels, ctx):
        ids = xs[0].reshape(xs[0].shape[0]).long()
        return params[0][ids]


def flat_size(shape) -> int:
    return math.prod(shape) if shape else 1
