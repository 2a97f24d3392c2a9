"""What every framework's cost model answers (planning/estimate.py's _Model is `model`), and its defaults. Pure.

A framework's cost part lives in planning/framework_costs/<framework>.py and its runtime part in
shoal/strategies/<framework>.py: the strategy builds the exchanges, this module's subclasses say what
one step of them moves and costs. Both are counted from the exchanges' code (runtime/exchanges/):
a change to what an exchange sends changes its cost model with it (tests/test_fixed_costs.py,
tests/test_bytes_counted.py and the layouts' tests check them against real runs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from shoal.planning.cluster_facts import Compression


@dataclass
class Phases:
    """A framework's terms of one group step in the cost model (planning/estimate.py), in seconds."""

    reduce: float = 0.0
    update: float = 0.0
    exchange: Optional[float] = None  # None: the model's time for the framework's traffic
    staleness: str = ""
    bounds: Optional[dict[str, float]] = None  # samples/s caps of what the groups share
    # named parts of the phases above, printed one line each: {"kind", "what", "seconds"} (e.g. an exchange's copies)
    terms: tuple = ()


@dataclass(frozen=True)
class Messages:
    """Calls one group step makes that each pay a fixed cost whatever their size (the cost model's per-message term).

    `kind` "collective": a gloo collective over the processes `ranks` (reduce, broadcast, all-reduce, gather: about
    one hop per member but one, in sequence); "message": one point-to-point send or receive of a request/response
    protocol between `ranks` (its two ends).
    `count` is per group step, averaged where they happen every few steps (a meeting every H steps: 1/H)."""

    what: str  # e.g. "reduce + broadcast per bucket (2 buckets)"
    count: float
    kind: str = "collective"
    ranks: tuple[int, ...] = ()

    @property
    def hops(self) -> int:
        return max(1, len(self.ranks) - 1) if self.kind == "collective" else 1


def encoded_parts(compression: Compression) -> int:
    """Tensors one encoded message is sent as (each its own collective or message): the codec's buffers
    (runtime/exchanges/compression.py: top-k, indices and values; a cast, one; uncompressed, the tensor itself)."""
    return 2 if compression.topk else 1


class FrameworkCosts:
    """One framework's cost terms; the defaults suit a framework that moves nothing between processes (one worker)."""

    def served_elements(self, model: Any, rank: int, served: int) -> int:
        """Elements the updater of process `rank` updates (`served`: those of the slices its servers own)."""
        return model.elements if model.plan.in_one_process else served

    def extra_param_bytes(self, model: Any) -> int:
        """Param bytes a process holds besides its workers' (copies of its own)."""
        return 0

    def traffic(self, model: Any, move) -> None:
        """Call move(src_rank, dst_rank, bytes) for every message of one group step (none in memory)."""

    def messages(self, model: Any) -> list[Messages]:
        """The collectives and point-to-point messages one group step issues (none in memory), counted from the
        exchange's code: keep in step with runtime/exchanges/ (each framework names what it counts)."""
        return []

    def phases(self, model: Any, compute: float, links: dict) -> Phases:
        """The reduce, update (and exchange, bounds, staleness) terms of one group step."""
        return Phases(update=model.update_s(model.elements, model.plan.threads_per_worker))
