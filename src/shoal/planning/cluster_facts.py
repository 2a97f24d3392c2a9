"""The facts of a job's cluster section that the strategies and the reports need, typed and frozen (issue 41).

Planning reads the cluster section; everything else reads the JobPlan's facts (`plan.compression`,
`plan.asynchrony`, `plan.meetings`, `plan.sync_freq`, the group and server counts), never `plan.cluster`.
Pure: each is computed from the cluster section alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from shoal.config import job_pb2


@dataclass(frozen=True)
class Compression:
    """cluster.compression and cluster.topk_fraction: what the exchanges over processes encode what they send with."""

    kind: int = job_pb2.kNone  # a job_pb2.Compression value
    topk_fraction: float = 0.0

    @property
    def dense(self) -> bool:
        """Nothing encoded: the tensors travel as they are."""
        return self.kind == job_pb2.kNone

    @property
    def topk(self) -> bool:
        return self.kind == job_pb2.kTopK

    @classmethod
    def of(cls, cluster: job_pb2.ClusterProto) -> "Compression":
        return cls(cluster.compression, cluster.topk_fraction)


@dataclass(frozen=True)
class AsyncBounds:
    """What bounds asynchronous groups (Downpour, in-memory Hogwild): cluster.max_staleness (-1: none),
    cluster.warmup_steps, cluster.max_update_lag (-1: unbounded) and cluster.overlap_push."""

    max_staleness: int = -1
    warmup_steps: int = 0
    max_update_lag: int = -1
    overlap_push: bool = False

    @classmethod
    def of(cls, cluster: job_pb2.ClusterProto) -> "AsyncBounds":
        return cls(cluster.max_staleness, cluster.warmup_steps, cluster.max_update_lag, bool(cluster.overlap_push))


@dataclass(frozen=True)
class Meetings:
    """When Local SGD's groups meet: every step of a warm-up (cluster.local_warmup_steps), then every
    cluster.local_steps steps; with cluster.sparse_outer_step (SparseLoCo) a meeting sends its encoding."""

    local_steps: int = 0
    warmup_steps: int = 0
    sparse_outer_step_bytes: Optional[bytes] = None  # cluster.sparse_outer_step, serialized (None: not set)

    @property
    def sparse(self) -> bool:
        return self.sparse_outer_step_bytes is not None

    @property
    def sparse_outer_step(self) -> Optional[job_pb2.SparseOuterStepProto]:
        """A fresh copy of cluster.sparse_outer_step (None: not set)."""
        if self.sparse_outer_step_bytes is None:
            return None
        return job_pb2.SparseOuterStepProto.FromString(self.sparse_outer_step_bytes)

    def count(self, steps: int) -> int:
        """Meetings in a run of `steps` steps."""
        return min(steps, self.warmup_steps) + max(0, steps - self.warmup_steps) // max(1, self.local_steps)

    def per_step(self, train_steps: int) -> float:
        """Meetings per step, over a run of `train_steps` steps (the cost model's average)."""
        steps = max(1, train_steps)
        return self.count(steps) / steps

    @classmethod
    def of(cls, cluster: job_pb2.ClusterProto) -> "Meetings":
        sparse = cluster.sparse_outer_step.SerializeToString() if cluster.HasField("sparse_outer_step") else None
        return cls(cluster.local_steps, cluster.local_warmup_steps, sparse)


# the cluster section's layout fields a run records (summary.json's "cluster"), in this order
LAYOUT_FIELDS = ("nworker_groups", "nworkers_per_group", "nserver_groups", "nservers_per_group",
                 "nworkers_per_procs", "nservers_per_procs", "server_worker_separate", "share_memory")


def restarts_override(environ: Mapping[str, str], configured: int) -> int:
    """SHOAL_MAX_RESTARTS where set (a count, else refused in one line), else the job's cluster.max_restarts. Here,
    torch-free: `shoal run` reads it before torch's import too (launcher/process_server.py), as plan_job does."""
    from shoal.planning.strategy import UnsupportedClusterError

    text = environ.get("SHOAL_MAX_RESTARTS")
    if not text:
        return configured
    if not text.isdigit():
        raise UnsupportedClusterError(f"SHOAL_MAX_RESTARTS={text!r}: expected 0 or more (overrides cluster.max_restarts)")
    return int(text)
