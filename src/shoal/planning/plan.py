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

import enum
import os
from dataclasses import dataclass, field
from typing import Optional

import torch

from shoal.config import job_pb2
from shoal.errors import ShoalError
from shoal.neuralnet.net import NeuralNet
from shoal.neuralnet.params import ParamStore
from shoal.neuralnet.updaters import make_updater
from shoal.planning.devices import worker_device_names
from shoal.planning.nodes import node_of_rank
from shoal.planning.partition import PartitionPlan, partition
from shoal.planning.placement import Placement, ProcessPlan, WorkerId, place
from shoal.planning.process_groups import ProcessGroupPlan, sliced_groups, whole_group
from shoal.planning.shares import train_input_shares


class UnsupportedClusterError(ShoalError, ValueError):
    """A cluster layout this build of the runtime cannot run yet (said in one line)."""


class Framework(enum.Enum):
    """SINGA's frameworks: names for cluster configurations, not classes (the value is the display name)."""

    SINGLE_WORKER = "single worker"
    ALLREDUCE = "AllReduce"  # one group; servers share the workers' processes (or threads of one process)
    SANDBLASTER = "Sandblaster"  # one group; servers in processes of their own
    IN_MEMORY_HOGWILD = "in-memory Hogwild"  # async groups as threads sharing one copy of the params
    IN_MEMORY_DOWNPOUR = "in-memory Downpour"  # async groups as threads, each on its own copy
    DOWNPOUR = "Downpour"  # async groups over processes, one server group
    DISTRIBUTED_HOGWILD = "Distributed Hogwild"  # async groups over processes, a server group each
    LOCAL_SGD = "Local SGD"  # groups on their own copies meet every local_steps (DiLoCo with an outer momentum)

    @property
    def synchronous(self) -> bool:
        return self in (Framework.SINGLE_WORKER, Framework.ALLREDUCE, Framework.SANDBLASTER)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, eq=False)
class JobPlan:
    """How a validated job runs: its processes, framework, partitioned net, shares, devices and threads."""

    job: job_pb2.JobProto
    framework: Framework
    placement: Placement  # processes, their workers and servers, and the param slices each server owns
    partition: PartitionPlan  # one group's train net cut over its workers
    params: dict[str, tuple[int, ...]]  # every param's shape, in declaration order
    batch_shares: list[list[int]]  # per training input layer, each worker's rows of the group's batch
    devices: list[list[str]]  # per process, the configured device of each of its workers
    threads_per_worker: int  # intra-op threads of each worker: the host's cores shared by its workers
    updater: job_pb2.UpdaterProto  # what the servers apply: the job's, momentum compensated under asynchrony
    outer_updater: Optional[job_pb2.UpdaterProto] = None  # Local SGD / DiLoCo: applied to the groups' mean change
    nnodes: int = 1
    notes: list[str] = field(default_factory=list)
    process_groups: tuple[ProcessGroupPlan, ...] = ()  # what the exchanges' collectives run over, created in this order

    @property
    def cluster(self) -> job_pb2.ClusterProto:
        return self.job.cluster

    @property
    def nprocs(self) -> int:
        return len(self.placement.processes)

    @property
    def in_one_process(self) -> bool:
        return self.nprocs == 1

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
        """The framework as users name the layout: one process of several synchronous workers is in-memory Sandblaster."""
        if self.framework in (Framework.ALLREDUCE, Framework.SANDBLASTER) and self.in_one_process:
            return "in-memory Sandblaster"
        if self.framework is Framework.LOCAL_SGD and self.outer_updater is not None and self.outer_updater.momentum > 0:
            return "DiLoCo"
        return self.framework.value

    def process(self, rank: int) -> ProcessPlan:
        return self.placement.processes[rank]

    def devices_of(self, rank: int) -> list[str]:
        return self.devices[rank]

    def all_devices(self) -> list[str]:
        return [d for per_process in self.devices for d in per_process]

    def group_ranks(self, group: int) -> dict[int, int]:
        """Worker id -> rank of the process hosting it, for one worker group."""
        return {w.id: p.rank for p in self.placement.processes for w in p.workers if w.group == group}

    def ranks_of_group(self, group: int) -> list[int]:
        return sorted({self.placement.process_of(WorkerId(group, w)) for w in range(self.cluster.nworkers_per_group)})


def plan_job(job: job_pb2.JobProto, cores: Optional[int] = None, nnodes: int = 1) -> JobPlan:
    """The JobPlan of a validated job on hosts of `cores` cores (default: this one's)."""
    store = ParamStore(allocate=False)
    net = NeuralNet(job.neuralnet, job_pb2.kTrain, store, torch.Generator())
    sizes = {name: info.numel for name, info in store.info.items()}
    placement = place(job.cluster, sizes)
    parts = partition(net, job.neuralnet, job.cluster.nworkers_per_group)
    framework = framework_of(job, placement, parts)
    workers = job.cluster.nworker_groups * job.cluster.nworkers_per_group
    updater = server_updater(job, framework)
    plan = JobPlan(
        job=job,
        framework=framework,
        placement=placement,
        partition=parts,
        params={name: tuple(info.shape) for name, info in store.info.items()},
        batch_shares=train_input_shares(job),
        devices=(devices := [worker_device_names(job, len(p.workers)) for p in placement.processes]),
        # every worker on a host shares its cores: oversubscription is what kills CPU throughput
        threads_per_worker=thread_budget(job, workers_on_host=busiest_node_workers(placement, nnodes), cores=cores),
        updater=updater,
        outer_updater=outer_updater(job) if framework is Framework.LOCAL_SGD else None,
        nnodes=nnodes,
        notes=list(parts.notes) + _updater_notes(job, updater) + _compression_notes(job, framework, len(placement.processes)) + _local_sgd_notes(job, framework)
        + _staleness_notes(job, framework),
        process_groups=_process_groups(framework, placement, devices, nnodes),
    )
    if job.cluster.auto_batch_shares:
        _check_balanceable(plan)
    if plan.outer_updater is not None:
        try:
            make_updater(plan.outer_updater)
        except ValueError as err:  # the updater's checks name `updater.…`: here it is the cluster's outer one
            raise UnsupportedClusterError(f"cluster.outer_{err}") from None
    return plan


def _process_groups(framework: Framework, placement, devices: list[list[str]], nnodes: int) -> tuple[ProcessGroupPlan, ...]:
    """The named process groups of a layout over processes (shoal.planning.process_groups)."""
    if len(placement.processes) == 1:
        return ()
    if framework in (Framework.ALLREDUCE, Framework.SANDBLASTER):
        return sliced_groups(placement, devices, nnodes)
    if framework is Framework.LOCAL_SGD:
        return (whole_group("meeting", range(len(placement.processes)), devices, nnodes),)
    return ()


def server_updater(job: job_pb2.JobProto, framework: Framework) -> job_pb2.UpdaterProto:
    """The updater the servers apply. Asynchronous groups: N outstanding updates (G groups, 2G with overlap_push)
    already add momentum of their own (an update computed on params N-1 updates old, on average), so the servers'
    momentum is 1 - N·(1 - momentum), which keeps the job's effective momentum (cluster.async_momentum: kAsConfigured keeps SINGA's, the job's own)."""
    updater = job_pb2.UpdaterProto()
    updater.CopyFrom(job.updater)
    if framework.synchronous or framework is Framework.LOCAL_SGD or job.cluster.async_momentum != job_pb2.kCompensated or updater.momentum <= 0:
        return updater
    updater.momentum = max(0.0, 1.0 - outstanding_updates(job.cluster) * (1.0 - updater.momentum))
    return updater


def outstanding_updates(cluster: job_pb2.ClusterProto) -> int:
    """How many updates asynchronous groups can have computed and not yet applied at once: one per group, two per
    group when its next step overlaps its push (overlap_push)."""
    return cluster.nworker_groups * (2 if cluster.overlap_push else 1)


def outer_updater(job: job_pb2.JobProto) -> job_pb2.UpdaterProto:
    """Local SGD / DiLoCo's outer updater: the job's cluster.outer_updater, else plain averaging (SGD, lr 1)."""
    if job.cluster.HasField("outer_updater"):
        return job.cluster.outer_updater
    return job_pb2.UpdaterProto(type=job_pb2.kSGD, learning_rate=job_pb2.LRGenProto(type=job_pb2.kFixed, base_lr=1.0))


def _local_sgd_notes(job: job_pb2.JobProto, framework: Framework) -> list[str]:
    """When Local SGD's groups meet, and what that costs against a synchronous exchange every step."""
    c = job.cluster
    if framework is not Framework.LOCAL_SGD:
        if c.local_warmup_steps:
            raise UnsupportedClusterError("cluster.local_warmup_steps: applies to Local SGD only (cluster.local_steps > 0 and several worker groups)")
        return []
    warmup = f"after each of the first {c.local_warmup_steps} steps (synchronous warm-up), then " if c.local_warmup_steps else ""
    steps = max(1, job.train_steps)
    meetings = min(steps, c.local_warmup_steps) + max(0, steps - c.local_warmup_steps) // c.local_steps
    return [f"groups meet {warmup}every {c.local_steps} steps: {meetings} meeting(s) in {steps} steps, "
            f"{steps / max(1, meetings):.1f}x fewer exchanges than a synchronous job's"]


# what cluster.compression encodes, per framework over processes (runtime/exchanges/compression.py)
_COMPRESSED = {
    Framework.DOWNPOUR: "pushes",
    Framework.ALLREDUCE: "gradients (to the servers of their slices, and their sum back)",
    Framework.SANDBLASTER: "gradients (to the servers of their slices, and their sum back)",
    Framework.DISTRIBUTED_HOGWILD: "syncs (deltas to the masters, and their answers)",
    Framework.LOCAL_SGD: "pseudo-gradients at each meeting",
}


def _compression_notes(job: job_pb2.JobProto, framework: Framework, nprocs: int) -> list[str]:
    """Compression applies to every exchange over processes; in one process nothing moves, so nothing is encoded."""
    kind = job.cluster.compression
    if kind == job_pb2.kNone:
        return []
    if kind == job_pb2.kTopK and not 0 < job.cluster.topk_fraction <= 1:
        raise UnsupportedClusterError(f"cluster.topk_fraction: {job.cluster.topk_fraction:g} is not in (0, 1]")
    what = f"top-{job.cluster.topk_fraction:g} with error feedback" if kind == job_pb2.kTopK else job_pb2.Compression.Name(kind)[1:]
    if nprocs == 1 or framework not in _COMPRESSED:
        return [f"cluster.compression ({what}) not applied: {framework.value} in one process moves no bytes"]
    exact = " (no longer bit-exact with one worker)" if framework.synchronous else ""
    return [f"{_COMPRESSED[framework]} compressed ({what}): the run does not compute what uncompressed {framework.value} would{exact}"]


def _staleness_notes(job: job_pb2.JobProto, framework: Framework) -> list[str]:
    """What bounds the staleness of asynchronous updates (runtime/exchanges/staleness.py), or why a bound cannot hold."""
    c = job.cluster
    notes = []
    if c.overlap_push:
        if framework is not Framework.DOWNPOUR:
            raise UnsupportedClusterError(f"cluster.overlap_push: applies to Downpour over processes, not to {framework.value}")
        notes.append("each group computes its next step while its push is at the servers (cluster.overlap_push): "
                     "its params are one answer older, its communication hidden")
    if c.max_update_lag >= 0:
        if framework.synchronous:
            notes.append(f"cluster.max_update_lag ({c.max_update_lag}) has no effect: {framework.value} applies every update on fresh params")
        elif c.max_update_lag < outstanding_updates(c) - 1:  # each of the other updates out may have to land first
            least = "2 * nworker_groups - 1 (overlap_push)" if c.overlap_push else "nworker_groups - 1"
            raise UnsupportedClusterError(
                f"cluster.max_update_lag: {c.max_update_lag} is below {least} = {outstanding_updates(c) - 1}: "
                f"{outstanding_updates(c)} updates in flight could never all land")
        else:
            notes.append(f"every update lands at most {c.max_update_lag} updates after its params were read (cluster.max_update_lag); "
                         "a group waits only when another's update in flight would otherwise land later than that")
    if c.max_staleness >= 0 and not framework.synchronous:
        notes.append(f"no group runs more than {c.max_staleness} steps ahead of the slowest (cluster.max_staleness): "
                     "the fast groups keep the slowest one's pace")
    return notes


def _updater_notes(job: job_pb2.JobProto, servers: job_pb2.UpdaterProto) -> list[str]:
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


def framework_of(job: job_pb2.JobProto, placement: Placement, parts: PartitionPlan) -> Framework:
    """The framework a placement runs as, or UnsupportedClusterError naming what does not fit."""
    c = job.cluster
    nprocs = len(placement.processes)
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
    if c.nworker_groups == 1:
        if c.nworkers_per_group == 1 and nprocs == 1:
            return Framework.SINGLE_WORKER
        return Framework.SANDBLASTER if c.server_worker_separate else Framework.ALLREDUCE
    if c.local_steps > 0:
        if any(len({w.group for w in p.workers}) != 1 or len(p.workers) != c.nworkers_per_group for p in placement.processes if nprocs > 1) \
                or (nprocs > 1 and c.server_worker_separate):
            raise UnsupportedClusterError(
                f"cluster.local_steps: over processes, each process holds one whole worker group (nworkers_per_procs: "
                f"{c.nworkers_per_group}, server_worker_separate: false), or all groups share one process")
        if c.max_staleness >= 0 or c.warmup_steps > 0 or c.max_update_lag >= 0:
            raise UnsupportedClusterError("cluster: max_staleness, max_update_lag and warmup_steps do not apply to local_steps (groups "
                                          "meet in lockstep; local_warmup_steps is Local SGD's warm-up)")
        if c.local_warmup_steps < 0:
            raise UnsupportedClusterError(f"cluster.local_warmup_steps: must be >= 0, got {c.local_warmup_steps}")
        return Framework.LOCAL_SGD
    if nprocs == 1:
        if c.nserver_groups > 1:
            raise UnsupportedClusterError(
                "cluster: asynchronous groups in one process need nserver_groups: 1 (in-memory Hogwild or Downpour); "
                "Distributed Hogwild runs one group per process"
            )
        # SINGA's docs call both in-memory Downpour; groups sharing one copy of the params update it lock-free: Hogwild
        return Framework.IN_MEMORY_HOGWILD if c.share_memory else Framework.IN_MEMORY_DOWNPOUR
    if c.nserver_groups > 1:
        for p in placement.processes:  # every process holds one whole worker group and its whole server group
            if len({m.group for m in p.workers + p.servers}) != 1 or len(p.workers) != c.nworkers_per_group or len(p.servers) != c.nservers_per_group:
                raise UnsupportedClusterError(
                    "cluster: with several server groups over processes, each process must hold one whole worker group and "
                    f"its server group (Distributed Hogwild: nworkers_per_procs: {c.nworkers_per_group}, "
                    f"nservers_per_procs: {c.nservers_per_group}, nserver_groups = nworker_groups, server_worker_separate: false)"
                )
        if c.max_staleness >= 0 or c.warmup_steps > 0 or c.max_update_lag >= 0:
            raise UnsupportedClusterError("cluster: max_staleness, max_update_lag and warmup_steps apply to Downpour and in-memory "
                                          "Hogwild, not to Distributed Hogwild")
        return Framework.DISTRIBUTED_HOGWILD
    if not c.server_worker_separate:
        raise UnsupportedClusterError(
            f"cluster: asynchronous groups over {nprocs} processes with servers in the workers' processes are not supported yet: "
            "asynchronous groups over processes run as Downpour (nserver_groups: 1, server_worker_separate: true) "
            f"or in one process (nworkers_per_procs: {c.nworker_groups * c.nworkers_per_group}); see `shoal plan`"
        )
    if any(len({w.group for w in p.workers}) > 1 for p in placement.processes):
        raise UnsupportedClusterError("cluster: a process hosting workers of several groups is not supported over processes yet")
    return Framework.DOWNPOUR


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
