"""Helpers shared by the layer modules: config errors, flattening, random draws, top-k."""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from shoal.config import job_pb2
from shoal.neuralnet.layers.base import Context, LayerConfigError


def config_error(conf: job_pb2.LayerProto, message: str) -> LayerConfigError:
    """A LayerConfigError that names the layer and its type, e.g. `layer 'conv1' (kConvolution): ...`."""
    return LayerConfigError(f"layer {conf.name!r} ({job_pb2.LayerType.Name(conf.type)}): {message}")


def numel(shape: Sequence[int]) -> int:
    """Values per sample of a per-sample shape (1 for a scalar per sample)."""
    return math.prod(shape)


def flat(x: torch.Tensor) -> torch.Tensor:
    """(B, ...) → (B, values per sample): SINGA's blobs are matrices for these layers."""
    return x.reshape(x.shape[0], -1)


def uniform(shape: Sequence[int], ctx: Context, device: torch.device, per_sample: bool = False) -> torch.Tensor:
    """U[0, 1) float32 values drawn from ctx.generator, on `device`.

    The draw happens on the generator's own device (a CPU generator can serve
    GPU data) and in float32 whatever the data's dtype, so a float64 gradient
    check sees the draws a float32 run sees. per_sample: dim 0 is this worker's
    rows of the batch (see `draw`).
    """
    return draw(torch.rand, shape, ctx, device, per_sample)


def normal(shape: Sequence[int], ctx: Context, device: torch.device, per_sample: bool = False) -> torch.Tensor:
    """N(0, 1) float32 values drawn as `uniform` draws."""
    return draw(torch.randn, shape, ctx, device, per_sample)


def draw(fn, shape: Sequence[int], ctx: Context, device: torch.device, per_sample: bool) -> torch.Tensor:
    """fn(shape) from ctx.generator. With per_sample and ctx.rows = (offset, share, global batch),
    the draw is made for the whole batch and this worker's rows are kept: every worker of a
    group (same generator state) sees, row for row, the values one worker with the whole batch sees."""
    generator = ctx.generator
    where = generator.device if generator is not None else device
    shape = tuple(shape)
    if per_sample and ctx.rows is not None and shape and shape[0] == ctx.rows[1] != ctx.rows[2]:
        offset, share, total = ctx.rows
        return fn((total,) + shape[1:], generator=generator, device=where)[offset : offset + share].to(device)
    return fn(shape, generator=generator, device=where).to(device)


def top_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Column ids of the k largest scores per row, best first.

    Ties go to the higher column id, as SINGA's partial_sort over
    (score, id) pairs with std::greater does: reverse the columns, sort
    stably descending (equal scores keep reversed order), map ids back.
    """
    columns = scores.shape[1]
    order = torch.sort(scores.flip(1), dim=1, descending=True, stable=True).indices[:, :k]
    return columns - 1 - order
