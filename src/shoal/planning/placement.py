"""Placement: which process hosts which workers and servers, and which param slices each server owns.

Pure arithmetic on ClusterProto (SINGA 0.3's formulas, src/utils/cluster.cc):
  nworker_procs = nworker_groups · nworkers_per_group / nworkers_per_procs
  nserver_procs = nserver_groups · nservers_per_group / nservers_per_procs
  nprocs = nworker_procs + nserver_procs    if server_worker_separate
         = max(nworker_procs, nserver_procs) otherwise (the first processes host both)
Worker group g uses server group ⌊g / (nworker_groups / nserver_groups)⌋.
Params are cut into lcm(nserver_groups, nservers_per_group) slices of
near-equal size (SINGA's Param::ComputeSlices, for load balance), slice i is
served by server i mod nservers_per_group of every server group, and its
master group (for Hogwild syncs between groups) is i mod nserver_groups.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from shoal.config import job_pb2
from shoal.config.validate import validate_cluster
from shoal.errors import ShoalError


class PlacementError(ShoalError, ValueError):
    """The cluster section cannot be placed; the message shows the failing arithmetic."""


@dataclass(frozen=True)
class WorkerId:
    group: int
    id: int

    def __str__(self) -> str:
        return f"worker(group={self.group}, id={self.id})"


@dataclass(frozen=True)
class ServerId:
    group: int
    id: int

    def __str__(self) -> str:
        return f"server(group={self.group}, id={self.id})"


@dataclass(frozen=True)
class ParamSlice:
    """Elements [start, stop) of a param's flattened value."""

    param: str
    index: int  # global slice index, 0 .. nslices-1
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class ProcessPlan:
    rank: int
    workers: tuple[WorkerId, ...] = ()
    servers: tuple[ServerId, ...] = ()


@dataclass(frozen=True)
class Placement:
    """Deeply immutable: the cluster section is kept as its bytes (`cluster` parses a fresh copy), members in tuples."""

    cluster_bytes: bytes
    processes: tuple[ProcessPlan, ...]
    slices: tuple[ParamSlice, ...] = ()
    nworker_groups: int = 1
    nserver_groups: int = 1
    nservers_per_group: int = 1

    @property
    def cluster(self) -> job_pb2.ClusterProto:
        """A copy of the cluster section this placement was computed from (changing it changes nothing here)."""
        return job_pb2.ClusterProto.FromString(self.cluster_bytes)

    @property
    def nslices(self) -> int:
        return math.lcm(self.nserver_groups, self.nservers_per_group)

    def server_group_of(self, worker_group: int) -> int:
        return worker_group // (self.nworker_groups // self.nserver_groups)

    def server_of_slice(self, slice_index: int, server_group: int) -> ServerId:
        return ServerId(server_group, slice_index % self.nservers_per_group)

    def master_group_of_slice(self, slice_index: int) -> int:
        return slice_index % self.nserver_groups

    def slices_of(self, server: ServerId) -> list[ParamSlice]:
        return [s for s in self.slices if self.server_of_slice(s.index, server.group) == server]

    def process_of(self, member) -> int:
        for proc in self.processes:
            if member in proc.workers or member in proc.servers:
                return proc.rank
        raise KeyError(member)


def _check(cluster: job_pb2.ClusterProto) -> None:
    problems = validate_cluster(cluster)
    if problems:
        raise PlacementError("; ".join(f"cluster.{f}: {m}" for f, m in problems))


def place(cluster: job_pb2.ClusterProto, param_sizes: Optional[dict[str, int]] = None) -> Placement:
    """The deterministic placement of a cluster section (and the slicing of `param_sizes`)."""
    _check(cluster)
    nworkers = cluster.nworker_groups * cluster.nworkers_per_group
    nservers = cluster.nserver_groups * cluster.nservers_per_group
    nworker_procs = math.ceil(nworkers / cluster.nworkers_per_procs)
    nserver_procs = math.ceil(nservers / cluster.nservers_per_procs)
    nprocs = nworker_procs + nserver_procs if cluster.server_worker_separate else max(nworker_procs, nserver_procs)
    workers: list[list[WorkerId]] = [[] for _ in range(nprocs)]
    servers: list[list[ServerId]] = [[] for _ in range(nprocs)]
    for flat in range(nworkers):  # workers fill processes in (group, id) order
        group, wid = divmod(flat, cluster.nworkers_per_group)
        workers[flat // cluster.nworkers_per_procs].append(WorkerId(group, wid))
    first_server_proc = nworker_procs if cluster.server_worker_separate else 0
    for flat in range(nservers):
        group, sid = divmod(flat, cluster.nservers_per_group)
        servers[first_server_proc + flat // cluster.nservers_per_procs].append(ServerId(group, sid))
    nslices = math.lcm(cluster.nserver_groups, cluster.nservers_per_group)
    return Placement(cluster.SerializeToString(), tuple(ProcessPlan(r, tuple(workers[r]), tuple(servers[r])) for r in range(nprocs)),
                     tuple(slice_params(param_sizes, nslices)) if param_sizes else (),
                     cluster.nworker_groups, cluster.nserver_groups, cluster.nservers_per_group)


def process_count(cluster: job_pb2.ClusterProto) -> int:
    """How many processes the cluster section places (PlacementError as `place` says it)."""
    return len(place(cluster).processes)


def slice_params(param_sizes: dict[str, int], nslices: int) -> list[ParamSlice]:
    """Cut the params (in order) into `nslices` near-equal buckets; a param may span buckets.

    Bucket i receives elements [i·avg, (i+1)·avg) of the params laid end to end
    (avg = ceil(total / nslices)), so every server of a group gets the same
    load whatever the sizes of individual params: SINGA's ComputeSlices.
    """
    total = sum(param_sizes.values())
    avg = max(1, math.ceil(total / nslices))
    slices: list[ParamSlice] = []
    offset = 0  # position in the concatenation of all params
    for name, size in param_sizes.items():
        start = 0
        while start < size:
            bucket = min((offset + start) // avg, nslices - 1)
            bucket_end = (bucket + 1) * avg if bucket < nslices - 1 else total
            stop = min(size, bucket_end - offset)
            slices.append(ParamSlice(name, bucket, start, stop))
            start = stop
        offset += size
    return slices
