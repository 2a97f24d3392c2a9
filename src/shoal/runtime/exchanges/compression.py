"""Compressed pushes: what a worker group sends its servers, in fewer bytes.

  none    float32, as SINGA
  bf16    bfloat16 values: half the bytes, 8 bits of mantissa
  fp16    float16 values: half the bytes, 11 bits of mantissa, a narrower range
  top-k   the k = ceil(fraction · n) entries of largest magnitude, as int32 indices and bfloat16
          values (6 bytes an entry: 1 % of the entries is about 67x fewer bytes), with error
          feedback: what was not sent is kept and added to the next push (Stich et al. 2018;
          SINGA 4's DistOpt offers the same), so every gradient is eventually applied

A compressed run is no longer bit-exact with one worker; `shoal plan` says so.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from shoal.config import job_pb2


class Codec:
    """Encodes a flat float32 gradient into the tensors sent, and decodes them back (one per direction)."""

    def buffers(self, size: int) -> list[torch.Tensor]:
        return [torch.zeros(size)]

    def encode(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat]

    def decode(self, received: list[torch.Tensor], size: int) -> torch.Tensor:
        return received[0]


class CastCodec(Codec):
    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def buffers(self, size: int) -> list[torch.Tensor]:
        return [torch.zeros(size, dtype=self.dtype)]

    def encode(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat.to(self.dtype)]

    def decode(self, received: list[torch.Tensor], size: int) -> torch.Tensor:
        return received[0].float()


class TopKCodec(Codec):
    """Top-k with error feedback; one codec per (sender, receiver) pair: it holds the sender's residual."""

    def __init__(self, fraction: float):
        self.fraction = fraction
        self.residual: Optional[torch.Tensor] = None

    def k(self, size: int) -> int:
        return min(size, max(1, math.ceil(self.fraction * size))) if size else 0

    def buffers(self, size: int) -> list[torch.Tensor]:
        k = self.k(size)
        return [torch.zeros(k, dtype=torch.int32), torch.zeros(k, dtype=torch.bfloat16)]

    def encode(self, flat: torch.Tensor) -> list[torch.Tensor]:
        corrected = flat if self.residual is None else flat + self.residual
        k = self.k(corrected.numel())
        index = corrected.abs().topk(k, sorted=False).indices
        values = corrected[index].to(torch.bfloat16)
        sent = torch.zeros_like(corrected)
        sent[index] = values.float()
        self.residual = corrected - sent  # what was not sent, bf16 rounding included, goes out later
        return [index.to(torch.int32), values]

    def decode(self, received: list[torch.Tensor], size: int) -> torch.Tensor:
        flat = torch.zeros(size)
        flat[received[0].long()] = received[1].float()
        return flat


def codec_for(cluster: job_pb2.ClusterProto) -> Codec:
    """A fresh codec for one sender's pushes, as the cluster section says."""
    kind = cluster.compression
    if kind == job_pb2.kBF16:
        return CastCodec(torch.bfloat16)
    if kind == job_pb2.kFP16:
        return CastCodec(torch.float16)
    if kind == job_pb2.kTopK:
        return TopKCodec(cluster.topk_fraction)
    return Codec()


def wire_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
