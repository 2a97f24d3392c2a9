"""Two-process gloo channels made through the job's store, and the door a serving side opens for them.

The job's world process group cannot take a new process in a dead rank's place, so Downpour's
stubs and servers talk over channels of their own: one gloo process group of two processes per
(server, worker group, incarnation), built on the job's TCPStore under a prefix of its own. A
process that joins later, or a second time after its predecessor died, builds a new channel the
same way; nobody else has to take part.

A `Door` is the store-side handshake, the same for a group's first join and for a rejoin:

- `g<G>/incarnation`: how many times group G was (re)started; the launcher (or the process
  rejoining by hand) adds one before the new process connects;
- `s<S>/g<G>/i<N>/hello`: a nonce, set by incarnation N's stub before it builds its side of the
  channel to server S; `.../accepted`: the nonce the server answers, when it builds its side (or
  `s<S>/closed`: the server has finished, nothing is served any more). The channel's name holds the
  nonce, so a second knock at one incarnation (an impostor's) never shares a channel with the first;
- once the channel is up, both sides prove they hold the job's secret (`authenticate`: a nonce from
  each side and an HMAC over both, shoal.comm.auth) before anything else is sent: a server refuses a
  stub that cannot (one line in its log) and applies nothing it sends;
- `s<S>/g<G>/state`: the server's word on the group ("serving N", "lost N", "finished");
- `g<G>/given_up`: the last incarnation the launcher will not restart again (no wait for it);
- `restarts`: set when the launcher restarts dead groups (a server then waits a moment for its word);
- `g<G>/i<N>/skipped`: Distributed Hogwild, "FIRST STOP": the steps incarnation N of group G skipped when it rejoined
  (FIRST = STOP: none), which every group re-trains a share of at its end; `g<G>/resharing`: "RETRAINED END", how
  many of them group G trained beyond train_steps, and its last step, once it is done; `g<G>/waiting`: the count of
  skipped steps whose share group G trained, while it waits for its peers (-1: it trains).

Every word but `incarnation` (a counter of the store's `add`) carries a MAC under the job's secret
(shoal.comm.signed_store): a word that fails authentication is as if nobody had said it.
"""
from __future__ import annotations

import datetime
import secrets
import time
from typing import Optional

import torch
import torch.distributed as dist

from shoal.comm import auth
from shoal.comm import dist as comm
from shoal.comm.signed_store import SignedStore
from shoal.errors import ShoalError

POLL_S = 0.01  # store polls: loopback round trips are ~0.1 ms, and a rejoin should take milliseconds


TAG_NONCE, TAG_PROOF = 91, 92  # the handshake's messages, before any of the channel's kind


class ImpostorServer(ShoalError, RuntimeError):
    """The process serving a channel could not prove it holds the job's secret."""


def job_store_client(host: str, port: int, secret: Optional[bytes], attempt: int = 0,
                     timeout_s: Optional[float] = None) -> SignedStore:
    """A client of the store a `shoal run` launcher holds for its ranks (their keys' prefix and the job's
    namespace, as shoal.comm.dist.init_with_agent_store gives them, its values signed with `secret`), for a
    process outside the world."""
    timeout = datetime.timedelta(seconds=timeout_s or comm.timeout_seconds())
    return comm.agent_store_client(host, port, attempt, secret, timeout)


def public_store_client(host: str, port: int, attempt: int = 0, timeout_s: Optional[float] = None):
    """The store's part outside the job's namespace, where the world's ranks proved they hold the secret."""
    return comm.public_part(job_store_client(host, port, None, attempt, timeout_s).raw)


def join_as_client(host: str, port: int, interface: Optional[str], secret: Optional[bytes], timeout_s: float, attempt: int = 0) -> None:
    """A process rejoining a running job: the job's store only, no process group (its channels need none);
    `timeout_s`: the plan's cluster.comm_timeout_s, as the world's ranks were given."""
    import os

    if interface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    comm.use_store(job_store_client(host, port, secret, attempt, timeout_s), timeout_s)


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


def authenticate(channel: Channel, name: str, side: int, secret: Optional[bytes]) -> bool:
    """Both sides of a new channel prove they hold the job's secret: each sends a nonce, then an HMAC over both
    nonces, its role and the channel's name (nothing a third process could replay). True: the peer proved it.

    Side 0 serves, side 1 knocks. A job without a secret (one process's threads) has nothing to prove.
    """
    if secret is None:
        return True
    mine = torch.frombuffer(bytearray(secrets.token_bytes(auth.NONCE_BYTES)), dtype=torch.uint8)
    theirs = torch.zeros(auth.NONCE_BYTES, dtype=torch.uint8, device="cpu")
    _exchange(channel, mine, theirs, TAG_NONCE)
    server_nonce, stub_nonce = (mine, theirs) if side == 0 else (theirs, mine)
    nonces = (bytes(server_nonce.tolist()), bytes(stub_nonce.tolist()))
    roles = ("server", "stub")
    my_proof = torch.frombuffer(bytearray(auth.proof(secret, roles[side], name, *nonces)), dtype=torch.uint8)
    their_proof = torch.zeros(auth.PROOF_BYTES, dtype=torch.uint8, device="cpu")
    _exchange(channel, my_proof, their_proof, TAG_PROOF)
    return auth.proves(secret, bytes(their_proof.tolist()), roles[1 - side], name, *nonces)


def _exchange(channel: Channel, send: torch.Tensor, receive: torch.Tensor, tag: int) -> None:
    """Send ours and receive theirs at once (each side posts its receive first: neither waits on the other's send)."""
    pending = channel.irecv(receive, tag)
    channel.send(send, tag)
    pending.wait()


# The doors in the job's store, one kind each: a door's keys lie under shoal/<kind>/ (the wire's: never rename one).
# Both sides take the names from here: the exchanges that open a door or knock at it, and the launcher that
# announces restarts there (it imports no exchange for a key).
DOWNPOUR_DOOR = "downpour"  # Downpour's channels between a group's stub and the servers
HOGWILD_DOOR = "hogwild"  # where a restarted Distributed Hogwild group knocks at the live groups
MEETING_DOOR = "meetings"  # the launcher's word on a meeting's dead and restarted processes (Local SGD)
STEP_DOOR = "steps"  # the launcher's word on a replicated group's dead and restarted processes, keyed by rank


class Door:
    """The handshake keys of one kind of channel (e.g. "downpour") in the job's store: see the module's text."""

    def __init__(self, kind: str, store=None, secret: Optional[bytes] = None):
        """`store`: the job's (default: this process's; a plain torch store: its values signed with `secret`, its
        keys at the top); `secret`: the job's (default: this process's, from its environment)."""
        self.kind = kind
        self.secret = secret if secret is not None else auth.process_secret()
        base = store if store is not None else comm.signed_job_store()
        if not isinstance(base, SignedStore):
            base = SignedStore(base, self.secret)
        self._base = base.raw
        self._store = base.clone().under(f"shoal/{kind}/")

    def open(self, name: str, side: int) -> Channel:
        """Side `side` of channel `name` (0 serves, 1 knocks), on the job's store."""
        return open_channel(name, side, self._base)

    # -- the store, politely --------------------------------------------------------------------
    def _get(self, key: str) -> Optional[str]:
        """The word at `key`; None when nobody said it, or what is there failed authentication."""
        return self._store.get(key)

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
        return self._get("restarts") == "1"

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

    # -- a server's restarts (Downpour's servers heal from the chief's mirror) ----------------------
    def server_restart(self, server: int) -> int:
        """The newest restart of `server` (0: its first process)."""
        return self._store.add(f"server{server}/restart", 0)

    def next_server_restart(self, server: int) -> int:
        """Announce a new process for `server` (its groups wait for it instead of failing); returns its restart."""
        restart = self._store.add(f"server{server}/restart", 1)
        self._store.set(f"server{server}/restarted", str(restart))  # the same word, signed: `server_restarted`
        return restart

    def server_restarted(self, server: int) -> int:
        """The newest restart of `server` in the launcher's signed word (0: none): a stub stops waiting on the
        process it reached at an older restart (the counter `server_restart` reads is unsigned: anyone could raise it)."""
        return self._int(f"server{server}/restarted", 0)

    def give_up_server(self, server: int, restart: int) -> None:
        """Restart `restart` of `server` will not come: its groups stop waiting for it."""
        self._store.set(f"server{server}/given_up", str(restart))

    def server_given_up(self, server: int) -> int:
        return self._int(f"server{server}/given_up", -1)

    # -- Distributed Hogwild's skipped steps, re-shared over the groups at their end ------------------
    def say_skipped(self, group: int, incarnation: int, first: int, stop: int) -> None:
        """Incarnation `incarnation` of `group` skipped steps [first, stop) when it rejoined (first = stop: none)."""
        self._store.set(f"g{group}/i{incarnation}/skipped", f"{first} {stop}")

    def skipped(self, group: int, incarnation: int) -> Optional[tuple[int, int]]:
        """[first, stop) of the steps that incarnation skipped; None while it has not said."""
        value = self._get(f"g{group}/i{incarnation}/skipped")
        try:
            first, stop = (int(v) for v in value.split()) if value is not None else (None, None)
        except ValueError:
            return None
        return None if first is None else (first, stop)

    def say_waiting(self, group: int, skipped: int) -> None:
        """`group` trained its share of `skipped` steps and waits for its peers (-1: it trains its share)."""
        self._store.set(f"g{group}/waiting", str(skipped))

    def waiting(self, group: int) -> Optional[int]:
        return self._int(f"g{group}/waiting", -1)

    def say_resharing(self, group: int, retrained: int, end: int) -> None:
        """`group` trained `retrained` of the skipped steps beyond train_steps, ending at step `end` (its own last)."""
        self._store.set(f"g{group}/resharing", f"{retrained} {end}")

    def resharing(self, group: int) -> Optional[tuple[int, int]]:
        value = self._get(f"g{group}/resharing")
        try:
            return tuple(int(v) for v in value.split()) if value is not None else None
        except ValueError:
            return None

    # -- one server's side ----------------------------------------------------------------------
    def hello(self, server: int, group: int, incarnation: int) -> Optional[str]:
        """The nonce of the knock at `incarnation` of `group` (None: nobody knocked)."""
        return self._get(f"s{server}/g{group}/i{incarnation}/hello")

    def accept(self, server: int, group: int, incarnation: int, nonce: str) -> str:
        """Answer the knock that said `nonce`; returns the name of the channel both sides build."""
        self._store.set(f"s{server}/g{group}/i{incarnation}/accepted", nonce)
        return channel_name(self.kind, server, group, incarnation, nonce)

    def close(self, server: int) -> None:
        """This server serves nobody any more: stubs still knocking are told so."""
        self._store.set(f"s{server}/closed", "1")

    def closed(self, server: int) -> bool:
        return self._get(f"s{server}/closed") == "1"

    def say_healed(self, server: int) -> None:
        """A restarted server took its heal and serves (a stub that would heal it itself, the chief dead, waits for this)."""
        self._store.set(f"s{server}/healed", "1")

    def healed(self, server: int) -> bool:
        return self._get(f"s{server}/healed") == "1"

    def set_state(self, server: int, group: int, state: str) -> None:
        self._store.set(f"s{server}/g{group}/state", state)

    def state(self, server: int, group: int) -> Optional[str]:
        return self._get(f"s{server}/g{group}/state")

    # -- a stub's side --------------------------------------------------------------------------
    def knock(self, server: int, group: int, incarnation: int, timeout_s: float) -> Optional[Channel]:
        """Say hello to `server`, wait for it to accept, open the channel and prove who we are (and check it does):
        the channel, or None when the server has closed."""
        nonce = secrets.token_hex(16)
        hello = f"s{server}/g{group}/i{incarnation}/hello"
        self._store.set(hello, nonce)
        deadline = time.monotonic() + timeout_s
        while (accepted := self._get(f"s{server}/g{group}/i{incarnation}/accepted")) != nonce:
            if self.closed(server):
                return None
            if time.monotonic() > deadline:
                raise RuntimeError(f"server {server} did not answer worker group {group} within {timeout_s:.0f} s")
            if accepted is not None and self._get(hello) != nonce:  # another knock took our place: knock again
                self._store.set(hello, nonce)
            time.sleep(POLL_S)
        name = channel_name(self.kind, server, group, incarnation, nonce)
        channel = self.open(name, 1)
        if not authenticate(channel, name, 1, self.secret):
            raise ImpostorServer(f"worker group {group}: the process serving as server {server} could not prove it holds "
                                 "the job's secret; nothing was sent to it")
        return channel


def channel_name(kind: str, server: int, group: int, incarnation: int, nonce: str) -> str:
    return f"{kind}/s{server}/g{group}/i{incarnation}/{nonce}"
