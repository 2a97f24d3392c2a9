"""Buckets: how a worker group's param slices travel between processes (pure planning).

Backward produces gradients from the last layer to the first, so buckets are
formed in that order: consecutive slices (SINGA's lcm slicing decides which
server, hence which rank, owns each) with the same owner are grouped until a
bucket would exceed `cap` elements. A bucket is one message each way: the
gradients of its slices to the owner, their new values back. A slice larger
than the cap is cut into pieces of `cap` elements, each a bucket of its own
that travels without a copy, so the owner updates and returns one piece while
the next is still arriving; small slices (biases) share a bucket so they cost
one message, not one each.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from typing import Mapping, Optional

from shoal.errors import ShoalError
from shoal.planning.placement import ParamSlice

DEFAULT_CAP = 1 << 20  # elements (4 MB of float32): small params coalesce, big ones go alone


class BucketSizeError(ShoalError, ValueError):
    """SHOAL_BUCKET_MB is not a number of megabytes (one line)."""


def cap_of(mb: float) -> int:
    """A bucket cap of `mb` float32 megabytes, in elements."""
    return max(1, int(mb * 2**20 / 4))


def cap_from_env(environ: Optional[Mapping[str, str]] = None, mb: float = 4.0) -> int:
    """The bucket cap in elements: SHOAL_BUCKET_MB (float32 megabytes, as DDP's bucket_cap_mb) where set, else `mb`
    (the job's cluster.bucket_mb: JobPlan.bucket_elements)."""
    text = (os.environ if environ is None else environ).get("SHOAL_BUCKET_MB")
    if not text:
        return cap_of(mb)
    try:
        value = float(text)
    except ValueError:
        raise BucketSizeError(f"SHOAL_BUCKET_MB={text!r}: not a number of megabytes") from None
    if not value > 0:
        raise BucketSizeError(f"SHOAL_BUCKET_MB={text!r}: must be > 0")
    return cap_of(value)


@dataclass(frozen=True)
class Bucket:
    index: int  # position in backward order; also the message tag
    owner: int  # rank of the process whose server updates these slices
    slices: tuple[ParamSlice, ...]

    @cached_property  # read for every message of every step: computed once
    def numel(self) -> int:
        return sum(s.size for s in self.slices)

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """Where each slice starts in the bucket's flat message."""
        out, at = [], 0
        for s in self.slices:
            out.append(at)
            at += s.size
        return tuple(out)

    @cached_property
    def params(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.param for s in self.slices))


def plan_buckets(slices: list[ParamSlice], owner: dict[int, int], cap: int = DEFAULT_CAP) -> list[Bucket]:
    """Group `slices` (in param order) into buckets in backward order; owner maps slice index to rank."""
    if cap < 1:
        raise ValueError(f"bucket cap must be at least one element, not {cap}")
    buckets: list[Bucket] = []
    current: list[ParamSlice] = []

    def close() -> None:
        if current:
            buckets.append(Bucket(len(buckets), owner[current[0].index], tuple(current)))
            current.clear()

    for s in reversed(slices):
        for start in range(s.start, s.stop, cap):  # pieces of at most `cap` elements
            piece = ParamSlice(s.param, s.index, start, min(s.stop, start + cap))
            if current and (owner[s.index] != owner[current[0].index] or sum(x.size for x in current) + piece.size > cap):
                close()
            current.append(piece)
    close()
    return buckets
