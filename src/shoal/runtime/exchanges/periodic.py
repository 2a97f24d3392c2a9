"""Local SGD and DiLoCo: groups train on their own copies and meet every `local_steps` steps.

Between meetings a group is a plain synchronous group: its gradients go to its own
inner Server (the job's updater), on its own copy of the params. At a meeting
every group contributes its pseudo-gradient, the change since the last meeting
(anchor − current); their mean goes through the outer updater, applied to the
anchor (the values every group started the round from), and every group goes on
from the new anchor. With plain averaging as the outer updater (SGD, lr 1) the new
anchor is the mean of the groups' values: Local SGD (Stich 2019). With Nesterov
momentum 0.9, lr 0.7 it is DiLoCo (Douillard et al. 2023).

Communication is one sum of the pseudo-gradients per meeting: an all-reduce over
the groups' processes, or a barrier and a sum in memory when the groups are
threads of one process. A group moves its params' bytes once per `local_steps`
steps, where Downpour moves them twice per step.

With `warmup_steps` K (cluster.local_warmup_steps) the groups meet after each of their first K
steps, a plain average (synchronous training: post-local SGD, Lin et al. 2020), and every
`local_steps` steps after that; the outer updater applies from the first local round.

With cluster.sparse_outer_step (SparseLoCo, runtime/exchanges/sparse_outer.py) a meeting after the warm-up sends
each group's sparse, 2-bit outer step instead: an all-gather of a few bytes per chunk, every group decoding and
summing them in rank order; the group's error-feedback accumulator replaces the outer updater's momentum.

A meeting goes on without a group that died or stalled: its sum is the mean over the groups that came (in
memory, a group whose thread failed leaves the meeting; over processes the chief decides each meeting's
quorum, shoal.comm.quorum, and the members sum again over a group re-formed without the missing one). A
process the launcher restarted (cluster.max_restarts) knocks and is admitted at the next meeting: after the
meeting's outer step, the chief's group sends it the new anchor (its values), the outer updater's state and
group 0's inner updater state, and it trains on from that meeting's step; the data position is a function of
the step and the group's shard, so none is sent. Its error feedback (SparseLoCo's accumulator, the codec's
residual) starts at zero: what the dead process still owed the meetings is lost with it.

Checkpoints hold every group's state: the chief's file its values, inner updater state,
the anchor and the outer updater's state; each other group's part its own (`own_state`);
both the residual of the group's codec (cluster.compression). A run resumed mid-round
continues every group's round from its own values, as the uninterrupted run does.
"""
from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from shoal.comm import collectives
from shoal.comm import quorum as quorums
from shoal.comm.channels import MEETING_DOOR
from shoal.errors import ShoalError
from shoal.neuralnet import checkpoint as ckpt_io
from shoal.neuralnet.algorithms import Grads
from shoal.neuralnet.params import ParamStore
from shoal.neuralnet.updaters import Updater
from shoal.report.metrics import MetricWindow
from shoal.runtime.exchanges.compression import CastCodec, Codec, TopKCodec, codecs_state, load_codecs_state, wire_bytes
from shoal.runtime.exchanges.groups import GroupsAborted
from shoal.runtime.exchanges.local import aggregate, clipped
from shoal.runtime.exchanges.server import Server
from shoal.runtime.exchanges.sparse_outer import SparseOuterStep
from shoal.runtime.interfaces import GroupDropped

ANCHOR, OUTER = "outer.anchor", "outer."  # checkpoint slots of the outer loop, beside the inner updater's
ERROR_FEEDBACK = "outer.error_feedback"  # SparseLoCo's accumulator, a slot of the outer loop
DOOR = MEETING_DOOR  # the launcher's word on a meeting's dead and restarted processes (shoal.comm.channels.Door)


class GroupsDisagree(ShoalError):
    """Groups in processes of their own do not start from the same anchor (nothing is broadcast: each process builds
    its values itself, so they must agree)."""


class MeetingTimedOut(ShoalError, RuntimeError):
    """Groups of one process neither came to a meeting nor left it within cluster.comm_timeout_s."""


@dataclass(frozen=True)
class MeetingSum:
    """A meeting's sum of the pseudo-gradients, and the worker groups that came (whose pseudo-gradients it holds)."""

    total: torch.Tensor
    came: tuple[int, ...]


class InMemoryMeeting:
    """Groups that are threads of one process meet in memory: the meeting closes once every group still training has
    brought its pseudo-gradient; a group whose thread failed leaves (`leave`), and the others never wait for it."""

    def __init__(self, groups: int, timeout_s: float):
        self.groups = groups
        self.codec = Codec()  # nothing is encoded in memory: the identity, which keeps no residual to checkpoint
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._present = set(range(groups))  # the groups that still come to meetings
        self._brought: dict[int, torch.Tensor] = {}  # this meeting's pseudo-gradients so far, by group
        self._meeting = -1  # the meeting they are for
        self._closed: dict[int, tuple[MeetingSum, int]] = {}  # meeting -> (its sum, groups yet to take it)
        self._abandoned = False

    def sum(self, flat: torch.Tensor, group: int, meeting: int, step: int = -1) -> MeetingSum:
        with self._cond:
            self._brought[group], self._meeting = flat, meeting
            self._close_if_complete()
            deadline = time.monotonic() + self.timeout_s
            while meeting not in self._closed:
                if self._abandoned:
                    raise GroupsAborted(f"worker group {group} stops: the job is ending")
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = ", ".join(str(g) for g in sorted(self._present - set(self._brought)))
                    raise MeetingTimedOut(f"worker group {group}: worker group(s) {missing} neither came to the meeting after "
                                          f"step {step} nor left it within {self.timeout_s:g} s (cluster.comm_timeout_s)")
                self._cond.wait(min(left, 0.5))
            result, takers = self._closed[meeting]
            if takers > 1:
                self._closed[meeting] = (result, takers - 1)
            else:
                del self._closed[meeting]
            return result

    def _close_if_complete(self) -> None:
        """Every group still training brought its pseudo-gradient: their sum, in group order (the same every run)."""
        if not self._brought or not self._present <= set(self._brought):
            return
        came = tuple(sorted(self._brought))
        total = self._brought[came[0]].clone()
        for g in came[1:]:
            total += self._brought[g]
        self._closed[self._meeting] = (MeetingSum(total, came), len(came))
        self._brought = {}
        self._cond.notify_all()

    def leave(self, group: int) -> None:
        """`group` comes to no more meetings (its thread failed, or it finished): the others never wait for it."""
        with self._cond:
            self._present.discard(group)
            self._close_if_complete()
            self._cond.notify_all()

    def sum_sparse(self, buffer: torch.Tensor, contribution, group: int, meeting: int, step: int = -1) -> MeetingSum:
        """SparseLoCo in memory: the groups' contributions (decoded values and senders) summed; nothing crosses a wire."""
        return self.sum(contribution(buffer), group, meeting, step)

    def welcome(self, state) -> tuple[int, ...]:
        """No group of threads comes back (nothing restarts a thread)."""
        return ()

    def close(self) -> None:
        """Nothing waits for the meetings' end."""

    def await_close(self) -> tuple[int, ...]:
        """Group 0's thread never dies alone: nobody takes its place (no group found gone)."""
        return ()

    def leads(self, group: int) -> bool:
        """Whether `group` speaks for the job (its run log, summary, checkpoint file): group 0, the chief's thread."""
        return group == 0

    def check_same(self, anchor: ParamStore, names: list[str]) -> None:
        """Groups in one process start from one set of values: nothing to check."""

    def sent(self, payload_bytes: int) -> int:
        """What a group's meeting counts as sent: nothing crosses a wire in memory, so the payload it hands over."""
        return payload_bytes

    def abandon(self) -> None:
        """The chief failed or the job ends early: nobody waits for a meeting any more."""
        with self._cond:
            self._abandoned = True
            self._cond.notify_all()


class ProcessMeeting:
    """Groups in processes of their own: one all-reduce of the pseudo-gradients over the meeting's quorum, every group's
    process that came (cluster.compression: of each group's encoded pseudo-gradient, its residual kept by the group's
    codec), the plan's meeting group until a group is missing (shoal.comm.quorum: the chief decides each meeting's
    quorum, and a failed sum is summed again over the members that remain). The pseudo-gradient stays on the store's
    device: NCCL moves it where the plan allows, else gloo via the host (always, once the group is re-formed)."""

    groups: int

    def __init__(self, groups: int, codec: Optional[Codec] = None, quorum: Optional[quorums.Quorum] = None,
                 group_of: Optional[dict[int, int]] = None, first: Optional[collectives.Group] = None):
        """`quorum`: this process's side of the meetings (shoal.comm.quorum); `group_of`: the worker group of each
        member process; `first`: the plan's meeting group (None in a process restarted into the job:
        it knocks)."""
        self.groups = groups
        self.codec = codec or Codec()
        self.quorum, self.group_of, self.first = quorum, dict(group_of or {}), first
        self.joining = quorum is not None and quorum.group is None
        self.sent_bytes = 0  # what the last meeting sent

    def sum(self, flat: torch.Tensor, group: int, meeting: int, step: int = -1) -> MeetingSum:
        sent = self.codec.encode(flat)  # once: an attempt summed again sends the same message (the residual moved once)
        size = flat.numel()
        met = self._meet(meeting, step, lambda attempt: _reduce_encoded(self.codec, sent, size, attempt))
        self.sent_bytes = wire_bytes(sent)
        return met

    def sum_sparse(self, buffer: torch.Tensor, contribution, group: int, meeting: int, step: int = -1) -> MeetingSum:
        """SparseLoCo: every member's byte buffer all-gathered, and their contributions (decoded values and senders)
        summed in rank order (the same sum everywhere); this group handed over its buffer."""
        def contribute(attempt) -> torch.Tensor:
            gathered = attempt.all_gather(buffer)
            total = contribution(gathered[0])
            for received in gathered[1:]:
                total += contribution(received)
            return total

        met = self._meet(meeting, step, contribute)
        self.sent_bytes = buffer.numel() * buffer.element_size()
        return met

    def _meet(self, meeting: int, step: int, contribute) -> MeetingSum:
        try:
            met = self.quorum.meet(meeting, step, contribute)
        except quorums.LeftOut as err:  # it came too late (it was stalled): the others went on without it
            raise GroupDropped(str(err)) from None
        return MeetingSum(met.result, tuple(sorted(self.group_of[r] for r in met.came)))

    def welcome(self, state: Callable[[], list[torch.Tensor]]) -> tuple[int, ...]:
        """After a meeting's outer step: the groups of the processes admitted at it, which got `state()` from the chief."""
        return tuple(sorted(self.group_of[r] for r in self.quorum.welcome(state)))

    def join(self, incarnation: int) -> quorums.Admission:
        """A process restarted into the job: knock, and wait for the chief to admit it at its next meeting."""
        return self.quorum.join(incarnation)  # (MeetingsOver when the meetings ended first)

    def receive(self, tensors: list[torch.Tensor], donor: int) -> None:
        self.quorum.receive(tensors, donor)

    def close(self) -> None:
        """The chief's meetings are over: a process still knocking is told so."""
        self.quorum.close()

    def await_close(self) -> tuple[int, ...]:
        """Another group's end: the chief's word that the meetings are over, or its place taken when it died before
        (Quorum.await_close); the groups of the processes then found gone."""
        return tuple(self.group_of[r] for r in self.quorum.await_close())

    def leads(self, group: int) -> bool:
        """Whether this process's group speaks for the job: the quorum's decider (group 0's process, or in a user's loop
        the member that took its place when it died: shoal.comm.quorum's `replaceable`)."""
        return self.quorum.chief

    def sent(self, payload_bytes: int) -> int:
        """What this group's last meeting sent, as the meeting itself counted it (encoded)."""
        return self.sent_bytes

    def check_same(self, anchor: ParamStore, names: list[str]) -> None:
        """Before the first step: every group's anchor is the same, checked by an 8-byte digest per group (one tiny
        all-gather) instead of broadcasting the values, which every process built from the same seed or file. A
        process restarted into the job takes the anchor from a live group instead."""
        if self.joining:
            return
        mine = torch.tensor([int.from_bytes(_digest(anchor, names)[:8], "little", signed=True)], dtype=torch.int64,
                            device=anchor.device)
        gathered = self.first.all_gather(mine)  # the plan's meeting group (a restarted process has none: returned above)
        if any(not torch.equal(g, gathered[0]) for g in gathered):
            raise GroupsDisagree("Local SGD: the groups' processes start from different values (their digests differ): "
                                 "each process must build the same initial values (seed the model, or give checkpoint_path)")

    def abandon(self) -> None:
        """Collectives end with the process group's timeout."""


def _digest(store: ParamStore, names: list[str]) -> bytes:
    digest = hashlib.sha256()
    for name in names:
        digest.update(store.values[name].detach().to("cpu").reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.digest()


def _reduce_encoded(codec: Codec, sent: list[torch.Tensor], size: int, attempt) -> torch.Tensor:
    """The members' sum of what each sent (`codec.encode` of its pseudo-gradient), over one attempt of a meeting
    (shoal.comm.quorum.Attempt): casts all-reduce in their own precision; top-k all-gathers every member's
    (indices, values) and each adds them up in rank order, so all hold the same sum (SINGA 4 DistOpt's sparse update does
    the same; a ring sums the union of the k's no better)."""
    if isinstance(codec, TopKCodec):
        gathered = [attempt.all_gather(part) for part in sent]
        total = torch.zeros(size, device=sent[1].device)
        for parts in zip(*gathered):
            total += codec.decode(list(parts), size)
        return total
    if isinstance(codec, CastCodec):
        return attempt.all_reduce_sum(sent[0]).float()
    return attempt.all_reduce_sum(sent[0])


class PeriodicExchange:
    """One group's side of Local SGD / DiLoCo."""

    duties_taken_over = "it decides the steps, tests and validates, writes the run log and the checkpoints"

    def __init__(self, store: ParamStore, inner: Updater, outer: Updater, local_steps: int, meeting, group: int,
                 global_batch: int, warmup_steps: int = 0, sparse_outer_step=None,
                 on_step_done: Optional[Callable[[int], None]] = None, annotate: Optional[Callable[[dict], None]] = None):
        """`sparse_outer_step`: a job_pb2.SparseOuterStepProto (cluster.sparse_outer_step), or None: the outer updater;
        `on_step_done(steps)`: told the steps this group has done after each (the in-memory board: who died when);
        `annotate(fields)`: the chief's summary.json (the groups that missed meetings)."""
        self.store, self.group, self.meeting = store, group, meeting
        self.on_step_done, self.annotate = on_step_done, annotate
        self.inner = Server(store, inner)
        self.names = self.inner.names
        self.local_steps = max(1, local_steps)
        self.warmup_steps = max(0, warmup_steps)
        self.anchor = store.copy()
        self.outer = Server(self.anchor, outer, self.names)
        self.sparse = None if sparse_outer_step is None else SparseOuterStep.configured(
            sparse_outer_step, [store.values[n].numel() for n in self.names], store.device)
        self.global_batch = global_batch
        self.meetings = 0
        self.bytes_sent = 0  # payload handed to the meeting: the pseudo-gradients
        self._window_bytes = 0  # ... since the last display
        # the chief's count of every group's payload over the whole run, to its last meeting (summary.json's bytes_sent):
        # each group that came to a meeting handed over as much as this one (one codec, one set of params)
        self.job_bytes_sent = 0
        self._samples = 0
        self._restored = False  # this group's own values came from its checkpoint part
        self.present = tuple(range(meeting.groups))  # the groups that came to the last meeting
        self.attended = dict.fromkeys(self.present, 0)  # meetings of this run each group came to
        self.held = 0  # meetings held in this run
        self.missed: dict[int, list[tuple[int, int]]] = {}  # group -> (meeting of this run, its step) of each it missed
        self.back: dict[int, set[int]] = {}  # group -> the meetings of this run after which it rejoined

    @property
    def chief(self) -> bool:
        """Whether this group speaks for the job now: group 0, or the group that took its dead process's place."""
        return self.meeting.leads(self.group)

    def speak_for_the_job(self, log: Callable[[str], None], annotate: Callable[[dict], None]) -> None:
        """This group took the chief's place (the quorum made its process the decider): summary.json is its to write
        from now on, and says at once what the dead chief's would have (missed_updates)."""
        self.annotate = annotate
        self._annotate()

    def begin(self, step: int) -> None:
        """A group never waits between meetings."""

    def step(self, step: int, parts: list[tuple[Grads, int]]) -> None:
        self.inner.update(step, clipped(aggregate(parts, target=self.store.device), self.inner))  # DiLoCo's inner clipping
        self._samples += sum(share for _, share in parts) * len(self.present)  # the groups training in lockstep
        if self.meets_after(step):
            self._meet(step)
        if self.on_step_done is not None:
            self.on_step_done(step + 1)

    def meets_after(self, step: int) -> bool:
        """Every step of the warm-up, then every local_steps steps."""
        return step < self.warmup_steps or (step + 1 - self.warmup_steps) % self.local_steps == 0

    def meetings_before(self, step: int) -> int:
        return min(step, self.warmup_steps) + max(0, step - self.warmup_steps) // self.local_steps

    def _meet(self, step: int) -> None:
        values, anchor = self.store.values, self.anchor.values
        flat = torch.cat([(anchor[n] - values[n]).reshape(-1) for n in self.names]) if self.names else torch.zeros(0, device=self.store.device)
        warmup = self.meetings < self.warmup_steps
        if self.sparse is not None and not warmup:  # SparseLoCo: the accumulator's sparse step, the mean of those that sent
            buffer, _ = self.sparse.encode(flat)
            met = self.meeting.sum_sparse(buffer, self.sparse.contribution, self.group, self.meetings, step)
            mean = self.sparse.outer_step(met.total)
            sent = self.meeting.sent(buffer.numel())
        else:  # the mean over the groups that came
            met = self.meeting.sum(flat, self.group, self.meetings, step)
            mean = met.total / len(met.came)
            sent = self.meeting.sent(flat.numel() * flat.element_size())
        self.bytes_sent += sent
        self._window_bytes += sent
        self.job_bytes_sent += sent * len(met.came)
        grads, offset = {}, 0
        for name in self.names:
            size = values[name].numel()
            grads[name] = mean[offset : offset + size].view_as(values[name])
            offset += size
        if warmup or self.sparse is not None:  # a warm-up meeting: the groups' mean; SparseLoCo: outer_lr x theirs
            for name in self.names:
                anchor[name].sub_(grads[name])
        else:
            self.outer.update(self.meetings - self.warmup_steps, grads)
        self.meetings += 1
        for name in self.names:
            values[name].copy_(anchor[name])
        self._note_attendance(met.came, step)
        if self.loop_state is None:  # (a user's loop hands over after its loop's body, its schedulers stepped: `heal`)
            self.heal(step)

    def heal(self, step: int) -> tuple[int, ...]:
        """After the meeting after step `step`: the processes restarted into the job and admitted at it take the state
        from the chief's group (`_handover`); returns their groups. A user's loop calls it after the loop's body."""
        joined = self.meeting.welcome(self._handover)
        if joined and self.chief:  # each process admitted took the handover from the chief
            self.job_bytes_sent += len(joined) * wire_bytes(self._handover())
        if joined:
            self._note_joined(joined, step)
        return joined

    # -- who came --------------------------------------------------------------------------------------
    @property
    def absent_groups(self) -> frozenset[int]:
        """The groups missing from the last meeting: a checkpoint does not wait for their parts."""
        return frozenset(range(self.meeting.groups)) - set(self.present)

    def _note_attendance(self, came: tuple[int, ...], step: int) -> None:
        left = [g for g in self.present if g not in came]
        self.present = came
        for g in came:
            self.attended[g] = self.attended.get(g, 0) + 1
        for g in range(self.meeting.groups):
            if g not in came:
                self.missed.setdefault(g, []).append((self.held, step))
        self.held += 1
        if left:
            self._annotate()

    def _note_joined(self, groups: tuple[int, ...], step: int) -> None:
        self.present = tuple(sorted(set(self.present) | set(groups)))
        for g in groups:
            self.back.setdefault(g, set()).add(self.held - 1)
        self._annotate()

    def _absence(self, group: int) -> str:
        """`missing from the meetings after steps 14 to 19, back after the last`: each spell away, as the chief saw it."""
        spells: list[list[int]] = []  # [first step, last step, meetings, last meeting]
        for held, step in self.missed[group]:
            if spells and held == spells[-1][3] + 1:
                spells[-1][1:] = [step, spells[-1][2] + 1, held]
            else:
                spells.append([step, step, 1, held])
        said = []
        for first, last, count, held in spells:
            text = f"missing from the meeting after step {first}" if count == 1 else f"missing from the meetings after steps {first} to {last}"
            if held in self.back.get(group, ()):
                text += ", back after it" if count == 1 else ", back after the last"
            said.append(text)
        return "; ".join(said)

    def _annotate(self) -> None:
        """The chief's word in summary.json (missed_updates): each group that missed meetings, how many it came to."""
        if not self.chief or self.annotate is None or not self.missed:
            return
        self.annotate({"missed_updates": {str(g): {"meetings": self.attended.get(g, 0), "of": self.held, "why": self._absence(g)}
                                          for g in sorted(self.missed)}})

    # -- a process restarted into the job --------------------------------------------------------------
    def _handover(self, loop_state: Optional[Callable[[], list[torch.Tensor]]] = None) -> list[torch.Tensor]:
        """What a process joining at a meeting starts from, in one order on both sides: the anchor (the meeting's new
        values), this group's values of what the meetings do not average (running statistics), the outer updater's
        state and this group's inner updater state; then a user's loop's state (`loop_state`, default the session's)."""
        tensors = [self.anchor.values[n] for n in self.names]
        tensors += [v for n, v in self.store.values.items() if n not in self.names]
        for server in (self.outer, self.inner):
            state = server.state_dict()
            tensors += [state[n][slot] for n in self.names for slot in sorted(state.get(n, {}))]
        loop_state = loop_state or self.loop_state
        return tensors + (loop_state() if loop_state is not None else [])

    # a user's own loop (shoal.session): what its loop holds beyond the exchange (the module's buffers, the optimizers'
    # and schedulers' state, torch's RNG state), handed over after the exchange's own, in one order on both sides
    loop_state: Optional[Callable[[], list[torch.Tensor]]] = None

    def rejoin(self, incarnation: int, loop_state: Optional[Callable[[], list[torch.Tensor]]] = None) -> tuple[int, int, dict]:
        """This group's process was restarted into the job (incarnation `incarnation`): knock, and once the chief admits
        it at a meeting, take what the chief's group hands over (`_handover`; a user's loop: into `loop_state()` too)
        and train on from the step after it; returns (that step, the meeting's number, digests of the anchor before and
        after)."""
        before = _digest(self.anchor, self.names).hex()[:16]
        admission = self.meeting.join(incarnation)
        self.meeting.receive(self._handover(loop_state), admission.donor)
        for name in self.names:
            self.store.values[name].copy_(self.anchor.values[name])
        self.meetings = admission.meeting + 1
        first = admission.step + 1
        if self.meetings != self.meetings_before(first):  # every process counts meetings alike: a bug of ours
            raise RuntimeError(f"meeting {admission.meeting} after step {admission.step} does not fit the plan's meetings")
        donor = self.meeting.group_of[admission.donor]
        took = (f"the anchor and worker group {donor}'s inner updater state (its error feedback starts at zero)" if self.sparse is not None
                else f"the anchor, the outer updater's state and worker group {donor}'s inner updater state")
        digests = {"before": before, "received": _digest(self.anchor, self.names).hex()[:16], "from_group": donor,
                   "took": f"{took}, after the meeting after step {admission.step}"}
        return first, admission.meeting, digests

    def view_updater(self):
        """Every param goes through the group's own inner server."""
        return None

    def metrics(self, window: MetricWindow) -> dict[str, float]:
        """The chief reports the samples of all groups (they train in lockstep), the meetings so far and the bytes
        its group handed to the meetings in the window."""
        values = window.averages()
        if self.chief:
            values |= {"samples": self._samples, "meetings": self.meetings, "sent_bytes": self._window_bytes,
                       "groups_met": len(self.present)}
        self._samples = self._window_bytes = 0  # (every group counts: the one that takes the chief's place shows its own)
        return values

    def updater_state(self) -> dict[str, dict[str, torch.Tensor]]:
        state = {name: dict(slots) for name, slots in self.inner.state_dict().items()}
        for name in self.names:
            state.setdefault(name, {})[ANCHOR] = self.anchor.values[name]
            for slot, value in self.outer.state_dict()[name].items():
                state[name][OUTER + slot] = value
        if self.sparse is not None:  # the accumulator, param by param (views of the flat one)
            for name, part in zip(self.names, self._error_parts()):
                state[name][ERROR_FEEDBACK] = part.clone().view_as(self.store.values[name])  # a tensor of its own: a checkpoint holds no shared storage
        return state

    def _error_parts(self) -> list[torch.Tensor]:
        values = self.store.values
        return list(self.sparse.error.split([values[n].numel() for n in self.names])) if self.names else []

    def load_updater_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        self.inner.load_state({n: {s: v for s, v in slots.items() if not s.startswith(OUTER)} for n, slots in state.items()})
        self.outer.load_state({n: {s[len(OUTER):]: v for s, v in slots.items() if s.startswith(OUTER) and s not in (ANCHOR, ERROR_FEEDBACK)}
                               for n, slots in state.items()})
        if self.sparse is not None:
            for name, part in zip(self.names, self._error_parts()):
                if ERROR_FEEDBACK in state.get(name, {}):
                    part.copy_(state[name][ERROR_FEEDBACK].reshape(-1))
        for name, slots in state.items():
            if ANCHOR in slots and name in self.anchor.values:
                self.anchor.values[name].copy_(slots[ANCHOR])

    def own_state(self) -> dict[str, torch.Tensor]:
        """What the chief's checkpoint file does not hold of this group: another group's values and updater state
        (inner, anchor, outer); every group's codec residual and count of the job's bytes (alike on every group: the
        one that resumes as chief counts on); the chief's display counters."""
        tensors = codecs_state("codec", {"meeting": self.meeting.codec})
        tensors["count/job_bytes_sent"] = torch.tensor(self.job_bytes_sent, device="cpu")
        if self.chief:
            return tensors | {"count/samples": torch.tensor(self._samples, device="cpu"),
                              "count/window_bytes": torch.tensor(self._window_bytes, device="cpu")}
        tensors |= {f"value/{name}": value for name, value in self.store.values.items()}
        for name, slots in self.updater_state().items():
            tensors |= {f"state/{name}/{slot}": value for slot, value in slots.items()}
        return tensors

    def load_own_state(self, tensors: dict[str, torch.Tensor]) -> None:
        load_codecs_state("codec", {"meeting": self.meeting.codec}, tensors)
        # by what the state holds, not by who loads it: after a succession the chief's file was another group's
        self._samples = int(tensors.get("count/samples", 0))
        self._window_bytes = int(tensors.get("count/window_bytes", 0))
        self.job_bytes_sent = int(tensors.get("count/job_bytes_sent", 0))  # a resumed run counts on
        values, state = ckpt_io.values_and_state(tensors)
        if not values:
            return
        self.store.load(values, strict=True)
        self.load_updater_state(state)
        self._restored = True

    def start_from(self, values: ParamStore, resumed: bool, step: int) -> None:
        """Before training: this group's copy is `values` (the chief's: initial, loaded or resumed); a fresh
        round starts from them too, a resumed one from the anchor its checkpoint holds (and the group's own
        values, where its checkpoint part holds them: an older checkpoint has only the chief's)."""
        stores = (self.store, self.anchor) if not resumed else () if self._restored else (self.store,)
        for store in stores:
            if store is not values:
                store.load(values.state_dict())
        self.meetings = self.meetings_before(step)
        self.meeting.check_same(self.anchor, self.names)  # over processes the anchors must agree: nothing is broadcast

    def finish(self) -> None:
        """Every group ends at train_steps; the last meeting (if train_steps is a multiple of local_steps) was in step.
        The chief says the meetings are over (a process still knocking has nothing left to join); every other group
        waits for its word, and takes its place if it died after the last meeting (its trainer or loop then writes the
        final test and checkpoint)."""
        gone = self.meeting.await_close()
        if gone:  # their state died with them: the final checkpoint waits for no part of theirs (`absent_groups`)
            self.present = tuple(g for g in self.present if g not in gone)
        if self.chief:
            self.meeting.close()
            self._annotate()

    def abandon(self) -> None:
        self.meeting.abandon()

