"""The JobPlan: every decision about how a job runs, computed once, before anything starts.

`plan_job(job)` is the one call site of the planners (placement, partitioning,
batch shares, devices, thread budget). Everything downstream receives the
JobPlan: the launcher spawns `plan.nprocs` processes, each process assembles
its part from `plan.processes[rank]` (shoal.runtime.assemble), the run log
records the plan's layout, and `shoal plan` prints it (planning.describe), so
what `shoal plan` shows is what runs.

Pure: no process, no data, no param values (the net is built with
unallocated params for its shapes). A layout this runtime cannot run is
refused here, in one line that shows the failing arithmetic.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Mapping, Optional

import torch

from shoal.config import job_pb2
from shoal.neuralnet.net import NeuralNet
from shoal.neuralnet.params import ParamStore
from shoal.neuralnet.updaters import make_updater
from shoal.planning.buckets import DEFAULT_CAP, cap_from_env
from shoal.planning.cluster_facts import LAYOUT_FIELDS, AsyncBounds, Compression, Meetings, restarts_override
from shoal.planning.devices import worker_device_names
from shoal.planning.nodes import node_of_rank
from shoal.planning.partition import PartitionPlan, partition
from shoal.planning.placement import Placement, ProcessPlan, WorkerId, place
from shoal.planning.process_groups import ProcessGroupPlan, job_group
from shoal.planning.shares import GroupShards, train_input_shares
from shoal.planning.strategy import (Framework, Layout, Registry, Strategy, UnsupportedClusterError,  # noqa: F401 - re-exported
                                     installed_registry, recognise)


@dataclass(frozen=True, eq=False)
class JobPlan:
    """How a validated job runs: its processes, framework, partitioned net, shares, devices and threads.

    Frozen all the way down where it holds data: protos as their bytes (`job`, `updater`, `outer_updater`
    and `cluster` parse a fresh copy: changing one changes nothing here), tuples and read-only mappings.
    The partition's net (layer objects, for shapes and costs) is the one part not frozen."""

    job_bytes: bytes  # the validated job (JobProto), serialized
    strategy: Strategy  # the framework's (shoal/strategies/): everything specific to it
    placement: Placement  # processes, their workers and servers, and the param slices each server owns
    partition: PartitionPlan  # one group's train net cut over its workers
    params: Mapping[str, tuple[int, ...]]  # every param's shape, in declaration order
    batch_shares: tuple[tuple[int, ...], ...]  # per training input layer, each worker's rows of the group's batch
    devices: tuple[tuple[str, ...], ...]  # per process, the configured device of each of its workers
    threads_per_worker: int  # intra-op threads of each worker: the host's cores shared by its workers
    updater_bytes: bytes  # what the servers apply (UpdaterProto): the job's, momentum compensated under asynchrony
    outer_updater_bytes: Optional[bytes] = None  # Local SGD / DiLoCo: applied to the groups' mean change
    nnodes: int = 1
    notes: tuple[str, ...] = ()
    group_shards: GroupShards = GroupShards()  # where each worker group starts reading its training inputs
    balance_freq: int = 0  # cluster.auto_batch_shares: re-split a group's batch every this many steps (0: never)
    bucket_elements: int = DEFAULT_CAP  # cluster.bucket_mb (SHOAL_BUCKET_MB overrides): a gradient bucket's cap
    max_restarts: int = 0  # cluster.max_restarts (--max-restarts; SHOAL_MAX_RESTARTS overrides): restarts of a dead group
    comm_timeout_s: float = 45.0  # cluster.comm_timeout_s (SHOAL_COMM_TIMEOUT overrides): a collective waits this long for a peer
    stall_timeout_s: float = 10.0  # cluster.stall_timeout_s (SHOAL_STALL_TIMEOUT overrides): silence that makes a process stalled
    join_timeout_s: float = 600.0  # cluster.join_timeout_s (SHOAL_JOIN_TIMEOUT overrides): how long nodes wait to meet
    process_groups: tuple[ProcessGroupPlan, ...] = ()  # what the exchanges' collectives run over, created in this order
    # job.checkpoint_interval_s where the job sets no checkpoint_freq, else 0: a checkpoint about every this many seconds
    checkpoint_interval_s: float = 600.0
    round_steps: int = 1  # how far a trainer may run ahead of the chief between two meetings (Local SGD: local_steps)

    @property
    def job(self) -> job_pb2.JobProto:
        return _parse_job(self.job_bytes)

    @property
    def updater(self) -> job_pb2.UpdaterProto:
        return job_pb2.UpdaterProto.FromString(self.updater_bytes)

    @property
    def outer_updater(self) -> Optional[job_pb2.UpdaterProto]:
        return None if self.outer_updater_bytes is None else job_pb2.UpdaterProto.FromString(self.outer_updater_bytes)

    @property
    def framework(self) -> Framework:
        return self.strategy.framework

    @property
    def cluster(self) -> job_pb2.ClusterProto:
        return self.placement.cluster

    @property
    def nprocs(self) -> int:
        return len(self.placement.processes)

    @property
    def in_one_process(self) -> bool:
        return self.nprocs == 1

    @property
    def tensor_parallel(self) -> bool:
        """A user's loop whose module is cut on its features over the group's processes: SINGA's `partition_dim: 1`
        for a session's job (torch's tensor parallelism: frontend/session_partition.py). Each process computes on the
        group's whole batch; check_layout says which layouts allow it."""
        return self.own_loop and self.job.neuralnet.partition_dim == 1

    @property
    def own_loop(self) -> bool:
        """A user's own loop (shoal.session()): its job has no net (the module is the user's), and the user's optimizer
        updates every replica (a job file's and fit's net always has layers)."""
        return not self.job.neuralnet.layer

    @property
    def nworker_groups(self) -> int:
        return self.cluster.nworker_groups

    @property
    def max_update_lag(self) -> int:
        """cluster.max_update_lag: how many other updates an asynchronous update may land after (-1: unbounded)."""
        return self.cluster.max_update_lag

    @property
    def nworkers_per_group(self) -> int:
        return self.cluster.nworkers_per_group

    @property
    def nserver_groups(self) -> int:
        return self.cluster.nserver_groups

    @property
    def nservers_per_group(self) -> int:
        return self.cluster.nservers_per_group

    @property
    def server_worker_separate(self) -> bool:
        """cluster.server_worker_separate: the servers in processes of their own."""
        return bool(self.cluster.server_worker_separate)

    @property
    def compression(self) -> Compression:
        """cluster.compression (and its top-k fraction): how the exchanges over processes encode what they send."""
        return Compression.of(self.cluster)

    @property
    def asynchrony(self) -> AsyncBounds:
        """What bounds asynchronous groups: max_staleness, warmup_steps, max_update_lag, overlap_push."""
        return AsyncBounds.of(self.cluster)

    @property
    def meetings(self) -> Meetings:
        """When Local SGD's groups meet (local_steps, local_warmup_steps) and SparseLoCo's encoding of a meeting."""
        return Meetings.of(self.cluster)

    @property
    def sync_freq(self) -> int:
        """cluster.sync_freq: Distributed Hogwild's groups sync their masters' slices every this many steps."""
        return self.cluster.sync_freq

    @property
    def layout_fields(self) -> dict:
        """The cluster section's layout fields (LAYOUT_FIELDS), as a run records them (summary.json's "cluster")."""
        c = self.cluster
        return {name: getattr(c, name) for name in LAYOUT_FIELDS}

    @property
    def nworkers(self) -> int:
        return self.cluster.nworker_groups * self.cluster.nworkers_per_group

    @property
    def nservers(self) -> int:
        return self.cluster.nserver_groups * self.cluster.nservers_per_group

    @property
    def global_batch(self) -> int:
        """Samples per training step of a group."""
        return max((sum(shares) for shares in self.batch_shares), default=0)

    @property
    def partitioned(self) -> bool:
        """Whether a group's net is cut otherwise than on the batch (features or placed layers)."""
        return self.cluster.nworkers_per_group > 1 and self.partition.partitioned

    @property
    def label(self) -> str:
        """The framework as users name the layout (e.g. in-memory Sandblaster, DiLoCo)."""
        return self.strategy.label(self)

    def process(self, rank: int) -> ProcessPlan:
        return self.placement.processes[rank]

    def devices_of(self, rank: int) -> list[str]:
        return list(self.devices[rank])

    def all_devices(self) -> list[str]:
        return [d for per_process in self.devices for d in per_process]

    def group_ranks(self, group: int) -> dict[int, int]:
        """Worker id -> rank of the process hosting it, for one worker group."""
        return {w.id: p.rank for p in self.placement.processes for w in p.workers if w.group == group}

    def ranks_of_group(self, group: int) -> list[int]:
        return sorted({self.placement.process_of(WorkerId(group, w)) for w in range(self.cluster.nworkers_per_group)})

    def is_group_stub(self, rank: int) -> bool:
        """Whether process `rank` hosts workers and is the first process of its worker group (its stub: the one that
        talks to the servers, and may take the chief's place)."""
        workers = self.process(rank).workers
        return bool(workers) and self.ranks_of_group(workers[0].group)[0] == rank


def sliced_for(plan: JobPlan, param_sizes: Mapping[str, int]) -> JobPlan:
    """A user's loop's plan (shoal.session: its job has no net, so its placement has no slices) with `param_sizes`
    (the user's module's trained params, in order) cut into the plan's slices as a net's are: which server group
    masters what (Distributed Hogwild's syncs). Every process cuts the same module the same way."""
    return replace(plan, placement=place(plan.cluster, dict(param_sizes)))


def plan_job(job: job_pb2.JobProto, cores: Optional[int] = None, nnodes: int = 1, strategies: Optional[Registry] = None,
             environ: Optional[Mapping[str, str]] = None) -> JobPlan:
    """The JobPlan of a validated job on hosts of `cores` cores (default: this one's), its framework one of
    `strategies` (default: the installed registry, planning.strategy.install: shoal.strategies.registry's once that
    is imported; the launcher and the front ends pass it). `environ` (default: this process's)
    holds the documented overrides of job fields: SHOAL_BUCKET_MB, SHOAL_MAX_RESTARTS and the timeouts' (TIMEOUT_OVERRIDES;
    docs/cluster.md)."""
    environ = os.environ if environ is None else environ
    store = ParamStore(allocate=False)
    net = NeuralNet(job.neuralnet, job_pb2.kTrain, store, torch.Generator())
    sizes = {name: info.numel for name, info in store.info.items()}
    placement = place(job.cluster, sizes)
    parts = partition(net, job.neuralnet, job.cluster.nworkers_per_group)
    strategy = strategy_of(job, placement, parts, strategies or installed_registry())
    updater = server_updater(job, strategy)
    plan = JobPlan(
        job_bytes=job.SerializeToString(),
        strategy=strategy,
        placement=placement,
        partition=parts,
        params=MappingProxyType({name: tuple(info.shape) for name, info in store.info.items()}),
        batch_shares=tuple(tuple(shares) for shares in train_input_shares(job)),
        devices=(devices := tuple(tuple(worker_device_names(job, len(p.workers))) for p in placement.processes)),
        # every worker on a host shares its cores: oversubscription is what kills CPU throughput
        threads_per_worker=thread_budget(job, workers_on_host=busiest_node_workers(placement, nnodes), cores=cores),
        updater_bytes=updater.SerializeToString(),
        outer_updater_bytes=outer_updater(job).SerializeToString() if strategy.meets else None,
        nnodes=nnodes,
        group_shards=GroupShards(job.cluster.nworker_groups, always_disjoint=strategy.meets),
        balance_freq=max(1, job.cluster.auto_batch_freq) if job.cluster.auto_batch_shares else 0,
        bucket_elements=cap_from_env(environ, job.cluster.bucket_mb),
        max_restarts=restarts_override(environ, job.cluster.max_restarts),
        **{name: seconds_override(environ, variable, name, getattr(job.cluster, name)) for name, variable in TIMEOUT_OVERRIDES.items()},
        process_groups=(strategy.process_groups(placement, devices, nnodes, parts) + (job_group(devices, nnodes),)
                        if len(placement.processes) > 1 else ()),
        checkpoint_interval_s=0.0 if job.checkpoint_freq > 0 else float(job.checkpoint_interval_s),
        round_steps=max(1, strategy.round_steps(job.cluster)[0]),
    )
    if job.cluster.local_warmup_steps and not strategy.meets:
        raise UnsupportedClusterError("cluster.local_warmup_steps: applies to Local SGD only (cluster.local_steps > 0 and several worker groups)")
    if job.cluster.HasField("sparse_outer_step") and not strategy.meets:
        raise UnsupportedClusterError("cluster.sparse_outer_step: applies to Local SGD only (cluster.local_steps > 0 and several worker groups)")
    compressed = _compression_notes(job, strategy, len(placement.processes), strategy.compressed_in(plan))
    plan = replace(plan, notes=tuple(list(parts.notes) + updater_notes(job, updater) + compressed
                                     + strategy.notes(plan) + _staleness_notes(job, strategy)))
    if job.cluster.auto_batch_shares:
        _check_balanceable(plan)
    if plan.outer_updater is not None:
        try:
            make_updater(plan.outer_updater)
        except ValueError as err:  # the updater's checks name `updater.…`: here it is the cluster's outer one
            raise UnsupportedClusterError(f"cluster.outer_{err}") from None
    return plan


def server_updater(job: job_pb2.JobProto, strategy: Strategy) -> job_pb2.UpdaterProto:
    """The updater the servers apply. Asynchronous groups: N outstanding updates (G groups, 2G with overlap_push)
    already add momentum of their own (an update computed on params N-1 updates old, on average), so the servers'
    momentum is 1 - N·(1 - momentum), which keeps the job's effective momentum (cluster.async_momentum: kAsConfigured keeps SINGA's, the job's own)."""
    updater = job_pb2.UpdaterProto()
    updater.CopyFrom(job.updater)
    if not strategy.compensates_async_momentum or job.cluster.async_momentum != job_pb2.kCompensated or updater.momentum <= 0:
        return updater
    updater.momentum = max(0.0, 1.0 - outstanding_updates(job.cluster) * (1.0 - updater.momentum))
    return updater


def servers_updater(plan: "JobPlan", updater: job_pb2.UpdaterProto) -> tuple[job_pb2.UpdaterProto, list[str]]:
    """What the servers of `plan` apply for a user's SINGA `updater` (a shoal.SingaOptimizer's, in a user's loop), as
    `server_updater` does for a job file's, and the line that says so where it differs."""
    job = job_pb2.JobProto()
    job.cluster.CopyFrom(plan.job.cluster)
    job.updater.CopyFrom(updater)
    servers = server_updater(job, plan.strategy)
    return servers, updater_notes(job, servers)


def outstanding_updates(cluster: job_pb2.ClusterProto) -> int:
    """How many updates asynchronous groups can have computed and not yet applied at once: one per group, two per
    group when its next step overlaps its push (overlap_push)."""
    return cluster.nworker_groups * (2 if cluster.overlap_push else 1)


def outer_updater(job: job_pb2.JobProto) -> job_pb2.UpdaterProto:
    """Local SGD / DiLoCo's outer updater: the job's cluster.outer_updater, else plain averaging (SGD, lr 1)."""
    if job.cluster.HasField("outer_updater"):
        return job.cluster.outer_updater
    return job_pb2.UpdaterProto(type=job_pb2.kSGD, learning_rate=job_pb2.LRGenProto(type=job_pb2.kFixed, base_lr=1.0))


def _compression_notes(job: job_pb2.JobProto, strategy: Strategy, nprocs: int, compressed: Optional[str]) -> list[str]:
    """Compression applies to every exchange over processes; in one process nothing moves, so nothing is encoded."""
    kind = job.cluster.compression
    if kind == job_pb2.kNone:
        return []
    if kind == job_pb2.kTopK and not 0 < job.cluster.topk_fraction <= 1:
        raise UnsupportedClusterError(f"cluster.topk_fraction: {job.cluster.topk_fraction:g} is not in (0, 1]")
    what = f"top-{job.cluster.topk_fraction:g} with error feedback" if kind == job_pb2.kTopK else job_pb2.Compression.Name(kind)[1:]
    name = strategy.framework.value
    if nprocs == 1 or compressed is None:
        return [f"cluster.compression ({what}) not applied: {name} in one process moves no bytes"]
    exact = " (no longer bit-exact with one worker)" if strategy.synchronous else ""
    return [f"{compressed} compressed ({what}): the run does not compute what uncompressed {name} would{exact}"]


def _staleness_notes(job: job_pb2.JobProto, strategy: Strategy) -> list[str]:
    """What bounds the staleness of asynchronous updates (runtime/exchanges/staleness.py), or why a bound cannot hold."""
    c = job.cluster
    notes = []
    if c.overlap_push:
        if not strategy.overlaps_push:
            raise UnsupportedClusterError(f"cluster.overlap_push: applies to Downpour over processes, not to {strategy.framework.value}")
        notes.append("each group computes its next step while its push is at the servers (cluster.overlap_push): "
                     "its params are one answer older, its communication hidden")
    if c.max_update_lag >= 0:
        if strategy.synchronous:
            notes.append(f"cluster.max_update_lag ({c.max_update_lag}) has no effect: {strategy.framework.value} applies every update on fresh params")
        elif c.max_update_lag < outstanding_updates(c) - 1:  # each of the other updates out may have to land first
            least = "2 * nworker_groups - 1 (overlap_push)" if c.overlap_push else "nworker_groups - 1"
            raise UnsupportedClusterError(
                f"cluster.max_update_lag: {c.max_update_lag} is below {least} = {outstanding_updates(c) - 1}: "
                f"{outstanding_updates(c)} updates in flight could never all land")
        else:
            notes.append(f"every update lands at most {c.max_update_lag} updates after its params were read (cluster.max_update_lag); "
                         "a group waits only when another's update in flight would otherwise land later than that")
    if c.max_staleness >= 0 and not strategy.synchronous:
        notes.append(f"no group runs more than {c.max_staleness} steps ahead of the slowest (cluster.max_staleness): "
                     "the fast groups keep the slowest one's pace")
    return notes


def updater_notes(job: job_pb2.JobProto, servers: job_pb2.UpdaterProto) -> list[str]:
    """The line saying the servers' momentum differs from the job's (compensated under asynchrony; none where not)."""
    compensated = servers.momentum
    if compensated == job.updater.momentum:
        return []
    return [f"updater.momentum {job.updater.momentum:g} -> {compensated:g} at the servers: {job.cluster.nworker_groups} "
            "asynchronous groups add momentum of their own (cluster.async_momentum: kAsConfigured keeps the job's)"]


def busiest_node_workers(placement: Placement, nnodes: int) -> int:
    """The most workers any node hosts, its ranks placed as `shoal run --nnodes` places them (planning/nodes.py)."""
    node = node_of_rank(len(placement.processes), nnodes)
    per_node = [0] * max(1, nnodes)
    for p in placement.processes:
        per_node[node[p.rank]] += len(p.workers)
    return max(per_node)


def thread_budget(job: job_pb2.JobProto, workers_on_host: int = 1, cores: Optional[int] = None) -> int:
    """Intra-op threads per worker: the job's num_openblas_threads if set, else cores / workers."""
    if job.HasField("num_openblas_threads"):
        return max(1, job.num_openblas_threads)
    if job.cluster.threads_per_worker > 0:
        return job.cluster.threads_per_worker
    return max(1, (cores or os.cpu_count() or 1) // max(1, workers_on_host))


def strategy_of(job: job_pb2.JobProto, placement: Placement, parts: PartitionPlan, strategies: Registry) -> Strategy:
    """The strategy a placement runs as, or UnsupportedClusterError naming what does not fit."""
    c = job.cluster
    if c.nworkers_per_group > 1 and parts.partitioned:
        if job.train_one_batch.alg != job_pb2.kBP:
            raise UnsupportedClusterError("train_one_batch.alg: layers partitioned on features or placed by location train with kBP only")
        hosted = [[w.group for w in p.workers] for p in placement.processes]
        spans = any(groups.count(g) != c.nworkers_per_group for groups in hosted for g in groups)
        if spans and c.nworker_groups > 1:
            raise UnsupportedClusterError(
                f"cluster: an asynchronous partitioned group's {c.nworkers_per_group} workers must share one process "
                f"(nworkers_per_procs: a multiple of {c.nworkers_per_group}); one synchronous group may span processes"
            )
    return recognise(Layout(job, placement, parts), strategies)


def framework_of(job: job_pb2.JobProto, placement: Placement, parts: PartitionPlan, strategies: Optional[Registry] = None) -> Framework:
    """The framework a placement runs as (its strategy's), or UnsupportedClusterError naming what does not fit."""
    return strategy_of(job, placement, parts, strategies or installed_registry()).framework


# each timeout of the cluster section, and the environment variable that overrides it (docs/cluster.md)
TIMEOUT_OVERRIDES = {"comm_timeout_s": "SHOAL_COMM_TIMEOUT", "stall_timeout_s": "SHOAL_STALL_TIMEOUT", "join_timeout_s": "SHOAL_JOIN_TIMEOUT"}


def seconds_override(environ: Mapping[str, str], variable: str, field: str, configured: float) -> float:
    """`variable` where set (seconds > 0, else refused in one line), else the job's cluster.`field`."""
    text = environ.get(variable)
    if not text:
        return float(configured)
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise UnsupportedClusterError(f"{variable}={text!r}: expected seconds > 0 (overrides cluster.{field})")
    return value


def _parse_job(data: bytes) -> job_pb2.JobProto:
    return job_pb2.JobProto.FromString(data)


def _check_balanceable(plan: JobPlan) -> None:
    """auto_batch_shares re-splits a group's batch between threads of one process, over one batch size."""
    per_group = plan.cluster.nworkers_per_group
    if any(len(p.workers) % per_group for p in plan.placement.processes):
        raise UnsupportedClusterError(
            "cluster.auto_batch_shares: the workers of a group must share one process "
            f"(nworkers_per_procs: a multiple of {per_group}) to re-split its batch"
        )
    if plan.partitioned:
        raise UnsupportedClusterError("cluster.auto_batch_shares: a group with layers cut on features or placed by location splits by layer, not by batch")
    sizes = {sum(shares) for shares in plan.batch_shares}
    if len(sizes) > 1:
        raise UnsupportedClusterError(f"cluster.auto_batch_shares: the training input layers read batches of different sizes ({sorted(sizes)})")
