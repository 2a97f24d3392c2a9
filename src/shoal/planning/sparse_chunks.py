"""SparseLoCo's message, counted (pure): how each param is cut into chunks, how many entries of each chunk are kept, and
the bytes of one group's message at a meeting. The runtime's encoder (runtime/exchanges/sparse_outer.py) cuts and packs
by these numbers, and the plan's cost model (planning/framework_costs/local_sgd.py) counts by them: one definition.

Every param is cut into chunks of chunk_size entries (a smaller param, a bias or a norm, is one short chunk), keeping
topk_per_chunk of each at the same density; each kept entry's position takes 12 bits (two in three bytes) when
chunk_size <= 4096, else 16; its value 2 bits (four in a byte) plus two bfloat16 magnitudes per chunk, or one bfloat16.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Sequence

TWELVE_BIT_CHUNK = 4096  # positions 0..4095 fit in 12 bits


class Chunking(NamedTuple):
    """One param of `size` entries: `rows` chunks of `width` entries, `k` kept per chunk (all 0 for an empty param)."""

    size: int
    rows: int
    width: int
    k: int


def chunking(size: int, chunk_size: int, topk_per_chunk: int) -> Chunking:
    if not size:
        return Chunking(0, 0, 0, 0)
    width = min(chunk_size, size)
    return Chunking(size, math.ceil(size / width), width, min(width, max(1, math.ceil(topk_per_chunk * width / chunk_size))))


def index_bits(chunk_size: int) -> int:
    return 12 if chunk_size <= TWELVE_BIT_CHUNK else 16


def index_bytes(entries: int, bits: int) -> int:
    return math.ceil(entries / 2) * 3 if bits == 12 else 2 * entries


def value_bytes(entries: int, rows: int, value_bits: int) -> int:
    return math.ceil(entries / 4) + 2 * 2 * rows if value_bits == 2 else 2 * entries


def message_bytes(conf, sizes: Sequence[int]) -> int:
    """One group's message at a meeting under cluster.sparse_outer_step `conf`, for params of these sizes."""
    chunks = [chunking(size, conf.chunk_size, conf.topk_per_chunk) for size in sizes]
    entries, rows = sum(c.rows * c.k for c in chunks), sum(c.rows for c in chunks)
    return index_bytes(entries, index_bits(conf.chunk_size)) + value_bytes(entries, rows, conf.value_bits)
