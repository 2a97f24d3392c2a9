"""Downpour's server: owns slices of the params, their updater state and one version, and serves every worker group.

The protocol (its messages, the door, a server's restart) is runtime/exchanges/downpour.py's. A server serves each
group on a thread with blocking receives from that group's stub, one thread per incarnation of the group: a group
whose process dies only ends its thread, and the server waits at the door for the group's new process.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from shoal.errors import warn
from shoal.planning.placement import Placement, ServerId
from shoal.comm import channels
from shoal.comm import dist as comm
from shoal.comm import heartbeat
from shoal.report.terminal import also_on_the_terminal
from shoal.report.writes import open_for_append
from shoal.neuralnet.params import ParamStore
from shoal.runtime.exchanges.compression import Codec, wire_bytes
from shoal.runtime.exchanges.downpour import (ANNOUNCEMENT_S, DOOR, FINAL, FIRST, HEAL, MIRROR, PULL, PUSH, REFUSED, STATE, STOP,
                                              TAG_BYTES, TAG_GRAD, TAG_HAS_GRAD, TAG_HEADER, TAG_HYPER, TAG_LAGS, TAG_REPLY,
                                              TAG_STATE, TAG_VALUES, server_key, state_layout)
from shoal.runtime.exchanges.downpour_mirror import answer_mirror, counters, receive_first, receive_heal
from shoal.runtime.exchanges.requests import Segment, gather, let_in, post, scatter, server_segments, wait_unless, words
from shoal.runtime.exchanges.staleness import StalenessStats, may_apply
from shoal.runtime import rejoined
from shoal.runtime.rejoined import fingerprint
from shoal.neuralnet.updaters import ParamUpdate, Updater


class DownpourServer:
    """One server of the (single) server group: owns slices, their updater state and one version."""

    def __init__(self, store: ParamStore, updater: Updater, placement: Placement, server: ServerId,
                 stubs: dict[int, int], log: Callable[[str], None] = print, max_staleness: int = -1, warmup_steps: int = 0,
                 after_update: Optional[Callable[[int], None]] = None, max_update_lag: int = -1, overlap_push: bool = False,
                 codecs: Optional[Callable[..., Codec]] = None, chief_replaceable: bool = False):
        """`after_update(version)`: called after each update (fault injection for tests: shoal.launcher.faults).
        The cluster section's settings come as the strategy reads them from the plan: `max_staleness`, `warmup_steps`,
        `max_update_lag`, `overlap_push` and `codecs` (cluster.compression: a fresh codec per connection; None: float32).
        `chief_replaceable`: group 0 is dropped like any other group (another group's stub takes the chief's place and
        sends the last request: shoal.comm.succession)."""
        self.store, self.updater, self.server, self.stubs, self.log = store, updater, server, stubs, log
        self.chief_replaceable = chief_replaceable
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
        # after a heal, the groups that have not said their step yet hold nobody back: the mirror's count is older
        self._untold: set[int] = set()
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
        # a user's loop (carry_hyper): the user's schedule at the pushing group's step, set before each push's update
        self.hyper_size = 0
        self.set_hyper: Optional[Callable[[torch.Tensor], None]] = None

    def carry_hyper(self, size: int, set_hyper: Callable[[torch.Tensor], None]) -> None:
        """A user's loop (shoal.session): every push carries `size` float64 hyper-parameters, which `set_hyper` puts on
        the updater's optimizer before the push's update."""
        self.hyper_size, self.set_hyper = size, set_hyper

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
        return gather(self.store, self.segments)

    def _state_size(self) -> int:
        return sum(size for _, _, size in self.layout)

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
            # never join a thread blocked in a receive from a stalled group: it may never return
            wait_unless(serving, lambda: self._drop_if_stalled(group, rank, incarnation), 0.25)
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
            channel = let_in(self.door, name)
            if channel is not None:
                return channel
            why = "it could not prove it holds the job's secret"
        except RuntimeError as err:
            why = f"its handshake failed: {comm.describe_error(err)}"
        self.log(f"{self.server} refused a process knocking as worker group {group} (restart {incarnation}): {why}; "
                 "nothing it sends is applied")
        return None

    def _note_expected(self, group: int, rank: int, incarnation: int) -> None:
        """While a group is away: is a new process of it announced (the chief's last request waits for it)?"""
        # (a first process that died before it connected: awaited is 0, and its restart is incarnation 1)
        expected = self.door.expected(group, max(incarnation - 1, 0))
        # the first process died before it connected: its silence, or the launcher gave up restarting it
        first_never_came = incarnation == 0 and (group != 0 or self.chief_replaceable) and (
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
        """A group whose stub stopped answering is dropped like a dead one (group 0's too where another group's stub takes
        the chief's place; else its stall fails the job)."""
        if (group == 0 and not self.chief_replaceable) or not heartbeat.is_stalled(rank):
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

    def _told(self, group: int, step: int) -> None:
        """A group's request said the step it reached (`_running` held): a healed server's count may be older."""
        self._steps[group] = max(self._steps.get(group, 0), step)
        self._untold.discard(group)
        self._running.notify_all()  # (a push held by max_staleness may go now)

    def _may_go(self, step: int) -> bool:
        live = [self._steps[g] for g in self._live - self._warming - self._untold]
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
        finished, push = False, None
        try:
            while True:
                # the next push's receives are posted with its header's, before the stub asks (requests.Posted says
                # why); a stub's last request (STOP, FINAL) comes with a zero push that fills them
                push = push or post(channel, [(part, TAG_GRAD) for part in received] + [(has_grad, TAG_HAS_GRAD)]
                                    + [(t, TAG_HYPER) for t in extra])
                channel.recv(header, TAG_HEADER)
                kind, _, read_version = header.tolist()
                if kind in (PUSH, STOP, FINAL):
                    push.wait()
                    push = None
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
                        self._told(group, step)  # (its step, newer than a healed server's count)
                        self._running.wait_for(lambda: self._may_go(step) and self._lag_allows(group))
                        values, version, lag = self.apply(grad, read_version, has_grad, group, step,
                                                          hyper if self.hyper_size else None)
                        self.bytes_moved += wire_bytes(received) + wire_bytes([values])  # the push and its answer
                        self._steps[group] = step + 1
                        self._reads[group] = (self._reads.get(group) or [version] * self.depth)[1:] + [version]
                        self._running.notify_all()
                    channel.send(values, TAG_VALUES)
                    channel.send(words(version, lag), TAG_REPLY)
                elif kind == PULL:  # a group's first params (after group 0's warm-up), or a rejoining group's
                    with self._running:
                        # a live group's pull after this server's restart says the step it reached: the healed
                        # counters are as old as the chief's mirror (a rejoin's pull says 0: nothing to learn)
                        self._told(group, header.tolist()[1])
                        self._warming.add(group)
                        self._running.wait_for(self._warm)
                        self._warming.discard(group)
                    with self._running, self._lock:  # the live values, their version and the steps the group has done
                        values, version = self.values(), self.version
                        self._reads[group] = [version] * self.depth
                        self.bytes_moved += wire_bytes([values])  # a joining or rejoining group's first values
                        channel.send(values, TAG_VALUES)
                        channel.send(words(version, self._steps[group]), TAG_REPLY)
                    if incarnation > 0:
                        self.log(f"{self.server} sent worker group {group} (restart {incarnation}) the live values of "
                                 f"version {version} (digest {fingerprint([values])}) and its step {self._steps[group]}")
                elif kind == MIRROR:  # the chief's mirror of this server's updater state and counters
                    with self._running, self._lock:  # this answer's bytes counted, then the counters that carry them
                        state = self.state_flat()
                        self.bytes_moved += wire_bytes([state, self._counters()])
                        mirrored = self._counters()
                    answer_mirror(channel, state, mirrored)
                elif kind == STATE:
                    with self._lock:
                        channel.send(self.state_flat(), TAG_STATE)
                    with self._running:
                        channel.send(words(self.bytes_moved), TAG_BYTES)
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
                        channel.send(words(*counts.shape), TAG_LAGS)
                        channel.send(counts, TAG_LAGS)
                    with self._running:  # every other group stopped or is gone: their whole run's bytes
                        channel.send(words(self.bytes_moved), TAG_BYTES)
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
        """What the chief's mirror holds of this server besides the updater state (downpour_mirror.counters)."""
        groups = sorted(self.stubs)
        return counters(self.version, self.bytes_moved, [self._steps.get(g, 0) for g in groups],
                        [self.applied.get(g, 0) for g in groups], self.lag_counts())

    def _first_values(self, channel, step: int, version: int) -> None:
        """The chief's FIRST (a user's loop): its module's values of this server's slices and, on --resume, the
        checkpoint's updater state (a fresh start keeps the updater's first state), at `step` and `version`."""
        values, state = receive_first(channel, self.size, self._state_size())
        with self._running, self._lock:
            scatter(self.store, values, self.segments)
            offset = 0
            for seg, slot, size in self.layout:
                if state is not None:
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
        heal = receive_heal(channel, self.size, self._state_size())
        values, version, mirrored_version = heal.values, heal.version, heal.mirrored_version
        with self._running, self._lock:
            scatter(self.store, values, self.segments)
            offset = 0
            for seg, slot, size in self.layout:
                if mirrored_version >= 0:  # (no mirror yet: the updater's first state, as the dead server began)
                    self.state[seg][slot].view(-1).copy_(heal.state[offset : offset + size])
                offset += size
            self.version, self.bytes_moved = version, heal.bytes_moved
            for g, steps, applied, lags in zip(sorted(self.stubs), heal.steps, heal.applied, heal.lags):
                self._steps[g], self.applied[g] = steps, applied
                self.lags[g] = StalenessStats()
                for lag, n in lags.items():
                    self.lags[g].add(lag, n)
            # the chief's own step, newer than its mirror's count; every other group says its own when it next pulls
            # or pushes, and holds nobody back (max_staleness) by the mirror's count till then
            self._steps[group] = max(self._steps.get(group, 0), step)
            self._untold = set(self.stubs) - {group}
            self._reads = {g: [version] * self.depth for g in self._reads}
            self._running.notify_all()
        self._healed.set()
        self.door.say_healed(self.key)  # (a stub that would heal it in a dead chief's place pulls instead)
        healed_at = time.time()
        digest = fingerprint([values])
        state_words = (f"the updater state of version {mirrored_version}" if mirrored_version >= 0
                       else "the updater's first state (no mirror yet" + ("; its counts of updates and bytes restart here)"
                                                                          if version > 0 else ")"))
        line = (f"{self.server} (process restart {self.restart}) healed from worker group {group}'s mirror: its values of "
                f"version {version} (digest {digest}) and {state_words}, "
                f"{healed_at - self.started_at:.2f} s after its process started; updates applied after version {version} "
                "by the dead server, and pushes in flight, are lost")
        # beside the groups' rejoins (summary.json's `rejoins`; "group" None, "server" its id, "step" the chief's), written
        # before the line: a job whose groups end as the heal is said stops this process soon after, record or not
        record = {"group": None, "server": self.server.id, "rank": self.rank, "pid": os.getpid(), "incarnation": self.restart, "step": step,
                  "version": version, "mirrored_state_version": mirrored_version, "healed_from_group": group,
                  "digest": digest, "time": healed_at, "process_start_to_heal_s": round(healed_at - self.started_at, 3)}
        if self.workspace is not None:
            with open_for_append(Path(self.workspace) / "logs" / rejoined.RECORDS_FILE) as f:  # through no link
                f.write(json.dumps(record) + "\n")
        self.log(line)
        also_on_the_terminal(line)  # the job's terminal (the launcher's)

    def _refuse(self, group: int, channel, kind: int) -> None:
        """Answer a dropped group's request without applying anything: version -1 tells it to leave."""
        if kind in (PUSH, PULL):  # a push's gradient was received already (_serve_incarnation)
            channel.send(torch.zeros(self.size, device="cpu"), TAG_VALUES)
            channel.send(words(REFUSED, 0), TAG_REPLY)
        self.log(f"{self.server} refused a request of worker group {group}, dropped after it stalled")
