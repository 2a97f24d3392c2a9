"""Distributed Hogwild: a group's own steps and its syncs with the other groups' masters (SINGA's delta rule, steps 1
and 3: send Δ = cur − last_sync, take the master's fresh value), and its finish. The protocol, and the algorithm as a
whole: runtime/exchanges/hogwild.py; the group as master of its slices: hogwild_master.py; its restarts and checkpoint
state: hogwild_recovery.py.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, NamedTuple, Optional

import torch

from shoal.errors import warn
from shoal.neuralnet.algorithms import Grads
from shoal.planning.placement import Placement, ServerId
from shoal.comm import dist as comm
from shoal.comm import channels, heartbeat
from shoal.comm.succession import Successor, say_chief_done
from shoal.report.metrics import MetricWindow
from shoal.neuralnet.params import ParamStore
from shoal.runtime.exchanges.compression import Codec, wire_bytes
from shoal.runtime.exchanges.hogwild import (KINDS, STOP, SYNC, SYNC_ENCODED, TAG_SYNC_DELTA, TAG_SYNC_DELTA_2,
                                            TAG_SYNC_HEADER, TAG_SYNC_VALUE, TAG_SYNC_VALUE_2, WorldLink, mastered_by)
from shoal.runtime.exchanges.hogwild_master import HogwildMaster
from shoal.runtime.exchanges.hogwild_recovery import HogwildRecovery
from shoal.runtime.exchanges.local import aggregate, clipped
from shoal.runtime.exchanges.requests import gather, post, scatter, server_segments, wait_unless, words
from shoal.runtime.exchanges.server import Server


# How long a group waits for a master's answer to its sync before it trains on without it (the answer is applied when
# it comes): a sync takes milliseconds, so only a master that stopped or is starved waits this long, and a stopped one
# then no longer holds the group up for the whole stall timeout (cluster.stall_timeout_s) until it is dropped. Not the
# first sync with a master: that one waits (its loop may start seconds after this one's).
SYNC_PATIENCE_S = 1.0
# How long a finished group waits for the launcher's word that a peer which died before its STOP is restarted (the
# launcher says it within a heartbeat of the death; without restarts left it never does)
RETURN_WAIT_S = 2.0


class Sent(NamedTuple):
    """A master's slices in this group's replica (their segments) and their values when a sync was sent."""
    segments: list
    values: torch.Tensor


class Asked:
    """A sync sent to `master` on a thread of its own, waiting for the answer: `sent` (this group's values of the
    master's slices at sending), `fresh()` (the master's values once answered), `failed` (the exchange's error)."""

    def __init__(self, master: int, exchange: Callable[[], None], sent: Sent, fresh: Callable[[], torch.Tensor]):
        self.sent, self.fresh, self.failed = sent, fresh, []
        self.late = False  # the group trained on before it came: the answer is merged with the updates made since

        def run() -> None:
            try:
                exchange()
            except Exception as err:  # noqa: BLE001 (any failure is the sync's: never a zero answer applied as the master's)
                self.failed.append(err)

        self.thread = threading.Thread(target=run, name=f"shoal-sync-to{master}", daemon=True)
        self.thread.start()


class HogwildExchange(HogwildMaster, HogwildRecovery):
    """One group's local updates plus its syncs with the other groups' replicas (its master service: HogwildMaster; its
    restarts and checkpoint state: HogwildRecovery)."""
    absent_groups: frozenset[int] = frozenset()  # every group stays in the job (only Local SGD's meetings leave one out)
    job_notes: dict = {}  # the chief's, after finish: summary.json's reshared_steps and steps_per_group (hogwild_recovery)
    duties_taken_over = "it tests and validates, writes the run log and the checkpoints (from its replica)"

    def __init__(self, store: ParamStore, server: Server, placement: Placement, rank: int, group: int,
                 sync_freq: int, ngroups: int, log: Callable[[str], None] = print, codecs: Optional[Callable[..., Codec]] = None,
                 door: Optional[channels.Door] = None, rejoining: bool = False, timeout_s: float = 60.0,
                 successor: Optional[Successor] = None):
        """`sync_freq` (cluster.sync_freq), `ngroups` (cluster.nserver_groups: one master group each) and `codecs`
        (cluster.compression) as the strategy reads them from the plan. `door`: where restarted groups knock (None:
        no group is restarted); `rejoining`: this process was restarted into the running job (it knocks, `rejoin`);
        `successor`: this process may take a dead chief's place (shoal.comm.succession; None: it never does)."""
        self.store, self.server, self.rank, self.group, self.log = store, server, rank, group, log
        self.chief = group == 0 and not rejoining  # (a dead chief's restarted process rejoins as an ordinary group)
        self.successor = successor
        self.sync_freq = max(1, sync_freq)
        self.ngroups, self._samples = ngroups, 0
        self.lock = threading.Lock()  # local updates and masters' delta additions do not interleave
        trainable = set(store.trainable_names())
        group_rank = {g: placement.process_of(ServerId(g, 0)) for g in range(ngroups)}
        # the other groups' slices this group asks for, per master process
        self.requests = {group_rank[g]: server_segments(mastered_by(placement, trainable, g)) for g in range(ngroups) if g != group}
        self.last_sync: dict[int, torch.Tensor] = {}  # per master: the values at the last sync (from the first step)
        # what this group masters, served to each other group
        self.served = server_segments(mastered_by(placement, trainable, group))
        self.peers = {g: r for g, r in group_rank.items() if g != group}
        self.asked = dict(self.requests)  # every master's segments, for a restarted master's syncs to resume
        # how this process reaches each peer: the world's point-to-point, or a channel once one of them was restarted
        self.links = {} if rejoining else {r: WorldLink(r) for r in self.peers.values()}
        self.door, self.timeout_s, self.incarnation = door, timeout_s, 0
        self.linked = {g: 0 for g in self.peers}  # the incarnation of each peer group this process syncs with
        self.peer_steps: dict[int, int] = {}  # per peer group: its step at its latest sync with this group's masters
        # the step this run's groups began at (a resumed run's checkpoint step): a group that has not synced here since
        # did all its synced work before it, so a restart of it goes on from there (never from step 0 of a resumed run)
        self.began_at = 0
        self.synced_at: dict[int, float] = {}  # per master process: when this group's latest sync with it was
        self._late: dict[int, Asked] = {}  # per master process: a sync whose answer had not come in SYNC_PATIENCE_S
        self.steps_done = 0
        self.skipped: Optional[tuple[int, int]] = None  # restarted: the steps it skipped, [its last sync's, the step it joined at)
        self._closing = False
        self._admitting: Optional[threading.Thread] = None
        self.updates = 0
        self.syncs = 0
        self._syncs_shown = 0
        # bytes of this group's own syncs since the last display, both ways (its deltas and the answers): what a
        # sync costs, counted where it is made (the answers this group serves follow the others' timing)
        self.sync_bytes = 0
        # the same, over the whole run (and a resumed run's before it): a group's STOP carries it to its masters, so
        # the chief ends with every group's (summary.json's bytes_sent)
        self.own_bytes = 0
        # per thread that answered a peer (one per peer process): the peer's own count from its STOP, or, for a peer
        # that died or stalled first, the syncs it made here as this group answered them
        self._peer_bytes: dict[int, int] = {}
        self.job_bytes_sent: Optional[int] = None  # the chief's, after finish
        self.codecs = codecs
        if codecs is not None:
            self.delta_codecs = {master: codecs() for master in self.requests}  # top-k: a residual per master
            self.answer_codecs = {g: codecs(False) for g in self.peers}  # the difference from `known` is the feedback
            self.known: dict[int, torch.Tensor] = {}  # per requesting group: what it holds of this group's slices
        self._threads: dict[int, threading.Thread] = {}  # per peer group: the thread answering its syncs
        self._served_links: dict[int, object] = {}  # per peer group: the link its syncs come on (its newest process's)
        self._stopped_links: set[int] = set()  # the links whose peer said STOP (the others' peers died first)
        self._started = False

    def _start(self) -> None:
        """The values every group starts from are set (initial, loaded or resumed): remember them, start serving."""
        if self._started:
            return
        self._started = True
        # a resumed group goes on from what it held when its checkpoint was written (load_own_state)
        self.last_sync = {r: self.last_sync[r] if r in self.last_sync else gather(self.store, segs) for r, (segs, _) in self.requests.items()}
        if self.codecs is not None:
            start = gather(self.store, self.served[0])
            self.known = {g: self.known[g] if g in self.known else start.clone() for g in self.peers}
        for g, r in self.peers.items():
            if r in self.links:
                self._answer(g, r)
        if self.door is not None:  # restarted groups knock: a thread lets them in
            self.door.set_state(self.group, self.group, f"serving {self.incarnation}")
            self._admitting = threading.Thread(target=self._admit, name="shoal-sync-admit", daemon=True)
            self._admitting.start()

    # -- the group's own steps ----------------------------------------------------------
    def begin(self, step: int) -> None:
        """Nothing to wait for: a group only ever waits for its own replica."""
        if not self._started:
            self.began_at = step
        self._start()

    def step(self, step: int, parts: list[tuple[Grads, int]]) -> None:
        with self.lock:
            # the group's whole gradient, clipped by its own global norm (as an asynchronous group clips its push)
            self.server.update(self.server.updates, clipped(aggregate(parts, target=self.store.device), self.server),
                               group_step=(self.group, step))
        self.updates += 1
        self.steps_done = step + 1
        self._samples += sum(share for _, share in parts)
        if self.updates % self.sync_freq == 0:
            self._sync()
        self._watch_the_chief()

    def _watch_the_chief(self, now: bool = False) -> None:
        """At a step's end (the trainer then takes over the chief's duties: `chief`), and at the finish (`now`): whether
        the chief is gone and this process is the lowest living one (shoal.comm.succession)."""
        if not self.chief and self.successor is not None and self.successor.takes_over(now):
            self.chief = True

    def speak_for_the_job(self, log: Callable[[str], None], annotate: Callable[[dict], None]) -> None:
        """This group took the dead chief's place: its replica is the job's from now on (the checkpoints' file, the
        final values), its lines the job's; what the chief would have said at the end, it says (job_notes)."""
        self.log = log

    def _sync(self) -> None:
        for master in list(self.requests):
            segments, size = self.requests[master]
            if size == 0:
                continue
            late = self._late.get(master)
            if late is not None:  # its answer to an earlier sync is late: settle it first, or train on without it
                if late.thread.is_alive():
                    if heartbeat.is_stalled(master):  # dropped (the chief has warned); its thread stays blocked
                        wait_unless(late.thread, lambda: heartbeat.is_stalled(master), 0.05)
                        self._drop(master)
                    continue
                if self._late.pop(master, None) is not late or not self._settle(master, late):
                    continue
            with self.lock:  # (the link read with the values: a restarted master's re-linking swaps it under this lock)
                sent = gather(self.store, segments)
                link = self.links[master]
            try:
                ask = self._ask if self.codecs is None else self._ask_encoded
                asked = ask(master, link, sent - self.last_sync[master], size, Sent(segments, sent))
            except RuntimeError as err:
                if self._current(master, link):  # (else it went to a dead predecessor: the new process is synced next)
                    self._stop_syncing(master, err)
                continue
            if master in self.synced_at:
                asked.thread.join(timeout=SYNC_PATIENCE_S)
            else:  # its first answer: the master's loop may start later than this one's; waiting for it lines the groups
                wait_unless(asked.thread, lambda: heartbeat.is_stalled(master), 0.05)  # up (only a stall gives up on it)
            with self.lock:
                if not self._current(master, link):
                    # asked of the dead process the master's restart replaced (re-linked while this sync was under way):
                    # never answered, never kept as late, else this group would wait on it instead of syncing again
                    continue
            if not asked.thread.is_alive():
                self._settle(master, asked)
            elif heartbeat.is_stalled(master):  # the master stalled: dropped (the chief has warned)
                wait_unless(asked.thread, lambda: heartbeat.is_stalled(master), 0.05)
                self._drop(master)
            else:  # a slow or stopped master: the group trains on; the answer is applied when it comes
                asked.late = True
                with self.lock:
                    if self._current(master, link):  # (the re-linking drops late syncs under this lock)
                        self._late[master] = asked

    def _current(self, master: int, link) -> bool:
        """Whether `link` is still the link to `master` (a restarted master's process comes with a new one)."""
        return self.links.get(master) is link

    def _settle(self, master: int, asked: "Asked") -> bool:
        """The master answered `asked`: take its fresh values (SINGA's step 3: cur = master + (cur − value at sending),
        which is the master's value where nothing changed since the sending); False if the exchange failed."""
        if asked.failed:
            self._stop_syncing(master, asked.failed[0])
            return False
        segments, fresh = asked.sent.segments, asked.fresh()
        with self.lock:
            if asked.late:
                scatter(self.store, fresh + (gather(self.store, segments) - asked.sent.values), segments)
            else:  # (the training thread made no update since: the master's value as it is, bit for bit)
                scatter(self.store, fresh, segments)
        self.last_sync[master] = fresh
        self.synced_at[master] = time.time()
        self.syncs += 1
        return True

    def settle_late(self) -> None:
        """Wait for every sync whose answer is still due and apply it, or drop its master once it stalls: before the
        end, and before a checkpoint (whose last_sync must be the master's answer to what was sent: else a resumed
        group would send that delta again, and the master would add it twice)."""
        for master, late in list(self._late.items()):
            if wait_unless(late.thread, lambda: heartbeat.is_stalled(master), 0.05) and self._late.pop(master, None) is late:
                self._settle(master, late)
            else:
                self._drop(master)

    def _stop_syncing(self, master: int, err: BaseException) -> None:
        warn(f"WARNING: worker group {self.group} stops syncing with process {master}: {comm.describe_error(err)}")
        self._drop(master)

    def _drop(self, master: int) -> None:
        self.requests.pop(master, None)
        self._late.pop(master, None)

    def _ask(self, master: int, link, delta: torch.Tensor, size: int, sent: "Sent") -> "Asked":
        """Send Δ to `master` over `link` on a thread of its own, which waits for its fresh value (gloo's receives cannot
        be cancelled: a stalled master's leaves it waiting). `sent`: this group's values of those slices now."""
        fresh = torch.zeros(size, device="cpu")

        def exchange() -> None:
            answer = post(link, [(fresh, TAG_SYNC_VALUE)])  # posted first (requests.Posted says why)
            link.send(self._header(SYNC), TAG_SYNC_HEADER)
            link.send(delta, TAG_SYNC_DELTA)
            answer.wait()

        self._count(8 + wire_bytes([delta, fresh]))
        return Asked(master, exchange, sent, lambda: fresh)

    def _ask_encoded(self, master: int, link, delta: torch.Tensor, size: int, sent: "Sent") -> "Asked":
        """As _ask, Δ and the answer encoded; the fresh value is what this group held plus the decoded answer."""
        codec, answer = self.delta_codecs[master], self.answer_codecs[self.group_of(master)].buffers(size)
        parts = codec.encode(delta)
        held = self.last_sync[master]

        def exchange() -> None:
            answers = post(link, list(zip(answer, (TAG_SYNC_VALUE, TAG_SYNC_VALUE_2))))
            link.send(self._header(SYNC_ENCODED), TAG_SYNC_HEADER)
            for part, tag in zip(parts, (TAG_SYNC_DELTA, TAG_SYNC_DELTA_2)):
                link.send(part, tag)
            answers.wait()

        self._count(8 + wire_bytes(parts + answer))
        return Asked(master, exchange, sent, lambda: held + codec.decode(answer, size))

    def _count(self, sent: int) -> None:
        self.sync_bytes += sent
        self.own_bytes += sent

    def _header(self, kind: int) -> torch.Tensor:
        """A sync's first message: its kind and this group's steps (KINDS); a STOP's, this group's bytes of the whole run."""
        count = self.own_bytes if kind == STOP else self.steps_done
        return words(kind + KINDS * count)

    def group_of(self, rank: int) -> int:
        return next(g for g, r in self.peers.items() if r == rank)

    def finish(self) -> None:
        """Training is over here: tell the masters, then serve the others until they are done too. The door stays open
        meanwhile: a peer that dies before its STOP and is restarted is let in and served to its end (its share of the
        skipped steps, trained with the live values, reaches this group's masters); only then does it close."""
        self._start()  # a group that had no step left to train still serves the others
        self.settle_late()  # answers still due: their receives must not be left pending
        self.say_resharing()  # (before its STOP: the chief, waiting for every STOP, then reads every group's)
        told: set[int] = set()  # the links this group said STOP on
        if self.chief and self.successor is not None:
            say_chief_done()  # (from here on nobody waits to take its place: its death restarts the whole job)
        while True:
            self._say_stop(told)
            self._serve_to_the_end()
            if self.door is None or not self._awaits_a_return():
                break
        if self.door is not None:
            self._closing = True  # from here on a knock finds the door closed: the restarted group trains on alone
            self.door.close(self.group)
            self._admitting.join(timeout=self.timeout_s)  # a knock being let in now is answered below too
            self._say_stop(told)
            self._serve_to_the_end()
            self.door.set_state(self.group, self.group, "finished")
        # every peer said STOP here (or is gone): this group's syncs and theirs with anyone, each counted once, by its requester
        self.job_bytes_sent = self.own_bytes + sum(self._peer_bytes.values())
        if self.successor is not None and not self.successor.chief_done():  # the chief died before its STOP
            self._watch_the_chief(now=True)
        if self.chief and self.end_step is not None:  # the skipped steps and who re-trained them (summary.json)
            self.job_notes = self.resharing_notes(self.train_steps)

    def _say_stop(self, told: set[int]) -> None:
        """STOP to each master this group has not told yet (one let in during the finish too)."""
        for master, (_, size) in list(self.requests.items()):
            link = self.links[master]
            if id(link) in told:
                continue
            told.add(id(link))
            zeros = self.delta_codecs[master].buffers(size) if self.codecs is not None else [torch.zeros(size, device="cpu")]
            try:  # the master has this request's Δ receive posted (_serve): it gets zeros
                link.send(self._header(STOP), TAG_SYNC_HEADER)
                for part, tag in zip(zeros if size else [], (TAG_SYNC_DELTA, TAG_SYNC_DELTA_2)):
                    link.send(part, tag)
            except RuntimeError:
                pass

    def _serve_to_the_end(self) -> None:
        for group, t in list(self._threads.items()):
            wait_unless(t, lambda: heartbeat.is_stalled(self.peers[group]), 0.25)  # never wait for a dropped group

    def _awaits_a_return(self) -> bool:
        """Whether a peer that ended without its STOP (it died) comes back: the launcher's word on its restart (up to
        RETURN_WAIT_S), then its knock, let in (True: serve it to its end too)."""
        linked = dict(self.linked)
        for group, link in list(self._served_links.items()):
            if id(link) not in self._stopped_links and self.door.dead_groups_restart():
                self.door.await_announcement(group, self.linked[group], RETURN_WAIT_S)
        self._await_announced()
        return self.linked != linked

    # -- the trainer's interface --------------------------------------------------------
    def metrics(self, window: MetricWindow) -> dict[str, float]:
        """This group's losses, how many syncs with master replicas it made since the last display, and the job's
        samples as every other framework counts them: the groups do not report to the chief, so its own times the
        groups (they run side by side at about one pace)."""
        values = window.averages() | {"syncs": self.syncs - self._syncs_shown, "sync_bytes": self.sync_bytes,
                                      "samples": self._samples * self.ngroups}
        self._syncs_shown, self.sync_bytes, self._samples = self.syncs, 0, 0
        return values

    def view_updater(self):
        """Each group's server updates whole params once its group's gradient is summed."""
        return None

    def updater_state(self):
        return self.server.state_dict()

    def load_updater_state(self, state) -> None:
        self.server.load_state(state)
