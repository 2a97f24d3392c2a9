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
from typing import Callable, Optional

import torch

from shoal.errors import warn
from shoal.neuralnet import checkpoint as ckpt_io
from shoal.neuralnet.algorithms import Grads
from shoal.planning.placement import Placement, ServerId
from shoal.comm import dist as comm
from shoal.comm import heartbeat
from shoal.report.metrics import MetricWindow
from shoal.neuralnet.params import ParamStore
from shoal.runtime.exchanges.compression import Codec, codecs_state, load_codecs_state, wire_bytes
from shoal.runtime.exchanges.downpour import Segment, server_segments
from shoal.runtime.exchanges.local import aggregate, clipped
from shoal.runtime.exchanges.server import Server

SYNC, STOP, SYNC_ENCODED = 1, 2, 3
TAG_SYNC_HEADER, TAG_SYNC_DELTA, TAG_SYNC_VALUE, TAG_SYNC_DELTA_2, TAG_SYNC_VALUE_2 = 21, 22, 23, 24, 25


def mastered_by(placement: Placement, trainable: set[str], group: int) -> list:
    """The slices whose master copy lives in server group `group`."""
    return [s for s in placement.slices if s.param in trainable and placement.master_group_of_slice(s.index) == group]


class HogwildExchange:
    """One group's local updates plus its syncs with the other groups' replicas (and its master service)."""

    def __init__(self, store: ParamStore, server: Server, placement: Placement, rank: int, group: int,
                 sync_freq: int, ngroups: int, log: Callable[[str], None] = print, codecs: Optional[Callable[..., Codec]] = None):
        """`sync_freq` (cluster.sync_freq), `ngroups` (cluster.nserver_groups: one master group each) and `codecs`
        (cluster.compression) as the strategy reads them from the plan."""
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
        self.updates = 0
        self.syncs = 0
        self._syncs_shown = 0
        # bytes of this group's own syncs since the last display, both ways (its deltas and the answers): what a
        # sync costs, counted where it is made (the answers this group serves follow the others' timing)
        self.sync_bytes = 0
        self.codecs = codecs
        if codecs is not None:
            self.delta_codecs = {master: codecs() for master in self.requests}  # top-k: a residual per master
            self.answer_codecs = {g: codecs(False) for g in self.peers}  # the difference from `known` is the feedback
            self.known: dict[int, torch.Tensor] = {}  # per requesting group: what it holds of this group's slices
        self._threads = [threading.Thread(target=self._serve, args=(g, r), name=f"shoal-sync-group{g}", daemon=True)
                         for g, r in self.peers.items()]
        self._started = False

    def _start(self) -> None:
        """The values every group starts from are set (initial, loaded or resumed): remember them, start serving."""
        if self._started:
            return
        self._started = True
        # a resumed group goes on from what it held when its checkpoint was written (load_own_state)
        self.last_sync = {r: self.last_sync[r] if r in self.last_sync else self._gather(segs) for r, (segs, _) in self.requests.items()}
        if self.codecs is not None:
            start = self._gather(self.served[0])
            self.known = {g: self.known[g] if g in self.known else start.clone() for g in self.peers}
        for t in self._threads:
            t.start()

    def _gather(self, segments: list[Segment]) -> torch.Tensor:
        parts = [self.store.values[s.param].view(-1)[s.start : s.stop] for s in segments]
        return torch.cat(parts) if parts else torch.zeros(0, device="cpu")

    def _scatter(self, flat: torch.Tensor, segments: list[Segment]) -> None:
        for s in segments:
            self.store.values[s.param].view(-1)[s.start : s.stop].copy_(flat[s.offset : s.offset + s.size])

    # -- the group's own steps ----------------------------------------------------------
    def begin(self, step: int) -> None:
        """Nothing to wait for: a group only ever waits for its own replica."""
        self._start()

    def step(self, step: int, parts: list[tuple[Grads, int]]) -> None:
        with self.lock:
            # the group's whole gradient, clipped by its own global norm (as an asynchronous group clips its push)
            self.server.update(self.server.updates, clipped(aggregate(parts, target=self.store.device), self.server),
                               group_step=(self.group, step))
        self.updates += 1
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
                    delta = self._gather(segments) - self.last_sync[master]
                fresh = self._ask(master, delta, size) if self.codecs is None else self._ask_encoded(master, delta, size)
            except RuntimeError as err:
                warn(f"WARNING: worker group {self.group} stops syncing with process {master}: {comm.describe_error(err)}")
                del self.requests[master]
                continue
            if fresh is None:  # the master stalled: dropped (the chief has warned)
                del self.requests[master]
                continue
            with self.lock:
                self._scatter(fresh, segments)
            self.last_sync[master] = fresh
            self.syncs += 1

    def _ask(self, master: int, delta: torch.Tensor, size: int):
        """Send Δ to `master` and wait for its fresh value; None once the master stalls (the exchange is left
        waiting on its own thread: gloo's receives cannot be cancelled)."""
        fresh = torch.zeros(size, device="cpu")

        def exchange() -> None:
            answer = comm.irecv(fresh, master, TAG_SYNC_VALUE)  # posted first: see _serve
            comm.send(torch.tensor([SYNC], dtype=torch.int64, device="cpu"), master, TAG_SYNC_HEADER)
            comm.send(delta, master, TAG_SYNC_DELTA)
            answer.wait()

        self.sync_bytes += 8 + wire_bytes([delta, fresh])
        return fresh if self._exchange(master, exchange) else None

    def _ask_encoded(self, master: int, delta: torch.Tensor, size: int):
        """As _ask, Δ and the answer encoded; the fresh value is what this group held plus the decoded answer."""
        codec, answer = self.delta_codecs[master], self.answer_codecs[self.group_of(master)].buffers(size)
        parts = codec.encode(delta)

        def exchange() -> None:
            answers = [comm.irecv(part, master, tag) for part, tag in zip(answer, (TAG_SYNC_VALUE, TAG_SYNC_VALUE_2))]
            comm.send(torch.tensor([SYNC_ENCODED], dtype=torch.int64, device="cpu"), master, TAG_SYNC_HEADER)
            for part, tag in zip(parts, (TAG_SYNC_DELTA, TAG_SYNC_DELTA_2)):
                comm.send(part, master, tag)
            for receive in answers:
                receive.wait()

        self.sync_bytes += 8 + wire_bytes(parts + answer)
        if not self._exchange(master, exchange):
            return None
        return self.last_sync[master] + codec.decode(answer, size)

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
        while asking.is_alive():
            asking.join(timeout=0.05)
            if asking.is_alive() and heartbeat.is_stalled(master):
                heartbeat.abandon()
                return False
        if failed:
            raise failed[0]
        return True

    # -- this group as master of its slices ---------------------------------------------
    def _serve(self, group: int, rank: int) -> None:
        """Answer `group`'s syncs. The next request's receives are posted before this answer is sent, as the
        requester posts its answer's before it asks: gloo sends a message only once its receiver has said it is
        ready, and that word queues behind whatever data is already on the way in its direction (the other group's
        request). Posted late, each message waited for the link to drain the other way: the two groups' syncs
        alternated instead of crossing, 1.5x the link time of their bytes (benchmarks/shaped_links.py)."""
        segments, size = self.served
        header = torch.zeros(1, dtype=torch.int64, device="cpu")
        codec = self.answer_codecs[group] if self.codecs is not None else None
        received = codec.buffers(size) if codec is not None else [torch.zeros(size, device="cpu")]

        def post() -> list:  # a group that masters nothing is never asked, only told to stop
            return [comm.irecv(header, rank, TAG_SYNC_HEADER)] + [comm.irecv(part, rank, tag) for part, tag in zip(received, (TAG_SYNC_DELTA, TAG_SYNC_DELTA_2)) if size]

        try:
            receives = post()
            while True:
                for receive in receives:
                    receive.wait()
                if int(header[0]) == STOP:  # its Δ is zeros, sent so that no receive is left pending
                    return
                delta = codec.decode(received, size) if codec is not None else received[0]
                if heartbeat.is_stalled(rank):  # it woke after being dropped: its delta is stale, never added
                    self.log(f"server group {self.group} refused a sync of worker group {group}, dropped after it stalled")
                    return
                with self.lock:
                    for s in segments:
                        self.store.values[s.param].view(-1)[s.start : s.stop].add_(delta[s.offset : s.offset + s.size])
                    fresh = self._gather(segments)
                encoded = int(header[0]) == SYNC_ENCODED
                receives = post()  # Δ is added: its buffers take the next request
                if encoded:  # the change since what the requester holds
                    parts = codec.encode(fresh - self.known[group])
                    self.known[group] += codec.decode(parts, size)
                    for part, tag in zip(parts, (TAG_SYNC_VALUE, TAG_SYNC_VALUE_2)):
                        comm.send(part, rank, tag)
                    continue
                comm.send(fresh, rank, TAG_SYNC_VALUE)
        except RuntimeError as err:
            if not heartbeat.is_stalled(rank):  # a stalled group was dropped already (the chief warned)
                warn(f"WARNING: server group {self.group} drops worker group {group} (process {rank}): {comm.describe_error(err)}")

    def finish(self) -> None:
        """Training is over here: tell the masters, then serve the others until they are done too."""
        self._start()  # a group that had no step left to train still serves the others
        for master, (_, size) in self.requests.items():
            zeros = self.delta_codecs[master].buffers(size) if self.codecs is not None else [torch.zeros(size, device="cpu")]
            try:  # the master has this request's Δ receive posted (_serve): it gets zeros
                comm.send(torch.tensor([STOP], dtype=torch.int64, device="cpu"), master, TAG_SYNC_HEADER)
                for part, tag in zip(zeros if size else [], (TAG_SYNC_DELTA, TAG_SYNC_DELTA_2)):
                    comm.send(part, master, tag)
            except RuntimeError:
                pass
        for peer, t in zip(self.peers.values(), self._threads):
            while t.is_alive() and not heartbeat.is_stalled(peer):  # never wait for a dropped group
                t.join(timeout=0.25)
            if t.is_alive():
                heartbeat.abandon()

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
            tensors |= {"count/updates": torch.tensor(self.updates, device="cpu"), "count/server_updates": torch.tensor(self.server.updates, device="cpu")}
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
        if self.codecs is not None:
            load_codecs_state("delta", self.delta_codecs, tensors)
        values, state = ckpt_io.values_and_state(tensors)
        if values:
            self.store.load(values, strict=True)
            self.server.load_state(state)
