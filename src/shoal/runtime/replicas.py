"""Param replicas on a group's devices, and gradients combined over them as a tree.

The group's param store lives on one device (the root: worker 0's device, where
the server updates, as Caffe's P2PSync updates at GPU 0). A worker on another
device computes on a replica of the params there. Data crosses devices only at
the group boundary: each worker's input share goes to its device, gradients
come back up the tree (shoal.planning.devices.tree_levels) to the root, and the updated
values go back down it before the next step.
"""
from __future__ import annotations

import warnings
from typing import Optional, Sequence

import torch

from shoal.neuralnet.algorithms import Grads
from shoal.config import job_pb2
from shoal.planning.devices import broadcast_order, tree_levels, worker_device_names
from shoal.neuralnet.params import ParamStore


def torch_device(name: str) -> torch.device:
    """"cpu:N" is a CPU device in shoal's sense (its own replica) and torch's plain CPU."""
    return torch.device("cpu") if name.startswith("cpu") else torch.device(name)


def usable_device_names(names: Sequence[str], warn=lambda message: warnings.warn(message, stacklevel=3)) -> list[str]:
    """The devices asked for, with any CUDA device this machine lacks replaced by the CPU (said once each)."""
    usable = []
    for k, name in enumerate(names):
        if name.startswith("cuda") and not (torch.cuda.is_available() and torch_device(name).index < torch.cuda.device_count()):
            warn(f"{name} ignored: no such CUDA device here; worker {k} runs on the CPU")
            name = "cpu"
        usable.append(name)
    return usable


def process_devices(job: job_pb2.JobProto, count: int) -> list[str]:
    """The devices this process's `count` workers run on (SINGA's `gpu:` or shoal's `device:` list), usable here."""
    return usable_device_names(worker_device_names(job, count))


def device_label(name: str) -> str:
    """SINGA's words for a device in startup lines: "GPU 0", "CPU"."""
    kind, _, index = name.partition(":")
    return f"GPU {index}" if kind == "cuda" else ("CPU " + index if index else "CPU")


class DeviceReplicas:
    """The store of each device a group's workers use: the root's own store, a copy on every other."""

    def __init__(self, root: ParamStore, root_name: str, worker_devices: Sequence[str]):
        self.stores: dict[str, ParamStore] = {root_name: root}
        for name in worker_devices:
            if name not in self.stores:
                self.stores[name] = root.copy_to(torch_device(name))
        # the root of the broadcast tree is the store's device, then the workers in order
        self._copies = broadcast_order([root_name, *worker_devices])

    def store_of(self, device: str) -> ParamStore:
        return self.stores[device]

    def refresh(self) -> None:
        """Send the root's values down the tree to every replica (before each step)."""
        for src, dst in self._copies:
            source, target = self.stores[src].values, self.stores[dst].values
            for name, value in target.items():
                value.copy_(source[name])


def tree_reduce(parts: Sequence[tuple[Grads, int]], total: int, target: Optional[torch.device] = None) -> Grads:
    """Σ (share_i / total) · g_i, combined in Caffe's tree order, the result on `target` (default: worker 0's).

    A worker's gradient is scaled by its share (its loss is a mean over its share) as it is first
    added, in the same pass (add_ with alpha); a worker with no share (balanced out of the step) or
    no gradient adds nothing. Gradients are combined in place: workers make fresh ones every step.
    """
    # a worker balanced out of the step (share 0) computed nothing and has no names
    names = list(next((grads for grads, share in parts if share > 0), parts[0][0]))
    weights = [share / total for _, share in parts]
    out: Grads = {}
    for name in names:
        # per tree node: [partial sum, the weight not yet applied to it (None once scaled)]
        nodes: list[Optional[list]] = [
            None if share <= 0 or grads.get(name) is None else [grads[name], w] for (grads, share), w in zip(parts, weights)
        ]
        for level in tree_levels(len(nodes)):
            for into, frm in level:
                if nodes[frm] is None:
                    continue
                if nodes[into] is None:
                    nodes[into] = nodes[frm]
                    continue
                acc, src = nodes[into], nodes[frm]
                if acc[1] is not None:
                    acc[0].mul_(acc[1])
                    acc[1] = None
                acc[0].add_(src[0].to(acc[0].device), alpha=1.0 if src[1] is None else src[1])
        root = nodes[0]
        if root is not None and root[1] is not None:  # nothing was added to it: scale it alone
            root[0].mul_(root[1])
        out[name] = None if root is None else root[0] if target is None else root[0].to(target)
    return out
