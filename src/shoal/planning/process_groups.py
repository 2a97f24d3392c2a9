"""The process groups a job's collectives run over, named, and whether NCCL may carry each. Pure.

Every rank creates every group, in this order (torch.distributed requires it; shoal.comm.collectives
does it). NCCL carries a group's CUDA tensors only when each member computes only on GPUs of its own:
NCCL refuses two processes on one GPU, and a member without a GPU (a CPU worker, a separate server)
has nothing for it to move; such a group is gloo's, and its CUDA tensors stage through host memory.

A partitioned group spanning processes adds one group per pair of its workers that a bridge joins
across processes (`bridge_groups`): a pair's two threads alone use it, both in the plan's node order.

Every plan of several processes also names the whole job (`job_group`, last): the collectives every process
joins (the sliced exchange's metrics, clipping norm and totals, the replicated exchange's first meeting, a
user's loop's first values). No collective runs on any group but these (tests/test_architecture_collectives.py).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from shoal.config import job_pb2
from shoal.planning.nodes import node_of_rank
from shoal.planning.partition import PartitionPlan
from shoal.planning.placement import Placement, WorkerId


@dataclass(frozen=True)
class ProcessGroupPlan:
    name: str
    ranks: tuple[int, ...]
    nccl: bool  # every member computes on GPUs of its own: CUDA tensors may ride NCCL
    # never the world's own handle, even with the world's ranks: its collectives run while other threads of the same
    # processes run theirs on other groups (a bridge pair's), which on one handle would be matched out of order
    dedicated: bool = False
    # the whole job: the world's own handle (no connections of its own), CUDA tensors on NCCL exactly when the world's
    # backend carries them (comm.dist.process_group_backend, the same rule as `nccl_capable`)
    world: bool = False


def nccl_capable(rank_devices: Sequence[Sequence[str]], rank_nodes: Sequence[int]) -> bool:
    """Whether every listed rank computes only on CUDA devices that no other listed rank uses."""
    taken: set[tuple[int, str]] = set()
    for devices, node in zip(rank_devices, rank_nodes):
        if not devices or not all(d.startswith("cuda") for d in devices):
            return False
        mine = {(node, d if ":" in d else "cuda:0") for d in devices}
        if mine & taken:
            return False
        taken |= mine
    return bool(rank_devices)


def sliced_group_name(owner: int) -> str:
    """The group of a synchronous group's buckets owned by rank `owner`: the worker processes and the owner."""
    return f"sliced/owner{owner}"


def sliced_owners(placement: Placement) -> list[int]:
    """The ranks whose servers own a slice (server group 0: a synchronous group has one), ascending."""
    return sorted({placement.process_of(placement.server_of_slice(s.index, 0)) for s in placement.slices})


def sliced_groups(placement: Placement, devices: Sequence[Sequence[str]], nnodes: int = 1) -> tuple[ProcessGroupPlan, ...]:
    """AllReduce / Sandblaster over processes: per owner rank, the worker processes and the owner
    (gradients are reduced to the owner, its new values broadcast back)."""
    workers = [p.rank for p in placement.processes if p.workers]
    node = node_of_rank(len(placement.processes), nnodes)
    groups = []
    for owner in sliced_owners(placement):
        ranks = tuple(sorted(set(workers) | {owner}))
        groups.append(ProcessGroupPlan(sliced_group_name(owner), ranks,
                                       nccl_capable([devices[r] for r in ranks], [node[r] for r in ranks])))
    return tuple(groups)


def whole_group(name: str, ranks: Sequence[int], devices: Sequence[Sequence[str]], nnodes: int = 1) -> ProcessGroupPlan:
    """One group of `ranks` (Local SGD's meeting: every group's process)."""
    node = node_of_rank(len(devices), nnodes)
    ranks = tuple(sorted(ranks))
    return ProcessGroupPlan(name, ranks, nccl_capable([devices[r] for r in ranks], [node[r] for r in ranks]))


JOB_GROUP = "job"


def job_group(devices: Sequence[Sequence[str]], nnodes: int = 1) -> ProcessGroupPlan:
    """Every process of the job (`devices`: each rank's), the world: what the collectives every process joins run over."""
    return replace(whole_group(JOB_GROUP, range(len(devices)), devices, nnodes), world=True)


def worker_group_name(group: int) -> str:
    """The group of worker group `group`'s processes (Downpour: the stub's reduce and broadcast)."""
    return f"workers/g{group}"


def worker_groups(placement: Placement) -> tuple[ProcessGroupPlan, ...]:
    """Per worker group spread over several processes, the group of its processes, in group order. gloo's (never NCCL):
    what it moves (Downpour's flat gradient and params) lives on the host, and its members beside separate CPU servers
    made the world gloo's, as these groups were before the plan named them."""
    groups = []
    for group in sorted({w.group for p in placement.processes for w in p.workers}):
        ranks = tuple(sorted({p.rank for p in placement.processes if any(w.group == group for w in p.workers)}))
        if len(ranks) > 1:
            groups.append(ProcessGroupPlan(worker_group_name(group), ranks, nccl=False))
    return tuple(groups)


def bridge_group_name(group: int, a: int, b: int) -> str:
    """The group carrying the bridges between workers `a` and `b` (either order) of worker group `group`."""
    low, high = sorted((a, b))
    return f"bridges/g{group}/w{low}+w{high}"


def bridge_groups(partition: PartitionPlan, placement: Placement, devices: Sequence[Sequence[str]],
                  nnodes: int = 1) -> tuple[ProcessGroupPlan, ...]:
    """Per worker group, one two-process group per pair of its workers in different processes joined by a bridge
    (either way), in the order of the partitioned net's first bridge between them (runtime/partitioned.py)."""
    if not partition.partitioned:  # a plain data-parallel group runs Workers, without bridges
        return ()
    by_name = {n.name: n for n in partition.nodes}
    pairs = []
    for dst in partition.nodes:
        if dst.layer.conf.type == job_pb2.kBridgeDst:
            pair = tuple(sorted((by_name[dst.peer].worker, dst.worker)))
            if pair not in pairs:
                pairs.append(pair)
    node = node_of_rank(len(placement.processes), nnodes)
    groups = []
    for group in sorted({w.group for p in placement.processes for w in p.workers}):
        for a, b in pairs:
            ranks = tuple(sorted({placement.process_of(WorkerId(group, a)), placement.process_of(WorkerId(group, b))}))
            if len(ranks) == 2:
                groups.append(ProcessGroupPlan(bridge_group_name(group, a, b), ranks,
                                               nccl_capable([devices[r] for r in ranks], [node[r] for r in ranks]), dedicated=True))
    return tuple(groups)
