"""Geometry shared by the image layers (convolution, pooling, LRN)."""
from __future__ import annotations

from collections.abc import Sequence

from shoal.config import job_pb2
from shoal.neuralnet.layers.common import config_error

Shape = tuple[int, ...]


def image_shape(conf: job_pb2.LayerProto, src_shapes: Sequence[Shape]) -> tuple[int, int, int]:
    """(C, H, W) of the single source; an H×W source is one channel, as in SINGA."""
    if len(src_shapes) != 1:
        raise config_error(conf, f"needs exactly one srclayer, got {len(src_shapes)}")
    shape = tuple(src_shapes[0])
    if len(shape) == 2:
        return (1,) + shape
    if len(shape) != 3:
        raise config_error(conf, f"expects C×H×W (or H×W) input, got per-sample shape {shape}; give the input layer's store_conf.shape as C, H, W")
    return shape


def yx_pair(conf_message, name: str) -> tuple[int, int]:
    """(y, x) of `name` (kernel, pad or stride): `name_y` / `name_x` override `name` when set."""
    base = getattr(conf_message, name)
    y = getattr(conf_message, f"{name}_y") if conf_message.HasField(f"{name}_y") else base
    x = getattr(conf_message, f"{name}_x") if conf_message.HasField(f"{name}_x") else base
    return int(y), int(x)


def output_size(size: int, kernel: int, pad: int, stride: int) -> int:
    """Windows along one axis, as SINGA computes them for convolution and pooling:
    ⌊(size + 2·pad − kernel) / stride⌋ + 1 (floor; Caffe's pooling rounds up instead)."""
    return (size + 2 * pad - kernel) // stride + 1
