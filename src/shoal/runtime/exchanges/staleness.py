"""Staleness of asynchronous updates: counting it, and bounding it without making anyone wait needlessly.

The staleness (version lag) of an update is the number of updates other groups
applied between the moment its group read the params and the moment it lands.

cluster.max_update_lag = τ bounds it where updates are applied (Downpour's
servers, the in-memory server): an update may be applied only if every other
group whose update is still out can land within τ. Each outstanding group g
has a budget b_g = τ − (updates applied since g read); the state is safe when
the groups, taken from the smallest budget up, can land one after another
(the i-th has seen i others land before it: b ≥ i for the i-th smallest).
A push is held only while applying it would leave an unsafe state: a fast
group waits only when the slow group's update in flight would otherwise land
more than τ stale, so a group up to τ times faster than the slowest never
waits. The group with the smallest budget can always land: with τ ≥ N − 1,
N the updates that can be outstanding at once (G groups, 2G with
overlap_push), nothing deadlocks (shoal.planning.plan refuses less).
Compare max_staleness (stale-synchronous parallel): it bounds how many *steps*
a group may run ahead, which holds every group to the slowest one's pace once
the gap is reached.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping, Sequence


@dataclass
class StalenessStats:
    """Lags of a stream of updates: count, mean, max and how many of each lag."""

    count: int = 0
    total: int = 0
    max: int = 0
    counts: Counter = field(default_factory=Counter)

    def add(self, lag: int, times: int = 1) -> None:
        if times <= 0:
            return
        self.count += times
        self.total += lag * times
        self.max = max(self.max, lag)
        self.counts[lag] += times

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0


def may_apply(group: int, version: int, reads: Mapping[int, Sequence[int]], bound: int) -> bool:
    """Whether `group`'s next update may be applied now, at `version`, under max_update_lag `bound`.

    `reads`: per group, the versions its outstanding updates are computed on, oldest first (one per
    group; two for a group that computes its next step while its push is out, cluster.overlap_push).
    The update applied is `group`'s oldest; after it every other one's budget is one less, and the
    state stays safe if, smallest first, the i-th budget ≥ i.
    """
    if bound < 0:
        return True
    others = [read for g, versions in reads.items() for read in (versions[1:] if g == group else versions)]
    budgets = sorted(bound - (version + 1 - read) for read in others)
    return all(budget >= i for i, budget in enumerate(budgets))


def histogram(stats: Mapping[int, StalenessStats]) -> dict:
    """summary.json's staleness histogram: updates per lag, over every group and per group, with each group's mean and max."""
    every: Counter = Counter()
    for s in stats.values():
        every.update(s.counts)
    return {
        "updates_per_lag": {str(lag): every[lag] for lag in sorted(every)},
        "groups": {str(g): {"updates": s.count, "mean": round(s.mean, 4), "max": s.max,
                            "updates_per_lag": {str(lag): s.counts[lag] for lag in sorted(s.counts)}}
                   for g, s in sorted(stats.items())},
    }


def staleness_line(histogram: dict, bound: int) -> str:
    """The chief's line on a run's staleness histogram (a job file's chief and a user's loop under Downpour say it)."""
    lags = histogram["updates_per_lag"]
    since = histogram.get("counted_from_version")  # a server healed without a mirror: its counts restarted there
    return (f"Staleness: {sum(lags.values())} updates" + (f" since version {since} (a server's counts restarted there)" if since else "")
            + f", lag at most {max(map(int, lags), default=0)}" + (f" (cluster.max_update_lag {bound})" if bound >= 0 else ""))
