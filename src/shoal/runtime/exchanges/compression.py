"""Compressed exchange: gradients, pushes, deltas and pseudo-gradients in fewer bytes.

  none    float32, as SINGA
  bf16    bfloat16 values: half the bytes, 8 bits of mantissa
  fp16    float16 values: half the bytes, 11 bits of mantissa, a narrower range
  top-k   the k = ceil(fraction · n) entries of largest magnitude, as int32 indices and bfloat16
          values (6 bytes an entry: 1 % of the entries is about 67x fewer bytes), with error
          feedback: what was not sent is kept and added to the next push (Stich et al. 2018;
          SINGA 4's DistOpt offers the same), so every gradient is eventually applied

Every exchange over processes uses these codecs (cluster.compression): Downpour's pushes, a
synchronous group's gradients to the servers of their slices and the summed gradient back (the
sliced exchange), or each process's gradient to every other (the replicated exchange),
Distributed Hogwild's deltas and the masters' answers, Local SGD's pseudo-gradients. In-memory
layouts move no bytes and stay uncompressed. A compressed run is no longer bit-exact with one
worker; `shoal plan` says so.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from shoal.config import job_pb2


class Codec:
    """Encodes a flat float32 gradient into the tensors sent, and decodes them back (one per direction)."""

    def buffers(self, size: int, device: torch.device | str = "cpu") -> list[torch.Tensor]:
        return [torch.zeros(size, device=device)]

    def encode(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat]

    def decode(self, received: list[torch.Tensor], size: int) -> torch.Tensor:
        return received[0]

    residual: Optional[torch.Tensor] = None  # what error feedback still owes the receiver (checkpointed)


def codecs_state(prefix: str, codecs: dict) -> dict[str, torch.Tensor]:
    """The residuals of a sender's codecs (one per receiver or bucket), as checkpoint tensors `PREFIX/KEY`."""
    return {f"{prefix}/{key}": codec.residual for key, codec in codecs.items() if codec.residual is not None}


def load_codecs_state(prefix: str, codecs: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Give each codec back the residual `codecs_state` took (a codec with none in `tensors` starts empty)."""
    for key, codec in codecs.items():
        saved = tensors.get(f"{prefix}/{key}")
        codec.residual = None if saved is None else saved.clone()


class CastCodec(Codec):
    """bf16/fp16 values; with error feedback the rounding error of one message goes out with the next."""

    def __init__(self, dtype: torch.dtype, error_feedback: bool = False):
        self.dtype = dtype
        self.error_feedback = error_feedback
        self.residual: Optional[torch.Tensor] = None

    def buffers(self, size: int, device: torch.device | str = "cpu") -> list[torch.Tensor]:
        return [torch.zeros(size, dtype=self.dtype, device=device)]

    def encode(self, flat: torch.Tensor) -> list[torch.Tensor]:
        corrected = flat if self.residual is None else flat + self.residual
        sent = corrected.to(self.dtype)
        if self.error_feedback:
            self.residual = corrected - sent.float()
        return [sent]

    def decode(self, received: list[torch.Tensor], size: int) -> torch.Tensor:
        return received[0].float()


class TopKCodec(Codec):
    """Top-k with error feedback; one codec per (sender, receiver) pair: it holds the sender's residual.
    error_feedback=False: the caller tracks what the receiver holds (its difference is the feedback)."""

    def __init__(self, fraction: float, error_feedback: bool = True):
        self.fraction = fraction
        self.error_feedback = error_feedback
        self.residual: Optional[torch.Tensor] = None

    def k(self, size: int) -> int:
        return min(size, max(1, math.ceil(self.fraction * size))) if size else 0

    def buffers(self, size: int, device: torch.device | str = "cpu") -> list[torch.Tensor]:
        k = self.k(size)
        return [torch.zeros(k, dtype=torch.int32, device=device), torch.zeros(k, dtype=torch.bfloat16, device=device)]

    def encode(self, flat: torch.Tensor) -> list[torch.Tensor]:
        corrected = flat if self.residual is None else flat + self.residual
        k = self.k(corrected.numel())
        index = corrected.abs().topk(k, sorted=False).indices
        values = corrected[index].to(torch.bfloat16)
        sent = torch.zeros_like(corrected)
        sent[index] = values.float()
        if self.error_feedback:
            self.residual = corrected - sent  # what was not sent, bf16 rounding included, goes out later
        return [index.to(torch.int32), values]

    def decode(self, received: list[torch.Tensor], size: int) -> torch.Tensor:
        flat = torch.zeros(size, device=received[1].device)
        flat[received[0].long()] = received[1].float()
        return flat


def codec_for(compression: int, topk_fraction: float = 0.01, error_feedback: bool = True) -> Codec:
    """A fresh codec for one sender's pushes: `compression` a job_pb2.Compression (cluster.compression, and
    cluster.topk_fraction for kTopK), handed down by the framework's strategy."""
    if compression == job_pb2.kBF16:
        return CastCodec(torch.bfloat16, error_feedback)
    if compression == job_pb2.kFP16:
        return CastCodec(torch.float16, error_feedback)
    if compression == job_pb2.kTopK:
        return TopKCodec(topk_fraction, error_feedback)
    return Codec()


def codec_factory(compression: int, topk_fraction: float = 0.01) -> Optional[Callable[..., Codec]]:
    """What an exchange over processes is given: `factory(error_feedback=True)` makes a fresh codec per sender (top-k
    keeps its residual); None for kNone (nothing encoded)."""
    if compression == job_pb2.kNone:
        return None
    return lambda error_feedback=True: codec_for(compression, topk_fraction, error_feedback)


def encode_tentatively(codec: Codec, flat: torch.Tensor) -> tuple[list[torch.Tensor], Optional[torch.Tensor]]:
    """What `codec.encode(flat)` sends, and the residual it would leave, with the codec's own residual left as it was:
    a sender whose message may not count (a step its quorum does not commit with it) keeps what it still owes, and
    sets `codec.residual` to the returned one only once the message counted."""
    kept = codec.residual
    try:
        sent = codec.encode(flat)
        return sent, codec.residual
    finally:
        codec.residual = kept


def wire_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
