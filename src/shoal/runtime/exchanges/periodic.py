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

Checkpoints hold every group's state: the chief's file its values, inner updater state,
the anchor and the outer updater's state; each other group's part its own (`own_state`);
both the residual of the group's codec (cluster.compression). A run resumed mid-round
continues every group's round from its own values, as the uninterrupted run does.
"""
from __future__ import annotations

import hashlib
import threading
from typing import Optional

import torch

from shoal.comm import collectives
from shoal.comm import dist as comm
from shoal.errors import ShoalError
from shoal.neuralnet import checkpoint as ckpt_io
from shoal.neuralnet.algorithms import Grads
from shoal.neuralnet.params import ParamStore
from shoal.neuralnet.updaters import Updater
from shoal.report.metrics import MetricWindow
from shoal.runtime.exchanges.compression import Codec, all_reduce_encoded, codecs_state, load_codecs_state
from shoal.runtime.exchanges.local import aggregate, clipped
from shoal.runtime.exchanges.server import Server
from shoal.runtime.exchanges.sparse_outer import SparseOuterStep

ANCHOR, OUTER = "outer.anchor", "outer."  # checkpoint slots of the outer loop, beside the inner updater's
ERROR_FEEDBACK = "outer.error_feedback"  # SparseLoCo's accumulator, a slot of the outer loop


class GroupsDisagree(ShoalError):
    """Groups in processes of their own do not start from the same anchor (nothing is broadcast: each process builds
    its values itself, so they must agree)."""


class InMemoryMeeting:
    """Groups that are threads of one process meet at a barrier and sum their pseudo-gradients in memory."""

    def __init__(self, groups: int, timeout_s: float):
        self.groups = groups
        self.codec = Codec()  # nothing is encoded in memory: the identity, which keeps no residual to checkpoint
        self._barrier = threading.Barrier(groups, timeout=timeout_s)
        self._lock = threading.Lock()
        self._sum: Optional[torch.Tensor] = None
        self._result: Optional[torch.Tensor] = None

    def sum(self, flat: torch.Tensor) -> torch.Tensor:
        with self._lock:
            self._sum = flat.clone() if self._sum is None else self._sum.add_(flat)
        if self._barrier.wait() == 0:  # one thread takes the sum for everyone
            self._result, self._sum = self._sum, None
        self._barrier.wait()
        return self._result

    def sum_sparse(self, buffer: torch.Tensor, contribution) -> torch.Tensor:
        """SparseLoCo in memory: the groups' contributions (decoded values and senders) summed; nothing crosses a wire."""
        return self.sum(contribution(buffer))

    def check_same(self, anchor: ParamStore, names: list[str]) -> None:
        """Groups in one process start from one set of values: nothing to check."""

    def sent(self, payload_bytes: int) -> int:
        """What a group's meeting counts as sent: nothing crosses a wire in memory, so the payload it hands over."""
        return payload_bytes

    def abandon(self) -> None:
        """A group failed or the job ends early: nobody waits for a meeting any more."""
        self._barrier.abort()


class ProcessMeeting:
    """Groups in processes of their own: one all-reduce over the plan's meeting group, every group's process
    (cluster.compression: of each group's encoded pseudo-gradient, its residual kept by the group's codec).
    The pseudo-gradient stays on the store's device: NCCL moves it where the plan allows, else gloo via the host."""

    groups: int

    def __init__(self, groups: int, codec: Optional[Codec] = None, group: Optional[collectives.Group] = None):
        self.groups = groups
        self.codec = codec or Codec()
        self.group = group
        self.sent_bytes = 0  # what the last meeting sent

    def sum(self, flat: torch.Tensor) -> torch.Tensor:
        total, self.sent_bytes = all_reduce_encoded(self.codec, flat, self.group)
        return total

    def sum_sparse(self, buffer: torch.Tensor, contribution) -> torch.Tensor:
        """SparseLoCo: every group's byte buffer all-gathered, and their contributions (decoded values and senders)
        summed in rank order (the same sum everywhere); this group handed over its buffer."""
        gathered = comm.all_gather(buffer) if self.group is None else self.group.all_gather(buffer)
        total = contribution(gathered[0])
        for received in gathered[1:]:
            total += contribution(received)
        self.sent_bytes = buffer.numel() * buffer.element_size()
        return total

    def sent(self, payload_bytes: int) -> int:
        """What this group's last meeting sent, as the meeting itself counted it (encoded)."""
        return self.sent_bytes

    def check_same(self, anchor: ParamStore, names: list[str]) -> None:
        """Before the first step: every group's anchor is the same, checked by an 8-byte digest per group (one tiny
        all-gather) instead of broadcasting the values, which every process built from the same seed or file."""
        digest = hashlib.sha256()
        for name in names:
            digest.update(anchor.values[name].detach().to("cpu").reshape(-1).view(torch.uint8).numpy().tobytes())
        mine = torch.tensor([int.from_bytes(digest.digest()[:8], "little", signed=True)], dtype=torch.int64,
                            device=anchor.device)
        gathered = comm.all_gather(mine) if self.group is None else self.group.all_gather(mine)
        if any(not torch.equal(g, gathered[0]) for g in gathered):
            raise GroupsDisagree("Local SGD: the groups' processes start from different values (their digests differ): "
                                 "each process must build the same initial values (seed the model, or give checkpoint_path)")

    def abandon(self) -> None:
        """Collectives end with the process group's timeout."""


class PeriodicExchange:
    """One group's side of Local SGD / DiLoCo."""

    def __init__(self, store: ParamStore, inner: Updater, outer: Updater, local_steps: int, meeting, group: int,
                 global_batch: int, warmup_steps: int = 0, sparse_outer_step=None):
        """`sparse_outer_step`: a job_pb2.SparseOuterStepProto (cluster.sparse_outer_step), or None: the outer updater."""
        self.store, self.group, self.meeting = store, group, meeting
        self.chief = group == 0
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
        self._samples = 0
        self._restored = False  # this group's own values came from its checkpoint part

    def begin(self, step: int) -> None:
        """A group never waits between meetings."""

    def step(self, step: int, parts: list[tuple[Grads, int]]) -> None:
        self.inner.update(step, clipped(aggregate(parts, target=self.store.device), self.inner))  # DiLoCo's inner clipping
        self._samples += sum(share for _, share in parts) * self.meeting.groups
        if self.meets_after(step):
            self._meet(step)

    def meets_after(self, step: int) -> bool:
        """Every step of the warm-up, then every local_steps steps."""
        return step < self.warmup_steps or (step + 1 - self.warmup_steps) % self.local_steps == 0

    def meetings_before(self, step: int) -> int:
        return min(step, self.warmup_steps) + max(0, step - self.warmup_steps) // self.local_steps

    def _meet(self, step: int) -> None:
        values, anchor = self.store.values, self.anchor.values
        flat = torch.cat([(anchor[n] - values[n]).reshape(-1) for n in self.names]) if self.names else torch.zeros(0, device=self.store.device)
        warmup = self.meetings < self.warmup_steps
        if self.sparse is not None and not warmup:  # SparseLoCo: the accumulator's sparse step, the groups' mean
            buffer, _ = self.sparse.encode(flat)
            mean = self.sparse.outer_step(self.meeting.sum_sparse(buffer, self.sparse.contribution))
            sent = self.meeting.sent(buffer.numel())
        else:
            mean = self.meeting.sum(flat) / self.meeting.groups
            sent = self.meeting.sent(flat.numel() * flat.element_size())
        self.bytes_sent += sent
        self._window_bytes += sent
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

    def view_updater(self):
        """Every param goes through the group's own inner server."""
        return None

    def metrics(self, window: MetricWindow) -> dict[str, float]:
        """The chief reports the samples of all groups (they train in lockstep), the meetings so far and the bytes
        its group handed to the meetings in the window."""
        values = window.averages()
        if self.chief:
            values |= {"samples": self._samples, "meetings": self.meetings, "sent_bytes": self._window_bytes}
            self._samples = self._window_bytes = 0
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
        (inner, anchor, outer); every group's codec residual; the chief's display counters."""
        tensors = codecs_state("codec", {"meeting": self.meeting.codec})
        if self.chief:
            return tensors | {"count/samples": torch.tensor(self._samples, device="cpu"),
                              "count/window_bytes": torch.tensor(self._window_bytes, device="cpu")}
        tensors |= {f"value/{name}": value for name, value in self.store.values.items()}
        for name, slots in self.updater_state().items():
            tensors |= {f"state/{name}/{slot}": value for slot, value in slots.items()}
        return tensors

    def load_own_state(self, tensors: dict[str, torch.Tensor]) -> None:
        load_codecs_state("codec", {"meeting": self.meeting.codec}, tensors)
        if self.chief:
            self._samples = int(tensors.get("count/samples", 0))
            self._window_bytes = int(tensors.get("count/window_bytes", 0))
            return
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
        """Every group ends at train_steps; the last meeting (if train_steps is a multiple of local_steps) was in step."""

    def abandon(self) -> None:
        self.meeting.abandon()

