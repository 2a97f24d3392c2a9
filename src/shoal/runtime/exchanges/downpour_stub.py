"""Downpour's worker group side: its stub pushes the group's gradient to every server and installs their answers.

The protocol (its messages, the door, a server's restart) is runtime/exchanges/downpour.py's. Each worker group is
synchronous inside (its processes sum their gradients into the group's stub, its lowest rank, and receive the new
params from it); a stub that finds its server dead waits for the launcher's restart of it, and the chief heals the
new server from its mirror (runtime/exchanges/downpour_mirror.py).
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from shoal.neuralnet.algorithms import Grads
from shoal.planning.placement import Placement, ServerId
from shoal.comm import channels
from shoal.comm import dist as comm
from shoal.comm import heartbeat
from shoal.comm.succession import CHECK_EVERY_S, Successor, say_chief_done
from shoal.report.metrics import MetricWindow
from shoal.neuralnet.params import ParamStore
from shoal.runtime.exchanges.compression import Codec, codecs_state, load_codecs_state, wire_bytes
from shoal.runtime.exchanges.clipping import clip_, max_norm_of
from shoal.runtime.exchanges.downpour import (DOOR, FINAL, PULL, PUSH, REFUSED, SERVER_ANNOUNCEMENT_S, STATE, STOP,
                                              TAG_BYTES, TAG_GRAD, TAG_HAS_GRAD, TAG_HEADER, TAG_HYPER, TAG_LAGS, TAG_REPLY,
                                              TAG_STATE, TAG_VALUES, server_key, state_layout)
from shoal.runtime.endings import JobOver, ServerLost
from shoal.runtime.exchanges.downpour_mirror import ask_mirror, mirror_interval, send_first, send_heal
from shoal.runtime.exchanges.local import aggregate
from shoal.runtime.exchanges.requests import Guarded, PeerGone, Segment, Waiter, gather, post, scatter, server_segments, words
from shoal.runtime.exchanges.staleness import StalenessStats, histogram
from shoal.runtime.interfaces import GroupDropped
from shoal.runtime.rejoined import fingerprint
from shoal.neuralnet.updaters import Updater
from shoal.report.terminal import write_line


class DownpourExchange:
    """A worker group's side of Downpour, in one of the group's processes."""
    absent_groups: frozenset[int] = frozenset()  # every group stays in the job (only Local SGD's meetings leave one out)
    duties_taken_over = ("it tests and validates, writes the run log and the checkpoints, keeps the servers' mirror and "
                         "sends their last request")

    def __init__(self, store: ParamStore, updater: Updater, placement: Placement, rank: int, group: int,
                 group_ranks: list[int], group_comm, server_ranks: dict[ServerId, int], global_batch: int, *, timeout_s: float,
                 warmup_steps: int = 0, overlap_push: bool = False, codecs: Optional[Callable[..., Codec]] = None,
                 servers_heal: bool = False, rejoining: bool = False, successor: Optional[Successor] = None,
                 resends: bool = False):
        """As the strategy reads them from the plan: `timeout_s` (cluster.comm_timeout_s: how long a server may take to
        answer a knock), `warmup_steps`, `overlap_push` and `codecs` (cluster.compression; None: float32); `group_comm`: the
        plan's group of this worker group's processes (shoal.comm.collectives.Group; None: the group is one process);
        `servers_heal` (cluster.max_restarts > 0): a dead server is restarted into the job, the chief keeps a mirror of
        each server's updater state to heal it from, and every stub waits for the new server instead of failing.
        `rejoining`: this process was restarted into the running job (a dead chief's too: then as an ordinary group);
        `successor`: this process may take a dead chief's place (shoal.comm.succession; None: it never does);
        `resends` (a synchronous group of one stub, the chief: Sandblaster's, no overlap_push): a push lost with its server
        is sent again to the healed one, which the chief's HEAL set to the values that push was computed on, so no step's
        update is lost (its optimizer state is still the mirror's)."""
        self.store, self.rank, self.group = store, rank, group
        self.successor = successor
        self._mirror_now = False  # a successor's first mirror is asked at once, not K steps later
        # the version of a server healed from no mirror after updates (a dead chief's successor, before its first
        # mirror): the servers' counts of updates and bytes restart there, so the job's are not known (None: they are)
        self.healed_without_counts: Optional[int] = None
        self.timeout_s = timeout_s
        self.group_ranks, self.group_comm = group_ranks, group_comm
        self.stub = group_ranks[0]
        self.chief = group == 0 and rank == self.stub and not rejoining
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
        self._channels: dict[int, Guarded] = {}  # server rank -> this stub's channel, opened at first use
        self.overlap = overlap_push
        self._awaited: list = []  # the answers to the last push, while they are on their way (overlap_push)
        self.servers_heal = servers_heal
        self.resends = resends and servers_heal and not overlap_push
        self._pushing: Optional[tuple[int, torch.Tensor, torch.Tensor]] = None  # (step, flat, had) of the push out (resends)
        self.server_restarts = {rank: 0 for _, rank, _, _ in self.servers}  # the server process each stub talks to
        # the chief's mirror of each server's updater state and counters ([version, bytes, groups, steps, applied, lags]),
        # refreshed every mirror_every[server] of its steps (mirror_interval: the cost model's choice)
        self.mirrors: dict[int, Optional[tuple[torch.Tensor, torch.Tensor]]] = {rank: None for _, rank, _, _ in self.servers}
        self.mirror_every = {rank: mirror_interval(self._state_size(rank), size) for _, rank, _, size in self.servers}
        self._old_channels: list = []  # channels to dead servers: kept, not destroyed (gloo may block tearing one down)
        # every call on a server's channel runs on this thread and is given up on the launcher's word that the server
        # died (`_gone`): gloo, under load, may leave a call on a dead server's link blocked for the whole comm timeout
        self._waiter = Waiter(f"shoal-downpour-group{group}-calls")
        self._word_door: Optional[channels.Door] = None  # where `_gone` reads that word (its own store connection)
        # a user's loop (carry_hyper): each push carries the optimizer's hyper-parameters now
        self.hyper: Optional[Callable[[], torch.Tensor]] = None
        self.hyper_size = 0

    def carry_hyper(self, size: int, hyper: Callable[[], torch.Tensor]) -> None:
        """A user's loop (shoal.session): each push carries `hyper()`, the optimizer's hyper-parameters now (a float64
        vector of `size`, the servers' DownpourServer.carry_hyper)."""
        self.hyper_size, self.hyper = size, hyper

    def _to(self, server_rank: int) -> Guarded:
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
        gone = self._gone(server, server_rank, restart)
        channel = self._waiter.call(lambda: door.knock(server_key(server.id, restart), self.group, self.incarnation,
                                                       self.timeout_s), gone)
        if channel is None:  # its door closed: only the server's answer to the chief's FINAL closes it
            reason = gone()
            if reason is not None:  # (a process that finished is not restarted: a newer one serves, knock there)
                raise PeerGone(reason)
            raise JobOver(f"worker group {self.group}: {server} has finished serving; the job is over")
        self._channels[server_rank] = Guarded(channel, gone, self._waiter)

    def _gone(self, server: ServerId, server_rank: int, restart: int) -> Callable[[], Optional[str]]:
        """The launcher's word that the process of `server` this stub reaches at `restart` (its channel's, not the
        newest the door knows when asked) died: it announced a newer restart, or gave up restarting this one."""
        if self._word_door is None:
            self._word_door = channels.Door(DOOR)
        door = self._word_door

        def gone() -> Optional[str]:
            newest = door.server_restarted(server.id)
            if newest > restart:
                return f"the launcher saw its process die and restarted it (restart {newest})"
            if door.server_given_up(server.id) >= restart:
                return "the launcher saw its process die and does not restart it"
            return None
        return gone

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
            self._await_heal_or_take_over(door, server_key(server.id, restart))
            if self.chief:  # (the server says the heal on the terminal: one line)
                self._send_heal(server_rank, segments, step)
                return
            self._pull_from(server_rank, segments, size, step)
        except RuntimeError as again:  # it died again meanwhile
            self._recover(server, server_rank, step, again)
            return
        write_line(f"worker group {self.group}: {server} was restarted (restart {restart}); the push of step {step} was "
                   f"dropped; took its values of version {self.read_version[server_rank]} (it had seen version {seen})")

    def _await_heal_or_take_over(self, door: channels.Door, key) -> None:
        """A restarted server answers nobody before its heal. A process that may take the chief's place pulls from it
        only once it is healed (by the chief) or, the chief dead, heals it itself (shoal.comm.succession): a pull sent
        while the launcher's word on the chief's death is still on its way would wait for a heal nobody sends."""
        deadline = time.monotonic() + self.timeout_s
        self._watch_the_chief(now=True)
        while self.successor is not None and not self.chief and not door.healed(key) and time.monotonic() < deadline:
            time.sleep(CHECK_EVERY_S / 4)
            self._watch_the_chief(now=True)

    def _send_heal(self, server_rank: int, segments: list[Segment], step: int) -> None:
        """HEAL: this process's newest values of the server's slices and their version, and its mirror."""
        if self.mirrors[server_rank] is None and self.read_version[server_rank] > 0:
            self.healed_without_counts = self.read_version[server_rank]
        send_heal(self._channels[server_rank], step, self.read_version[server_rank], gather(self.store, segments),
                  self.mirrors[server_rank], self._state_size(server_rank))

    def _pull_from(self, server_rank: int, segments: list[Segment], size: int, step: int) -> None:
        channel, reply = self._channels[server_rank], torch.zeros(2, dtype=torch.int64, device="cpu")
        # `step` (the first whose push the server did not apply) tells the healed server this group's step: its
        # own count is as old as the chief's mirror, and a later rejoin of this group starts from it
        channel.send(words(PULL, step, self.read_version[server_rank]), TAG_HEADER)
        values = torch.zeros(size, device="cpu")
        channel.recv(values, TAG_VALUES)
        channel.recv(reply, TAG_REPLY)
        self._leave_if_refused(int(reply[0]), step)
        scatter(self.store, values, segments)
        self.read_version[server_rank] = int(reply[0])

    def _refresh_mirrors(self, step: int) -> None:
        """The chief, every mirror_every steps: each server's updater state and counters, to heal it from if it dies."""
        if not (self.chief and self.servers_heal):
            return
        now, self._mirror_now = self._mirror_now, False
        for server, server_rank, _, _ in self.servers:
            if (step - self.first_step) % self.mirror_every[server_rank] and not now:
                continue
            try:
                mirror = ask_mirror(self._channels[server_rank], step, self._state_size(server_rank))
            except RuntimeError as err:
                self._recover(server, server_rank, step, err)
                continue
            self.mirrors[server_rank] = mirror

    def start_loop(self, step: int, whole_state: Optional[dict[str, dict[str, torch.Tensor]]] = None) -> int:
        """A user's loop (shoal.session), before its first step: the chief sends every server FIRST (its module's
        values, which are where the servers start, and on --resume the checkpoint's updater state `whole_state`; a
        fresh start keeps the updater's first state); every other group's stub pulls the servers' values (after group 0's
        warm-up, if any); the stub's values go to the rest of its group. Returns the step this group starts at."""
        start = step
        if self.chief:
            version = self.last_version
            for _, server_rank, segments, _ in self.servers:
                send_first(self._to(server_rank), step, version, gather(self.store, segments),
                           self._flat_state(server_rank, whole_state or {}), resumed=bool(whole_state))
                self.read_version[server_rank] = version
        elif self.rank == self.stub:
            try:
                start, _ = self._pull_live_values()  # (the stub alone: its group gets the step below)
            except ServerLost as err:
                raise ServerLost(str(err).replace("could not rejoin", "could not start")) from None
        if len(self.group_ranks) > 1:  # the group's first step, as its stub's
            first = words(start)
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
        if len(self.group_ranks) > 1:  # a group over several processes, all restarted: its stub pulls for them all
            return self._rejoin_as_a_group(incarnation)
        return self._pull_live_values()

    def _rejoin_as_a_group(self, incarnation: int) -> tuple[int, int]:
        """Every process of the group came back (their group formed afresh: shoal.comm.regroup): the stub pulls the
        live values, the version and the group's steps, and gives them to the rest of the group (`rejoin`'s answer)."""
        before = fingerprint([self.store.values[n] for n in self.names])
        where = torch.zeros(2, dtype=torch.int64, device="cpu")
        if self.rank == self.stub:
            try:
                where[0], where[1] = self._pull_live_values()
            except JobOver:  # (the servers finished before the group came back: so does the rest of the group)
                self.group_comm.broadcast(where.fill_(-1), self.stub).wait()
                raise
        self.group_comm.broadcast(where, self.stub).wait()
        if int(where[0]) < 0:
            raise JobOver(f"worker group {self.group}: the servers finished serving before it came back (its stub, process "
                          f"{self.stub}, found them so); the job is over")
        self._share_params()
        self.first_step, self.last_version = int(where[0]), int(where[1])
        self.warmup = False
        if self.rank != self.stub:  # (the stub's record names what it pulled from each server)
            self.digests = {"before": {"group": before},
                            "pulled": {"group": fingerprint([self.store.values[n] for n in self.names])}}
        return self.first_step, self.last_version

    def _pull_live_values(self) -> tuple[int, int]:
        """The stub's pull of the servers' live values, their version and the steps its group has done."""
        reply, steps = torch.zeros(2, dtype=torch.int64, device="cpu"), []
        self.digests = {"before": {}, "pulled": {}}  # per server: this process's values before and after the pull
        try:
            for server, server_rank, segments, size in self.servers:
                self._to(server_rank).send(words(PULL, 0, 0), TAG_HEADER)
                values = torch.zeros(size, device="cpu")
                self._to(server_rank).recv(values, TAG_VALUES)
                self._to(server_rank).recv(reply, TAG_REPLY)
                self._leave_if_refused(int(reply[0]), 0)
                self.digests["before"][server.id] = fingerprint([gather(self.store, segments)])
                scatter(self.store, values, segments)
                self.digests["pulled"][server.id] = fingerprint([gather(self.store, segments)])  # what the group trains on
                self.read_version[server_rank] = int(reply[0])
                steps.append(int(reply[1]))
        except RuntimeError as err:
            raise ServerLost(f"worker group {self.group} could not rejoin: {comm.describe_error(err)}") from None
        version = min(self.read_version.values())
        self.first_step, self.last_version = min(steps), version
        self.warmup = False  # pulled already
        return self.first_step, version

    def succeed(self, step: int, parts: list[tuple[Grads, int]]) -> list[int]:
        """Group 0's stub from now on, in a dead chief's place (Sandblaster's worker processes, whose quorum made this
        process the decider: runtime/exchanges/sandblaster.py), with the group's gradient `parts` of step `step`: knock
        at every server as group 0's incarnation `self.incarnation`, take its values, version and the steps group 0 has
        done (a server serves a group's new process only once the dead one's thread ended: it applied the dead chief's
        push of a step whole or not at all), and push the step's gradient to each server that has not applied it, so
        that the push counts once; its mirror is asked at once (`_mirror_now`). Returns the ranks of the servers that had
        applied it (from the dead chief)."""
        done = self.take_the_groups_place(step)
        applied = frozenset(r for r, steps in done.items() if steps > step)
        flat, had = self._flat_grads(parts)
        clip_([flat], self.max_norm)  # (the same clipped push the dead chief sent: the same mean, the same norm)
        self._push_pull(step, flat, had, applied)
        return sorted(applied)

    def take_the_groups_place(self, step: int) -> dict[int, int]:
        """Knock at every server as group 0's incarnation `self.incarnation` (after step `step`), and take its values and
        version; returns, per server's rank, the steps group 0 has done there. The mirror is asked at the next push (none
        yet: a server that dies before it heals from the values alone)."""
        reply, done = torch.zeros(2, dtype=torch.int64, device="cpu"), {}
        for server, server_rank, segments, size in self.servers:
            def pull(server_rank=server_rank, size=size) -> torch.Tensor:
                channel = self._to(server_rank)
                channel.send(words(PULL, 0, 0), TAG_HEADER)  # (step 0: tells the server nothing of group 0's steps)
                values = torch.zeros(size, device="cpu")
                channel.recv(values, TAG_VALUES)
                channel.recv(reply, TAG_REPLY)
                return values
            values = self._asking(server, server_rank, step, pull)
            self._leave_if_refused(int(reply[0]), step)
            scatter(self.store, values, segments)
            self.read_version[server_rank] = int(reply[0])
            done[server_rank] = int(reply[1])
        self.last_version = min(self.read_version.values())  # the job's samples count on from here (metrics)
        self._mirror_now = True
        return done

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
                    self._to(server_rank).send(words(PULL, step, 0), TAG_HEADER)
                    values = torch.zeros(size, device="cpu")
                    self._to(server_rank).recv(values, TAG_VALUES)
                    self._to(server_rank).recv(reply, TAG_REPLY)
                    self._leave_if_refused(int(reply[0]), step)
                    scatter(self.store, values, segments)
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
        self._watch_the_chief()
        if self._mirror_now and self.rank == self.stub:  # a successor's first mirror: at once, the heal's window short
            self._refresh_mirrors(step)

    def _watch_the_chief(self, now: bool = False) -> None:
        """Whether the chief is gone and this process is the lowest living one (shoal.comm.succession): at a step's end
        (the trainer then takes over the chief's duties), when a server died (its heal is the chief's), at the finish
        (`now`: asked at once)."""
        if self.chief or self.successor is None or not self.successor.takes_over(now):
            return
        self.chief = True
        self.last_version = min(self.read_version.values())  # the job's samples count on from here (metrics)
        self._mirror_now = True  # no mirror yet: asked at the end of this step (a server dead before heals without one)

    def speak_for_the_job(self, log: Callable[[str], None], annotate: Callable[[dict], None]) -> None:
        """This group took the dead chief's place: its lines and summary.json's fields go through the trainer's."""

    def _await_the_chiefs_last_word(self) -> None:
        """A process that may take the chief's place does not say STOP before the chief said its last request (FINAL):
        the chief may still die before, and then this process sends it instead."""
        while self.successor is not None and not self.chief and not self.successor.chief_done():
            self._watch_the_chief(now=True)
            if not self.chief:
                time.sleep(CHECK_EVERY_S)

    def _push_pull(self, step: int, flat: torch.Tensor, had: torch.Tensor, applied: frozenset[int] = frozenset()) -> None:
        """Push the step's gradient to every server, and take the answers: at once, or (overlap_push) the previous
        push's answers now and this one's while the group computes its next step. `applied`: the ranks of servers
        that applied this push already (a dead chief's, `succeed`): nothing is sent to them."""
        # this push's answers are posted first (requests.Posted says why); the previous push's answers (overlap_push)
        # still fill the receives posted before these
        answers = [None if server_rank in applied else self._posted_answer(server, server_rank, size, step)
                   for server, server_rank, _, size in self.servers]
        self._pushing = (step, flat, had) if self.resends else None
        for i, (server, server_rank, segments, _) in enumerate(self.servers):
            if server_rank in applied:
                continue
            if answers[i] is None:  # its server died: this push to it is dropped (or sent to the healed one: resends)
                answers[i] = self._push_again(i, step) if self.resends else None
                continue
            try:
                self._to(server_rank).run(lambda r=server_rank, g=segments: self._send_push(r, g, step, flat, had))
            except RuntimeError as err:
                self._recover(server, server_rank, step, err)  # (or ServerLost) this push to it is dropped
                answers[i] = self._push_again(i, step) if self.resends else None
        self._settle(step)
        self._awaited = answers
        if not self.overlap:
            self._settle(step)
        self._refresh_mirrors(step)

    def _send_push(self, server_rank: int, segments: list[Segment], step: int, flat: torch.Tensor, had: torch.Tensor) -> None:
        """A push's messages on the server's channel (run on the waiter's thread)."""
        channel = self._channels[server_rank]
        channel.send(words(PUSH, step, self.read_version[server_rank]), TAG_HEADER)
        for part in self.codecs[server_rank].encode(self._gather(flat, segments)):
            channel.send(part, TAG_GRAD)
            self.pushed_bytes += wire_bytes([part])
        # one byte per segment: cheaper than a flag inside the (uncopied) gradient
        channel.send(torch.tensor([had[self.position[s.param]] > 0 for s in segments], dtype=torch.uint8, device="cpu"), TAG_HAS_GRAD)
        if self.hyper_size:
            channel.send(self.hyper(), TAG_HYPER)

    def _push_again(self, index: int, step: int) -> tuple:
        """`resends`: the push of `step` to server `index`'s healed process (again after each death meanwhile), its
        answer's receives posted first; says so in the process's log."""
        server, server_rank, segments, size = self.servers[index]
        _, flat, had = self._pushing
        while True:
            try:
                answer = self._await_answer(server_rank, size)
                self._to(server_rank).run(lambda: self._send_push(server_rank, segments, step, flat, had))
                break
            except RuntimeError as err:
                self._recover(server, server_rank, step, err)
        write_line(f"worker group {self.group}: sent the push of step {step} again to {server} (restart "
                   f"{self.server_restarts[server_rank]}), healed with the values it was computed on")
        return answer

    def _posted_answer(self, server: ServerId, server_rank: int, size: int, step: int) -> Optional[tuple]:
        """The receives of a push's answer, posted; None when the server was found dead and recovered (servers that heal)."""
        try:
            return self._await_answer(server_rank, size)
        except RuntimeError as err:
            self._recover(server, server_rank, step, err)
            return None

    def _await_answer(self, server_rank: int, size: int) -> tuple:
        values, reply = torch.zeros(size, device="cpu"), torch.zeros(2, dtype=torch.int64, device="cpu")
        return values, reply, post(self._to(server_rank), [(values, TAG_VALUES), (reply, TAG_REPLY)])

    def _lost(self, server: ServerId, server_rank: int, step: int, err: RuntimeError) -> ServerLost:
        return ServerLost(f"{server} in process {server_rank} stopped answering worker group {self.group} "
                          f"at step {step}: {comm.describe_error(err)}")

    def _settle(self, step: int) -> None:
        """Take the answers to the last push, if not taken yet: the new values, their version and the push's lag."""
        if not self._awaited:
            return
        awaited, self._awaited, lags = self._awaited, [], []
        for (server, server_rank, segments, _), answer in zip(self.servers, awaited):
            if answer is None or answer[2].link is not self._channels.get(server_rank):  # its server died: recovered already
                continue
            values, reply, posted = answer
            try:
                posted.link.run(posted.wait)
            except RuntimeError as err:
                self._recover(server, server_rank, step, err)  # (or ServerLost) the answer is lost with its push
                if not (self._pushing is not None and self._pushing[0] == step):
                    continue
                index = next(i for i, s in enumerate(self.servers) if s[1] == server_rank)
                self._awaited = [None] * len(self.servers)  # (the others' answers are taken already, or next)
                self._awaited[index] = self._push_again(index, step)
                self._settle(step)  # this answer, from the healed server
                continue
            self._leave_if_refused(int(reply[0]), step)
            scatter(self.store, values, segments)
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
                self._to(server_rank).send(words(STATE, 0, 0), TAG_HEADER)
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
            self.count_on_from(int(tensors.get("count/job_bytes_sent", 0)))

    def count_on_from(self, bytes_before: int) -> None:
        """The job's bytes before this run (a resumed run's, from its checkpoint), which the chief's count goes on from."""
        self._bytes_before = bytes_before

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
        channel.send(words(kind, 0, 0), TAG_HEADER)
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
        self._await_the_chiefs_last_word()
        if self.chief and self.successor is not None:
            say_chief_done()  # (from here on nobody waits to take its place: its death restarts the whole job)
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
            scatter(self.store, values, segments)
            flats.append((server_rank, flat))
            lags.append(counts)
        self.final_state = self._state_from(flats)
        # every server's count: every group's whole run (not known where a server's count restarted at a heal)
        self.job_bytes_sent = self._bytes_before + moved if self.healed_without_counts is None else None
        self.lag_histogram = histogram(_stats_of(lags[0])) if lags else None


def _stats_of(counts: torch.Tensor) -> dict[int, StalenessStats]:
    """A server's (group, lag) counts as StalenessStats per group."""
    stats = {}
    for group, row in enumerate(counts.tolist()):
        stats[group] = StalenessStats()
        for lag, n in enumerate(row):
            stats[group].add(lag, n)
    return stats
