"""SparseLoCo's outer step (Sarfi et al. 2025, arXiv 2508.15706): Local SGD's meetings send a few bytes per chunk.

Plain top-k of the pseudo-gradient feeding DiLoCo's Nesterov momentum loses what momentum needs (its residual
and its momentum disagree about what was applied). SparseLoCo folds the two into one per-group accumulator:

    e ← decay · e + Δ            Δ: the group's pseudo-gradient (anchor − its values), decay ≈ 0.95
    s ← C(e)                     C: in every chunk of chunk_size entries of a param, its topk_per_chunk largest |e|,
                                 each value in value_bits (2: a sign and a magnitude bit; 16: bfloat16)
    e ← e − s                    what was not sent (quantization error included) goes out later
    θ ← θ − outer_lr · mean(s)   each entry's mean over the groups that sent it; every group goes on from the same θ

The error feedback's decay plays the outer momentum's part (the paper's finding), so no outer updater applies.

On the wire, per group and meeting, one byte buffer (`encode`), its layout fixed by the params' sizes, so every
group knows how to read every other's:
  indices  each kept entry's position in its chunk: 12 bits (two in three bytes) when chunk_size <= 4096, else 16
  values   2 bits per kept entry (four in a byte), and per chunk row two bfloat16 magnitudes (the mean |e| of
           its kept entries below and at-or-above their median |e|); or one bfloat16 per entry (value_bits 16)
Over processes the groups all-gather their buffers and every process decodes and sums them in rank order, so
every group applies bit-identical values.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shoal.planning import sparse_chunks



@dataclass(frozen=True)
class Block:
    """One param's rows in the padded space: `rows` chunks of `width` entries, `k` kept per row."""

    offset: int  # in the flat pseudo-gradient
    size: int
    start: int  # in the padded space
    rows: int
    width: int
    k: int
    first_row: int  # among every param's rows


class SparseOuterStep:
    """One group's accumulator and its encoding (cluster.sparse_outer_step); `sizes`: the params' element counts,
    in the exchange's order."""

    def __init__(self, sizes: list[int], chunk_size: int, topk_per_chunk: int, value_bits: int, error_decay: float,
                 outer_lr: float, device: torch.device | str = "cpu"):
        self.decay, self.lr, self.bits = error_decay, outer_lr, value_bits
        self.device = torch.device(device)
        self.blocks: list[Block] = []
        offset = start = first_row = 0
        for size in sizes:
            _, rows, width, k = sparse_chunks.chunking(size, chunk_size, topk_per_chunk)
            self.blocks.append(Block(offset, size, start, rows, width, k, first_row))
            offset, start, first_row = offset + size, start + rows * width, first_row + rows
        self.size, self.padded = offset, start
        self.index_bits = sparse_chunks.index_bits(chunk_size)
        self.entries = sum(b.rows * b.k for b in self.blocks)
        self.rows = sum(b.rows for b in self.blocks)
        # where each of the flat's entries sits in the padded space (a param's padding is at its end); each kept
        # entry's row, and that row's start in the padded space
        self._unpad = torch.cat([b.start + torch.arange(b.size, device=self.device) for b in self.blocks] or [torch.zeros(0, dtype=torch.long, device=self.device)])
        self._entry_row = torch.cat([b.first_row + torch.arange(b.rows, device=self.device).repeat_interleave(b.k)
                                     for b in self.blocks] or [torch.zeros(0, dtype=torch.long, device=self.device)])
        self._row_start = torch.cat([b.start + torch.arange(b.rows, device=self.device) * b.width
                                     for b in self.blocks] or [torch.zeros(0, dtype=torch.long, device=self.device)])[self._entry_row]
        self.error = torch.zeros(self.size, device=self.device)

    @classmethod
    def configured(cls, conf, sizes: list[int], device: torch.device | str = "cpu") -> "SparseOuterStep":
        """The step cluster.sparse_outer_step (`conf`, a SparseOuterStepProto) gives params of these sizes."""
        return cls(sizes, conf.chunk_size, conf.topk_per_chunk, conf.value_bits, conf.error_decay, conf.outer_lr, device)

    # -- bytes ---------------------------------------------------------------------------------------
    def index_bytes(self) -> int:
        return sparse_chunks.index_bytes(self.entries, self.index_bits)

    def value_bytes(self) -> int:
        return sparse_chunks.value_bytes(self.entries, self.rows, self.bits)

    def message_bytes(self) -> int:
        """What one group sends at a meeting (its buffer's length)."""
        return self.index_bytes() + self.value_bytes()

    # -- one meeting ---------------------------------------------------------------------------------
    def encode(self, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fold the pseudo-gradient into the accumulator, choose and encode what goes out, and take it out of the
        accumulator: (the byte buffer, its decoding: what every group will read from it)."""
        self.error.mul_(self.decay).add_(delta)
        padded = torch.zeros(self.padded, device=self.device)
        padded[self._unpad] = self.error
        index, values = [], []
        for b in self.blocks:
            rows = padded[b.start : b.start + b.rows * b.width].view(b.rows, b.width)
            chosen = rows.abs().topk(b.k, dim=1, sorted=False).indices
            index.append(chosen.reshape(-1))
            values.append(rows.gather(1, chosen).reshape(-1))
        index = torch.cat(index) if index else torch.zeros(0, dtype=torch.long, device=self.device)
        values = torch.cat(values) if values else torch.zeros(0, device=self.device)
        buffer = torch.cat([self._pack_index(index), self._encode_values(values)])
        sent = self.decode(buffer)
        self.error.sub_(sent)
        return buffer, sent

    def decode(self, buffer: torch.Tensor) -> torch.Tensor:
        """The flat tensor a group's buffer stands for (zeros where it sent nothing)."""
        return self.contribution(buffer)[: self.size]

    def contribution(self, buffer: torch.Tensor) -> torch.Tensor:
        """What a group's buffer adds to a meeting's sum: its decoded values, then a 1 where it sent an entry
        (the groups' sum of these is what `outer_step` averages)."""
        cut = self.index_bytes()
        index, values = self._unpack_index(buffer[:cut]), self._decode_values(buffer[cut:])
        padded = torch.zeros(2, self.padded, device=self.device)
        padded[0, self._row_start + index] = values
        padded[1, self._row_start + index] = 1.0
        return padded[:, self._unpad].reshape(-1)

    def outer_step(self, summed: torch.Tensor) -> torch.Tensor:
        """outer_lr x each entry's mean over the groups that sent it (zero where none did), from the groups' summed
        contributions: an entry only one group chose moves as far as that group asked, not 1/G of it (SparseLoCo's
        reference aggregation; a plain mean over all groups loses the rest, which no accumulator holds any more)."""
        total, senders = summed[: self.size], summed[self.size :]
        return total * self.lr / senders.clamp(min=1)

    # -- indices: 12 bits (two in three bytes) or 16 ---------------------------------------------------
    def _pack_index(self, index: torch.Tensor) -> torch.Tensor:
        if self.index_bits == 16:
            return index.to(torch.int32).to(torch.int16).view(torch.uint8) if index.numel() else torch.zeros(0, dtype=torch.uint8, device=self.device)
        even = torch.cat([index, index.new_zeros(index.numel() % 2)]).view(-1, 2)
        a, b = even[:, 0], even[:, 1]
        return torch.stack([a & 0xFF, (a >> 8) | ((b & 0xF) << 4), b >> 4], dim=1).reshape(-1).to(torch.uint8)

    def _unpack_index(self, raw: torch.Tensor) -> torch.Tensor:
        if self.index_bits == 16:
            return raw.clone().view(torch.int16).long() & 0xFFFF  # a copy: a view of another dtype needs its own storage
        triple = raw.long().view(-1, 3)
        a = triple[:, 0] | ((triple[:, 1] & 0xF) << 8)
        b = (triple[:, 1] >> 4) | (triple[:, 2] << 4)
        return torch.stack([a, b], dim=1).reshape(-1)[: self.entries]

    # -- values: 2 bits (sign, magnitude) with two magnitudes per row, or bfloat16 -----------------------
    def _encode_values(self, values: torch.Tensor) -> torch.Tensor:
        if self.bits == 16:
            return values.to(torch.bfloat16).view(torch.uint8)
        magnitude = values.abs()
        row = self._entry_row
        # each row's median |e| splits its kept entries into a low and a high bin; a bin decodes as its mean
        median = torch.zeros(self.rows, device=self.device)
        start = 0
        for b in self.blocks:
            if b.rows:
                median[b.first_row : b.first_row + b.rows] = magnitude[start : start + b.rows * b.k].view(b.rows, b.k).median(dim=1).values
            start += b.rows * b.k
        high = magnitude >= median[row]
        levels = torch.zeros(2, self.rows, device=self.device)
        counts = torch.zeros(2, self.rows, device=self.device)
        levels.index_put_((high.long(), row), magnitude, accumulate=True)
        counts.index_put_((high.long(), row), torch.ones_like(magnitude), accumulate=True)
        levels = (levels / counts.clamp(min=1)).to(torch.bfloat16)
        codes = (values < 0).to(torch.uint8) * 2 + high.to(torch.uint8)
        codes = torch.cat([codes, codes.new_zeros((-codes.numel()) % 4)]).view(-1, 4)
        packed = codes[:, 0] | (codes[:, 1] << 2) | (codes[:, 2] << 4) | (codes[:, 3] << 6)
        return torch.cat([packed, levels.reshape(-1).view(torch.uint8)])

    def _decode_values(self, raw: torch.Tensor) -> torch.Tensor:
        if self.bits == 16:
            return raw.clone().view(torch.bfloat16).float()
        cut = math.ceil(self.entries / 4)
        packed, levels = raw[:cut], raw[cut:].clone().view(torch.bfloat16).float().view(2, self.rows)
        codes = torch.stack([(packed >> s) & 3 for s in (0, 2, 4, 6)], dim=1).reshape(-1)[: self.entries].long()
        magnitude = levels[codes & 1, self._entry_row]
        return torch.where(codes >= 2, -magnitude, magnitude)
