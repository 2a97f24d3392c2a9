"""Meetings that go on without a member (Local SGD / DiLoCo): each meeting's quorum, agreed through the job's store,
and gloo groups re-formed over it.

torch.distributed's process groups can neither drop a member nor take a new one, so the members of a meeting
(one process per worker group) sum over a group of the current quorum's processes: the plan's meeting group
first (epoch 0), then, whenever the quorum changes, a gloo group built over the quorum's ranks alone, on the
job's store under a prefix of its own (`shoal/quorum/groups/e<E>/`), as a Downpour channel is. A quorum's
epoch is the chief's count of such changes.

One meeting, attempt K (keys under `shoal/quorum/` in the job's store; every value signed with the job's secret,
shoal.comm.signed_store):

- every member sums over the attempt's group. A member whose sum fails (a peer's connection closed) sets
  `m<M>/a<K>/broken`; one still waiting in its sum gives up on it when that key appears, when the chief has
  decided, or when a member is gone: stalled (the heartbeat's verdict) or ended (the launcher's word, in the
  door of shoal.comm.channels: a newer incarnation of its group announced, or its incarnation given up on).
  A collective given up on stays pending in gloo (heartbeat.abandon: the process ends without gloo's teardown);
- every member but the chief reports `m<M>/a<K>/r<R>` = "ok" or "failed";
- the decider (the chief, rank 0, at first) waits for every member's report, or for the word that the member is
  gone (after timeout_s, a member still silent is left out), and publishes `m<M>/a<K>/outcome`:
    "commit E MEMBERS JOINERS D": every member that reported summed successfully: the meeting counts the attempt's
      members (all contributed), and the next meetings run over MEMBERS (those that reported, with JOINERS, the
      restarted processes admitted now) in epoch E, decided by D;
    "retry E MEMBERS D": some sum failed: the meeting is summed again over the members that reported, in epoch E;
  each member, R:I (rank, incarnation). Every member reads it; one not in MEMBERS was left out and leaves;
- the decider's own death (`replaceable`: AllReduce's and Sandblaster's replicas, Local SGD / DiLoCo's groups of one
  process each, in a user's loop or a job file; issue 38): a member waiting for an
  outcome asks, every DECIDER_EVERY_S, whether the decider is gone (the launcher's word, or stalled); when it is,
  and so is every member ranked below this one, this member decides the attempt in its place. The outcome is
  written first-writer-wins (SignedStore.set_first), so a late word of a stalled decider and its successor's never
  both count; the commit names the new decider, whom every member follows from then on (its donor of joiners'
  state too). After the last meeting every other member waits for the decider's `closed` and takes its place the
  same way when it died first (`await_close`). Not replaceable (Local SGD's groups of several processes): the chief's
  death stops the job;
- a process restarted in a dead one's place (shoal.launcher.rejoin) knocks, `knock/r<R>` = its incarnation, and
  waits for `admit/r<R>/i<I>` = "M STEP E MEMBERS DONOR", which the decider writes with the next commit that admits
  it (the newest incarnation the launcher announced for its group). After the meeting's outer step, every member
  of epoch E builds its group, and the donor (the decider) broadcasts the state the joiner starts from over it;
- `closed`: the chief's meetings are over (a process still knocking has nothing left to join).

A meeting's keys are deleted by the chief KEPT_MEETINGS meetings later (members are at most a meeting apart), so a
job that meets every step keeps a bounded store.

A meeting without a member is the mean over the members that came: which members come to which meeting is
decided by the chief alone, so every member applies the same mean; for a given fault schedule (which process
is gone at which meeting) the result is deterministic.
"""
from __future__ import annotations

import datetime
import queue
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist

from shoal.comm import dist as comm
from shoal.comm import heartbeat
from shoal.errors import ShoalError

KEYS = "shoal/quorum/"  # the protocol's keys, under the job's namespace
GROUPS = "shoal/quorum/groups/"  # each epoch's gloo rendezvous
WAIT_SLICE_S = 0.05  # a member waiting in a collective asks every this often whether to give up on it
POLL_S = 0.02  # the longest pause between two polls of the store for a word of the protocol
DOOR_EVERY_S = 1.0  # how often a member waiting in a collective reads the launcher's word on the others
GRACE_S = 0.01  # members report at once after their sums: only then does the chief ask whether a silent one is gone
# A meeting's keys are removed this many meetings later (the chief deletes them, every member forgets their freshness):
# members are at most one meeting apart, so nobody reads them again, and a job of a million steps (one meeting each
# under the replicated exchange) keeps a bounded store and a bounded memory of what it read.
KEPT_MEETINGS = 64
DECIDER_EVERY_S = 0.2  # how often a member waiting for an outcome asks whether the decider is gone (replaceable only)
DECIDER_AFTER_S = 0.05  # and from how long into its wait

T = TypeVar("T")
_ABANDONED_MAKERS: list[dict] = []  # rendezvous given up on (MeetingGroup.formed): what they make stays referenced


class PeerLost(RuntimeError):
    """A member of a meeting's group died or stalled mid-collective: the attempt failed (control flow, not a user's
    error: the quorum decides what happens next)."""


class LeftOut(RuntimeError):
    """The chief left this process out of a meeting's quorum (it came too late, or was found stalled): it leaves."""


def meetings_over(store) -> bool:
    """Whether the chief closed the meetings (its last step is done), read through `store`, a signed view of the job's
    store (the launcher's): a process restarted now would have nothing left to join."""
    return store.under(KEYS).get("closed") == "1"


def admitted(store, rank: int, incarnation: int) -> bool:
    """Whether the restarted process `rank` (incarnation `incarnation`) was admitted to the meetings, read through
    `store` as `meetings_over` reads it (the launcher's word on whose state a restarted process heals from)."""
    return store.under(KEYS).get(f"admit/r{rank}/i{incarnation}") is not None


class MeetingsOver(ShoalError):  # not a RuntimeError: nothing failed
    """A restarted process knocked after the last meeting: there is nothing left for it to join (the one class: the
    exchanges let it through and runtime/endings.py names it for the launcher; comm cannot import runtime)."""


class ChiefSilent(ShoalError, RuntimeError):
    """The chief did not decide a meeting's outcome in time (it is stalled or gone: the job stops)."""


class MeetingFailed(ShoalError, RuntimeError):
    """A meeting's sum failed attempt after attempt over the members that remained (the job stops)."""


@dataclass(frozen=True)
class Member:
    rank: int
    incarnation: int = 0

    def text(self) -> str:
        return f"{self.rank}:{self.incarnation}"


def _members_text(members: Sequence[Member]) -> str:
    return ",".join(m.text() for m in members) or "-"


def _parse_members(text: str) -> tuple[Member, ...]:
    if text == "-":
        return ()
    return tuple(Member(int(r), int(i)) for r, i in (item.split(":") for item in text.split(",")))


@dataclass(frozen=True)
class Outcome:
    """The chief's word on one attempt of a meeting (see the module's text)."""

    commit: bool
    epoch: int
    members: tuple[Member, ...]
    joiners: tuple[Member, ...] = ()
    decider: int = 0  # who decides from now on

    def text(self) -> str:
        if self.commit:
            return f"commit {self.epoch} {_members_text(self.members)} {_members_text(self.joiners)} {self.decider}"
        return f"retry {self.epoch} {_members_text(self.members)} {self.decider}"

    @staticmethod
    def parse(text: str) -> "Outcome":
        parts = text.split()
        if parts[0] == "commit" and len(parts) == 5:
            return Outcome(True, int(parts[1]), _parse_members(parts[2]), _parse_members(parts[3]), int(parts[4]))
        if parts[0] == "retry" and len(parts) == 4:
            return Outcome(False, int(parts[1]), _parse_members(parts[2]), decider=int(parts[3]))
        raise ValueError(text)

    def ranks(self) -> tuple[int, ...]:
        return tuple(m.rank for m in self.members)


@dataclass(frozen=True)
class Admission:
    """A restarted process's word from the chief: it joins after meeting `meeting` (held after step `step`)."""

    meeting: int
    step: int
    epoch: int
    members: tuple[Member, ...]
    donor: int

    def text(self) -> str:
        return f"{self.meeting} {self.step} {self.epoch} {_members_text(self.members)} {self.donor}"

    @staticmethod
    def parse(text: str) -> "Admission":
        meeting, step, epoch, members, donor = text.split()
        return Admission(int(meeting), int(step), int(epoch), _parse_members(members), int(donor))


class MeetingGroup:
    """One epoch's group: the plan's meeting group (a shoal.comm.collectives.Group: the world or a group of its own),
    or a gloo group over a quorum's ranks. Its collectives wait in slices, asking `give_up` between them."""

    def __init__(self, epoch: int, ranks: Sequence[int], rank: int, planned=None, backend=None):
        self.epoch, self.ranks, self.rank = epoch, tuple(ranks), rank
        self.planned, self.backend = planned, backend  # one of the two

    @classmethod
    def formed(cls, epoch: int, ranks: Sequence[int], rank: int, timeout_s: float,
               give_up: Callable[[], Optional[str]] = lambda: None) -> "MeetingGroup":
        """A new gloo group over `ranks` (sorted), made by each of them: returns once all have made it. gloo's rendezvous
        blocks for the group's whole timeout on a member that never comes (a joiner killed right after its admission),
        so it runs on a thread of its own and is waited for in slices, given up on (PeerLost) once `give_up` says why:
        the donor must not miss its servers' timeout waiting for a dead joiner (Sandblaster's chaos run, 2026-11-29)."""
        ranks = tuple(sorted(ranks))
        store = dist.PrefixStore(f"{GROUPS}e{epoch}", comm.job_store().clone())  # a connection of its own: the rendezvous blocks it
        made: dict = {}

        def make() -> None:  # (gloo's constructor releases the GIL while it waits)
            try:
                made["backend"] = dist.ProcessGroupGloo(store, ranks.index(rank), len(ranks), datetime.timedelta(seconds=timeout_s))
            except RuntimeError as err:
                made["error"] = err

        maker = threading.Thread(target=make, name=f"shoal-quorum-group-e{epoch}", daemon=True)
        maker.start()
        while True:
            maker.join(WAIT_SLICE_S)
            if not maker.is_alive():
                break
            reason = give_up()
            if reason is not None:
                _ABANDONED_MAKERS.append(made)  # (a group made after all stays referenced: its teardown would block)
                raise PeerLost(reason)
        if "error" in made:
            raise PeerLost(comm.describe_error(made["error"]))
        return cls(epoch, ranks, rank, backend=made["backend"])

    @property
    def on_nccl(self) -> bool:
        return self.planned is not None and self.planned.on_nccl

    def _host(self, tensor: torch.Tensor) -> torch.Tensor:
        """Where the collective reads and writes: a copy of its own (a collective given up on may still write into it),
        in host memory unless NCCL carries the group."""
        return tensor.clone() if self.on_nccl or not tensor.is_cuda else tensor.to("cpu")

    def all_reduce_sum(self, tensor: torch.Tensor, give_up: Callable[[], Optional[str]], in_place: bool = False) -> torch.Tensor:
        """The members' sum of `tensor` (a new tensor on `tensor`'s device; with `in_place`, a host tensor the caller
        made for this attempt alone is summed where it lies: no copy, and the caller drops it if the attempt fails)."""
        moved = tensor if in_place and not tensor.is_cuda else self._host(tensor)
        with _lost_in_plain_words():  # a group whose peer is gone may refuse the call itself
            if self.backend is not None:
                work = self.backend.allreduce([moved])
            else:
                work = dist.all_reduce(moved, op=dist.ReduceOp.SUM, group=self.planned.handle, async_op=True)
        _finish(work, give_up, self._abort if self.on_nccl else None)
        return moved.to(tensor.device)

    def all_gather(self, tensor: torch.Tensor, give_up: Callable[[], Optional[str]]) -> list[torch.Tensor]:
        """Every member's `tensor`, in rank order, on `tensor`'s device."""
        moved = self._host(tensor)
        gathered = [torch.empty_like(moved) for _ in self.ranks]
        with _lost_in_plain_words():
            if self.backend is not None:
                work = self.backend.allgather([gathered], [moved])
            else:
                work = dist.all_gather(gathered, moved, group=self.planned.handle, async_op=True)
        _finish(work, give_up, self._abort if self.on_nccl else None)
        return [g.to(tensor.device) for g in gathered]

    def _abort(self) -> None:
        """NCCL's collective given up on: its communicators end now (its watchdog would end this process once the
        collective timed out). Not tried on a machine of several GPUs yet."""
        try:
            (self.planned.handle or dist.group.WORLD).abort()
        except (RuntimeError, AttributeError):
            pass

    def broadcast(self, tensor: torch.Tensor, src: int, give_up: Callable[[], Optional[str]]) -> None:
        """Global rank `src`'s `tensor` (in host memory) into every member's (a re-formed group only: a joiner's state).
        Waited for in slices as the meetings' sums are: a joiner that stops answering (or whose killed process left its
        connections open in a child) holds the donor up only until `give_up` knows it, not for gloo's whole timeout,
        which is also how long the servers the donor pushes to wait for it."""
        options = dist.BroadcastOptions()
        options.rootRank = self.ranks.index(src)
        with _lost_in_plain_words():
            work = self.backend.broadcast([tensor], options)
        _finish(work, give_up)


@contextmanager
def _lost_in_plain_words():
    """A collective that could not even start: its peer is lost, said in shoal's words."""
    try:
        yield
    except RuntimeError as err:
        raise PeerLost(comm.describe_error(err)) from None


def _finish(work, give_up: Callable[[], Optional[str]], abort_nccl: Optional[Callable[[], None]] = None) -> None:
    """Wait for `work`; raise PeerLost when it fails, or when `give_up` says why to stop waiting (the collective then
    stays pending in gloo: heartbeat.abandon; NCCL's communicators are aborted: `abort_nccl`)."""
    nccl = abort_nccl is not None
    while True:
        if nccl:  # a timed wait on NCCL's work ends the communicator: poll instead
            done = work.is_completed()
            if not done:
                time.sleep(0.0005)
        else:
            try:
                work.wait(datetime.timedelta(seconds=WAIT_SLICE_S))
                return
            except RuntimeError as err:
                if work.is_completed():  # it ended, with an error (or just as the slice ran out)
                    try:
                        work.wait()
                        return
                    except RuntimeError:
                        raise PeerLost(comm.describe_error(err)) from None
                done = False
        if done:
            try:
                work.wait()
                return
            except RuntimeError as err:
                raise PeerLost(comm.describe_error(err)) from None
        reason = give_up()
        if reason is not None:
            heartbeat.abandon()
            if nccl:
                abort_nccl()
            raise PeerLost(reason)


@dataclass(frozen=True)
class Met:
    """A meeting's committed sum: what this member's `contribute` returned, and the ranks that contributed."""

    result: object
    came: tuple[int, ...]


class Quorum:
    """One process's side of the job's meetings (see the module's text)."""

    def __init__(self, rank: int, ranks: Sequence[int], group_of: dict[int, int], door, first=None, incarnation: int = 0,
                 timeout_s: float = comm.DEFAULT_TIMEOUT_S, chief: int = 0, admits: bool = False,
                 replaceable: bool = False, form_first: bool = False):
        """`ranks`: every member process of the plan; `group_of`: the worker group of each; `door`: the launcher's
        word on dead and restarted processes (shoal.comm.channels.Door); `first`: the plan's meeting group
        (shoal.comm.collectives.Group; None for a restarted process, which joins by knocking); `admits`: restarted
        processes may knock (the launcher restarts them: cluster.max_restarts); `replaceable`: the chief's death
        makes the lowest living member the decider (see the module's text); `form_first` (no `first`): the members
        make epoch 0's gloo group over `ranks` themselves (a plan whose process groups hold none of them alone:
        Sandblaster's worker processes beside its servers)."""
        self.rank, self.all_ranks, self.group_of, self.door = rank, tuple(ranks), dict(group_of), door
        self.incarnation, self.timeout_s, self.chief_rank, self.admits = incarnation, timeout_s, chief, admits
        self.replaceable = replaceable
        self.decider = chief  # who decides the meetings: the chief, until it is gone (replaceable)
        self.store = comm.signed_job_store().clone().under(KEYS)  # a connection of its own: waits block it
        self.members = tuple(Member(r) for r in self.all_ranks)
        self.epoch = 0
        self.group: Optional[MeetingGroup] = MeetingGroup(0, self.all_ranks, rank, planned=first) if first is not None else None
        if first is None and form_first:
            self.group = MeetingGroup.formed(0, self.all_ranks, rank, timeout_s)
        self._retired: list[MeetingGroup] = []  # groups given up on stay referenced: gloo's teardown would block on them
        self._next: Optional[Outcome] = None  # a commit that changes the quorum: the group is built in `welcome`
        self._admitted: dict[int, int] = {}  # the chief: rank -> the incarnation it admitted
        self._door_read_at = 0.0  # when a member waiting in a collective last read the launcher's word
        self._attempts: dict[int, int] = {}  # meeting -> its attempts, for the last KEPT_MEETINGS meetings
        self._sweeper = _Sweeper(self.store)  # the chief's removal of past meetings' keys
        self._decider_read_at = 0.0  # when a member waiting for an outcome last asked whether the decider is gone

    @property
    def chief(self) -> bool:
        """Whether this process decides the meetings now (the chief, or the member that took its place)."""
        return self.rank == self.decider

    # -- a meeting -----------------------------------------------------------------------------------
    def meet(self, meeting: int, step: int, contribute: Callable[["Attempt"], T], admit: bool = True) -> Met:
        """Sum this member's contribution with the others' (`contribute(attempt)` runs the collectives over
        `attempt`), again over the members that remain when an attempt fails, until the chief commits one. `admit`
        False: no restarted process is admitted at this meeting (a step's second meeting, whose joiners would miss
        the state handed over after its first: Sandblaster's values)."""
        attempt = 0
        while True:
            result, ok = None, False
            if self.group is not None:
                try:
                    result, ok = contribute(Attempt(self, meeting, attempt)), True
                except PeerLost:
                    self._set(f"m{meeting}/a{attempt}/broken", "1")
            if self.chief:
                outcome = self._decide(meeting, attempt, step, ok, admit)
            else:
                self._set(f"m{meeting}/a{attempt}/r{self.rank}", "ok" if ok else "failed")
                outcome = self._outcome(meeting, attempt, step, ok, admit)
            self.decider = outcome.decider
            if self.rank not in outcome.ranks():
                raise LeftOut(f"process {self.rank} was left out of the meeting after step {step}: the other members went on "
                              f"without it")
            if outcome.commit:
                self._clear_old(meeting, attempt + 1)
                came = tuple(m.rank for m in self.members)
                if outcome.epoch != self.epoch or outcome.members != self.members:
                    self._next = outcome
                return Met(result, came)
            self._reform(outcome.epoch, outcome.members)
            attempt += 1
            if attempt > 2 * len(self.all_ranks) + 2:  # each attempt drops a member or re-forms the group: not forever
                raise MeetingFailed(f"the meeting after step {step} failed {attempt} times over the processes that remained")

    def _clear_old(self, meeting: int, attempts: int) -> None:
        """Meeting `meeting` committed after `attempts` attempts: the keys of the meeting KEPT_MEETINGS before it go."""
        self._attempts[meeting] = attempts
        for old in [m for m in self._attempts if m <= meeting - KEPT_MEETINGS]:
            keys = [f"m{old}/a{a}/{name}" for a in range(self._attempts.pop(old))
                    for name in ["broken", "outcome"] + [f"r{r}" for r in self.all_ranks]]
            if self.chief:
                self._sweeper.sweep(keys)
            else:
                self.store.forget(keys)

    def welcome(self, state: Callable[[], list[torch.Tensor]]) -> tuple[int, ...]:
        """After a committed meeting (and its outer step): when the quorum changed, make the next epoch's group, and
        where processes joined, the donor (the chief) broadcasts `state()` to them over it. Returns the ranks of the
        joiners that took it: none where a joiner was lost again before (the group not made, or the handover given up
        on: the next meeting then goes on without it)."""
        outcome, self._next = self._next, None
        if outcome is None:
            return ()
        joiners = tuple(m.rank for m in outcome.joiners)
        for rank in joiners:
            heartbeat.revive(rank)  # the watch takes it up again (the launcher said its predecessor was done)
        self._reform(outcome.epoch, outcome.members)
        if not joiners or self.group is None:
            return ()
        tensors = state()
        try:
            self._broadcast_state(tensors)
        except RuntimeError:  # a joiner died again meanwhile: the next meeting finds it gone
            self._retire()
            return ()
        return joiners

    def share(self, tensor: torch.Tensor, src: int) -> None:
        """Member `src`'s `tensor` (in host memory) into every member's over the group, given up on (PeerLost) once a
        member is lost: the first values of a loop whose members made epoch 0's group themselves (`form_first`)."""
        self.group.broadcast(tensor, src, self._member_lost)

    def _broadcast_state(self, tensors: list[torch.Tensor]) -> None:
        for flat, _ in _packed(tensors):
            self.group.broadcast(flat, self.decider, self._member_lost)  # (the donor its admissions named)

    def close(self) -> None:
        """The chief's meetings are over: a process still knocking has nothing left to join (and the past meetings'
        keys are deleted, within a second)."""
        if self.chief:
            self._set("closed", "1")
            self._sweeper.swept(1.0)

    def await_close(self) -> tuple[int, ...]:
        """A member's end of the meetings (replaceable): wait for the decider's word that they are over (`close`), or
        decide in its place when it is gone first and so is every member ranked below this one (`_decider_gone`): this
        member is then the chief, which closes them, and speaks for the job's end (its final test and checkpoint). A
        chief dead after the last meeting's commit says nothing more: without this wait the others ended without the
        job's final test and checkpoint, and its restarted process knocked for ever. The chief closes right after its
        last meeting, so the wait is a member's lag behind it (Local SGD's: the steps after the last meeting, which a
        slower chief may take longer over: not bounded by a timeout, since a stalled or dead decider is seen as gone).
        Returns the members found gone when it took the decider's place (the decider, and any member ranked below this
        one), else ()."""
        if self.chief or not self.replaceable:
            return ()
        if self._word_or_succession(lambda: "1" if self.store.get("closed") == "1" else None, "end the meetings") is not None:
            return ()
        self.decider = self.rank
        return tuple(m.rank for m in self.members if m.rank < self.rank)

    def swept(self, timeout_s: float = 10.0) -> bool:
        """Whether the chief's deletes of past meetings' keys are done (waiting up to `timeout_s`)."""
        return self._sweeper.swept(timeout_s)

    # -- words beside the meetings: a member tells, the decider hears -------------------------------------
    def tell(self, topic: str, step: int, text: str) -> None:
        """This member's word on `topic` at `step` for the decider (a display window's sums): one signed store write,
        not waited for (no member waits on another for it, so a dead member holds nobody up)."""
        self._set(f"{topic}{step}/r{self.rank}", text)

    def hear(self, topic: str, step: int, ranks: Sequence[int]) -> dict[int, Optional[str]]:
        """The decider: each of `ranks`' word on `topic` at `step` (`tell`), waited for until it is there, or its member
        is gone (stalled, or ended: the launcher's word), or timeout_s passed (None for those); the keys are then
        removed. A member that came to the step tells right after it, so the wait is a member's lag behind this one."""
        keys = {r: f"{topic}{step}/r{r}" for r in ranks if r != self.rank}
        heard: dict[int, Optional[str]] = {}
        started = time.monotonic()
        while True:
            waiting = [r for r in keys if r not in heard]
            if waiting and self.store.check([keys[r] for r in waiting]):  # all there (the usual case): two requests
                heard |= dict(zip(waiting, self.store.multi_get([keys[r] for r in waiting])))
                break
            waited = time.monotonic() - started
            for r in waiting:
                if self.store.check([keys[r]]):
                    heard[r] = self.store.get(keys[r])
                elif waited > GRACE_S and (self._gone(self._member(r)) is not None or waited > self.timeout_s):
                    heard[r] = None
            if len(heard) == len(keys):
                break
            _pause(waited)
        self._sweeper.sweep(list(keys.values()))
        return heard

    # -- a restarted process -------------------------------------------------------------------------
    def join(self, incarnation: int, poll_s: float = 0.5) -> Admission:
        """Knock as incarnation `incarnation` of this rank and wait for the chief's admission (at its next meeting);
        MeetingsOver when the meetings ended first. Then make the admission's group with the members."""
        self.incarnation = incarnation
        self._set(f"knock/r{self.rank}", str(self.incarnation))
        key = f"admit/r{self.rank}/i{self.incarnation}"
        while True:
            text = self._wait_for(key, poll_s)
            if text is not None:
                break
            if self.store.get("closed") == "1":
                raise MeetingsOver(f"process {self.rank} knocked after the groups' last meeting: nothing left to join")
        admission = Admission.parse(text)
        self.members, self.epoch, self.decider = admission.members, admission.epoch, admission.donor
        self.group = MeetingGroup.formed(admission.epoch, [m.rank for m in admission.members], self.rank, self.timeout_s,
                                         self._member_lost)
        return admission

    def receive(self, tensors: list[torch.Tensor], donor: int) -> None:
        """The state the donor broadcasts after admitting this process, into `tensors` (in the donor's order)."""
        for flat, parts in _packed(tensors):
            self.group.broadcast(flat, donor, self._member_lost)
            _unpack(flat, parts)

    # -- the chief's decisions -------------------------------------------------------------------------
    def _decide(self, meeting: int, attempt: int, step: int, ok: bool, admit: bool = True) -> Outcome:
        reports = {self.rank: ok}
        gone: set[int] = set()
        keys = {m.rank: f"m{meeting}/a{attempt}/r{m.rank}" for m in self.members if m.rank != self.rank}
        started = time.monotonic()
        while True:
            waiting = [r for r in keys if r not in reports and r not in gone]
            if waiting and self.store.check([keys[r] for r in waiting]):  # all there (the usual case): two requests
                present = dict(zip(waiting, self.store.multi_get([keys[r] for r in waiting])))
            else:
                present = {r: self.store.get(keys[r]) for r in waiting}  # (None for one not there yet)
            waited = time.monotonic() - started
            for r in waiting:
                text = present.get(r)
                if text in ("ok", "failed"):
                    reports[r] = text == "ok"
                elif waited > GRACE_S and (self._gone(self._member(r)) is not None or waited > self.timeout_s):
                    gone.add(r)  # (after timeout_s a silent member is left out, as a collective would time out)
            if all(r in reports or r in gone for r in keys):
                break
            _pause(waited)
        reported = tuple(m for m in self.members if m.rank in reports)
        if all(reports.values()):
            joiners = self._knocks(meeting, step, reported) if self.admits and admit else ()
            members = tuple(sorted(reported + joiners, key=lambda m: m.rank))
            epoch = self.epoch + 1 if members != self.members else self.epoch
            outcome = Outcome(True, epoch, members, joiners, self.rank)
            for joiner in joiners:
                self._set(f"admit/r{joiner.rank}/i{joiner.incarnation}",
                          Admission(meeting, step, epoch, members, self.rank).text())
        else:
            outcome = Outcome(False, self.epoch + 1, reported, decider=self.rank)
        key = f"m{meeting}/a{attempt}/outcome"
        if not self.replaceable:
            self._set(key, outcome.text())
            return outcome
        first = self.store.set_first(key, outcome.text())  # a successor may have decided it (this one was stalled)
        if first is None:
            raise ChiefSilent(f"the outcome of the meeting after step {step} failed authentication")
        return Outcome.parse(first)

    def _knocks(self, meeting: int, step: int, present: tuple[Member, ...]) -> tuple[Member, ...]:
        """The restarted processes to admit now: absent ranks whose newest announced incarnation knocked."""
        here = {m.rank for m in present}
        joiners = []
        for rank in self.all_ranks:
            if rank in here or not self.store.check([f"knock/r{rank}"]):
                continue
            text = self.store.get(f"knock/r{rank}")
            if text is None or not text.isdigit():
                continue
            incarnation, group = int(text), self.group_of[rank]
            newest = self.door.incarnation(group)
            if incarnation == newest and incarnation > self._admitted.get(rank, 0) and self.door.given_up(group) < incarnation:
                self._admitted[rank] = incarnation
                joiners.append(Member(rank, incarnation))
        return tuple(joiners)

    def _member(self, rank: int) -> Member:
        """The member `rank` of the current quorum (a rank out of it: its first incarnation, for `_gone`)."""
        return next((m for m in self.members if m.rank == rank), Member(rank))

    def _gone(self, member: Member) -> Optional[str]:
        """Why `member` will not come (None: it may): stalled, or its process ended (the launcher's word)."""
        if heartbeat.is_stalled(member.rank):
            return f"process {member.rank} stopped answering"
        group = self.group_of[member.rank]
        try:
            if self.door.incarnation(group) > member.incarnation or self.door.given_up(group) >= member.incarnation:
                return f"process {member.rank} ended"
        except (dist.DistError, RuntimeError):  # the store is gone: the job is ending
            return "the job's store stopped answering"
        return None

    # -- everyone else's side ----------------------------------------------------------------------------
    def _outcome(self, meeting: int, attempt: int, step: int = 0, ok: bool = False, admit: bool = True) -> Outcome:
        """The chief's word on the attempt (it waits up to timeout_s for a silent member, then decides). A store wait
        returns as soon as the word is there, with no poll's delay; it times out only when the chief is gone (then the
        launcher, or the heartbeat, ends this process first). Replaceable: polled, and decided here in the decider's
        place when it is gone and so is every member ranked below this one (`ok`: this member's own sum; `admit`: the
        meeting's, which the decider's successor keeps: a joiner admitted at a meeting whose handover never comes would
        wait for it to its timeout)."""
        key = f"m{meeting}/a{attempt}/outcome"
        seconds = 2 * self.timeout_s + 10
        if self.replaceable:
            return self._outcome_or_takeover(key, seconds, meeting, attempt, step, ok, admit)
        try:
            self.store.wait([key], datetime.timedelta(seconds=seconds))
        except (dist.DistError, RuntimeError):
            raise ChiefSilent(f"process {self.chief_rank} did not decide the meeting's outcome within {seconds:g} s") from None
        text = self.store.multi_get([key])[0]  # there now: one request
        if text is None:  # (a value that failed authentication is waited past: the chief's comes)
            text = self._wait_for(key, seconds)
        if text is None:
            raise ChiefSilent(f"process {self.chief_rank} did not decide the meeting's outcome within {seconds:g} s")
        return Outcome.parse(text)

    def _outcome_or_takeover(self, key: str, seconds: float, meeting: int, attempt: int, step: int, ok: bool,
                             admit: bool = True) -> Outcome:
        """The decider's word on the attempt, or this member's own when it is to decide in a dead decider's place."""
        def word() -> Optional[str]:  # (None: not there yet, or it failed authentication)
            return self.store.multi_get([key])[0] if self.store.check([key]) else None  # (there now: one request)

        text = self._word_or_succession(word, "decide the meeting's outcome", seconds)
        return Outcome.parse(text) if text is not None else self._decide(meeting, attempt, step, ok, admit)

    def _word_or_succession(self, word: Callable[[], Optional[str]], what: str,
                            seconds: Optional[float] = None) -> Optional[str]:
        """The decider's word (`word()`, polled: a store wait cannot also watch for the decider's death), or None once
        this member is to act in its place (`_decider_gone`); ChiefSilent after `seconds` (None: no bound)."""
        started = time.monotonic()
        while True:
            said = word()
            if said is not None:
                return said
            now = time.monotonic()
            waited = now - started
            # (not at once: the decider's word usually comes within a millisecond or two, and asking costs requests)
            if waited >= DECIDER_AFTER_S and now - self._decider_read_at >= DECIDER_EVERY_S:
                self._decider_read_at = now
                if self._decider_gone():
                    return None
            if seconds is not None and waited > seconds:
                raise ChiefSilent(f"process {self.decider} did not {what} within {seconds:g} s")
            _pause(waited)

    def _decider_gone(self) -> bool:
        """Whether this member is to decide in the decider's place: the decider is gone (the launcher's word, or
        stalled), and so is every other member ranked below this one (the lowest living member succeeds it)."""
        decider = next((m for m in self.members if m.rank == self.decider), None)
        if decider is None or self._gone(decider) is None:
            return False
        return all(self._gone(m) is not None for m in self.members if m.rank < self.rank and m.rank != self.decider)

    def _give_up(self, meeting: int, attempt: int) -> Optional[str]:
        """Why a member waiting in the attempt's collective stops waiting (None: it goes on waiting). Asked every
        WAIT_SLICE_S; the launcher's word on each member (two requests a member) at most every DOOR_EVERY_S: a killed
        peer's connections close, so some member's sum fails and says so (`broken`) long before."""
        if self.store.check([f"m{meeting}/a{attempt}/broken"]):
            return "another member's sum failed"
        if self.store.check([f"m{meeting}/a{attempt}/outcome"]):
            return "the chief decided the meeting without this sum"
        return self._member_lost()

    def _member_lost(self) -> Optional[str]:
        """Why a member waiting in any collective of the group stops waiting: another member stopped answering, or the
        launcher said it is gone (read at most every DOOR_EVERY_S); None: it goes on waiting."""
        others = [m for m in self.members if m.rank != self.rank]
        stalled = next((m for m in others if heartbeat.is_stalled(m.rank)), None)
        if stalled is not None:
            return f"process {stalled.rank} stopped answering"
        now = time.monotonic()
        if now - self._door_read_at >= DOOR_EVERY_S:
            self._door_read_at = now
            for member in others:
                reason = self._gone(member)
                if reason is not None:
                    return reason
        return None

    def _reform(self, epoch: int, members: tuple[Member, ...]) -> None:
        """The group of `members` in `epoch` (None, when a member did not make it: the next attempt fails at once)."""
        self._retire()
        self.members, self.epoch = members, epoch
        try:
            self.group = MeetingGroup.formed(epoch, [m.rank for m in members], self.rank, self.timeout_s, self._member_lost)
        except RuntimeError:
            self.group = None

    def _retire(self) -> None:
        if self.group is not None:
            self._retired.append(self.group)
        self.group = None

    # -- the store ---------------------------------------------------------------------------------------
    def _set(self, key: str, text: str) -> None:
        self.store.set(key, text)

    def _wait_for(self, key: str, seconds: float) -> Optional[str]:
        """The authentic value at `key` once it is there (None: none within `seconds`; a value that fails authentication
        is waited past). The store is polled: a store wait that times out logs c10d's own text and leaves its
        connection out of step."""
        started = time.monotonic()
        while True:
            text = self.store.get(key)  # (None while there is none)
            waited = time.monotonic() - started
            if text is not None or waited > seconds:
                return text
            _pause(waited)


def _pause(waited: float) -> None:
    """Between two polls of the store: 0.2 ms at first, up to POLL_S once a wait has lasted a while."""
    time.sleep(min(POLL_S, 0.0002 + waited / 20))


class _Sweeper:
    """The chief's removal of past meetings' keys, on a thread and a store connection of their own: the store deletes
    one key per request, and none of them need hold up a step."""

    def __init__(self, store):
        self._store, self._queue = store, queue.Queue()
        self._thread: Optional[threading.Thread] = None

    def sweep(self, keys: list[str]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="shoal-quorum-sweeper", daemon=True)
            self._thread.start()
        self._queue.put(keys)

    def swept(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the keys handed over so far to be deleted; whether they were."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and self._thread is not None and self._thread.is_alive():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return not self._queue.unfinished_tasks

    def _run(self) -> None:
        try:
            store = self._store.clone()
            while True:
                keys = self._queue.get()
                try:
                    store.delete(keys)
                finally:
                    self._queue.task_done()
        except (dist.DistError, RuntimeError):  # the store is gone: the job is ending
            return


class Attempt:
    """One attempt of a meeting, as its member's `contribute` sees it: the attempt's collectives."""

    def __init__(self, quorum: Quorum, meeting: int, attempt: int):
        self.quorum, self.meeting, self.attempt = quorum, meeting, attempt

    def _give_up(self) -> Optional[str]:
        return self.quorum._give_up(self.meeting, self.attempt)

    def all_reduce_sum(self, tensor: torch.Tensor, in_place: bool = False) -> torch.Tensor:
        return self.quorum.group.all_reduce_sum(tensor, self._give_up, in_place)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return self.quorum.group.all_gather(tensor, self._give_up)


def _packed(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """`tensors` laid end to end, one flat host tensor per dtype (in order of first appearance), with the tensors each holds."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    return [(torch.cat([t.detach().reshape(-1).to("cpu") for t in parts]), parts) for parts in by_dtype.values()]


def _unpack(flat: torch.Tensor, parts: list[torch.Tensor]) -> None:
    offset = 0
    for t in parts:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n
