"""A worker group's processes, all restarted into a running job, form their in-group gloo group afresh.

A Downpour worker group over several processes reduces its gradient to its stub and broadcasts the params back over
a process group of its members (shoal.planning.process_groups.worker_groups), made with the job's world. Processes
restarted into the running job have no world (it cannot take a new member), so when the launcher restarts all of a
group's processes (shoal.launcher.rejoin), the new incarnations build a gloo group of their own on the job's store,
under a prefix naming the group and the incarnation (every member got the same from the launcher), and then prove to
each other that they hold the job's secret (each member's nonce to all, then each member's HMAC over every nonce, its
place and the group's name, shoal.comm.auth) before anything else is sent: a process that cannot is refused and the
group is not formed.

`FreshGroup` offers the calls the stub makes on the plan's group (shoal.comm.collectives.Group: reduce_sum, broadcast,
all_reduce_sum, by global rank), on host tensors: such a group moves only what lives on the host.
"""
from __future__ import annotations

import datetime
import secrets
from typing import Optional

import torch
import torch.distributed as dist

from shoal.comm import auth
from shoal.comm import dist as comm
from shoal.comm.collectives import Handle
from shoal.errors import ShoalError


class GroupImpostor(ShoalError, RuntimeError):
    """A member of a group formed afresh could not prove it holds the job's secret."""


class FreshGroup:
    """A gloo group of a worker group's restarted processes, addressed by their global ranks."""

    on_nccl = False

    def __init__(self, name: str, ranks: tuple[int, ...], handle):
        self.name, self.ranks, self.handle = name, ranks, handle

    def index(self, rank: int) -> int:
        return self.ranks.index(rank)

    def reduce_sum(self, tensor: torch.Tensor, dst: int, op: str = "sum") -> Handle:
        options = dist.ReduceOptions()
        options.rootRank, options.rootTensor = self.index(dst), 0
        options.reduceOp = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        return Handle(self.handle.reduce([tensor], options), None, None)

    def broadcast(self, tensor: torch.Tensor, src: int) -> Handle:
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = self.index(src), 0
        return Handle(self.handle.broadcast([tensor], options), None, None)

    def all_reduce_sum(self, tensor: torch.Tensor) -> Handle:
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.SUM
        return Handle(self.handle.allreduce([tensor], options), None, None)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        gathered = [torch.empty_like(tensor) for _ in self.ranks]
        Handle(self.handle.allgather([gathered], [tensor]), None, None).wait()
        return gathered


def form_afresh(name: str, ranks: tuple[int, ...], rank: int, incarnation: int, store=None,
                secret: Optional[bytes] = None, timeout_s: Optional[float] = None) -> FreshGroup:
    """Process `rank`'s side of group `name` (its members `ranks`) for their restart `incarnation`: returns once every
    member built it and proved it holds the job's secret (GroupImpostor: one could not; RuntimeError: a member did not
    come within the timeout)."""
    ranks = tuple(sorted(ranks))
    store = (store or comm.job_store()).clone()  # a connection of its own: a gloo rendezvous blocks its client
    timeout = datetime.timedelta(seconds=timeout_s or comm.timeout_seconds())
    context = f"regroup/{name}/i{incarnation}"
    with comm.in_plain_words():
        handle = dist.ProcessGroupGloo(dist.PrefixStore(f"shoal/{context}", store), ranks.index(rank), len(ranks), timeout)
    group = FreshGroup(name, ranks, handle)
    secret = secret if secret is not None else auth.process_secret()
    if secret is not None and not _members_prove(group, context, secret):
        raise GroupImpostor(f"{name}: a process joining restart {incarnation} of the group could not prove it holds the "
                            "job's secret; the group was not formed")
    return group


def _members_prove(group: FreshGroup, context: str, secret: bytes) -> bool:
    """Each member's nonce to all, then each member's proof over every nonce: True when every member proved it."""
    mine = torch.frombuffer(bytearray(secrets.token_bytes(auth.NONCE_BYTES)), dtype=torch.uint8)
    nonces = [bytes(n.tolist()) for n in group.all_gather(mine)]
    me = group.handle.rank()
    proof = torch.frombuffer(bytearray(auth.proof(secret, f"member{me}", context, *nonces)), dtype=torch.uint8)
    proofs = [bytes(p.tolist()) for p in group.all_gather(proof)]
    return all(auth.proves(secret, claimed, f"member{i}", context, *nonces) for i, claimed in enumerate(proofs))

