"""The process groups a job's collectives run over, named, and whether NCCL may carry each. Pure.

Every rank creates every group, in this order (torch.distributed requires it; shoal.comm.collectives
does it). NCCL carries a group's CUDA tensors only when each member computes only on GPUs of its own:
NCCL refuses two processes on one GPU, and a member without a GPU (a CPU worker, a separate server)
has nothing for it to move; such a group is gloo's, and its CUDA tensors stage through host memory.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from shoal.planning.nodes import node_of_rank
from shoal.planning.placement import Placement


@dataclass(frozen=True)
class ProcessGroupPlan:
    name: str
    ranks: tuple[int, ...]
    nccl: bool  # every member computes on GPUs of its own: CUDA tensors may ride NCCL


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
