"""Heartbeats through the job's store, and a watch that names the peer that went silent.

A daemon thread of every process sets `shoal/heartbeat/<rank>` to "<beat> <step>" four times within the
stall timeout (every 2.5 s at the default 10 s, at least every 5 s) and reads its peers' values in one
request once they all beat (after one that checks they are all there: shoal never deletes a beat), through
a store client of its own with a short timeout (a silent store cannot block it for long). A peer whose beat
has not changed for the stall timeout
(the plan's cluster.stall_timeout_s, passed in by shoal.launcher.stalls) is stalled. A SIGSTOPped
or frozen process stops its heartbeat thread with everything else, so the silent peer is the stalled one, not a healthy rank
that waits for it. When the store itself stops answering that long, its host is the stalled one
(rank 0 under srun or env://; under shoal run or torchrun the launcher hosts the store); a store that refuses
outright, twice in a row (its host died: a stopped host is silent instead), is lost at once. Only this process's monotonic clock is used:
the hosts' clocks need not agree.

A process that ends says "done" and is not watched any more. Every beat carries a MAC under the job's
secret and a freshness counter (shoal.comm.signed_store): a value that fails authentication (another
local user wrote the key: any user can list and write the store's keys) is ignored, named once per key,
and tells nothing about the peer, whose silence counts afresh from then on: while someone else writes
its key, the peer is not judged by its heartbeat (a peer truly stopped meanwhile is found by the comm
timeout). Without a secret (no job's), a value that does not parse is ignored with one warning per key and the
peer judged by its silence. A process that was itself
stopped longer than the timeout sees the gap between its own beats when it runs again (`on_woken`); the time
its watch did not run (stopped, or starved of CPU) never counts as the store's or a peer's silence.

Threads of the runtime that gave up on a peer leave a receive pending in gloo; the process must
then end without running gloo's destructors (`abandon`, `abandoned`).
"""
from __future__ import annotations

import datetime
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from shoal.comm.signed_store import SignedStore, failures, note_vanished
from shoal.errors import warn

KEY = "shoal/heartbeat/{}"
DONE = "done"


def beat_interval(timeout: float) -> float:
    """Four beats within the timeout (a short one in tests), at least one every 5 s: a beat is three requests to the
    store per process, the only bytes a low-communication job (Local SGD) sends between its meetings."""
    return min(5.0, timeout / 4)


@dataclass(frozen=True)
class Stall:
    """A peer that stopped answering: its rank (None: the store, hosted by no rank), its last step, how long it was silent."""

    rank: Optional[int]
    step: int
    silent_s: float
    store: bool = False  # found out because the store it hosts stopped answering
    lost: bool = False  # the store refuses outright (its host died): known at once, not after the timeout


class Watch:
    """This process's heartbeat and its watch over the peers' heartbeats (a daemon thread)."""

    def __init__(self, store, rank: int, world: int, on_stall: Callable[[Stall], None], timeout_s: float,
                 on_woken: Callable[[float], None] = lambda gap: None, store_host: Optional[int] = 0):
        """`store`: the job's (a SignedStore; a plain torch store: a job without a secret); `timeout_s`: seconds of
        silence after which a peer is stalled (the plan's cluster.stall_timeout_s)."""
        self.rank, self.on_stall, self.on_woken, self.store_host = rank, on_stall, on_woken, store_host
        self.timeout = timeout_s
        self.interval = beat_interval(self.timeout)
        if not isinstance(store, SignedStore):
            store = SignedStore(store, None)
        # one client per thread (c10d's advice), with a timeout well inside the stall timeout
        self._client = store.clone()
        self._client.set_timeout(datetime.timedelta(seconds=max(0.5, min(2.0, self.timeout / 3))))
        self._peers = [r for r in range(world) if r != rank]
        now = time.monotonic()
        self._seen: dict[int, tuple[str, int]] = {}  # peer -> (last beat, last step)
        self._changed_at = dict.fromkeys(self._peers, now)
        self._store_ok_at = now  # the last answer: peers' silence is counted up to it (what was read), never past it
        self._unanswered_since: Optional[float] = None  # the first request the store has not answered yet
        self._done: set[int] = set()
        self._stalled: set[int] = set()
        self._store_reported = False
        self._store_lost = False  # the store refused twice in a row, each well inside the client's timeout
        self._fast_failure = min(0.25, self.timeout / 12)  # a refusal is immediate; a silent store takes the timeout
        self._bad_reported: set[int] = set()
        self._step = -1
        self._beats = 0
        self._stop = threading.Event()
        # two threads: store calls can block past any timeout when the store's host is stopped, so the
        # judging happens on a thread that never touches the store
        self._beater = threading.Thread(target=self._beat, name="shoal-heartbeat", daemon=True)
        self._judge_thread = threading.Thread(target=self._watch, name="shoal-stall-watch", daemon=True)

    # -- what the runtime asks ----------------------------------------------------------
    def start(self) -> "Watch":
        self._beater.start()
        self._judge_thread.start()
        return self

    def note_step(self, step: int) -> None:
        """The step this process started (sent with the next beat: names where a stalled peer stopped)."""
        self._step = step

    def is_stalled(self, rank: int) -> bool:
        return rank in self._stalled

    def last_step(self, rank: int) -> int:
        """This process's step, or the one a peer's latest beat carried (-1 before its first beat)."""
        return self._step if rank == self.rank else self._seen.get(rank, ("", -1))[1]

    def revive(self, rank: int) -> None:
        """`rank` runs again (a restarted process in a dead one's place): watch it afresh."""
        self._done.discard(rank)
        self._stalled.discard(rank)
        self._changed_at[rank] = time.monotonic()

    def stop(self) -> None:
        """This process ends normally: say "done" (peers stop watching it) and end the thread."""
        self._stop.set()
        self._judge_thread.join()
        self._beater.join(timeout=2 * self.interval)
        ignored = failures()
        if ignored:
            counts = ", ".join(f"{key} ({n})" for key, n in sorted(ignored.items()))
            warn(f"WARNING: this process ignored {sum(ignored.values())} value(s) of the job's store that failed authentication: "
                 f"{counts}")
        if self._beater.is_alive():  # blocked on a silent store: nobody is left to tell
            return
        try:
            self._client.set(KEY.format(self.rank), f"{DONE} {self._step}")
        except Exception:  # the store's host ended first
            pass

    # -- the thread -----------------------------------------------------------------------
    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            started = time.monotonic()
            if self._unanswered_since is None:
                self._unanswered_since = started
            try:
                self._client.set(KEY.format(self.rank), f"{self._beats} {self._step}")
                self._beats += 1
                self._read_peers(time.monotonic())
                self._store_ok_at, self._unanswered_since = time.monotonic(), None
            except Exception:  # the store did not answer: judged by how long that lasts, unless it refused
                if time.monotonic() - started < self._fast_failure and self._refuses():
                    self._store_lost = True

    def _refuses(self) -> bool:
        """Whether the store refuses again at once, a moment later: its host is gone (a stopped host is silent)."""
        time.sleep(self._fast_failure)
        started = time.monotonic()
        try:
            self._client.check([KEY.format(self.rank)])
            return False
        except Exception:
            return time.monotonic() - started < self._fast_failure

    def _watch(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.interval / 2):
            now = time.monotonic()
            if now - last > self.timeout:  # this process was stopped (SIGSTOP): its peers have judged it
                self.on_woken(now - last)
            held_up = now - last - self.interval / 2
            if held_up > self.interval / 2 and self._unanswered_since is not None:
                # this thread did not run (the process stopped, or starved of CPU): a request in flight across the stop
                # was not left unanswered by the store (a stop just under the timeout, added to the time already
                # waited, would otherwise read as the store's silence)
                self._unanswered_since = min(now, self._unanswered_since + held_up)
            last = now
            self._judge(now)

    def _read_peers(self, now: float) -> None:
        watched = [p for p in self._peers if p not in self._done and p not in self._stalled]
        beating = [p for p in watched if p in self._seen]  # their keys exist: one multi_get reads them all
        if beating:
            keys = [KEY.format(p) for p in beating]
            if self._client.check(keys):
                values = self._client.multi_get(keys)
            else:  # shoal never deletes a beat: someone did (multi_get would wait for it until the timeout)
                values = [self._client.multi_get([k])[0] if self._client.check([k]) else self._vanished(k) for k in keys]
            for peer, text in zip(beating, values):
                self._take(peer, text, now)
        for peer in watched:
            if peer in beating:
                continue
            key = KEY.format(peer)
            if not self._client.check([key]):  # not beating yet (it counts as silent from our start)
                continue
            self._take(peer, self._client.multi_get([key])[0], now)

    def _vanished(self, key: str) -> None:
        if self._client.signed:
            note_vanished(self._client.prefix + key)
        return None

    def _take(self, peer: int, text: Optional[str], now: float) -> None:
        """`text`: the peer's beat as read; None: what was there failed authentication (named by the store)."""
        parsed = None if text is None else _parse(text)
        if parsed is None and self._client.signed:  # another process writes the key: nothing is known of the peer
            self._changed_at[peer] = now
            return
        if parsed is None:
            if peer not in self._bad_reported:
                self._bad_reported.add(peer)
                warn(f"WARNING: ignoring heartbeat key {KEY.format(peer)} = {(text or '')[:40]!r}: not written by shoal "
                     "(another process uses the job's store?)")
            return
        beat, step = parsed
        if beat == DONE:
            self._done.add(peer)
        elif self._seen.get(peer, (None, -1))[0] != beat:
            self._changed_at[peer] = now
        self._seen[peer] = (beat, step)

    def _judge(self, now: float) -> None:
        # The store is silent only while a request waits for its answer, and a peer only up to the last read: time this
        # process's threads did not run (stopped, starved of CPU, its beat thread scheduled late) is nobody's silence
        store_silent = 0.0 if self._unanswered_since is None else now - self._unanswered_since
        if self._store_lost or store_silent > self.timeout:
            host_gone = self.store_host in self._done or self.store_host == self.rank
            if not host_gone and not self._store_reported:
                self._store_reported = True
                if self.store_host is not None:
                    self._stalled.add(self.store_host)
                self.on_stall(Stall(self.store_host, self._seen.get(self.store_host, ("", -1))[1], store_silent, store=True,
                                    lost=self._store_lost))
            return  # nothing read from the store: the peers' silence says nothing about them
        for peer in self._peers:
            silent = self._store_ok_at - self._changed_at[peer]
            if peer not in self._done and peer not in self._stalled and silent > self.timeout:
                self._stalled.add(peer)
                store_lagging = peer == self.store_host and store_silent > 2 * self.interval
                self.on_stall(Stall(peer, self._seen.get(peer, ("", -1))[1], silent, store=store_lagging))


def _parse(raw: str) -> Optional[tuple[str, int]]:
    """(beat, step) from "<beat> <step>" or "done <step>"; None for anything else."""
    parts = raw.split()
    if len(parts) != 2 or not (parts[0].isdigit() or parts[0] == DONE):
        return None
    try:
        return parts[0], int(parts[1])
    except ValueError:
        return None


# -- this process's watch, for the runtime ---------------------------------------------------
_watch: Optional[Watch] = None
_abandoned = False


def start(rank: int, world: int, timeout_s: float, **kwargs) -> Watch:
    """Beat and watch over the job's store (shoal.comm.dist); rank 0 hosts it under srun or env://, else the launcher (shoal run, torchrun.s agent)."""
    from shoal.comm import dist as comm

    global _watch
    store = comm.signed_job_store()
    kwargs.setdefault("store_host", comm.store_host())
    _watch = Watch(store, rank, world, timeout_s=timeout_s, **kwargs).start()
    return _watch


def stop() -> None:
    global _watch
    if _watch is not None:
        _watch.stop()
        _watch = None


def note_step(step: int) -> None:
    if _watch is not None:
        _watch.note_step(step)


def last_step(rank: int) -> int:
    """The step `rank` last said it started: this process's own, or a peer's as its latest beat carried it
    (at most one beat old; -1 before its first beat or without a watch)."""
    return -1 if _watch is None else _watch.last_step(rank)


def is_stalled(rank: int) -> bool:
    """Whether this process's watch found `rank` silent (False without a watch)."""
    return _watch is not None and _watch.is_stalled(rank)


def any_stalled(ranks: Iterable[int]) -> bool:
    return any(is_stalled(r) for r in ranks)


def revive(rank: int) -> None:
    """This process's watch takes `rank` up again (shoal.launcher.rejoin: a process restarted in its place)."""
    if _watch is not None:
        _watch.revive(rank)


def say_gone(store: SignedStore, rank: int) -> None:
    """The launcher saw `rank` exit: its peers stop watching it (they do not wait for its silence to be a stall).
    `store`: the job's, as the launcher's client signs its values (shoal.comm.channels.job_store_client)."""
    store.set(KEY.format(rank), f"{DONE} -1")


def said_step(store: SignedStore, rank: int) -> Optional[int]:
    """The step `rank`'s latest beat (or its "done") carried, read by the launcher once the job's processes ended;
    None when there is none, or none that authenticates. `store`: as for `say_gone`."""
    text = store.get(KEY.format(rank))
    try:
        step = int(text.split()[1]) if text else -1
    except (IndexError, ValueError):
        return None
    return step if step >= 0 else None


def abandon() -> None:
    """A thread of this process stays blocked in a receive from a dropped peer (see `abandoned`)."""
    global _abandoned
    _abandoned = True


def abandoned() -> bool:
    """gloo aborts the process (std::terminate) if it is torn down under a pending receive: such a
    process must end with os._exit once its work is done."""
    return _abandoned
