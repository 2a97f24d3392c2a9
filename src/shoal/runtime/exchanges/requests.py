"""Request/response over point-to-point messages: the mechanics Downpour's and Distributed Hogwild's protocols share.

Both protocols ask and answer over a link to one peer (a shoal.comm.channels.Channel, or Distributed Hogwild's
world point-to-point to a peer that started with the job); a restarted process reaches its peers through a `Door`
(shoal.comm.channels: its incarnations, knocks and handshakes). What they share is here, once:

- a message's layout: slices of params laid end to end (`Segment`), taken from and put back into a store;
- receives posted early (`post`), before the request that their message answers, or before the answer
  that the next request follows;
- an int64 header of a request (`words`);
- a knock let in only when its process proves it holds the job's secret (`let_in`);
- a wait on a thread blocked in a receive from a peer, given up once the heartbeat says the peer stalled
  (`wait_unless`): gloo's receives cannot be cancelled;
- a link whose every blocking call is given up on the launcher's word that its peer's process was replaced or will
  not come back (`Guarded`).

Each protocol keeps its own kinds, tags and order of messages (its wire format).
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from shoal.comm import channels, heartbeat
from shoal.errors import ShoalError
from shoal.neuralnet.params import ParamStore
from shoal.planning.placement import ParamSlice


@dataclass(frozen=True)
class Segment:
    """Elements [start, stop) of `param`, at `offset` in a server's flat message."""

    param: str
    start: int
    stop: int
    offset: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def server_segments(slices: list[ParamSlice]) -> tuple[list[Segment], int]:
    """A server's (or a master's) slices laid end to end: what its messages carry, in order."""
    segments, offset = [], 0
    for s in slices:
        segments.append(Segment(s.param, s.start, s.stop, offset))
        offset += s.size
    return segments, offset


def gather(store: ParamStore, segments: list[Segment]) -> torch.Tensor:
    """The store's values of `segments`, laid end to end (a copy)."""
    parts = [store.values[s.param].reshape(-1)[s.start : s.stop] for s in segments]
    return torch.cat(parts) if parts else torch.zeros(0, device="cpu")


def scatter(store: ParamStore, flat: torch.Tensor, segments: list[Segment]) -> None:
    """`flat`'s values of `segments` into the store."""
    for s in segments:
        store.values[s.param].view(-1)[s.start : s.stop].copy_(flat[s.offset : s.offset + s.size])


def words(*values: int) -> torch.Tensor:
    """A request's header (or a short answer): int64 words on the host."""
    return torch.tensor(values, dtype=torch.int64, device="cpu")


class Posted:
    """Receives posted before their messages are due.

    gloo sends a message only once its receiver has said it is ready, and that word queues behind whatever data is
    already on the way in its direction (another peer's request, another group's values). Said late (after the
    request, or after the answer the next request follows), each message waits for the link to drain the other way:
    the two directions alternate instead of crossing (1.5x the link time of their bytes, benchmarks/shaped_links.py)."""

    def __init__(self, link, buffers: list[tuple[torch.Tensor, int]]):
        self.link = link
        self._receives = [link.irecv(tensor, tag) for tensor, tag in buffers]

    def wait(self) -> None:
        """Returns once every buffer holds its message (RuntimeError: the peer is gone)."""
        for receive in self._receives:
            receive.wait()


def post(link, buffers: list[tuple[torch.Tensor, int]]) -> Posted:
    """Post a receive of each (buffer, tag) from `link`'s peer, now."""
    return Posted(link, buffers)


def let_in(door: channels.Door, name: str) -> Optional[channels.Channel]:
    """The serving side of the channel `name` a knock asked for (Door.accept named it), once its process proved it holds
    the job's secret; None when it did not (RuntimeError: the handshake failed)."""
    channel = door.open(name, 0)
    return channel if channels.authenticate(channel, name, 0, door.secret) else None


def wait_unless(thread: threading.Thread, stalled: Callable[[], bool], poll_s: float) -> bool:
    """Wait for `thread` (blocked in a receive from a peer) to end, unless `stalled()` says the peer stopped answering:
    then the thread is left blocked (heartbeat.abandon: this process must end without tearing gloo down) and False."""
    while thread.is_alive():
        thread.join(timeout=poll_s)
        if thread.is_alive() and stalled():
            heartbeat.abandon()
            return False
    return True


GONE_POLL_S = 0.05  # how often a blocked call asks whether its peer is gone: one store read, only while it waits


class PeerGone(ShoalError, RuntimeError):
    """The launcher said that the peer of a link's blocked call is gone (replaced by a new process, or not coming back)."""


class Waiter:
    """Runs one blocking call at a time on a thread of its own, while the calling thread waits for it, asking `gone()`
    every GONE_POLL_S whether to stop waiting. Given up on, the call stays blocked on its thread (gloo's sends and
    receives can be neither cancelled nor waited for in slices: a timed-out wait closes the link) and the next
    call gets a new thread."""

    def __init__(self, name: str):
        self.name = name
        self._calls: Optional[queue.SimpleQueue] = None
        self._thread: Optional[threading.Thread] = None

    def call(self, work: Callable[[], object], gone: Callable[[], Optional[str]]):
        """`work()`'s result (or its error); PeerGone once `gone()` names why to stop waiting. A call made by a
        `work` (on the waiter's thread) runs in place: several calls go as one hand-over (`Guarded.run`)."""
        if threading.current_thread() is self._thread:
            return work()
        if self._calls is None:
            self._calls = queue.SimpleQueue()
            self._thread = threading.Thread(target=_run_calls, args=(self._calls,), name=self.name, daemon=True)
            self._thread.start()
        done, outcome = threading.Event(), {}
        self._calls.put((work, outcome, done))
        while not done.wait(GONE_POLL_S):
            reason = gone()
            if reason is not None and not done.is_set():
                heartbeat.abandon()  # this process ends without gloo's teardown under the blocked call
                self._calls = self._thread = None
                raise PeerGone(reason)
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("result")


def _run_calls(calls: queue.SimpleQueue) -> None:
    while True:
        work, outcome, done = calls.get()
        try:
            outcome["result"] = work()
        except BaseException as err:  # noqa: BLE001 (handed to the waiting thread, which raises it)
            outcome["error"] = err
        finally:
            done.set()


class Guarded:
    """A link (a shoal.comm.channels.Channel) whose blocking calls give up once `gone()` names why: the launcher's
    word that the peer's process died. gloo fails a call on a dead peer's link at once, most of the time; under load
    a send or receive now and then waits out the whole comm timeout (45 s) instead."""

    def __init__(self, link, gone: Callable[[], Optional[str]], waiter: Waiter):
        self.link, self.gone, self.waiter = link, gone, waiter

    def send(self, tensor: torch.Tensor, tag: int) -> None:
        self.waiter.call(lambda: self.link.send(tensor, tag), self.gone)

    def recv(self, tensor: torch.Tensor, tag: int) -> None:
        self.waiter.call(lambda: self.link.recv(tensor, tag), self.gone)

    def irecv(self, tensor: torch.Tensor, tag: int) -> "_GuardedReceive":
        return _GuardedReceive(self.link.irecv(tensor, tag), self)

    def run(self, calls: Callable[[], object]):
        """`calls()`, whose calls on this link (a request's messages, the waits for its answer) are handed to the
        waiter's thread once, not each: a hand-over costs a thread switch (about 25 us idle, far more on a busy machine)."""
        return self.waiter.call(calls, self.gone)


class _GuardedReceive:
    """A posted receive of a Guarded link: its wait() gives up as the link's calls do."""

    def __init__(self, receive, link: Guarded):
        self._receive, self._link = receive, link

    def wait(self) -> None:
        self._link.waiter.call(self._receive.wait, self._link.gone)
