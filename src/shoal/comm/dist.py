"""Process groups over gloo (CPU tensors) on an explicit address; thin wrappers over collectives.

Every collective is called by every rank in the same order (the training loop
is deterministic), which is what keeps a synchronous group deadlock-free.
Point-to-point messages (isend/irecv) are matched by (peer, tag) instead, so
they may be issued in any order and from any thread; each returns a handle
to wait on. A rank that dies or stalls makes the others fail after `timeout`
instead of hanging forever: the job's plan says how long (cluster.comm_timeout_s, passed in
when joining; this module reads no setting of its own).

Progress counters for naming a stalled rank: every collective, and every
round of point-to-point messages (`enter_round`, once per training step on
every rank), counts as one call; ranks publish their count in the store, so
the rank with fewer calls is the one the others wait for. A daemon thread
publishes the counters every PROGRESS_PUBLISH_S when they changed, rather than each call a round trip to
the store on the training step's path: they are read only after a collective
failed, comm_timeout_s after the peers stopped, and the reader publishes its
own first.
"""
from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from contextlib import contextmanager
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from shoal.comm import auth
from shoal.comm.signed_store import SignedStore

_store: "dist.TCPStore | None" = None
_signed: Optional[SignedStore] = None  # the job's store as its values are read and written: MACs under the job's secret
_store_host: Optional[int] = None  # the rank hosting the store (0 under srun or env://); None: a launcher hosts it
_calls = 0  # collectives and rounds this rank has entered: the rank with fewer is the one the others wait for
_calls_lock = threading.Lock()
PROGRESS_PUBLISH_S = 0.2  # how stale the published progress may be: far below any comm timeout
PUBLISHED_POLL_S = 0.05  # how often a published value is read again while what is there fails authentication
_publisher: "Optional[_ProgressPublisher]" = None
_timeout: Optional[datetime.timedelta] = None  # the world's (or a rejoined process's store's): every group and channel made later waits as long

# cluster.comm_timeout_s's default (config/job.proto), for a world joined outside a job (tests, calibration) where
# nobody passes the plan's; tests/test_recommend.py checks it against the proto's
DEFAULT_TIMEOUT_S = 45.0


def timeout_seconds() -> float:
    """How long a collective or a channel of this process waits for a silent peer: the timeout this process joined
    the job with (the plan's cluster.comm_timeout_s), DEFAULT_TIMEOUT_S before it joined."""
    return _timeout.total_seconds() if _timeout is not None else DEFAULT_TIMEOUT_S


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (bound and released on `host` only)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def host_store(host: str, port: int, world_size: int, timeout_s: float | None = None,
               wait_for_workers: bool = True) -> dist.TCPStore:
    """The world's rendezvous store, hosted by this process on host:port: its socket bound to `host` alone and handed to
    c10d (which would otherwise listen on every interface). Rank 0 hosts it (`init`), or, under srun or env://, rank 0's
    supervisor, whose store outlives the rank's process (shoal.launcher.supervisor; it waits for no worker here)."""
    timeout = datetime.timedelta(seconds=timeout_s or DEFAULT_TIMEOUT_S)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    listen_fd = sock.detach()  # c10d owns the socket from here on
    return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, master_listen_fd=listen_fd,
                         wait_for_workers=wait_for_workers)


def init(rank: int, world_size: int, host: str, port: int, interface: Optional[str] = "lo", timeout_s: float | None = None,
         backend: str = "gloo", secret: Optional[bytes] = None, hosts_store: Optional[bool] = None) -> None:
    """Join the job's process group; rank 0 hosts the rendezvous store on host:port (`hosts_store` False: another
    process does, rank 0's supervisor, and this rank is its client).

    Nothing listens beyond `interface` (loopback unless the user names one for several hosts):
    the store's socket is bound to `host` here and handed to c10d (which would otherwise listen
    on every interface), and gloo's own connections use `interface` (None: as GLOO_SOCKET_IFNAME
    says, else gloo's own choice, the interface of this host's name). With the job's `secret`
    (shoal.comm.auth), every rank proves it holds the same one and the job's keys live under its namespace.
    `timeout_s`: the plan's cluster.comm_timeout_s (None: DEFAULT_TIMEOUT_S, a world outside a job).
    """
    global _store_host
    timeout = datetime.timedelta(seconds=timeout_s or DEFAULT_TIMEOUT_S)
    hosts = rank == 0 if hosts_store is None else hosts_store
    if hosts:
        store = host_store(host, port, world_size, timeout_s)
    else:
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    _join(_secured(store, rank, world_size, secret, timeout), rank, world_size, interface, timeout, backend, secret,
          attempt_scope(None))
    _store_host = None if hosts_store is False else 0  # (a supervisor's store is no rank's)


def init_with_agent_store(rank: int, world_size: int, host: str, port: int, attempt: int, interface: Optional[str] = None,
                          timeout_s: float | None = None, backend: str = "gloo", secret: Optional[bytes] = None) -> None:
    """Join a process group whose store torchrun's elastic agent hosts at host:port (every rank is a client).

    The agent's store outlives a restart of the job's processes: each attempt's keys get their own prefix.
    `timeout_s`: the plan's cluster.comm_timeout_s (None: DEFAULT_TIMEOUT_S).
    """
    global _store_host
    timeout = datetime.timedelta(seconds=timeout_s or DEFAULT_TIMEOUT_S)
    client = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    attempt_store = dist.PrefixStore(attempt_scope(attempt), client)
    _join(_secured(attempt_store, rank, world_size, secret, timeout), rank, world_size, interface, timeout, backend, secret,
          attempt_scope(attempt))
    _store_host = None


def attempt_scope(attempt: Optional[int]) -> str:
    """The prefix of an attempt's keys in a store a launcher hosts ("" for a store of the world's own): bound into
    every value's MAC, so that a value of one attempt is worth nothing in another."""
    return "" if attempt is None else f"/shoal/attempt_{attempt}"


def agent_store_client(host: str, port: int, attempt: int, secret: Optional[bytes], timeout: datetime.timedelta) -> SignedStore:
    """The job's keys in a store a launcher hosts, for a process outside the world (a rejoining one, the launcher);
    `attempt` None: a store of the world's own (srun, env://: rank 0's or its supervisor's), its keys unprefixed as
    `init` leaves them (a PrefixStore of "" would put a "/" before every key)."""
    client = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    scoped = client if attempt is None else dist.PrefixStore(attempt_scope(attempt), client)
    return SignedStore(in_namespace(scoped, secret), secret, attempt_scope(attempt))


def in_namespace(store, secret: Optional[bytes]):
    """The job's part of `store`: under the prefix derived from its secret (the whole store for a job without one)."""
    return store if secret is None else dist.PrefixStore(auth.namespace(secret), store)


def public_part(store):
    """The part of the store outside every job's namespace: where ranks prove to each other they hold the secret."""
    return dist.PrefixStore("shoal/auth", store)


def _secured(store, rank: int, world_size: int, secret: Optional[bytes], timeout: datetime.timedelta):
    """Prove to the other ranks that this one holds the job's secret, check their proofs, and return the job's namespace."""
    if secret is None:
        return store
    public = public_part(store)
    auth.introduce(public, rank, secret)
    try:
        public.wait([f"rank{r}" for r in range(world_size)], timeout)
    except dist.DistStoreError:  # c10d names the keys it waited for: say which processes and the setting, in our words
        absent = [r for r in range(world_size) if not public.check([f"rank{r}"])]
        who = (f"process{'es' if len(absent) > 1 else ''} {', '.join(map(str, absent))} of {world_size}" if absent
               else f"the job's {world_size} processes")  # the last came as the wait ended
        raise CommunicationFailed(f"{who} did not join within {timeout.total_seconds():g} s: raise cluster.comm_timeout_s "
                                  "on a busy machine") from None
    for peer in range(world_size):
        if peer != rank and not auth.holds_same_secret(public, peer, secret):
            raise auth.SecretError(f"process {peer}'s job secret differs from process {rank}'s: give every node the same "
                                   f"{auth.SECRET_VARIABLE} (or {auth.SECRET_FILE_VARIABLE})")
    return in_namespace(store, secret)


def _join(store, rank: int, world_size: int, interface: Optional[str], timeout: datetime.timedelta, backend: str,
          secret: Optional[bytes], scope: str) -> None:
    """`secret` and `scope` (attempt_scope): what the MACs of the job's values are made with and bound to."""
    global _store, _signed, _timeout
    _timeout = timeout
    if interface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    _store, _signed = store, SignedStore(store, secret, scope)


def process_group_backend(rank_devices: Sequence[Sequence[str]], rank_nodes: Sequence[int], nccl_usable: bool) -> str:
    """The process group's backend: NCCL for CUDA tensors when every process computes only on its own GPUs, else gloo.

    rank_devices: the devices of each rank's workers; rank_nodes: the node each rank runs on. NCCL
    needs every process to hold a GPU of its own (two processes on one GPU are refused by NCCL), so
    a process without workers (a separate server) or with a CPU worker keeps the whole group on
    gloo. With NCCL, CPU tensors still travel over gloo ("cpu:gloo,cuda:nccl": torch picks by the
    tensor's device), so host-memory staging goes on working.
    """
    if not nccl_usable or not rank_devices:
        return "gloo"
    gpus_taken: set[tuple[int, str]] = set()
    for devices, node in zip(rank_devices, rank_nodes):
        if not devices or not all(d.startswith("cuda") for d in devices):
            return "gloo"
        mine = {(node, d if ":" in d else "cuda:0") for d in devices}
        if mine & gpus_taken:
            return "gloo"
        gpus_taken |= mine
    return "cpu:gloo,cuda:nccl"


def nccl_usable() -> bool:
    """This build has NCCL and this host a CUDA device."""
    return dist.is_nccl_available() and torch.cuda.is_available()


def group_timeout() -> datetime.timedelta:
    """How long a collective of any group waits for a silent peer: the world's timeout."""
    return datetime.timedelta(seconds=timeout_seconds())


def world_size() -> int:
    return dist.get_world_size()


def backend_name() -> str:
    """The backend the process group was made with ("gloo", or "cpu:gloo,cuda:nccl")."""
    return str(dist.get_backend()) if dist.is_initialized() else "none"


def job_store():
    """The job's store (None before joining): shoal.comm.channels builds Downpour's channels on it."""
    return _store


def signed_job_store() -> Optional[SignedStore]:
    """The job's store as its values are written and read (MACs under the job's secret; None before joining)."""
    return _signed


def use_store(store: SignedStore, timeout_s: float) -> None:
    """A process rejoining a running job joins no process group: the job's store is all it uses, and its channels
    wait `timeout_s` (the plan's cluster.comm_timeout_s) for a silent peer."""
    global _store, _signed, _store_host, _timeout
    _store, _signed, _store_host, _timeout = store.raw, store, None, datetime.timedelta(seconds=timeout_s)


def store_host() -> Optional[int]:
    """The rank hosting the job's store (0 under srun or env://); None when a launcher hosts it (shoal run, torchrun)."""
    return _store_host


def publish(key: str, value: str) -> None:
    """Set `key` in the job's store, signed (read by every rank with `read_published`)."""
    _signed.set(f"shoal/published/{key}", value)


def read_published(key: str, timeout_s: float) -> str:
    """The value another rank published under `key`, waiting up to `timeout_s` for an authentic one (a value that fails
    authentication is ignored: the rank that publishes it overwrites it)."""
    text = _authentic_published(key, timeout_s)
    if text is None:
        raise dist.DistStoreError(f"no authentic value of shoal/published/{key} within {timeout_s:.0f} s "
                                  "(another local user may be writing to this job's store)")
    return text


def published(key: str, wait_s: float = 0.0) -> Optional[str]:
    """The value published under `key`, waiting up to `wait_s` for it; None when there is none (or no store), or
    none that passed authentication in that time."""
    if _signed is None:
        return None
    try:
        return _authentic_published(key, wait_s)
    except (dist.DistError, RuntimeError):  # not published in time, or the store is gone
        return None


def _authentic_published(key: str, wait_s: float) -> Optional[str]:
    """The authentic value at shoal/published/`key` within `wait_s` (None: none came; the store's timeout raises)."""
    name = f"shoal/published/{key}"
    deadline = time.monotonic() + wait_s
    while True:
        left = deadline - time.monotonic()
        if left > 0 and not _signed.check([name]):
            _signed.wait([name], datetime.timedelta(seconds=left))
        text = _signed.get(name)
        if text is not None or time.monotonic() >= deadline:
            return text
        time.sleep(PUBLISHED_POLL_S)  # a value that failed: the publisher's own comes after (or over) it


class _ProgressPublisher(threading.Thread):
    """Writes this rank's count of collectives (`_calls`) to the store when it changed, every PROGRESS_PUBLISH_S."""

    def __init__(self, key: str):
        super().__init__(name="shoal-progress", daemon=True)
        self.key = key
        self.published: Optional[int] = None
        self.lock = threading.Lock()  # one publishing at a time (the thread, or a reader publishing its own first)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(PROGRESS_PUBLISH_S):
            try:
                self.publish()
            except (RuntimeError, dist.DistError):  # the store is gone: whoever reads progress names that instead
                return

    def publish(self) -> None:
        with self.lock:
            calls, store = _calls, _signed
            if store is not None and calls != self.published:
                store.set(self.key, str(calls))
                self.published = calls


def _enter() -> None:
    global _calls, _publisher
    with _calls_lock:
        _calls += 1
        if _publisher is None and _store is not None:
            _publisher = _ProgressPublisher(f"shoal/calls/{dist.get_rank()}")
            _publisher.start()


def enter_round() -> None:
    """Count one round of point-to-point messages (every rank enters the same rounds)."""
    _enter()


def _read(key: str) -> Optional[int]:
    """The count at `key`: -1 when there is none (or no store), None when what is there failed authentication."""
    try:
        if _signed is None or not _signed.check([key]):
            return -1
        text = _signed.get(key)
        return None if text is None else int(text)
    except ValueError:  # a job without a secret: whatever another process wrote there
        return None
    except Exception:  # the store died with its host process
        return -1


def progress(world_size: int) -> dict[int, int]:
    """The collectives every rank entered, as announced in the store (this rank's own count first, as it is; the
    step each started is in its heartbeat: shoal.comm.heartbeat.last_step, not written to the store every step).
    A rank whose count failed authentication is left out: another process wrote it, nothing is known of that rank."""
    if _publisher is not None:
        try:
            _publisher.publish()
        except (RuntimeError, dist.DistError):
            pass
    counts = {r: _read(f"shoal/calls/{r}") for r in range(world_size)}
    if _store is not None and dist.is_initialized():
        counts[dist.get_rank()] = _calls
    return {r: c for r, c in counts.items() if c is not None}


def shutdown() -> None:
    global _publisher
    if _publisher is not None:
        _publisher.stop.set()
        _publisher = None
    if dist.is_initialized():
        dist.destroy_process_group()


# -- blocking collectives on a group the plan names (shoal.comm.collectives.Group): counted for `progress` -----------
def broadcast(tensor: torch.Tensor, src: int, group) -> None:
    _enter()
    with in_plain_words():
        dist.broadcast(tensor, src=src, group=group.handle)


def all_reduce_sum(tensor: torch.Tensor, group) -> None:
    _enter()
    with in_plain_words():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group.handle)


def all_gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    """Every member's `tensor` (same shape and dtype everywhere), in rank order."""
    _enter()
    gathered = [torch.empty_like(tensor) for _ in group.ranks]
    with in_plain_words():
        dist.all_gather(gathered, tensor, group=group.handle)
    return gathered


def isend(tensor: torch.Tensor, dst: int, tag: int) -> "dist.Work":
    """Start sending `tensor` (contiguous; left untouched until the handle is waited) to `dst`."""
    return dist.isend(tensor, dst=dst, tag=tag)


def irecv(tensor: torch.Tensor, src: int, tag: int) -> "dist.Work":
    """Start receiving into `tensor` (contiguous) the message `src` sends with `tag`."""
    return dist.irecv(tensor, src=src, tag=tag)


# -- point to point: the parameter-server transport (Downpour) ----------------
def send(tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
    with in_plain_words():
        dist.send(tensor, dst=dst, tag=tag)


def recv(tensor: torch.Tensor, src: int, tag: int = 0) -> None:
    with in_plain_words():
        dist.recv(tensor, src=src, tag=tag)


def store_lost() -> bool:
    """Whether the job's store stopped answering: the process hosting it (torchrun's agent, or rank 0) died.

    Asked after a failure, to name its cause: a dead store's socket refuses at once (reset, broken pipe)."""
    if _store is None:
        return False
    try:
        _store.check(["shoal/alive"])
    except (dist.DistError, RuntimeError):
        return True
    return False


PEER_CLOSED = "the connection to another process of the job closed (that process died?)"
PEER_REFUSED = "another process of the job refused the connection (it is not running?)"
PEER_SILENT = "another process of the job did not answer in time"
COMMUNICATION_FAILED = "communication with the job's other processes failed"
# what gloo and c10d say, and shoal's words for it (their texts carry C++ source paths and advice paragraphs)
_PLAIN_WORDS = (
    (("connection closed by peer", "connection reset by peer", "broken pipe", "socket closed"), PEER_CLOSED),
    (("connection refused",), PEER_REFUSED),
    (("timed out waiting", "wait timeout", "socket timeout", "operation to complete"), PEER_SILENT),
)
_LIBRARY_MARKS = ("gloo", "c10d", ".cpp", ".hpp", ".cc:", "glhf", "processgroup", "tcpstore", "torch/csrc")


class CommunicationFailed(RuntimeError):
    """A collective or message of this process failed; the message says why in shoal's words, never gloo's or c10d's."""


@contextmanager
def in_plain_words():
    """A torch.distributed call whose failure is raised as CommunicationFailed, in words of shoal's (describe_error)."""
    try:
        yield
    except CommunicationFailed:
        raise
    except RuntimeError as err:  # gloo's and c10d's errors (DistError among them) are RuntimeErrors
        raise CommunicationFailed(describe_error(err)) from None


def describe_error(err: BaseException, store_at: Optional[str] = None, store_host: str = "the process hosting it") -> str:
    """An error of torch.distributed in a few words of shoal's: what happened to the connection (closed, refused,
    silent); no source location, no advice paragraph, no library's name. Other errors keep their first line.

    store_at ("HOST:PORT"): when the job's store no longer answers, that is the story (its host died),
    whatever the error that noticed it said ("Connection reset by peer", "Broken pipe").
    """
    import re

    if store_at is not None and store_lost():
        return f"lost the job's store at {store_at} ({store_host} died?)"
    if isinstance(err, CommunicationFailed):
        return str(err)
    text = str(err)
    lower = text.lower()
    for needles, words in _PLAIN_WORDS:
        if any(needle in lower for needle in needles):
            return words
    line = text.splitlines()[0] if text.strip() else type(err).__name__
    line = re.sub(r"^(\[[^\]]*\]\s*)+", "", line).split(". This is typically")[0].strip()
    if not line or any(mark in line.lower() for mark in _LIBRARY_MARKS):
        return COMMUNICATION_FAILED
    return line
