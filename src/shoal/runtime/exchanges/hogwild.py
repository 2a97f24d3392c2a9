"""Distributed Hogwild over processes: each group updates its own replica, replicas meet every sync_freq.

Each process hosts a whole worker group and its whole server group (SINGA's
Caffe-style layout, nserver_groups = nworker_groups, co-located). Updates are
local: the group's server applies them to the group's own replica at once.
Every `sync_freq` local updates the group synchronises the slices it does not
master with their master group (slice i's master is group i mod
nserver_groups, shoal.planning.placement), with SINGA's delta rule:
  1. the requester sends Δ = cur − last_sync,
  2. the master adds Δ to its replica and answers with its fresh value,
  3. the requester sets cur = master + (cur − value at sending) and last_sync = master.
The request is made between two local updates, so "cur − value at sending" is 0
here and the requester takes the master's value.

Masters answer on a thread per peer group, so a group that dies only ends its
thread; its requests end with a warning and the group trains on alone. A group
whose process stops answering (no heartbeat for cluster.stall_timeout_s,
shoal.comm.heartbeat) is dropped the same way: a sync waiting for it gives up
(its receive is left pending on a thread of its own), and if it wakes later its
deltas are never added.

A group whose process dies may be restarted (shoal run --max-restarts N, launcher/rejoin.py): the new
process is in no process group of the job, so it knocks at each live group's door (`DOOR`,
shoal.comm.channels.Door) and the two talk over a channel of their own from then on. Each group it
reaches sends it the live values of the slices it masters, its own copy of the restarted group's
slices as of its last sync with them, when that sync was and the restarted group's step at it (the
header of every sync carries the requester's step). The restarted group takes the live values, its
own slices from the latest of those syncs, and goes on from the step of its last sync, or from the step the run
began at where it has not synced since (a resumed run's: never step 0 again) (the data shards are a function of the step): what it had done since its last sync, and the updater state of its
server, are lost. The groups it reached then sync with it again, both ways. A restarted process knocks
at the groups that started with the job and at restarted ones of a lower group number (never both
ways, so two restarted groups make one channel); a group that is not running then is not synced with.

Every group starts from the same values (the job's seed, its checkpoint_path or the checkpoint a
run resumes from), taken as last_sync when the group begins its first step; its masters start
serving then too. Compressed (cluster.compression), the requester sends its encoded Δ (top-k:
what it did not send stays in its residual and goes with the next Δ) and the master answers with
the encoded change of its slices since what this requester holds (`known`, which the master
tracks from those common start values: the part of the change it did not send is still in the
next difference, so the answer needs no residual). The requester's copy of a master's slices is
then `known`, which trails the master's by what was not sent yet.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional

import torch

from shoal.errors import warn
from shoal.neuralnet import checkpoint as ckpt_io
from shoal.neuralnet.algorithms import Grads
from shoal.planning.placement import Placement, ServerId
from shoal.comm import dist as comm
from shoal.comm import channels, heartbeat
from shoal.report.metrics import MetricWindow
from shoal.neuralnet.params import ParamStore
from shoal.runtime.exchanges.compression import Codec, codecs_state, load_codecs_state, wire_bytes
from shoal.runtime.exchanges.local import aggregate, clipped
from shoal.runtime.exchanges.requests import gather, let_in, post, scatter, server_segments, wait_unless, words
from shoal.runtime.exchanges.server import Server

SYNC, STOP, SYNC_ENCODED = 1, 2, 3
KINDS = 4  # a sync's header is one int64: its kind + KINDS * the requester's steps (what a restarted group goes on from)
TAG_SYNC_HEADER, TAG_SYNC_DELTA, TAG_SYNC_VALUE, TAG_SYNC_DELTA_2, TAG_SYNC_VALUE_2 = 21, 22, 23, 24, 25
TAG_JOIN_INFO, TAG_JOIN_LIVE, TAG_JOIN_YOURS = 26, 27, 28  # what a live group sends a restarted one that knocked
DOOR = "hogwild"  # the store's door at which a restarted group's process knocks (shoal.comm.channels.Door)
ADMIT_POLL_S = 0.1  # how often a group looks for a restarted group's knock


class _World:
    """Messages with a peer that started with the job, over the job's world process group."""

    def __init__(self, rank: int):
        self.rank = rank

    def send(self, tensor: torch.Tensor, tag: int) -> None:
        comm.send(tensor, self.rank, tag)

    def irecv(self, tensor: torch.Tensor, tag: int):
        return comm.irecv(tensor, self.rank, tag)


def mastered_by(placement: Placement, trainable: set[str], group: int) -> list:
    """The slices whose master copy lives in server group `group`."""
    return [s for s in placement.slices if s.param in trainable and placement.master_group_of_slice(s.index) == group]


class HogwildExchange:
    """One group's local updates plus its syncs with the other groups' replicas (and its master service)."""
    absent_groups: frozenset[int] = frozenset()  # every group stays in the job (only Local SGD's meetings leave one out)

    def __init__(self, store: ParamStore, server: Server, placement: Placement, rank: int, group: int,
                 sync_freq: int, ngroups: int, log: Callable[[str], None] = print, codecs: Optional[Callable[..., Codec]] = None,
                 door: Optional[channels.Door] = None, rejoining: bool = False, timeout_s: float = 60.0):
        """`sync_freq` (cluster.sync_freq), `ngroups` (cluster.nserver_groups: one master group each) and `codecs`
        (cluster.compression) as the strategy reads them from the plan. `door`: where restarted groups knock (None:
        no group is restarted); `rejoining`: this process was restarted into the running job (it knocks, `rejoin`)."""
        self.store, self.server, self.rank, self.group, self.log = store, server, rank, group, log
        self.chief = group == 0
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
        self.links = {} if rejoining else {r: _World(r) for r in self.peers.values()}
        self.door, self.timeout_s, self.incarnation = door, timeout_s, 0
        self.linked = {g: 0 for g in self.peers}  # the incarnation of each peer group this process syncs with
        self.peer_steps: dict[int, int] = {}  # per peer group: its step at its latest sync with this group's masters
        # the step this run's groups began at (a resumed run's checkpoint step): a group that has not synced here since
        # did all its synced work before it, so a restart of it goes on from there (never from step 0 of a resumed run)
        self.began_at = 0
        self.synced_at: dict[int, float] = {}  # per master process: when this group's latest sync with it was
        self.steps_done = 0
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

    def _answer(self, group: int, rank: int) -> None:
        key = len(self._peer_bytes)
        self._peer_bytes[key] = 0
        self._threads[group] = threading.Thread(target=self._serve, args=(group, rank, self.links[rank], key),
                                                name=f"shoal-sync-group{group}", daemon=True)
        self._threads[group].start()

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

    def _sync(self) -> None:
        for master in list(self.requests):
            segments, size = self.requests[master]
            if size == 0:
                continue
            try:
                with self.lock:
                    delta = gather(self.store, segments) - self.last_sync[master]
                fresh = self._ask(master, delta, size) if self.codecs is None else self._ask_encoded(master, delta, size)
            except RuntimeError as err:
                warn(f"WARNING: worker group {self.group} stops syncing with process {master}: {comm.describe_error(err)}")
                del self.requests[master]
                continue
            if fresh is None:  # the master stalled: dropped (the chief has warned)
                del self.requests[master]
                continue
            with self.lock:
                scatter(self.store, fresh, segments)
            self.last_sync[master] = fresh
            self.synced_at[master] = time.time()
            self.syncs += 1

    def _ask(self, master: int, delta: torch.Tensor, size: int):
        """Send Δ to `master` and wait for its fresh value; None once the master stalls (the exchange is left
        waiting on its own thread: gloo's receives cannot be cancelled)."""
        fresh = torch.zeros(size, device="cpu")

        link = self.links[master]

        def exchange() -> None:
            answer = post(link, [(fresh, TAG_SYNC_VALUE)])  # posted first (requests.Posted says why)
            link.send(self._header(SYNC), TAG_SYNC_HEADER)
            link.send(delta, TAG_SYNC_DELTA)
            answer.wait()

        self._count(8 + wire_bytes([delta, fresh]))
        return fresh if self._exchange(master, exchange) else None

    def _ask_encoded(self, master: int, delta: torch.Tensor, size: int):
        """As _ask, Δ and the answer encoded; the fresh value is what this group held plus the decoded answer."""
        codec, answer = self.delta_codecs[master], self.answer_codecs[self.group_of(master)].buffers(size)
        parts = codec.encode(delta)

        link = self.links[master]

        def exchange() -> None:
            answers = post(link, list(zip(answer, (TAG_SYNC_VALUE, TAG_SYNC_VALUE_2))))
            link.send(self._header(SYNC_ENCODED), TAG_SYNC_HEADER)
            for part, tag in zip(parts, (TAG_SYNC_DELTA, TAG_SYNC_DELTA_2)):
                link.send(part, tag)
            answers.wait()

        self._count(8 + wire_bytes(parts + answer))
        if not self._exchange(master, exchange):
            return None
        return self.last_sync[master] + codec.decode(answer, size)

    def _count(self, sent: int) -> None:
        self.sync_bytes += sent
        self.own_bytes += sent

    def _header(self, kind: int) -> torch.Tensor:
        """A sync's first message: its kind and this group's steps (KINDS); a STOP's, this group's bytes of the whole run."""
        count = self.own_bytes if kind == STOP else self.steps_done
        return words(kind + KINDS * count)

    def group_of(self, rank: int) -> int:
        return next(g for g, r in self.peers.items() if r == rank)

    def _exchange(self, master: int, exchange: Callable[[], None]) -> bool:
        """Run `exchange` on a thread of its own; False once the master stalls, RuntimeError if it failed."""
        failed = []

        def run() -> None:
            try:
                exchange()
            except RuntimeError as err:
                failed.append(err)

        asking = threading.Thread(target=run, name=f"shoal-sync-to{master}", daemon=True)
        asking.start()
        if not wait_unless(asking, lambda: heartbeat.is_stalled(master), 0.05):
            return False
        if failed:
            raise failed[0]
        return True

    # -- this group as master of its slices ---------------------------------------------
    def _serve(self, group: int, rank: int, link, key: int) -> None:
        """Answer `group`'s syncs. The next request's receives are posted before this answer is sent, as the
        requester posts its answer's before it asks (requests.Posted says why: else the two groups' syncs alternate
        instead of crossing). `key`: this thread's entry of _peer_bytes."""
        segments, size = self.served
        header = torch.zeros(1, dtype=torch.int64, device="cpu")
        codec = self.answer_codecs[group] if self.codecs is not None else None
        received = codec.buffers(size) if codec is not None else [torch.zeros(size, device="cpu")]

        def post_next():  # a group that masters nothing is never asked, only told to stop
            return post(link, [(header, TAG_SYNC_HEADER)] + [(part, tag) for part, tag in zip(received, (TAG_SYNC_DELTA, TAG_SYNC_DELTA_2)) if size])

        try:
            receives = post_next()
            while True:
                receives.wait()
                kind, steps = int(header[0]) % KINDS, int(header[0]) // KINDS
                if kind == STOP:  # its Δ is zeros, sent so that no receive is left pending; its header, the peer's bytes
                    self._peer_bytes[key] = steps
                    return
                delta = codec.decode(received, size) if codec is not None else received[0]
                if heartbeat.is_stalled(rank):  # it woke after being dropped: its delta is stale, never added
                    self.log(f"server group {self.group} refused a sync of worker group {group}, dropped after it stalled")
                    return
                with self.lock:
                    for s in segments:
                        self.store.values[s.param].view(-1)[s.start : s.stop].add_(delta[s.offset : s.offset + s.size])
                    fresh = gather(self.store, segments)
                self.peer_steps[group] = steps
                encoded = kind == SYNC_ENCODED
                receives = post_next()  # Δ is added: its buffers take the next request
                if encoded:  # the change since what the requester holds
                    parts = codec.encode(fresh - self.known[group])
                    self.known[group] += codec.decode(parts, size)
                    for part, tag in zip(parts, (TAG_SYNC_VALUE, TAG_SYNC_VALUE_2)):
                        link.send(part, tag)
                    self._peer_bytes[key] += 8 + wire_bytes(received + parts)  # as the requester counts it
                    continue
                link.send(fresh, TAG_SYNC_VALUE)
                self._peer_bytes[key] += 8 + wire_bytes(received + [fresh])
        except RuntimeError as err:
            if not heartbeat.is_stalled(rank):  # a stalled group was dropped already (the chief warned)
                warn(f"WARNING: server group {self.group} drops worker group {group} (process {rank}): {comm.describe_error(err)}")

    def finish(self) -> None:
        """Training is over here: let in a restarted group the launcher announced, tell the masters, then serve the
        others until they are done too."""
        self._start()  # a group that had no step left to train still serves the others
        if self.door is not None:
            self._await_announced()
            self._closing = True  # from here on a knock finds the door closed: the restarted group trains on alone
            self.door.close(self.group)
            self._admitting.join(timeout=self.timeout_s)  # a knock being let in now is answered below too
        for master, (_, size) in list(self.requests.items()):
            zeros = self.delta_codecs[master].buffers(size) if self.codecs is not None else [torch.zeros(size, device="cpu")]
            link = self.links[master]
            try:  # the master has this request's Δ receive posted (_serve): it gets zeros
                link.send(self._header(STOP), TAG_SYNC_HEADER)
                for part, tag in zip(zeros if size else [], (TAG_SYNC_DELTA, TAG_SYNC_DELTA_2)):
                    link.send(part, tag)
            except RuntimeError:
                pass
        for group, t in list(self._threads.items()):
            wait_unless(t, lambda: heartbeat.is_stalled(self.peers[group]), 0.25)  # never wait for a dropped group
        if self.door is not None:
            self.door.set_state(self.group, self.group, "finished")
        # every peer said STOP here (or is gone): this group's syncs and theirs with anyone, each counted once, by its requester
        self.job_bytes_sent = self.own_bytes + sum(self._peer_bytes.values())

    # -- restarted groups ---------------------------------------------------------------
    def _await_announced(self) -> None:
        """Wait (up to the comm timeout) for the groups whose restart the launcher announced to knock and be let in."""
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline and any(self._knocks_expected(g) for g in self.peers):
            time.sleep(ADMIT_POLL_S)

    def _knocks_expected(self, group: int) -> bool:
        """Whether a restarted process of `group` that this process has not let in yet will knock here."""
        newest = self.door.incarnation(group)
        return (newest > self.linked[group] and self.door.given_up(group) < newest
                and self._knocks_at(self.group, self.incarnation, group) and self.door.state(group, group) != "finished")

    def _knocks_at(self, group: int, incarnation: int, knocker: int) -> bool:
        """Whether a restarted process of `knocker` knocks at `group`'s process (at incarnation `incarnation` of it):
        at those that started with the job, and at restarted ones of a lower group number (one channel per pair)."""
        return incarnation == 0 or group < knocker

    def _admit(self) -> None:
        """Let in each restarted group's process that knocks (a thread of its own, until this group finished)."""
        while not self._closing:
            for group in self.peers:
                try:
                    incarnation = self.door.incarnation(group)
                    nonce = None
                    if incarnation > self.linked[group] and self.door.given_up(group) < incarnation:
                        nonce = self.door.hello(self.group, group, incarnation)
                except RuntimeError:  # the job's store is gone: the job is ending
                    return
                if nonce is None or self._closing:
                    continue
                try:
                    self._let_in(group, incarnation, nonce)
                except RuntimeError as err:  # it died again half-way: its next restart knocks anew
                    self.linked[group] = incarnation
                    warn(f"WARNING: worker group {self.group} could not let worker group {group} in: {comm.describe_error(err)}")
            time.sleep(ADMIT_POLL_S)

    def _let_in(self, group: int, incarnation: int, nonce: str) -> None:
        """Open the channel the knock of `group`'s incarnation `incarnation` asked for; send it the live values of
        this group's slices, this group's copy of its slices as of their last sync and that sync's step and time;
        then sync with it again both ways."""
        rank = self.peers[group]
        channel = let_in(self.door, self.door.accept(self.group, group, incarnation, nonce))
        if channel is None:
            self.log(f"server group {self.group} refused a process knocking as worker group {group}: it could not prove it "
                     "holds the job's secret")
            self.linked[group] = incarnation
            return
        asked = self.asked[rank][1]
        with self.lock:
            live = gather(self.store, self.served[0])
            theirs = self.last_sync[rank].clone() if asked else torch.zeros(0, device="cpu")
        synced_at = int(self.synced_at.get(rank, 0.0) * 1000)
        channel.send(torch.tensor([self.peer_steps.get(group, self.began_at), synced_at], dtype=torch.int64, device="cpu"), TAG_JOIN_INFO)
        if self.served[1]:
            channel.send(live, TAG_JOIN_LIVE)
        if asked:
            channel.send(theirs, TAG_JOIN_YOURS)
        heartbeat.revive(rank)  # the launcher said its predecessor was done: watch the new process
        with self.lock:
            self.links[rank] = channel
            if self.codecs is not None:
                self.known[group] = live.clone()  # what it holds of this group's slices now
            if asked:
                self.requests[rank] = self.asked[rank]
        self._answer(group, rank)
        self.linked[group] = incarnation  # (last: finish waits for this, then for the thread that answers it)
        self.log(f"worker group {self.group} syncs with worker group {group} again (its restart {incarnation})")

    def rejoin(self, incarnation: int) -> tuple[int, str]:
        """This process was restarted in its group's dead one's place: knock at every live group, take the live values
        of the slices each masters and this group's own slices from the latest of their syncs with it; returns the
        step of that sync (the group goes on from there) and what it took, in words."""
        self.incarnation = incarnation
        steps, latest, own, linked = [0], -1, None, []
        for group, rank in self.peers.items():
            theirs = self.door.incarnation(group)
            if (self.door.state(group, group) != f"serving {theirs}" or self.door.given_up(group) >= theirs
                    or not self._knocks_at(group, theirs, self.group)):
                continue  # not running, finished, or it knocks here itself (then it is let in by _admit)
            try:
                channel = self.door.knock(group, self.group, incarnation, self.timeout_s)
                if channel is None:  # it finished meanwhile
                    continue
                info = torch.zeros(2, dtype=torch.int64, device="cpu")
                live = torch.zeros(self.asked[rank][1], device="cpu")
                mine = torch.zeros(self.served[1], device="cpu")
                channel.recv(info, TAG_JOIN_INFO)
                if live.numel():
                    channel.recv(live, TAG_JOIN_LIVE)
                if mine.numel():
                    channel.recv(mine, TAG_JOIN_YOURS)
            except RuntimeError as err:
                warn(f"WARNING: worker group {self.group} could not reach worker group {group} to rejoin: {comm.describe_error(err)}; "
                     "it does not sync with it")
                continue
            self._count(wire_bytes([info, live, mine]))  # what rejoining took from this group
            with self.lock:
                scatter(self.store, live, self.asked[rank][0])
                self.links[rank] = channel
                if self.codecs is not None:
                    self.known[group] = mine.clone()  # what that group holds of this group's slices
            self.last_sync[rank] = live
            self.linked[group] = theirs
            linked.append(group)
            steps.append(int(info[0]))
            if int(info[1]) > latest:
                latest, own = int(info[1]), (group, mine)
        self.requests = {rank: self.asked[rank] for rank in self.links if self.asked[rank][1]}
        if own is not None and self.served[1]:
            with self.lock:
                scatter(self.store, own[1], self.served[0])
        step = max(steps)
        self.updates = self.server.updates = step  # the sync cadence and the LR schedule's step go on from there
        self.steps_done = step
        self._start()
        if not linked:
            return step, "no live group answered: it trains on alone from its start values"
        masters = " and ".join(", ".join(map(str, linked)).rsplit(", ", 1))
        took = (f"the live values of the slices worker group{'s' if len(linked) > 1 else ''} {masters} "
                f"master{'' if len(linked) > 1 else 's'}")
        if own is not None and self.served[1]:
            took += f", and its own slices as worker group {own[0]} last synced them (its updates since that sync were lost)"
        return step, took

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

    def own_state(self) -> dict[str, torch.Tensor]:
        """What the chief's file does not hold of this group: another group's replica and updater state; every
        group's values at its last syncs, what each requester holds of its slices (compressed), its residuals
        and update counts (the sync cadence and the step an LR schedule sees)."""
        with self.lock:
            tensors = {f"last_sync/{r}": v for r, v in self.last_sync.items()}
            tensors |= {"count/updates": torch.tensor(self.updates, device="cpu"), "count/server_updates": torch.tensor(self.server.updates, device="cpu"),
                        "count/bytes_sent": torch.tensor(self.own_bytes, device="cpu")}
            if self.codecs is not None:
                tensors |= {f"known/{g}": v.clone() for g, v in self.known.items()}
                tensors |= codecs_state("delta", self.delta_codecs)
            if not self.chief:
                tensors |= {f"value/{n}": v.clone() for n, v in self.store.values.items()}
                for name, slots in self.server.state_dict().items():
                    tensors |= {f"state/{name}/{slot}": v.clone() for slot, v in slots.items()}
        return tensors

    def load_own_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.last_sync = {r: tensors[f"last_sync/{r}"].clone() for r in self.requests if f"last_sync/{r}" in tensors}
        if self.codecs is not None:
            self.known = {g: tensors[f"known/{g}"].clone() for g in self.peers if f"known/{g}" in tensors}
        self.updates = int(tensors.get("count/updates", 0))
        self.server.updates = int(tensors.get("count/server_updates", 0))
        self.own_bytes = int(tensors.get("count/bytes_sent", 0))  # a resumed run counts on
        if self.codecs is not None:
            load_codecs_state("delta", self.delta_codecs, tensors)
        values, state = ckpt_io.values_and_state(tensors)
        if values:
            self.store.load(values, strict=True)
            self.server.load_state(state)
