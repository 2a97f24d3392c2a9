"""Two-process gloo channels made through the job's store, and the door a serving side opens for them.

The job's world process group cannot take a new process in a dead rank's place, so Downpour's
stubs and servers talk over channels of their own: one gloo process group of two processes per
(server, worker group, incarnation), built on the job's TCPStore under a prefix of its own. A
process that joins later, or a second time after its predecessor died, builds a new channel the
same way; nobody else has to take part.

A `Door` is the store-side handshake, the same for a group's first join and for a rejoin:

- `g<G>/incarnation`: how many times group G was (re)started; the launcher (or the process
  rejoining by hand) adds one before the new process connects;
- `s<S>/g<G>/i<N>/hello`: set by incarnation N's stub before it builds its side of the channel to
  server S; `.../accepted` when the server builds its side (or `s<S>/closed`: the server has
  finished, nothing is served any more);
- `s<S>/g<G>/state`: the server's word on the group ("serving N", "lost N", "finished");
- `g<G>/given_up`: the last incarnation the launcher will not restart again (no wait for it);
- `restarts`: set when the launcher restarts dead groups (a server then waits a moment for its word).
"""
from __future__ import annotations

import datetime
import os
import time
from typing import Optional

import torch
import torch.distributed as dist

from shoal.comm import dist as comm

POLL_S = 0.01  # store polls: loopback round trips are ~0.1 ms, and a rejoin should take milliseconds


def job_store_client(host: str, port: int, attempt: int = 0, timeout_s: Optional[float] = None):
    """A client of the store a `shoal run` launcher holds for its ranks (their keys' prefix, as
    shoal.comm.dist.init_with_agent_store gives them), for a process outside the world."""
    timeout = datetime.timedelta(seconds=timeout_s or comm.timeout_seconds())
    client = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"/shoal/attempt_{attempt}", client)


def join_as_client(host: str, port: int, interface: Optional[str], attempt: int = 0) -> None:
    """A process rejoining a running job: the job's store only, no process group (its channels need none)."""
    if interface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    comm.use_store(job_store_client(host, port, attempt))


class Channel:
    """Blocking point-to-point messages with the one peer of a two-process gloo group."""

    def __init__(self, group, side: int):
        self._group, self.peer = group, 1 - side

    def send(self, tensor: torch.Tensor, tag: int) -> None:
        self._group.send([tensor], self.peer, tag).wait()

    def recv(self, tensor: torch.Tensor, tag: int) -> None:
        self._group.recv([tensor], self.peer, tag).wait()

    def irecv(self, tensor: torch.Tensor, tag: int):
        """Post a receive and return at once; the handle's wait() returns once `tensor` holds the message."""
        return self._group.recv([tensor], self.peer, tag)


def open_channel(name: str, side: int, store=None, timeout_s: Optional[float] = None) -> Channel:
    """Side 0 or 1 of the channel `name`: returns once both sides built it (or raises after the timeout)."""
    store = (store or comm.job_store()).clone()  # a connection of its own: a gloo rendezvous blocks its client
    timeout = datetime.timedelta(seconds=timeout_s or comm.timeout_seconds())
    group = dist.ProcessGroupGloo(dist.PrefixStore(f"shoal/channel/{name}", store), side, 2, timeout)
    return Channel(group, side)


class Door:
    """The handshake keys of one kind of channel (e.g. "downpour") in the job's store: see the module's text."""

    def __init__(self, kind: str, store=None):
        self.kind = kind
        self._store = dist.PrefixStore(f"shoal/{kind}/", (store or comm.job_store()).clone())

    # -- the store, politely --------------------------------------------------------------------
    def _get(self, key: str) -> Optional[str]:
        return self._store.get(key).decode() if self._store.check([key]) else None

    def _int(self, key: str, default: int) -> int:
        value = self._get(key)
        return int(value) if value is not None else default

    # -- incarnations ---------------------------------------------------------------------------
    def incarnation(self, group: int) -> int:
        """The newest incarnation of `group` (0: it never restarted)."""
        return self._store.add(f"g{group}/incarnation", 0)

    def next_incarnation(self, group: int) -> int:
        """Announce a new process for `group` (the servers then wait for it); returns its incarnation."""
        return self._store.add(f"g{group}/incarnation", 1)

    def restarts_dead_groups(self) -> None:
        """The launcher will restart dead groups (--max-restarts): a server waits a moment for its word on each."""
        self._store.set("restarts", "1")

    def dead_groups_restart(self) -> bool:
        return self._store.check(["restarts"])

    def await_announcement(self, group: int, after: int, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for a new incarnation of `group` to be announced (True) or given up on."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.expected(group, after):
                return True
            if self.given_up(group) >= after:
                return False
            time.sleep(POLL_S)
        return False

    def give_up(self, group: int, incarnation: int) -> None:
        """Incarnation `incarnation` of `group` will not come (its process died before it connected)."""
        self._store.set(f"g{group}/given_up", str(incarnation))

    def given_up(self, group: int) -> int:
        """The last incarnation of `group` the launcher gave up on (-1: none)."""
        return self._int(f"g{group}/given_up", -1)

    def expected(self, group: int, after: int) -> bool:
        """Whether an incarnation newer than `after` is announced and not given up on."""
        newest = self.incarnation(group)
        return newest > after and self.given_up(group) < newest

    # -- one server's side ----------------------------------------------------------------------
    def said_hello(self, server: int, group: int, incarnation: int) -> bool:
        return self._store.check([f"s{server}/g{group}/i{incarnation}/hello"])

    def accept(self, server: int, group: int, incarnation: int) -> None:
        self._store.set(f"s{server}/g{group}/i{incarnation}/accepted", "1")

    def close(self, server: int) -> None:
        """This server serves nobody any more: stubs still knocking are told so."""
        self._store.set(f"s{server}/closed", "1")

    def closed(self, server: int) -> bool:
        return self._store.check([f"s{server}/closed"])

    def set_state(self, server: int, group: int, state: str) -> None:
        self._store.set(f"s{server}/g{group}/state", state)

    def state(self, server: int, group: int) -> Optional[str]:
        return self._get(f"s{server}/g{group}/state")

    # -- a stub's side --------------------------------------------------------------------------
    def knock(self, server: int, group: int, incarnation: int, timeout_s: float) -> bool:
        """Say hello to `server` and wait for it to accept: True, or False when it has closed."""
        self._store.set(f"s{server}/g{group}/i{incarnation}/hello", str(os.getpid()))
        accepted = f"s{server}/g{group}/i{incarnation}/accepted"
        deadline = time.monotonic() + timeout_s
        while not self._store.check([accepted]):
            if self.closed(server):
                return False
            if time.monotonic() > deadline:
                raise RuntimeError(f"server {server} did not answer worker group {group} within {timeout_s:.0f} s")
            time.sleep(POLL_S)
        return True


def channel_name(kind: str, server: int, group: int, incarnation: int) -> str:
    return f"{kind}/s{server}/g{group}/i{incarnation}"
