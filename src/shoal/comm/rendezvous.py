"""How the nodes of a job started by `shoal run` find each other: torch.distributed.elastic's rendezvous, not ours.

`shoal run JOB` on one host, or on each of several hosts with `--nnodes`, is
a small launcher: it takes part in a node-level rendezvous, then spawns its
node's ranks, which join the job's process group as clients of the store the
rendezvous gave (as torchrun's workers do with its agent's store,
`TORCHELASTIC_USE_AGENT_STORE`). The rendezvous is torchrun's own:

- `--node-rank R` given: torch's static rendezvous (torchrun's `--node-rank
  --master-addr --master-port`): node 0 hosts the store at the master address;
- no `--node-rank`: torch's c10d dynamic rendezvous at the master address
  (torchrun's `--rdzv-backend=c10d --rdzv-endpoint`): node ranks are handed
  out as nodes arrive, and the node that became rank 0 hosts the job's store
  at its own address;
- one host: the same client/store split, with the store bound to loopback
  by this launcher (torch's static store would listen on every interface,
  and nothing of a one-host job listens beyond loopback).
"""
from __future__ import annotations

import datetime
import math
import socket
from dataclasses import dataclass, field
from typing import Any, Optional

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (RendezvousConnectionError, RendezvousError, RendezvousHandler,
                                                  RendezvousParameters, RendezvousTimeoutError)
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

LOOPBACK = "127.0.0.1"


class RendezvousFailed(RuntimeError):
    """The nodes did not meet (one line: why)."""


@dataclass
class NodeRendezvous:
    """This node's place among the job's nodes, and the store its ranks join (at store_host:store_port)."""

    node_rank: int
    nnodes: int
    store_host: str
    store_port: int
    backend: str  # "loopback" | "static" | "c10d"
    store: Any = field(default=None, repr=False)  # the store (or its server) this node holds: alive while the job runs
    handler: Optional[RendezvousHandler] = field(default=None, repr=False)  # torch's, across nodes

    def close(self) -> None:
        if self.handler is not None:
            try:
                self.handler.shutdown()
            except Exception:  # the job is over; a rendezvous that cannot say so changes nothing
                pass
        self.store = self.handler = None


def loopback(timeout_s: float) -> NodeRendezvous:
    """One host: a store on a free loopback port, held by this launcher for the job's ranks."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    store = dist.TCPStore(LOOPBACK, port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s), master_listen_fd=sock.detach())
    return NodeRendezvous(0, 1, LOOPBACK, port, "loopback", store=store)


def across_nodes(nnodes: int, node_rank: Optional[int], master_host: str, master_port: int, run_id: str,
                 local_addr: Optional[str], is_master_host: bool, join_timeout_s: float) -> NodeRendezvous:
    """Join the job's nodes through torch's rendezvous: static with a node rank, c10d (ranks handed out) without."""
    endpoint = f"{master_host}:{master_port}"
    # c10d: the node on the endpoint's machine serves the rendezvous store; several nodes on that machine (a
    # try-out on one host) find the port taken after the first, and join it as clients instead
    roles = [None] if node_rank is not None else [True, False] if is_master_host else [False]
    try:
        for attempt, is_host in enumerate(roles):
            if node_rank is not None:
                params = RendezvousParameters("static", endpoint, run_id, nnodes, nnodes, local_addr,
                                              rank=node_rank, timeout=math.ceil(join_timeout_s))  # (whole seconds:
                # rounded up, so that 0.5 s waits a second, not none)
            else:
                params = RendezvousParameters("c10d", endpoint, run_id, nnodes, nnodes, local_addr,
                                              is_host=is_host, join_timeout=join_timeout_s, last_call_timeout=1)
            try:
                handler = get_rendezvous_handler(params)
                break
            except RendezvousConnectionError:
                if attempt + 1 == len(roles):
                    raise
        info = handler.next_rendezvous()
    except RendezvousTimeoutError:
        raise RendezvousFailed(f"not all {nnodes} nodes joined within {join_timeout_s:.0f} s") from None
    except RendezvousError as err:
        raise RendezvousFailed(str(err).splitlines()[0] if str(err) else type(err).__name__) from None
    store_info = info.bootstrap_store_info
    return NodeRendezvous(info.rank, info.world_size, store_info.master_addr, store_info.master_port,
                          params.backend, store=info.store, handler=handler)
