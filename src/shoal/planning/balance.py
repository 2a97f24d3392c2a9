"""Batch shares that let every worker of a group finish a step together. Pure: no clocks, no tensors.

Caffe con Troll split each batch by hand (200 images on the GPU, 56 on the
CPU). shoal measures instead: each worker's step time is modelled as
t(n) = fixed + per_sample · n for a share of n samples (fixed: kernel
launches, synchronisation, copies that do not grow with n), fitted to the
times seen at the shares it has had. The split then minimises the slowest
worker's time. A worker whose fixed cost alone exceeds what the others need
for the whole batch gets no share at all, so adding a slow device never slows
a step down. Shares only decide who computes which rows of the same global
batch: the gradient, and so training, is the same whatever the split.
"""
from __future__ import annotations

import heapq
import statistics
from dataclasses import dataclass, field
from typing import Optional, Sequence

MIN_PER_SAMPLE = 1e-9  # seconds; a measured slope at or below zero is noise


@dataclass(frozen=True)
class LinearCost:
    """A worker's step time for a share of n samples: fixed + per_sample · n (0 for no share)."""

    fixed: float
    per_sample: float

    def seconds(self, n: int) -> float:
        return self.fixed + self.per_sample * n if n > 0 else 0.0


def fit_cost(points: dict[int, float]) -> Optional[LinearCost]:
    """Least squares over (share, typical seconds); one share measured gives a cost proportional to n."""
    points = {n: t for n, t in points.items() if n > 0}
    if not points:
        return None
    if len(points) == 1:
        (n, t), = points.items()
        return LinearCost(0.0, max(t / n, MIN_PER_SAMPLE))
    ns, ts = list(points), list(points.values())
    mean_n, mean_t = statistics.fmean(ns), statistics.fmean(ts)
    var = sum((n - mean_n) ** 2 for n in ns)
    slope = sum((n - mean_n) * (t - mean_t) for n, t in zip(ns, ts)) / var
    if slope <= MIN_PER_SAMPLE:  # noise swamped the shares' difference: trust the latest share alone
        n = ns[-1]
        return LinearCost(0.0, max(ts[-1] / n, MIN_PER_SAMPLE))
    fixed = mean_t - slope * mean_n
    if fixed < 0:  # the line through the points crosses zero: no fixed cost, same slope through the mean
        return LinearCost(0.0, mean_t / mean_n)
    return LinearCost(fixed, slope)


def split_batch(costs: Sequence[LinearCost], total: int) -> list[int]:
    """Shares summing to `total` that minimise the slowest worker's time.

    Each sample goes to the worker that would finish it soonest. As every
    worker's time grows with its share, the k-th sample handed out finishes no
    later than any split could finish it, so the last one's time (the step's)
    is the least possible.
    """
    shares = [0] * len(costs)
    heap = [(c.seconds(1), i) for i, c in enumerate(costs)]
    heapq.heapify(heap)
    for _ in range(total):
        _, i = heapq.heappop(heap)
        shares[i] += 1
        heapq.heappush(heap, (costs[i].seconds(shares[i] + 1), i))
    return shares


@dataclass
class ShareBalancer:
    """Collects each worker's compute seconds per step and proposes new shares every `freq` steps.

    `settle` steps after every change are not measured (caches and allocators adapt to new sizes).
    A proposal is taken only when it shortens the predicted step by more than `gain`, so noise does
    not make the shares wander.
    """

    shares: list[int]
    freq: int
    settle: int = 2
    gain: float = 0.03
    keep: int = 4  # the most recent distinct shares a worker's fit uses
    _times: list[dict[int, list[float]]] = field(init=False)
    _since_change: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._times = [dict() for _ in self.shares]

    def observe(self, seconds: Sequence[Optional[float]]) -> None:
        """One step's compute seconds per worker (None: computed nothing)."""
        self._since_change += 1
        if self._since_change <= self.settle:
            return
        for worker, (n, t) in enumerate(zip(self.shares, seconds)):
            if n > 0 and t is not None:
                times = self._times[worker]
                # re-inserted, so the dict lists shares from least to most recently measured
                recent = (times.pop(n, []) + [t])[-4 * self.freq :]
                times[n] = recent
                while len(times) > self.keep:
                    times.pop(next(iter(times)))

    def costs(self) -> Optional[list[LinearCost]]:
        fits = [fit_cost({n: statistics.median(ts) for n, ts in times.items()}) for times in self._times]
        return None if any(f is None for f in fits) else fits

    def propose(self) -> Optional[list[int]]:
        """New shares if they are worth it, else None; call every step, acts every `freq` steps."""
        if self._since_change < self.settle + self.freq:
            return None
        costs = self.costs()
        if costs is None:
            return None
        total = sum(self.shares)
        proposal = split_batch(costs, total)
        now = max(c.seconds(n) for c, n in zip(costs, self.shares))
        then = max(c.seconds(n) for c, n in zip(costs, proposal))
        if proposal == self.shares or then > now * (1 - self.gain):
            self._since_change = self.settle  # measure another window before asking again
            return None
        self.shares = proposal
        self._since_change = 0
        return proposal


def shares_line(next_step: int, shares: Sequence[int], devices: Sequence[str], costs: Sequence[LinearCost]) -> str:
    """What a group says when its split changes (the Trainer's and a user's loop's, frontend/session_shares.py)."""
    split = ", ".join(f"{n} on {device}" for n, device in zip(shares, devices))
    model = ", ".join(f"{c.fixed * 1e3:.1f} ms + {c.per_sample * 1e3:.3f} ms/row" for c in costs)
    return f"Batch shares from step {next_step}: {split} (measured step time per worker: {model})"
