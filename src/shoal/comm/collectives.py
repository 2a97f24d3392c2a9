"""Collectives over the process groups the plan names: CUDA tensors over NCCL, CPU tensors over gloo.

The plan (shoal.planning.process_groups) lists each group's ranks and whether NCCL may carry it
(every member computes on a GPU of its own). `create` makes them all, on every rank of the job in
the same order (torch.distributed requires it), and keeps them by name. A collective on a group
that NCCL cannot carry (gloo: a CPU worker or a separate server in it, two processes on one GPU,
a build without NCCL) with a CUDA tensor stages through host memory. gloo's own CUDA broadcast and
all-reduce do that asynchronously (a side stream into pinned memory, the copy back ordered before
the caller's stream continues), so those ops get the CUDA tensor itself (a broadcast's root excepted:
gloo writes its tensor back in place); for the others (reduce,
gather, all-gather: CPU only in gloo) shoal copies to the host, and back when the handle is waited.

Every call is asynchronous (the exchanges launch them from backward hooks) and returns a handle
with `wait()`. Collectives on one group must be launched in the same order on every member:
their order is what matches them, not a tag.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from shoal.comm.dist import group_timeout, in_plain_words, nccl_usable


GLOO_CUDA_OPS = frozenset({"broadcast", "all_reduce"})  # what ProcessGroupGloo moves from CUDA tensors itself


@dataclass(frozen=True)
class Group:
    """A named process group: its global ranks (sorted), its torch handle and whether CUDA tensors ride NCCL."""

    name: str
    ranks: tuple[int, ...]
    handle: object  # torch's ProcessGroup (None: the world)
    on_nccl: bool

    def _stage(self, tensor: torch.Tensor, op: str = "") -> Optional[torch.Tensor]:
        """A host copy of a CUDA tensor that this group's gloo must move instead (None: moved where it lives)."""
        return tensor.to("cpu") if tensor.is_cuda and not self.on_nccl and op not in GLOO_CUDA_OPS else None

    def reduce_sum(self, tensor: torch.Tensor, dst: int, op: str = "sum") -> "Handle":
        """Sum (or max) every member's `tensor` into global rank `dst`'s; the others' copies are scratch afterwards."""
        host = self._stage(tensor)
        reduce_op = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        work = dist.reduce(tensor if host is None else host, dst=dst, op=reduce_op, group=self.handle, async_op=True)
        return Handle(work, host, tensor if dist.get_rank() == dst else None)

    def broadcast(self, tensor: torch.Tensor, src: int) -> "Handle":
        """Global rank `src`'s `tensor` into every member's."""
        # the root stages: gloo's CUDA broadcast writes the result back into the root's tensor too, which bumps its
        # autograd version (a bridge's activation, saved for backward, then fails the backward: seen on an H200)
        host = self._stage(tensor, "broadcast" if dist.get_rank() != src else "")
        work = dist.broadcast(tensor if host is None else host, src=src, group=self.handle, async_op=True)
        return Handle(work, host, tensor if dist.get_rank() != src else None)

    def all_reduce_sum(self, tensor: torch.Tensor) -> "Handle":
        host = self._stage(tensor, "all_reduce")
        work = dist.all_reduce(tensor if host is None else host, op=dist.ReduceOp.SUM, group=self.handle, async_op=True)
        return Handle(work, host, tensor)

    def gather(self, tensor: torch.Tensor, into: Optional[Sequence[torch.Tensor]], dst: int) -> "Handle":
        """Every member's `tensor` into `into` (one per member, in rank order) on global rank `dst` (None elsewhere)."""
        host = self._stage(tensor)
        staged = None if into is None or host is None else [t.to("cpu") for t in into]
        work = dist.gather(tensor if host is None else host, staged if staged is not None else into, dst=dst,
                           group=self.handle, async_op=True)
        return Handle(work, staged, into if staged is not None else None)

    def gather_others(self, tensor: torch.Tensor, into: Optional[Sequence[torch.Tensor]], dst: int) -> "Handle":
        """Every other member's `tensor` into `into` (one per member, in rank order) on global rank `dst`, whose own
        slot is left as it is (it holds its own part already). Between two members this is one broadcast from the
        other, in place: gloo's list gather allocates a flat buffer of every slot at `dst` and copies each slot out."""
        if len(self.ranks) != 2:
            if into is not None:  # dst's own slot gets its copy too: a gather needs one
                return self.gather(tensor, into, dst)
            return self.gather(tensor, None, dst)
        other = self.ranks[1 - self.index(dst)]
        if into is None:  # the other member: its part to dst
            return self.broadcast(tensor, dist.get_rank())
        return self.broadcast(into[self.index(other)], other)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every member's `tensor` (same shape and dtype everywhere), in rank order, on `tensor`'s device (blocking)."""
        host = self._stage(tensor)
        moved = tensor if host is None else host
        gathered = [torch.empty_like(moved) for _ in self.ranks]
        with in_plain_words():
            dist.all_gather(gathered, moved, group=self.handle)
        return gathered if host is None else [g.to(tensor.device) for g in gathered]

    def index(self, rank: int) -> int:
        """Position of global `rank` among the members (gather's order)."""
        return self.ranks.index(rank)


class Handle:
    """A launched collective: `wait()` ends it and copies a staged result back to its device."""

    __slots__ = ("work", "host", "target")

    def __init__(self, work, host, target):
        self.work, self.host, self.target = work, host, target

    def wait(self) -> None:
        with in_plain_words():  # a peer that died: one line of shoal's, not gloo's
            self.work.wait()
        if self.host is None or self.target is None:
            return
        if isinstance(self.target, torch.Tensor):
            self.target.copy_(self.host)
        else:
            for into, staged in zip(self.target, self.host):
                into.copy_(staged)


def create(specs: Iterable) -> dict[str, Group]:
    """Make every group the plan names (ProcessGroupPlan: name, ranks, nccl, dedicated), on every rank, in the plan's order.

    A group of every rank that may ride NCCL exactly when the world does is the world itself (no new connections),
    unless it is dedicated: used by some threads while others use other groups (bridges), it needs a handle of its own.
    The whole job (`world`) is always the world itself, on NCCL exactly when the world is."""
    specs = list(specs)
    groups: dict[str, Group] = {spec.name: _world(spec) for spec in specs if spec.world}
    made = [spec for spec in specs if not spec.world]
    if not made:  # nothing to make (a layout whose exchanges use no group of their own)
        return groups
    world = dist.get_world_size()
    world_on_nccl = "nccl" in str(dist.get_backend())
    for spec in made:
        ranks = tuple(sorted(spec.ranks))
        on_nccl = bool(spec.nccl) and nccl_usable()
        if ranks == tuple(range(world)) and on_nccl == world_on_nccl and not spec.dedicated:
            handle = None
        else:
            handle = dist.new_group(ranks=list(ranks), backend="cpu:gloo,cuda:nccl" if on_nccl else "gloo",
                                    timeout=group_timeout())  # a stalled peer fails the others as the world's would
        groups[spec.name] = Group(spec.name, ranks, handle, on_nccl)
    return groups


def whole_job(specs: Iterable) -> Group:
    """The whole job's group among the plan's (its `world` one): the world's own handle, so nothing is made and any
    rank may take it at any time (a user's loop's first values, before its exchange makes the rest)."""
    return _world(next(spec for spec in specs if spec.world))


def _world(spec) -> Group:
    """(Its backend read once the world exists: a process assembled without one never uses it.)"""
    return Group(spec.name, tuple(sorted(spec.ranks)), None, dist.is_initialized() and "nccl" in str(dist.get_backend()))
