"""Downpour over processes: worker groups push gradients to one server group and pull fresh params.

Each worker group is synchronous inside (its processes sum their gradients
into the group's stub, its lowest rank, and receive the new params from it);
groups are asynchronous to each other. Per step a stub sends every server the
gradient of the slices it owns (SINGA's lcm slicing, shoal.planning.placement) with the
version of the params the group computed on; the server applies the updater
to its slices at once (the LR step is the slice version, as SINGA's), bumps
the version and answers with the new values, the new version and the
staleness of that update (updates other groups made in between).

Stubs and servers talk over channels of their own (shoal.comm.channels: a
two-process gloo group per server, group and incarnation, built through the
job's store), not over the job's world process group, so that a process can
take a dead one's place. A server serves each group on a thread with blocking
receives from that group's stub. A group whose process dies only ends that
thread (the server warns and goes on); the server then waits for a new process
of the group (shoal.launcher.rejoin: restarted by the launcher or by hand),
which pulls the live values, the version and the steps its group has done,
and trains the steps left. A push in flight when a process died is lost whole
(a server applies a push once it received all of it). The chief's last
request waits until every group has stopped or is gone with no new process
announced, so the final test and checkpoint see the model every group
trained; then the servers close. A group other than 0 whose stub stops
answering (no heartbeat for cluster.stall_timeout_s, shoal.comm.heartbeat) is
dropped the same way, though its thread stays blocked in its receive; if the
group wakes later, its pushes are refused (answered with version -1, never
applied) and it leaves.

A server's death, under cluster.max_restarts (Strategy.servers_heal): the
launcher announces the server's next restart at the door (server<S>/restart)
and starts a new process in its place (shoal.launcher.rejoin); every stub that
finds its channel to the server closed waits for that word (SERVER_ANNOUNCEMENT_S;
without it, ServerLost as before) and knocks at the new process's keys. The
mirror is the chief's: a stub already holds its newest answer's values of every
slice, so the chief keeps only what a worker lacks, each server's updater state
and counters (version, each group's steps and updates, bytes), asked for with
MIRROR every `mirror_interval` of its steps (the cost model's choice). The chief
heals the new server with HEAL: its newest values and their version, and that
mirror; the server answers nobody before. Every other stub then pulls the healed
values (PULL) and goes on. Lost: the updates the dead server applied after the
version of the chief's newest answer (other groups' pushes during the chief's
current step), every push in flight (dropped, never sent again: the values it
was computed on are gone), and the updater state's progress since the last
refresh (at most `mirror_interval` of the chief's steps old).
"""
from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from shoal.errors import ShoalError, warn
from shoal.neuralnet.algorithms import Grads
from shoal.planning.placement import ParamSlice, Placement, ServerId
from shoal.comm import channels
from shoal.comm import dist as comm
from shoal.comm import heartbeat
from shoal.report.metrics import MetricWindow
from shoal.report.writes import open_for_append
from shoal.neuralnet.params import ParamStore
from shoal.runtime.exchanges.compression import Codec, codecs_state, load_codecs_state, wire_bytes
from shoal.runtime.exchanges.clipping import clip_, max_norm_of
from shoal.runtime.exchanges.local import aggregate
from shoal.runtime.exchanges.staleness import StalenessStats, histogram, may_apply
from shoal.runtime.interfaces import GroupDropped
from shoal.runtime import rejoined
from shoal.runtime.rejoined import fingerprint
from shoal.neuralnet.updaters import ParamUpdate, Updater

PUSH, STOP, STATE, FINAL, PULL, MIRROR, HEAL, FIRST = 1, 2, 3, 4, 5, 6, 7, 8
REFUSED = -1  # the version a server answers a dropped group with
DOOR = "downpour"  # the channels' keys in the job's store (shoal.comm.channels)
ANNOUNCEMENT_S = 2.0  # how long a server waits for the launcher to say whether a dead group is restarted
TAG_HEADER, TAG_GRAD, TAG_VALUES, TAG_REPLY, TAG_STATE, TAG_HAS_GRAD, TAG_LAGS, TAG_BYTES = 11, 12, 13, 14, 15, 16, 17, 18
TAG_MIRROR = 19  # a mirror's counters (MIRROR's answer, HEAL's request)
TAG_HYPER = 20  # a push's hyper-parameters (a user's loop: its optimizer's lr, betas... as its scheduler left them)
SERVER_ANNOUNCEMENT_S = 10.0  # how long a stub that lost its server waits for the launcher to say it restarts it
# the chief refreshes its mirror of a server's updater state so that the mirror adds at most this share to the
# bytes the chief moves with that server (a gradient out and the values back per step): mirror_interval
MIRROR_SHARE = 0.25


def server_key(server_id: int, restart: int):
    """A server's keys at the door: its first process's are its id, as before; a restart's are its own."""
    return server_id if restart == 0 else f"{server_id}r{restart}"


COUNTERS_EVERY = 50  # an updater without state: the mirror holds counters only (steps, updates per group, bytes)


def mirror_interval(state_elements: int, shard_elements: int) -> int:
    """Every how many of its steps the chief refreshes its mirror of a server's updater state (the cost model's
    choice): the state's bytes spread over K steps are at most MIRROR_SHARE of the 2 x shard bytes a step moves with
    that server, so K = ceil(state / (MIRROR_SHARE x 2 x shard)): momentum every 2 steps, Adam every 4. The values
    need no refresh (the chief holds its newest answer's). Plain SGD (no state): every COUNTERS_EVERY steps, the
    counters only (a round trip per step would cost more than what it keeps)."""
    if state_elements <= 0 or shard_elements <= 0:
        return COUNTERS_EVERY
    return max(1, math.ceil(state_elements / (MIRROR_SHARE * 2 * shard_elements)))


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
    """A server's slices laid end to end: what its messages carry, in order."""
    segments, offset = [], 0
    for s in slices:
        segments.append(Segment(s.param, s.start, s.stop, offset))
        offset += s.size
    return segments, offset


def state_layout(updater: Updater, store: ParamStore, segments: list[Segment]) -> list[tuple[Segment, str, int]]:
    """A server's updater state in one flat message: each segment's slots in name order, with their sizes (an
    element-wise slot the segment's, a per-param slot such as torch's Adam step whole)."""
    layout = []
    for seg in segments:
        info = store.info[seg.param]
        for slot, shape in sorted(updater.state_shapes(seg.param, tuple(info.shape)).items()):
            numel = math.prod(shape)
            layout.append((seg, slot, seg.size if numel == info.numel else numel))
    return layout


class JobOver(ShoalError):  # not a RuntimeError: no channel failed
    """A process rejoined too late: the servers finished serving (the job ended without it)."""


class ServerLost(ShoalError, RuntimeError):
    """A server of the job died or stopped answering: the job cannot go on (resume from a checkpoint)."""


class DownpourServer:
    """One server of the (single) server group: owns slices, their updater state and one version."""

    def __init__(self, store: ParamStore, updater: Updater, placement: Placement, server: ServerId,
                 stubs: dict[int, int], log: Callable[[str], None] = print, max_staleness: int = -1, warmup_steps: int = 0,
                 after_update: Optional[Callable[[int], None]] = None, max_update_lag: int = -1, overlap_push: bool = False,
                 codecs: Optional[Callable[..., Codec]] = None):
        """`after_update(version)`: called after each update (fault injection for tests: shoal.launcher.faults).
        The cluster section's settings come as the strategy reads them from the plan: `max_staleness`, `warmup_steps`,
        `max_update_lag`, `overlap_push` and `codecs` (cluster.compression: a fresh codec per connection; None: float32)."""
        self.store, self.updater, self.server, self.stubs, self.log = store, updater, server, stubs, log
        self.codecs = codecs or Codec
        trainable = set(store.trainable_names())
        self.segments, self.size = server_segments([s for s in placement.slices_of(server) if s.param in trainable])
        self.state = {seg: updater.init_shard_state(self._view(seg), (seg.param, seg.start, seg.stop)) for seg in self.segments}
        self.layout = state_layout(updater, store, self.segments)
        self.version = 0
        self._lock = threading.Lock()  # a server applies one update at a time, as SINGA's
        self._running = threading.Condition()
        self._live = set(stubs)  # groups connected (or not yet: a group counts as live until it is lost)
        self._expected: set[int] = set()  # lost groups whose new process is announced: the chief's last request waits for them
        # bounded staleness and warm-up are enforced here, where every group's progress is known
        self.max_staleness, self.warmup_steps = max_staleness, warmup_steps
        self._steps = {g: 0 if g == 0 else warmup_steps for g in stubs}  # steps each group has pushed
        self.max_update_lag = max_update_lag
        # per group, the versions its outstanding updates are computed on, oldest first: one, or two when a group
        # computes its next step while its push is out (overlap_push); groups that wait for the warm-up read when they pull
        self.depth = 2 if overlap_push else 1
        self._reads = {g: [0] * self.depth for g in stubs if g == 0 or not warmup_steps}
        self.lags = {g: StalenessStats() for g in stubs}  # the lag of every update applied, per group
        self._warming: set[int] = set()  # groups waiting for group 0's warm-up hold nobody back
        self._dropped: set[tuple[int, int]] = set()  # (group, incarnation) whose stub stalled: never applied again
        self._finished: set[int] = set()  # groups that said STOP (or FINAL)
        self.applied = dict.fromkeys(stubs, 0)  # updates applied per group: their sum is the version (none lost)
        self.incarnations = dict.fromkeys(stubs, 0)  # the incarnation of each group served last
        self._refused: set[str] = set()  # the nonces of knocks that could not prove they hold the job's secret
        self._closed = False
        self.after_update = after_update
        # the payload every group pushed here and this server answered, in this run (summary.json's bytes_sent): counted
        # here, where a group that died has its pushes and pulls counted to its last one
        self.bytes_moved = 0
        self.restart = 0  # this server's restarts before this process (the door says, in serve)
        self.rank: Optional[int] = None  # this process's, and the workspace whose logs take a heal's record
        self.workspace: Optional[str] = None
        self.key = server.id  # its keys at the door (server_key)
        self._healed = threading.Event()  # a restarted server serves once the chief's mirror healed it
        self._healed.set()
        self.started_at = time.time()
        # a user's loop (shoal.session): every push carries `hyper_size` float64 hyper-parameters, which `set_hyper`
        # puts on the updater's optimizer before the push's update (the user's schedule at the pushing group's step)
        self.hyper_size = 0
        self.set_hyper: Optional[Callable[[torch.Tensor], None]] = None

    def await_first_values(self) -> None:
        """Serve nobody before the chief's FIRST (a user's loop: this process never saw the module, the chief's values
        and, resumed, the updater state come over the chief's channel)."""
        self._healed.clear()

    def _view(self, seg: Segment) -> torch.Tensor:
        return self.store.values[seg.param].view(-1)[seg.start : seg.stop]

    def load_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Resume: this server's slices of a whole-model updater state (any earlier slicing)."""
        for seg, slots in self.state.items():
            for slot, value in slots.items():
                if seg.param in state and slot in state[seg.param]:
                    whole = state[seg.param][slot].reshape(-1)
                    value.copy_(whole[seg.start : seg.stop] if whole.numel() == self.store.info[seg.param].numel
                                else whole.reshape(value.shape))

    def values(self) -> torch.Tensor:
        return torch.cat([self._view(seg) for seg in self.segments]) if self.segments else torch.zeros(0, device="cpu")

    def state_flat(self) -> torch.Tensor:
        parts = [self.state[seg][slot].reshape(-1) for seg, slot, _ in self.layout]
        return torch.cat(parts) if parts else torch.zeros(0, device="cpu")

    def apply(self, grad: torch.Tensor, read_version: int, has_grad: torch.Tensor, group: int = 0,
              step: Optional[int] = None, hyper: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, int, int]:
        """One update of every owned segment whose param some worker of the group had a gradient for (`step`: the
        group's own, which its push's header carries; `hyper`: the push's hyper-parameters, a user's loop's)."""
        with self._lock:
            if hyper is not None and self.set_hyper is not None:
                self.set_hyper(hyper)
            lag = self.version - read_version
            updates = []
            for seg, had in zip(self.segments, has_grad.tolist()):
                if not had:  # as the in-memory server: no gradient, no update (momentum and decay wait too)
                    continue
                info = self.store.info[seg.param]
                updates.append(ParamUpdate(self._view(seg), grad[seg.offset : seg.offset + seg.size], self.state[seg],
                                           info.lr_scale, info.wd_scale))
            # one update of the server's slices (torch: one step)
            self.updater.update_many(self.version, updates, group_step=None if step is None else (group, step))
            self.version += 1
            self.applied[group] = self.applied.get(group, 0) + 1
            self.lags.setdefault(group, StalenessStats()).add(lag)
            if self.after_update is not None:
                self.after_update(self.version)
            return self.values(), self.version, lag

    # -- serving: one thread per group for the job's life, one per incarnation of the group ------------
    def serve(self) -> None:
        """Serve every group (and every process that rejoins in a dead one's place) until the chief's last request."""
        self.door = channels.Door(DOOR)
        # announced by the launcher before it started this process: nonzero in a process restarted in a dead server's place
        self.restart = self.door.server_restart(self.server.id)
        self.key = server_key(self.server.id, self.restart)
        if self.restart:
            self._take_over()
        lives = [threading.Thread(target=self._group_life, args=(g,), name=f"shoal-serve-group{g}", daemon=True)
                 for g in self.stubs]
        for t in lives:
            t.start()
        for t in lives:  # each ends when its group finished or, the job over, nobody is left to wait for
            t.join()
        counts = ", ".join(f"group {g}: {n}" + (f" ({self.incarnations[g] + 1} processes)" if self.incarnations[g] else "")
                           for g, n in sorted(self.applied.items()))
        self.log(f"{self.server}: version {self.version}; updates applied: {counts}")

    def _take_over(self) -> None:
        """A restarted server: wait for the chief's mirror (HEAL) before serving anyone; the groups its dead
        predecessor saw finish, or lose with no new process coming, are not waited for."""
        self._healed.clear()
        self.started_at = rejoined.process_started_at()
        before = server_key(self.server.id, self.restart - 1)
        for group in self.stubs:
            state = self.door.state(before, group) or ""
            self.incarnations[group] = self.door.incarnation(group)
            if state == "finished":
                self._finished.add(group)
                self._live.discard(group)
            elif state.startswith("lost ") and not self.door.expected(group, int(state.split()[1])):
                self._live.discard(group)
            self.door.set_state(self.key, group, state)

    def _group_life(self, group: int) -> None:
        rank = self.stubs[group]
        if group in self._finished:
            return
        incarnation = self.incarnations[group]
        while True:
            channel, incarnation = self._accept(group, rank, incarnation)
            if channel is None:
                return
            serving = threading.Thread(target=self._serve_incarnation, args=(group, incarnation, channel),
                                       name=f"shoal-serve-group{group}-{incarnation}", daemon=True)
            serving.start()
            while serving.is_alive():  # never join a thread blocked in a receive from a stalled group: it may never return
                serving.join(timeout=0.25)
                if serving.is_alive() and self._drop_if_stalled(group, rank, incarnation):
                    heartbeat.abandon()
                    break
            if group in self._finished:
                return
            incarnation += 1

    def _accept(self, group: int, rank: int, incarnation: int):
        """Wait for the stub of `incarnation` (or a newer one) to knock and prove it holds the job's secret, and open
        its channel; (None, _) once closed. A knock that cannot prove it is refused, and the group's newest
        incarnation given up on (the chief's last request does not wait for an impostor)."""
        while True:
            with self._running:
                if self._closed:
                    return None, incarnation
            newest = max(incarnation, self.door.incarnation(group))
            knock = self._knock(group, incarnation, newest)
            if knock is not None:
                knocked, nonce = knock
                with self._running:
                    if self._closed:
                        return None, incarnation
                    name = self.door.accept(self.key, group, knocked, nonce)
                    self._live.add(group)  # the chief's last request waits while it proves itself
                    self._expected.discard(group)
                    self._running.notify_all()
                channel = self._authenticated(group, knocked, name)
                if channel is None:
                    self._refused.add(nonce)
                    if knocked == self.door.incarnation(group):  # nobody else announced: wait for nobody
                        self.door.give_up(group, knocked)
                    with self._running:
                        self._live.discard(group)
                        self._running.notify_all()
                    continue
                with self._running:
                    self.incarnations[group] = knocked
                if knocked > 0:  # a process restarted in a dead one's place: watch it afresh
                    heartbeat.revive(rank)
                self.door.set_state(self.key, group, f"serving {knocked}")
                return channel, knocked
            self._note_expected(group, rank, incarnation)
            time.sleep(channels.POLL_S * 5)

    def _knock(self, group: int, incarnation: int, newest: int) -> Optional[tuple[int, str]]:
        """(incarnation, nonce) of the knock to answer: the newest incarnation's, else, once a knock was refused, an
        older announced one's (an impostor that claimed the newest must not shut out the process the launcher started)."""
        for knocked in range(newest, incarnation - 1, -1):
            nonce = self.door.hello(self.key, group, knocked)
            if nonce is not None and nonce not in self._refused:
                return knocked, nonce
            if not self._refused:
                return None
        return None

    def _authenticated(self, group: int, incarnation: int, name: str):
        """The channel `name` once its stub proved it holds the job's secret; None (one line in this log) when it did not."""
        try:
            channel = self.door.open(name, 0)
            if channels.authenticate(channel, name, 0, self.door.secret):
                return channel
            why = "it could not prove it holds the job's secret"
        except RuntimeError as err:
            why = f"its handshake failed: {comm.describe_error(err)}"
        self.log(f"{self.server} refused a process knocking as worker group {group} (restart {incarnation}): {why}; "
                 "nothing it sends is applied")
        return None

    def _note_expected(self, group: int, rank: int, incarnation: int) -> None:
        """While a group is away: is a new process of it announced (the chief's last request waits for it)?"""
        expected = incarnation > 0 and self.door.expected(group, incarnation - 1)
        # the first process died before it connected: its silence, or the launcher gave up restarting it
        first_never_came = incarnation == 0 and group != 0 and (
            heartbeat.is_stalled(rank) or self.door.given_up(group) >= self.door.incarnation(group))
        with self._running:
            if expected:
                self._expected.add(group)
            else:
                self._expected.discard(group)
            if first_never_came and group in self._live:
                self.log(f"{self.server} drops worker group {group} (process {rank}): it never connected")
                self._live.discard(group)
            self._running.notify_all()

    def _drop_if_stalled(self, group: int, rank: int, incarnation: int) -> bool:
        """A group other than 0 whose stub stopped answering is dropped like a dead one (group 0's stall fails the job)."""
        if group == 0 or not heartbeat.is_stalled(rank):
            return False
        self._dropped.add((group, incarnation))
        self.log(f"{self.server} drops worker group {group} (process {rank}): it stopped answering")
        self._lost(group, incarnation)
        return True

    def _lost(self, group: int, incarnation: int) -> None:
        with self._running:
            if self.incarnations[group] == incarnation:
                self._live.discard(group)
                self._reads.pop(group, None)  # its update in flight is lost: nobody waits for it to land
                self.door.set_state(self.key, group, f"lost {incarnation}")
            self._running.notify_all()

    def _stopped(self, group: int) -> None:
        with self._running:
            self._finished.add(group)
            self._live.discard(group)
            self._reads.pop(group, None)
            self._running.notify_all()
        self.door.set_state(self.key, group, "finished")

    def restore(self, params: dict[str, torch.Tensor], updater_state: dict, step: int, version: int) -> None:
        """Continue from a checkpoint taken at `step`, when the version was `version`."""
        self.store.load(params, strict=True)
        self.load_state(updater_state)
        self.version = version
        self._steps = {g: step if g == 0 else max(step, self.warmup_steps) for g in self._steps}
        self._reads = {g: [version] * self.depth for g in self._reads}

    def _may_go(self, step: int) -> bool:
        live = [self._steps[g] for g in self._live - self._warming]
        return self.max_staleness < 0 or not live or step - min(live) <= self.max_staleness

    def _lag_allows(self, group: int) -> bool:
        """max_update_lag: may this group's update land now (shoal.runtime.exchanges.staleness)?"""
        reads = {g: r for g, r in self._reads.items() if g in self._live}
        return may_apply(group, self.version, reads, self.max_update_lag)

    def lag_counts(self) -> torch.Tensor:
        """Updates applied per (group, lag): the histogram the chief's last request takes to summary.json."""
        width = max((s.max for s in self.lags.values()), default=0) + 1
        counts = torch.zeros(len(self.stubs), width, dtype=torch.int64, device="cpu")
        for g, stats in self.lags.items():
            for lag, n in stats.counts.items():
                counts[g, lag] = n
        return counts

    def _warm(self) -> bool:
        return 0 not in self._live or self._steps.get(0, 0) >= self.warmup_steps

    def _serve_incarnation(self, group: int, incarnation: int, channel) -> None:
        header = torch.zeros(3, dtype=torch.int64, device="cpu")
        codec = self.codecs()
        received = codec.buffers(self.size)
        has_grad = torch.zeros(len(self.segments), dtype=torch.uint8, device="cpu")
        hyper = torch.zeros(self.hyper_size, dtype=torch.float64, device="cpu")
        extra = [hyper] if self.hyper_size else []  # (a user's loop's pushes carry its hyper-parameters)
        finished, push = False, []
        try:
            while True:
                # the next push's receives are posted with its header's, before the stub asks: gloo sends a message
                # only once its receiver has said it is ready, and said after the header, that word queued behind the
                # data on its way to the group (another group's values), so each push waited for the link to drain
                # the other way. A stub's last request (STOP, FINAL) comes with a zero push that fills them.
                push = push or [channel.irecv(part, TAG_GRAD) for part in received] + [channel.irecv(has_grad, TAG_HAS_GRAD)] \
                    + [channel.irecv(t, TAG_HYPER) for t in extra]
                channel.recv(header, TAG_HEADER)
                kind, _, read_version = header.tolist()
                if kind in (PUSH, STOP, FINAL):
                    for receive in push:
                        receive.wait()
                    push = []
                if (group, incarnation) in self._dropped:  # it woke after being dropped: its gradients are stale
                    self._refuse(group, channel, kind)
                    return
                if kind == HEAL:
                    self._heal(group, channel, header.tolist()[1])
                    continue
                if kind == FIRST and group == 0:
                    self._first_values(channel, header.tolist()[1], read_version)
                    continue
                self._healed.wait()  # a restarted server answers nobody before the chief's mirror healed it
                if kind == PUSH:
                    grad = codec.decode(received, self.size)
                    step = header.tolist()[1]
                    with self._running:  # hold a group too far ahead (max_staleness) or whose update is not due (max_update_lag)
                        self._running.wait_for(lambda: self._may_go(step) and self._lag_allows(group))
                        values, version, lag = self.apply(grad, read_version, has_grad, group, step,
                                                          hyper if self.hyper_size else None)
                        self.bytes_moved += wire_bytes(received) + wire_bytes([values])  # the push and its answer
                        self._steps[group] = step + 1
                        self._reads[group] = (self._reads.get(group) or [version] * self.depth)[1:] + [version]
                        self._running.notify_all()
                    channel.send(values, TAG_VALUES)
                    channel.send(torch.tensor([version, lag], dtype=torch.int64, device="cpu"), TAG_REPLY)
                elif kind == PULL:  # a group's first params (after group 0's warm-up), or a rejoining group's
                    with self._running:
                        self._warming.add(group)
                        self._running.wait_for(self._warm)
                        self._warming.discard(group)
                    with self._running, self._lock:  # the live values, their version and the steps the group has done
                        values, version = self.values(), self.version
                        self._reads[group] = [version] * self.depth
                        self.bytes_moved += wire_bytes([values])  # a joining or rejoining group's first values
                        channel.send(values, TAG_VALUES)
                        channel.send(torch.tensor([version, self._steps[group]], dtype=torch.int64, device="cpu"), TAG_REPLY)
                    if incarnation > 0:
                        self.log(f"{self.server} sent worker group {group} (restart {incarnation}) the live values of "
                                 f"version {version} (digest {fingerprint([values])}) and its step {self._steps[group]}")
                elif kind == MIRROR:  # the chief's mirror of this server's updater state and counters
                    with self._running, self._lock:
                        state, counters = self.state_flat(), self._counters()
                    channel.send(state, TAG_STATE)
                    channel.send(torch.tensor([counters.numel()], dtype=torch.int64, device="cpu"), TAG_MIRROR)
                    channel.send(counters, TAG_MIRROR)
                elif kind == STATE:
                    with self._lock:
                        channel.send(self.state_flat(), TAG_STATE)
                    with self._running:
                        channel.send(torch.tensor([self.bytes_moved], dtype=torch.int64, device="cpu"), TAG_BYTES)
                elif kind == FINAL:  # the chief is done: answer once every other group has stopped or is gone
                    finished = True
                    self._stopped(group)
                    with self._running:
                        self._running.wait_for(lambda: not self._live and not self._expected)
                        self._closed = True  # from now on nobody is accepted
                    self.door.close(self.key)
                    with self._lock:
                        channel.send(self.values(), TAG_VALUES)
                        channel.send(self.state_flat(), TAG_STATE)
                        counts = self.lag_counts()
                        channel.send(torch.tensor(counts.shape, dtype=torch.int64, device="cpu"), TAG_LAGS)
                        channel.send(counts, TAG_LAGS)
                    with self._running:  # every other group stopped or is gone: their whole run's bytes
                        channel.send(torch.tensor([self.bytes_moved], dtype=torch.int64, device="cpu"), TAG_BYTES)
                    return
                elif kind == STOP:
                    finished = True
                    self._stopped(group)
                    return
        except RuntimeError as err:
            if (group, incarnation) not in self._dropped:
                warn(f"WARNING: {self.server} lost worker group {group} (process {self.stubs[group]}"
                     f"{f', restart {incarnation}' if incarnation else ''}): {comm.describe_error(err)}")
                if self.door.dead_groups_restart() and self.door.await_announcement(group, incarnation, ANNOUNCEMENT_S):
                    with self._running:  # the chief's last request must not slip through before the launcher's word
                        self._expected.add(group)
        finally:
            if not finished:
                self._lost(group, incarnation)

    def _counters(self) -> torch.Tensor:
        """What a mirror holds besides the updater state: [version, bytes moved, groups, each group's steps, each
        group's updates applied, the lag histogram's width, its counts]."""
        groups = sorted(self.stubs)
        counts = self.lag_counts()
        return torch.tensor([self.version, self.bytes_moved, len(groups)] + [self._steps.get(g, 0) for g in groups]
                            + [self.applied.get(g, 0) for g in groups] + [counts.shape[1]] + counts.reshape(-1).tolist(),
                            dtype=torch.int64, device="cpu")

    def _first_values(self, channel, step: int, version: int) -> None:
        """The chief's FIRST (a user's loop): its module's values of this server's slices and, on --resume, the
        checkpoint's updater state (a fresh start keeps the updater's first state), at `step` and `version`."""
        values, state = torch.zeros(self.size, device="cpu"), torch.zeros(sum(n for _, _, n in self.layout), device="cpu")
        resumed = torch.zeros(1, dtype=torch.int64, device="cpu")
        channel.recv(values, TAG_VALUES)
        channel.recv(resumed, TAG_STATE)
        channel.recv(state, TAG_STATE)
        with self._running, self._lock:
            for seg in self.segments:
                self._view(seg).copy_(values[seg.offset : seg.offset + seg.size])
            offset = 0
            for seg, slot, size in self.layout:
                if int(resumed):
                    self.state[seg][slot].view(-1).copy_(state[offset : offset + size])
                offset += size
            self.version = version
            self._steps = {g: step if g == 0 else max(step, self.warmup_steps) for g in self._steps}
            self._reads = {g: [version] * self.depth for g in self._reads}
            self._running.notify_all()
        self._healed.set()

    def _heal(self, group: int, channel, step: int) -> None:
        """The chief's HEAL: its newest values of this server's slices and their version, and its mirror of the
        updater state and the counters (refreshed every few of its steps: mirror_interval)."""
        values, state = torch.zeros(self.size, device="cpu"), torch.zeros(sum(n for _, _, n in self.layout), device="cpu")
        length = torch.zeros(1, dtype=torch.int64, device="cpu")
        channel.recv(values, TAG_VALUES)
        channel.recv(state, TAG_STATE)
        channel.recv(length, TAG_MIRROR)
        counters = torch.zeros(int(length), dtype=torch.int64, device="cpu")
        channel.recv(counters, TAG_MIRROR)
        c = counters.tolist()
        version, mirrored_version, bytes_moved, ngroups = c[0], c[1], c[2], c[3]
        groups = sorted(self.stubs)
        steps, applied = c[4 : 4 + ngroups], c[4 + ngroups : 4 + 2 * ngroups]
        width = c[4 + 2 * ngroups] if len(c) > 4 + 2 * ngroups else 0
        lags = c[5 + 2 * ngroups :]
        with self._running, self._lock:
            for seg in self.segments:
                self._view(seg).copy_(values[seg.offset : seg.offset + seg.size])
            offset = 0
            for seg, slot, size in self.layout:
                if mirrored_version >= 0:  # (no mirror yet: the updater's first state, as the dead server began)
                    self.state[seg][slot].view(-1).copy_(state[offset : offset + size])
                offset += size
            self.version, self.bytes_moved = version, bytes_moved
            for i, g in enumerate(groups[:ngroups]):
                self._steps[g], self.applied[g] = steps[i], applied[i]
                self.lags[g] = StalenessStats()
                for lag in range(width):
                    if lags[i * width + lag]:
                        self.lags[g].add(lag, lags[i * width + lag])
            self._reads = {g: [version] * self.depth for g in self._reads}
            self._running.notify_all()
        self._healed.set()
        healed_at = time.time()
        digest = fingerprint([values])
        state_words = (f"the updater state of version {mirrored_version}" if mirrored_version >= 0
                       else "the updater's first state (no mirror yet)")
        line = (f"{self.server} (process restart {self.restart}) healed from worker group {group}'s mirror: its values of "
                f"version {version} (digest {digest}) and {state_words}, "
                f"{healed_at - self.started_at:.2f} s after its process started; updates applied after version {version} "
                "by the dead server, and pushes in flight, are lost")
        self.log(line)
        if sys.__stdout__ is not None and sys.stdout is not sys.__stdout__:
            print(line, file=sys.__stdout__, flush=True)  # the job's terminal (the launcher's)
        # beside the groups' rejoins (summary.json's `rejoins`): "group" None, "server" its id; "step" the chief's
        record = {"group": None, "server": self.server.id, "rank": self.rank, "pid": os.getpid(), "incarnation": self.restart, "step": step,
                  "version": version, "mirrored_state_version": mirrored_version, "healed_from_group": group,
                  "digest": digest, "time": healed_at, "process_start_to_heal_s": round(healed_at - self.started_at, 3)}
        if self.workspace is not None:
            with open_for_append(Path(self.workspace) / "logs" / rejoined.RECORDS_FILE) as f:  # through no link
                f.write(json.dumps(record) + "\n")

    def _refuse(self, group: int, channel, kind: int) -> None:
        """Answer a dropped group's request without applying anything: version -1 tells it to leave."""
        if kind in (PUSH, PULL):  # a push's gradient was received already (_serve_incarnation)
            channel.send(torch.zeros(self.size, device="cpu"), TAG_VALUES)
            channel.send(torch.tensor([REFUSED, 0], dtype=torch.int64, device="cpu"), TAG_REPLY)
        self.log(f"{self.server} refused a request of worker group {group}, dropped after it stalled")


class DownpourExchange:
    """A worker group's side of Downpour, in one of the group's processes."""
    absent_groups: frozenset[int] = frozenset()  # every group stays in the job (only Local SGD's meetings leave one out)

    def __init__(self, store: ParamStore, updater: Updater, placement: Placement, rank: int, group: int,
                 group_ranks: list[int], group_comm, server_ranks: dict[ServerId, int], global_batch: int, *, timeout_s: float,
                 warmup_steps: int = 0, overlap_push: bool = False, codecs: Optional[Callable[..., Codec]] = None,
                 servers_heal: bool = False):
        """As the strategy reads them from the plan: `timeout_s` (cluster.comm_timeout_s: how long a server may take to
        answer a knock), `warmup_steps`, `overlap_push` and `codecs` (cluster.compression; None: float32); `group_comm`: the
        plan's group of this worker group's processes (shoal.comm.collectives.Group; None: the group is one process);
        `servers_heal` (cluster.max_restarts > 0): a dead server is restarted into the job, the chief keeps a mirror of
        each server's updater state to heal it from, and every stub waits for the new server instead of failing."""
        self.store, self.rank, self.group = store, rank, group
        self.timeout_s = timeout_s
        self.group_ranks, self.group_comm = group_ranks, group_comm
        self.stub = group_ranks[0]
        self.chief = group == 0 and rank == self.stub
        self.global_batch = global_batch
        self.names = store.trainable_names()
        self.position = {name: i for i, name in enumerate(self.names)}
        self.offsets, offset = {}, 0
        for name in self.names:
            self.offsets[name] = offset
            offset += store.info[name].numel
        self.total = offset
        trainable = set(self.names)
        self.servers = []
        for server, server_rank in server_ranks.items():
            segments, size = server_segments([s for s in placement.slices_of(server) if s.param in trainable])
            self.servers.append((server, server_rank, segments, size))
        self.max_norm = max_norm_of(updater)
        self.layouts = {server_rank: state_layout(updater, store, segments) for _, server_rank, segments, _ in self.servers}
        self.read_version = {rank: 0 for _, rank, _, _ in self.servers}
        self.codecs = {rank: (codecs or Codec)() for _, rank, _, _ in self.servers}  # top-k keeps a residual per server
        self.pushed_bytes = 0  # gradient bytes this process pushed since the last display
        # the chief's: every group's pushes and pulls with their answers, as the servers counted them (summary.json's
        # bytes_sent, after finish), on from `_bytes_before` (a resumed run's, from its checkpoint)
        self.job_bytes_sent: Optional[int] = None
        self._bytes_before = 0
        self._servers_bytes = 0  # the servers' count in this run, as of the last checkpoint's STATE request
        self.staleness = StalenessStats()
        self.last_version = 0
        self.final_state: Optional[dict] = None
        self.lag_histogram: Optional[dict] = None  # the first server's count of every update's lag, after the chief's last request
        self.warmup = warmup_steps > 0
        self.first_step = 0  # a resumed run's, or where a joining group starts after group 0's warm-up
        self.incarnation = 0  # how many processes of this group came before this one (shoal.launcher.rejoin)
        self._channels: dict[int, channels.Channel] = {}  # server rank -> this stub's channel, opened at first use
        self.overlap = overlap_push
        self._awaited: list = []  # the answers to the last push, while they are on their way (overlap_push)
        self.servers_heal = servers_heal
        self.server_restarts = {rank: 0 for _, rank, _, _ in self.servers}  # the server process each stub talks to
        # the chief's mirror of each server's updater state and counters ([version, bytes, groups, steps, applied, lags]),
        # refreshed every mirror_every[server] of its steps (mirror_interval: the cost model's choice)
        self.mirrors: dict[int, Optional[tuple[torch.Tensor, torch.Tensor]]] = {rank: None for _, rank, _, _ in self.servers}
        self.mirror_every = {rank: mirror_interval(self._state_size(rank), size) for _, rank, _, size in self.servers}
        self._old_channels: list = []  # channels to dead servers: kept, not destroyed (gloo may block tearing one down)
        # a user's loop (shoal.session): each push carries the optimizer's hyper-parameters now (a float64 vector of
        # `hyper_size`, the servers' DownpourServer.hyper_size)
        self.hyper: Optional[Callable[[], torch.Tensor]] = None
        self.hyper_size = 0

    def _to(self, server_rank: int) -> channels.Channel:
        if not self._channels:
            self._connect()
        return self._channels[server_rank]

    def _connect(self) -> None:
        """Knock at every server's door and open a channel to each (first join and rejoin alike)."""
        door = channels.Door(DOOR)
        for server, server_rank, segments, _ in self.servers:
            self.server_restarts[server_rank] = restart = door.server_restart(server.id) if self.servers_heal else 0
            self._knock(door, server, server_rank, restart)
            if self.chief and restart:  # it died before the chief's first request: healed from the chief's first values
                self._send_heal(server_rank, segments, self.first_step)

    def _knock(self, door: channels.Door, server: ServerId, server_rank: int, restart: int) -> None:
        channel = door.knock(server_key(server.id, restart), self.group, self.incarnation, self.timeout_s)
        if channel is None:
            raise JobOver(f"worker group {self.group}: {server} has finished serving; the job is over")
        self._channels[server_rank] = channel

    # -- a server's death, under cluster.max_restarts: wait for its new process, heal it (the chief), pull ----------
    def _recover(self, server: ServerId, server_rank: int, step: int, err: RuntimeError) -> None:
        """`server` stopped answering: with servers that heal, wait for the launcher to restart it, reconnect, heal it
        from the chief's mirror (the chief) and take its values (every other group); else ServerLost, as before.
        This group's push in flight, if any, is dropped, not sent again: the values it was computed on are gone."""
        if not self.servers_heal:
            raise self._lost(server, server_rank, step, err)
        door = channels.Door(DOOR)
        known = self.server_restarts[server_rank]
        deadline = time.monotonic() + SERVER_ANNOUNCEMENT_S
        while (restart := door.server_restart(server.id)) <= known:
            if door.server_given_up(server.id) >= known or time.monotonic() > deadline:
                raise self._lost(server, server_rank, step, err)
            time.sleep(channels.POLL_S * 5)
        self._old_channels.append(self._channels.pop(server_rank, None))
        self.server_restarts[server_rank] = restart
        segments, size = next((seg, n) for s, r, seg, n in self.servers if r == server_rank)
        seen = self.read_version[server_rank]
        try:
            self._knock(door, server, server_rank, restart)
            heartbeat.revive(server_rank)  # its new process beats: watch it afresh (the launcher said the old one gone)
            if self.chief:  # (the server says the heal on the terminal: one line)
                self._send_heal(server_rank, segments, step)
                return
            self._pull_from(server_rank, segments, size, step)
        except RuntimeError as again:  # it died again meanwhile
            self._recover(server, server_rank, step, again)
            return
        print(f"worker group {self.group}: {server} was restarted (restart {restart}); the push of step {step} was "
              f"dropped; took its values of version {self.read_version[server_rank]} (it had seen version {seen})")

    def _send_heal(self, server_rank: int, segments: list[Segment], step: int) -> None:
        """HEAL: this process's newest values of the server's slices and their version, its mirror of the updater state
        and the counters (none yet: the server keeps the updater's first state)."""
        channel, version = self._channels[server_rank], self.read_version[server_rank]
        mirror = self.mirrors[server_rank]
        if mirror is None:
            state = torch.zeros(self._state_size(server_rank), device="cpu")
            counters = torch.tensor([version, -1, 0, 0], dtype=torch.int64, device="cpu")
        else:
            state = mirror[0]
            counters = torch.cat([torch.tensor([version], dtype=torch.int64, device="cpu"), mirror[1]])
        channel.send(torch.tensor([HEAL, step, version], dtype=torch.int64, device="cpu"), TAG_HEADER)
        channel.send(self._gather_values(segments), TAG_VALUES)
        channel.send(state, TAG_STATE)
        channel.send(torch.tensor([counters.numel()], dtype=torch.int64, device="cpu"), TAG_MIRROR)
        channel.send(counters, TAG_MIRROR)

    def _pull_from(self, server_rank: int, segments: list[Segment], size: int, step: int) -> None:
        channel, reply = self._channels[server_rank], torch.zeros(2, dtype=torch.int64, device="cpu")
        channel.send(torch.tensor([PULL, step, self.read_version[server_rank]], dtype=torch.int64, device="cpu"), TAG_HEADER)
        values = torch.zeros(size, device="cpu")
        channel.recv(values, TAG_VALUES)
        channel.recv(reply, TAG_REPLY)
        self._leave_if_refused(int(reply[0]), step)
        self._scatter_values(values, segments)
        self.read_version[server_rank] = int(reply[0])

    def _refresh_mirrors(self, step: int) -> None:
        """The chief, every mirror_every steps: each server's updater state and counters, to heal it from if it dies."""
        if not (self.chief and self.servers_heal):
            return
        for server, server_rank, _, _ in self.servers:
            if (step - self.first_step) % self.mirror_every[server_rank]:
                continue
            try:
                channel = self._channels[server_rank]
                channel.send(torch.tensor([MIRROR, step, 0], dtype=torch.int64, device="cpu"), TAG_HEADER)
                state, length = torch.zeros(self._state_size(server_rank), device="cpu"), torch.zeros(1, dtype=torch.int64, device="cpu")
                channel.recv(state, TAG_STATE)
                channel.recv(length, TAG_MIRROR)
                counters = torch.zeros(int(length), dtype=torch.int64, device="cpu")
                channel.recv(counters, TAG_MIRROR)
            except RuntimeError as err:
                self._recover(server, server_rank, step, err)
                continue
            self.mirrors[server_rank] = (state, counters)

    def start_loop(self, step: int, whole_state: Optional[dict[str, dict[str, torch.Tensor]]] = None) -> int:
        """A user's loop (shoal.session), before its first step: the chief sends every server FIRST (its module's
        values, which are where the servers start, and on --resume the checkpoint's updater state `whole_state`; a
        fresh start keeps the updater's first state); every other group's stub pulls the servers' values (after group 0's
        warm-up, if any); the stub's values go to the rest of its group. Returns the step this group starts at."""
        start = step
        if self.chief:
            version = self.last_version
            for _, server_rank, segments, _ in self.servers:
                channel = self._to(server_rank)
                channel.send(torch.tensor([FIRST, step, version], dtype=torch.int64, device="cpu"), TAG_HEADER)
                channel.send(self._gather_values(segments), TAG_VALUES)
                channel.send(torch.tensor([1 if whole_state else 0], dtype=torch.int64, device="cpu"), TAG_STATE)
                channel.send(self._flat_state(server_rank, whole_state or {}), TAG_STATE)
                self.read_version[server_rank] = version
        elif self.rank == self.stub:
            try:
                start, _ = self.rejoin(0)
            except ServerLost as err:
                raise ServerLost(str(err).replace("could not rejoin", "could not start")) from None
        if len(self.group_ranks) > 1:  # the group's first step, as its stub's
            first = torch.tensor([start], dtype=torch.int64, device="cpu")
            self.group_comm.broadcast(first, self.stub).wait()
            start = self.first_step = int(first)
        self._share_params()
        return start

    def _flat_state(self, server_rank: int, whole: dict[str, dict[str, torch.Tensor]]) -> torch.Tensor:
        """A server's slices of a whole-model updater state (`_state_from`'s inverse), zeros where it holds none."""
        flat = torch.zeros(self._state_size(server_rank), device="cpu")
        offset = 0
        for seg, slot, size in self.layouts[server_rank]:
            value = whole.get(seg.param, {}).get(slot)
            if value is not None:
                value = value.reshape(-1).to(device="cpu", dtype=flat.dtype)
                flat[offset : offset + size] = value[seg.start : seg.stop] if size == seg.size else value[:size]
            offset += size
        return flat

    def rejoin(self, incarnation: int) -> tuple[int, int]:
        """Take the place of this group's dead process: pull the servers' live values and version, and the steps
        the group has done (each server applied all of them or none of a step); returns (first step, version)."""
        self.incarnation = incarnation
        reply, steps = torch.zeros(2, dtype=torch.int64, device="cpu"), []
        self.digests = {"before": {}, "pulled": {}}  # per server: this process's values before and after the pull
        try:
            for server, server_rank, segments, size in self.servers:
                self._to(server_rank).send(torch.tensor([PULL, 0, 0], dtype=torch.int64, device="cpu"), TAG_HEADER)
                values = torch.zeros(size, device="cpu")
                self._to(server_rank).recv(values, TAG_VALUES)
                self._to(server_rank).recv(reply, TAG_REPLY)
                self._leave_if_refused(int(reply[0]), 0)
                self.digests["before"][server.id] = fingerprint([self._gather_values(segments)])
                self._scatter_values(values, segments)
                self.digests["pulled"][server.id] = fingerprint([self._gather_values(segments)])  # what the group trains on
                self.read_version[server_rank] = int(reply[0])
                steps.append(int(reply[1]))
        except RuntimeError as err:
            raise ServerLost(f"worker group {self.group} could not rejoin: {comm.describe_error(err)}") from None
        version = min(self.read_version.values())
        self.first_step, self.last_version = min(steps), version
        self.warmup = False  # pulled already
        return self.first_step, version

    def _flat_grads(self, parts: list[tuple[Grads, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """This process's share of the group's gradient (weighted by share of the group's batch), laid end to end,
        and per param whether it had one (a param no worker has a gradient for is not updated)."""
        grads = aggregate(parts, self.global_batch, target=torch.device("cpu"))
        flat, had = torch.zeros(self.total, device="cpu"), torch.zeros(len(self.names), device="cpu")
        for i, name in enumerate(self.names):
            g = grads.get(name)
            if g is not None:
                flat[self.offsets[name] : self.offsets[name] + g.numel()].copy_(g.reshape(-1))
                had[i] = 1
        return flat, had

    def _gather(self, flat: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        base = self.offsets
        return torch.cat([flat[base[s.param] + s.start : base[s.param] + s.stop] for s in segments])

    def _scatter_values(self, values: torch.Tensor, segments: list[Segment]) -> None:
        for s in segments:
            self.store.values[s.param].view(-1)[s.start : s.stop].copy_(values[s.offset : s.offset + s.size])

    def _gather_values(self, segments: list[Segment]) -> torch.Tensor:
        return torch.cat([self.store.values[s.param].reshape(-1)[s.start : s.stop] for s in segments]) if segments else torch.zeros(0, device="cpu")

    def _share_params(self) -> None:
        """The stub's fresh params to the other processes of its group."""
        if len(self.group_ranks) == 1:
            return
        flat = torch.cat([self.store.values[n].reshape(-1) for n in self.names])
        self.group_comm.broadcast(flat, self.stub).wait()
        for name in self.names:
            o = self.offsets[name]
            self.store.values[name].view(-1).copy_(flat[o : o + self.store.info[name].numel])

    def begin(self, step: int) -> None:
        """Groups other than 0 start from the params group 0 reached after its warm-up."""
        if step == self.first_step and self.group != 0 and self.warmup:
            if self.rank == self.stub:
                reply = torch.zeros(2, dtype=torch.int64, device="cpu")
                for _, server_rank, segments, size in self.servers:
                    self._to(server_rank).send(torch.tensor([PULL, step, 0], dtype=torch.int64, device="cpu"), TAG_HEADER)
                    values = torch.zeros(size, device="cpu")
                    self._to(server_rank).recv(values, TAG_VALUES)
                    self._to(server_rank).recv(reply, TAG_REPLY)
                    self._leave_if_refused(int(reply[0]), step)
                    self._scatter_values(values, segments)
                    self.read_version[server_rank] = int(reply[0])
            self._share_params()

    def step(self, step: int, parts: list[tuple[Grads, int]]) -> None:
        flat, had = self._flat_grads(parts)
        if len(self.group_ranks) > 1:
            self.group_comm.reduce_sum(flat, self.stub).wait()
            self.group_comm.reduce_sum(had, self.stub).wait()
        if self.rank == self.stub:
            clip_([flat], self.max_norm)  # the group's whole push, clipped by its own norm before it leaves
            self._push_pull(step, flat, had)
        self._share_params()

    def _push_pull(self, step: int, flat: torch.Tensor, had: torch.Tensor) -> None:
        """Push the step's gradient to every server, and take the answers: at once, or (overlap_push) the previous
        push's answers now and this one's while the group computes its next step."""
        server, server_rank = None, -1
        # this push's answers are posted first: gloo sends a message only once its receiver has said it is ready, and
        # said after the push, that word would queue behind whatever data is on its way to the server (another
        # group's push); the previous push's answers (overlap_push) still fill the receives posted before these
        answers = [self._posted_answer(server, server_rank, size, step) for server, server_rank, _, size in self.servers]
        for i, (server, server_rank, segments, _) in enumerate(self.servers):
            if answers[i] is None:  # its server died: this push to it is dropped
                continue
            try:
                self._to(server_rank).send(torch.tensor([PUSH, step, self.read_version[server_rank]], dtype=torch.int64, device="cpu"), TAG_HEADER)
                for part in self.codecs[server_rank].encode(self._gather(flat, segments)):
                    self._to(server_rank).send(part, TAG_GRAD)
                    self.pushed_bytes += wire_bytes([part])
                # one byte per segment: cheaper than a flag inside the (uncopied) gradient
                self._to(server_rank).send(torch.tensor([had[self.position[s.param]] > 0 for s in segments], dtype=torch.uint8, device="cpu"), TAG_HAS_GRAD)
                if self.hyper_size:
                    self._to(server_rank).send(self.hyper(), TAG_HYPER)
            except RuntimeError as err:
                self._recover(server, server_rank, step, err)  # (or ServerLost) this push to it is dropped
                answers[i] = None
        self._settle(step)
        self._awaited = answers
        if not self.overlap:
            self._settle(step)
        self._refresh_mirrors(step)

    def _posted_answer(self, server: ServerId, server_rank: int, size: int, step: int) -> Optional[tuple]:
        """The receives of a push's answer, posted; None when the server was found dead and recovered (servers that heal)."""
        try:
            return self._await_answer(server_rank, size)
        except RuntimeError as err:
            self._recover(server, server_rank, step, err)
            return None

    def _await_answer(self, server_rank: int, size: int) -> tuple:
        values, reply = torch.zeros(size, device="cpu"), torch.zeros(2, dtype=torch.int64, device="cpu")
        channel = self._to(server_rank)
        return values, reply, [channel.irecv(values, TAG_VALUES), channel.irecv(reply, TAG_REPLY)], channel

    def _lost(self, server: ServerId, server_rank: int, step: int, err: RuntimeError) -> ServerLost:
        return ServerLost(f"{server} in process {server_rank} stopped answering worker group {self.group} "
                          f"at step {step}: {comm.describe_error(err)}")

    def _settle(self, step: int) -> None:
        """Take the answers to the last push, if not taken yet: the new values, their version and the push's lag."""
        if not self._awaited:
            return
        awaited, self._awaited, lags = self._awaited, [], []
        for (server, server_rank, segments, _), answer in zip(self.servers, awaited):
            if answer is None or answer[3] is not self._channels.get(server_rank):  # its server died: recovered already
                continue
            values, reply, receives, _ = answer
            try:
                for receive in receives:
                    receive.wait()
            except RuntimeError as err:
                self._recover(server, server_rank, step, err)  # (or ServerLost) the answer is lost with its push
                continue
            self._leave_if_refused(int(reply[0]), step)
            self._scatter_values(values, segments)
            self.read_version[server_rank] = int(reply[0])
            lags.append(int(reply[1]))
        if lags:
            self.staleness.add(max(lags))

    def _leave_if_refused(self, version: int, step: int) -> None:
        if version == REFUSED:  # the servers dropped this group while it was stalled
            raise GroupDropped(f"worker group {self.group}: the servers refused its push at step {step}; they dropped "
                               "the group while it was stalled, so its processes leave")

    def metrics(self, window: MetricWindow) -> dict[str, float]:
        """This process's losses; the chief adds the job's samples (from the server version) and its staleness."""
        values = window.averages()
        if self.chief:
            version = min(self.read_version.values())
            values |= {"samples": (version - self.last_version) * self.global_batch,
                       "staleness": self.staleness.mean, "staleness_max": self.staleness.max, "pushed_bytes": self.pushed_bytes}
            self.pushed_bytes = 0
            self.last_version, self.staleness = version, StalenessStats()
        return values

    def _state_from(self, flats: list[tuple[int, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
        full: dict[str, dict[str, torch.Tensor]] = {n: {} for n in self.names}
        for server_rank, flat in flats:
            offset = 0
            for seg, slot, size in self.layouts[server_rank]:
                if slot not in full[seg.param]:
                    full[seg.param][slot] = torch.zeros(self.store.info[seg.param].shape if size == seg.size else size, device="cpu")
                if size == seg.size:
                    full[seg.param][slot].view(-1)[seg.start : seg.stop] = flat[offset : offset + size]
                elif seg.start == 0:  # a per-param slot: every segment of the param holds it, the first one counts
                    full[seg.param][slot].copy_(flat[offset : offset + size])
                offset += size
        return full

    def _state_size(self, server_rank: int) -> int:
        return sum(size for _, _, size in self.layouts[server_rank])

    def updater_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The whole updater state, asked of the servers (the chief writes checkpoints)."""
        if not self.chief:
            return {}
        if self.final_state is not None:
            return self.final_state
        self._settle(-1)  # the checkpoint holds the params its state belongs with
        flats, moved = [], 0
        for server, server_rank, segments, size in self.servers:
            def ask(server_rank=server_rank):
                self._to(server_rank).send(torch.tensor([STATE, 0, 0], dtype=torch.int64, device="cpu"), TAG_HEADER)
                flat, count = torch.zeros(self._state_size(server_rank), device="cpu"), torch.zeros(1, dtype=torch.int64, device="cpu")
                self._to(server_rank).recv(flat, TAG_STATE)
                self._to(server_rank).recv(count, TAG_BYTES)
                return flat, count
            flat, count = self._asking(server, server_rank, -1, ask)
            flats.append((server_rank, flat))
            moved += int(count)
        self._servers_bytes = moved  # own_state checkpoints it (the trainer asks for this state first)
        return self._state_from(flats)

    def _asking(self, server: ServerId, server_rank: int, step: int, ask: Callable):
        """`ask()` of `server`, asked again of its new process if it died meanwhile (servers that heal)."""
        while True:
            try:
                return ask()
            except RuntimeError as err:
                self._recover(server, server_rank, step, err)

    def load_updater_state(self, state) -> None:
        """Servers load their slices of the state themselves (DownpourServer.restore)."""

    def own_state(self) -> dict[str, torch.Tensor]:
        """The group's compression residuals, one per server it pushes to (servers only decode); the chief's, the
        job's bytes so far (a resumed run counts on from them)."""
        tensors = codecs_state("push", self.codecs)
        if self.chief:
            sent = self.job_bytes_sent if self.job_bytes_sent is not None else self._bytes_before + self._servers_bytes
            tensors["count/job_bytes_sent"] = torch.tensor(sent, device="cpu")
        return tensors

    def load_own_state(self, tensors: dict[str, torch.Tensor]) -> None:
        load_codecs_state("push", self.codecs, tensors)
        if self.chief:
            self._bytes_before = int(tensors.get("count/job_bytes_sent", 0))

    def view_updater(self):
        """The servers own every param: no worker updates a view itself."""
        return None

    def resume_at(self, step: int, version: int) -> None:
        """Continue a run checkpointed at `step`, when the servers' version was `version`."""
        self.read_version = dict.fromkeys(self.read_version, version)
        self.last_version = version
        self.first_step = step

    def start_at(self, step: int) -> None:
        """This group's first step (a group other than 0 joins where group 0's warm-up ends)."""
        self.first_step = step

    def _last_request(self, kind: int, server_rank: int, segments: list[Segment], size: int) -> None:
        """STOP or FINAL, with a zero push for the receives the server keeps posted (_serve_incarnation)."""
        channel = self._to(server_rank)
        channel.send(torch.tensor([kind, 0, 0], dtype=torch.int64, device="cpu"), TAG_HEADER)
        for part in self.codecs[server_rank].buffers(size):
            channel.send(part, TAG_GRAD)
        channel.send(torch.zeros(len(segments), dtype=torch.uint8, device="cpu"), TAG_HAS_GRAD)
        if self.hyper_size:
            channel.send(torch.zeros(self.hyper_size, dtype=torch.float64, device="cpu"), TAG_HYPER)

    def finish(self) -> None:
        """End of training: other stubs say stop; the chief waits for the final model."""
        if self.rank != self.stub:
            return
        self._settle(-1)
        if not self.chief:
            for server, server_rank, segments, size in self.servers:
                self._asking(server, server_rank, -1, lambda r=server_rank, g=segments, n=size: self._last_request(STOP, r, g, n))
            return
        flats = []
        for server, server_rank, segments, size in self.servers:
            self._asking(server, server_rank, -1, lambda r=server_rank, g=segments, n=size: self._last_request(FINAL, r, g, n))
        lags, moved = [], 0
        for server, server_rank, segments, size in self.servers:
            def final(server_rank=server_rank, segments=segments, size=size, again=False):
                if again:  # its server died while it waited for the other groups: the new one is asked again
                    self._last_request(FINAL, server_rank, segments, size)
                values, flat, shape = torch.zeros(size, device="cpu"), torch.zeros(self._state_size(server_rank), device="cpu"), torch.zeros(2, dtype=torch.int64, device="cpu")
                self._to(server_rank).recv(values, TAG_VALUES)
                self._to(server_rank).recv(flat, TAG_STATE)
                self._to(server_rank).recv(shape, TAG_LAGS)
                counts = torch.zeros(*shape.tolist(), dtype=torch.int64, device="cpu")
                self._to(server_rank).recv(counts, TAG_LAGS)
                count = torch.zeros(1, dtype=torch.int64, device="cpu")
                self._to(server_rank).recv(count, TAG_BYTES)
                return values, flat, counts, count
            try:
                values, flat, counts, count = final()
            except RuntimeError as err:
                self._recover(server, server_rank, -1, err)
                values, flat, counts, count = self._asking(server, server_rank, -1, lambda f=final: f(again=True))
            moved += int(count)
            self._scatter_values(values, segments)
            flats.append((server_rank, flat))
            lags.append(counts)
        self.final_state = self._state_from(flats)
        self.job_bytes_sent = self._bytes_before + moved  # every server's count: every group's whole run
        self.lag_histogram = histogram(_stats_of(lags[0])) if lags else None


def _stats_of(counts: torch.Tensor) -> dict[int, StalenessStats]:
    """A server's (group, lag) counts as StalenessStats per group."""
    stats = {}
    for group, row in enumerate(counts.tolist()):
        stats[group] = StalenessStats()
        for lag, n in enumerate(row):
            stats[group].add(lag, n)
    return stats
