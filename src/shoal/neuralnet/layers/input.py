"""kRecordInput / kCSVInput: the batch fed by the runtime, normalised as SINGA's store input layers."""
from __future__ import annotations

import torch

from shoal.neuralnet.layers.base import Context, Layer
from shoal.neuralnet.layers.common import config_error, numel
from shoal.neuralnet.layers.registry import register


def fed_batch(layer: Layer, ctx: Context) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(data, labels) the runtime put in ctx.feeds for this input layer."""
    try:
        return ctx.feeds[layer.name]
    except KeyError:
        raise KeyError(f"input layer {layer.name!r}: no batch in ctx.feeds (feeds for {sorted(ctx.feeds)})") from None


@register("kRecordInput", "kCSVInput")
class StoreInput(Layer):
    """Rows of a record store (kvfile) or CSV store, normalised: x = (x − mean) / std.

    mean: the mean image of store_conf.mean_file, else mean_value, else none.
    std: the values of store_conf.std_file, else std_value, else none.
    The runtime loads the files (shoal.data.dataset.load_mean) into `self.mean`
    and `self.std`; shapes come from store_conf.shape. The labels travel with the
    data as the layer's aux (none when store_conf.has_label is false).
    Feed: ctx.feeds[name] = (float32 data (B, ...), int64 labels (B,) or None).
    """

    category = "input"

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        store = conf.store_conf
        if not store.path:
            raise config_error(conf, "store_conf.path is required")
        if not store.shape:
            raise config_error(conf, "store_conf.shape is required (e.g. shape: 784, or shape: 3 shape: 32 shape: 32)")
        if store.HasField("std_value") and store.std_value == 0:
            raise config_error(conf, "store_conf.std_value must not be 0")
        self.shape = tuple(store.shape)
        self.mean: torch.Tensor | None = None
        self.std: torch.Tensor | None = None

    def _statistic(self, image: torch.Tensor | None, file_field: str, value_field: str):
        store = self.conf.store_conf
        if image is not None:
            if image.numel() != numel(self.shape):
                raise ValueError(f"layer {self.name!r}: store_conf.{file_field} holds {image.numel()} values, a sample has {numel(self.shape)}")
            return image.reshape(self.shape)
        if store.HasField(file_field):
            raise ValueError(f"layer {self.name!r}: store_conf.{file_field} is set but not loaded (the runtime sets layer.{file_field.split('_')[0]})")
        return getattr(store, value_field) if store.HasField(value_field) else None

    def forward(self, xs, params, labels, ctx):
        data, label = fed_batch(self, ctx)
        x = data.reshape((data.shape[0],) + self.shape)
        mean = self._statistic(self.mean, "mean_file", "mean_value")
        std = self._statistic(self.std, "std_file", "std_value")
        if mean is not None:
            x = x - mean
        if std is not None:
            x = x / std
        return x, (label if self.conf.store_conf.has_label else None)
