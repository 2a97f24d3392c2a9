"""SlicedExchange: one synchronous worker group over processes (AllReduce, Sandblaster), on collectives.

The group spans processes and params are sliced over servers (SINGA's lcm slicing decides which
rank owns which elements); the slices travel in buckets (shoal.planning.buckets), each owned by
one rank. Gradients travel while backward still runs: a hook on each param leaf hands its
gradient over as soon as autograd has accumulated it; once every worker of this process has
(threads sum in memory first), the buckets holding that param are complete, and the next ones
in bucket order are launched: an asynchronous gather of the bucket's gradients at its owner over
the owner's process group (the worker processes and the owner, named by the plan:
shoal.planning.process_groups), which sums them in rank order. A gather, not gloo's `reduce`: each
member's gradients go straight to the owner in one message, the direct bytes, where gloo's ring
`reduce` sends 1.25x them in two rounds (benchmarks/gloo_primitives.py). Buckets launch in index
order on every rank, so the collectives match by order (NCCL has no tags). Each owner's last bucket
also carries one float per param of that owner, 1 where the sender had a gradient for it: a slice
no process has one for is not updated (SINGA's servers update on received gradients only; momentum
and weight decay would otherwise move a param nothing trains); riding in the last bucket (every
param of the owner is complete when it leaves) it costs no collective of its own. Each owner then
applies the updater to its slices (updater state lives with the slice: ZeRO-1's owner-sharded
update) and broadcasts the new values over the bucket's group. With an element-wise torch optimizer
(every shoal.fit AdamW), a bucket's slices are laid out by param group (their run class: the group,
lr and wd scales), and the owner keeps a master copy of each bucket of several slices in that layout:
each run of one class is one flat shard of it, so the optimizer makes one call per run instead of one
per slice (as DDP's flat buckets and ZeRO's flat shards), and the master copy is what the owner
broadcasts (no copy into a message), copied into the params while it travels. A run where only some
params had a gradient is split into one shard per slice for good (their per-param slots, Adam's
step, part ways), as is one whose params' checkpointed per-param slots differ. Over all buckets this is
reduce-scatter + slice update + all-gather with buckets of unequal owners: the AllReduce framework
when servers share the workers' processes, Sandblaster when they have processes of their own
(those send nothing and receive no values). Tensors stay on the store's device: CUDA ones ride
NCCL where the plan allows it, else stage through the host (shoal.comm.collectives).

Compressed (cluster.compression) it is a compressed reduce-scatter + all-gather of the gradient,
as torch DDP's fp16/bf16/PowerSGD hooks and SINGA 4's DistOpt compress the gradient rather than the
params: each process's encoded gradient of a bucket is gathered at its owner (top-k: with its
residual, error feedback), the owner sums what it decodes, encodes the sum (top-k: with a residual
of its own, the server-side error feedback of DoubleSqueeze and 1-bit Adam) and broadcasts that,
not the values, with whether anyone had a gradient; every process, the owner too, applies the
decoded sum with the updater, so every process holds an updater state for every param it trains
and all replicas stay equal. Values cannot be compressed this way: a rounded or sparse value is a
different model.
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

import torch

from shoal.neuralnet.algorithms import Grads
from shoal.planning.placement import ParamSlice, Placement
from shoal.comm import dist as comm
from shoal.report.metrics import MetricWindow
from shoal.neuralnet.params import ParamStore
from shoal.planning.buckets import Bucket, plan_buckets
from shoal.neuralnet.updaters import ParamUpdate, Updater
from shoal.runtime.exchanges.clipping import max_norm_of, scale_for, sum_of_squares
from shoal.runtime.exchanges.compression import Codec, codecs_state, load_codecs_state, wire_bytes


from shoal.comm import collectives
from shoal.planning.process_groups import JOB_GROUP, sliced_group_name


@dataclass
class _Round:
    """One training step's exchange, from `begin` to the end of `step`."""

    step: int
    arrived: set[tuple[int, str]] = field(default_factory=set)  # (local worker, param) handed over
    count: dict[str, int] = field(default_factory=dict)  # local workers that handed a param over
    grad: dict[str, torch.Tensor] = field(default_factory=dict)  # this process's weighted sum, flat (zeros if none)
    weight: dict[str, float] = field(default_factory=dict)  # a lone gradient's weight, applied as it is copied out
    has_grad: set[str] = field(default_factory=set)  # params some local worker had a gradient for
    pending: dict[int, int] = field(default_factory=dict)  # bucket -> params not complete yet
    complete: set[int] = field(default_factory=set)  # buckets whose local part is complete, not launched yet
    launched: int = 0  # buckets launched so far: always a prefix, in index order (what matches the collectives)
    reducing: dict[int, collectives.Handle] = field(default_factory=dict)  # bucket -> its gradients' gather at the owner
    keep: list = field(default_factory=list)  # encoded tensors being sent (alive until their collectives end)


@dataclass
class _Run:
    """Consecutive slices of an owned bucket's layout that one optimizer call updates as one flat shard: a view of
    the owner's master copy of the bucket (their params share a param group and scales)."""

    at: int  # where it starts in the bucket's layout
    slices: list[ParamSlice]
    value: torch.Tensor  # the master copy's view
    state: dict[str, torch.Tensor]  # the optimizer's state of the run
    lr_scale: float
    wd_scale: float

    @property
    def numel(self) -> int:
        return self.value.numel()


class SlicedExchange:
    """A worker group spread over processes, its params sliced over the servers' ranks."""
    absent_groups: frozenset[int] = frozenset()  # every group stays in the job (only Local SGD's meetings leave one out)

    def __init__(
        self,
        store: ParamStore,
        updater: Updater,
        placement: Placement,
        rank: int,
        global_batch: int,
        workers: Sequence,
        bucket_cap: int,  # elements: the plan's bucket_elements (cluster.bucket_mb; SHOAL_BUCKET_MB overrides)
        codecs: Optional[Callable[[], Codec]] = None,  # cluster.compression: a fresh codec per (bucket, sender)
        *,
        groups: Mapping[str, collectives.Group],  # the plan's process groups, made (collectives.create): never its own
    ):
        self.store, self.updater, self.rank, self.global_batch = store, updater, rank, global_batch
        self.chief = rank == 0
        self.device = store.device
        self.names = store.trainable_names()
        trainable = set(self.names)
        slices = [s for s in placement.slices if s.param in trainable]
        # every server group holds a full replica; one group here (synchronous), group 0
        owner = {s.index: placement.process_of(placement.server_of_slice(s.index, 0)) for s in slices}
        self.worker_ranks = [p.rank for p in placement.processes if p.workers]
        hosts_workers = rank in self.worker_ranks
        every = plan_buckets(slices, owner, bucket_cap)
        # the buckets this process takes part in: all of them where it has workers, its own on a separate server
        self.buckets = [b for b in every if hosts_workers or b.owner == rank]
        self.owned = [b for b in self.buckets if b.owner == rank]
        self.owners = sorted({b.owner for b in self.buckets})
        self.group_of = {o: groups[sliced_group_name(o)] for o in self.owners}
        self.job = groups[JOB_GROUP]  # every process: the metrics, the clipping norm, the totals, the updater state
        self.buckets_of: dict[str, list[Bucket]] = {name: [] for name in self.names}
        for b in self.buckets:
            for name in b.params:
                self.buckets_of[name].append(b)
        # per owner, the params of its buckets (each once): one flag byte each, whether anyone had a gradient
        self.params_of = {o: list(dict.fromkeys(n for b in self.buckets if b.owner == o for n in b.params)) for o in self.owners}
        self.codecs = codecs
        if codecs is not None:  # compressed: a reduce (max) of a byte per param per owner, broadcast back
            self._flags = {o: torch.zeros(len(names), dtype=torch.uint8, device=self.device) for o, names in self.params_of.items()}
        # dense: each owner's last bucket carries a float per param of that owner, whether the sender had a gradient
        last_of = {b.owner: b for b in self.buckets}
        self.flagged = {b.index: self.params_of[o] for o, b in last_of.items()} if codecs is None else {}
        # where runs apply, each bucket's slices are laid out by run class (one flat optimizer call per run)
        classes = self._run_classes(updater)
        self._layout = {b.index: self._laid_out(b, classes) for b in self.buckets}
        self._runs: dict[int, list[_Run]] = {}  # owned bucket -> its runs (over its master copy)
        self._master: dict[int, torch.Tensor] = {}  # owned bucket of several slices -> a master copy of its values, in
        # its layout (a bucket of one slice is updated in the param itself and travels as a view of it)
        self._synced: dict[tuple[str, int, int], int] = {}  # owned slice -> its param's _version when the master was
        # last equal to it (anything else writing the store, a load, a received value, bumps it: copied in again)
        if classes is not None:
            self.state = {}
            for b in self.owned:
                if len(b.slices) > 1:
                    self._master[b.index] = torch.empty(b.numel, device=self.device)
                self._runs[b.index] = self._made_runs(b, classes)
        else:
            updated = self.buckets if codecs is not None and hosts_workers else self.owned  # compressed: replicated updates
            self.state = {self._key(s): updater.init_shard_state(self._value(s), self._key(s)) for b in updated for s in b.slices}
        self._owned_keys = {self._key(s) for b in self.owned for s in b.slices}
        self.sent_bytes = 0  # what this process sent since the last display (gradients, flags, sums or values)
        self._shown_bytes = 0  # ... in the windows displayed before (and the earlier run's, resumed)
        self.job_bytes_sent: Optional[int] = None  # every process's, summed by finish (summary.json's bytes_sent)
        if codecs is not None:
            self._send_codec = {b.index: codecs() for b in self.buckets if b.owner != rank}
            self._sum_codec = {b.index: codecs() for b in self.owned}
            # the owner gathers every member's encoding (its own slot is a placeholder it sends itself)
            # per encoded tensor, one buffer per member
            self._gathered = {b.index: [list(per_member) for per_member in zip(*(codecs().buffers(b.numel, self.device)
                                                                                  for _ in self.group_of[b.owner].ranks))]
                              for b in self.owned}
            self._summed_parts = {b.index: codecs().buffers(b.numel, self.device) for b in self.buckets if b.owner != rank}
        # one flat buffer per multi-slice (or flag-carrying) bucket each way; a bucket of one slice travels as a view
        self._outgoing = {b.index: torch.empty(self._message_numel(b), device=self.device) for b in self.buckets
                          if self._copied(b)}
        self._arriving = {b.index: torch.empty(b.numel, device=self.device) for b in self.buckets
                          if len(b.slices) > 1 and b.owner != rank and codecs is None}
        self._own: dict[int, torch.Tensor] = {}  # owned bucket -> this process's own message of this step
        if codecs is None:  # the owner's gather: a buffer per other member (its own part is its message), summed;
            # its own slot is a buffer only where gloo's list gather (not 2 members) copies into it
            self._parts = {b.index: [torch.empty(self._message_numel(b) if m != rank or len(self.group_of[rank].ranks) != 2 else 0,
                                                 dtype=self._dtype(b), device=self.device)
                                     for m in self.group_of[rank].ranks] for b in self.owned}
        if not workers:  # a separate server adds nothing to the sums: zeros it sends as its own part
            self._zeros = {b.index: torch.zeros(self._message_numel(b), dtype=self._dtype(b), device=self.device)
                           for b in self.owned}
        # clipping by the global norm: the owners' sums of squares, summed over the whole job's group in one scalar all-reduce
        self.max_norm = max_norm_of(updater)
        self.shares = [w.share for w in workers]
        # per local worker: whether its gradients leave during backward (kBP) or after compute
        self.streaming = [w.stream_gradients(self._hook(i)) for i, w in enumerate(workers)]
        self._lock = threading.Lock()
        self._round: Optional[_Round] = None

    def _run_classes(self, updater: Updater) -> Optional[dict[str, tuple]]:
        """Each trained param's run class (its updater's class, lr and wd scales) where the updater can update runs
        of slices as one flat shard (a torch optimizer that is element-wise) and the exchange is dense; else None."""
        if self.codecs is not None:
            return None
        classes = {}
        for name in self.names:
            kind = updater.run_class(name)
            if kind is None:
                return None
            info = self.store.info[name]
            classes[name] = (kind, info.lr_scale, info.wd_scale)
        return classes

    def _laid_out(self, b: Bucket, classes: Optional[dict[str, tuple]]) -> list[tuple[ParamSlice, int]]:
        """Bucket b's slices with their offsets in its flat message: in bucket order, or, with run classes, grouped by
        class (stable; the classes ranked by first param), so each class is one contiguous run. Every rank lays a
        bucket out alike: the same updater, the same params."""
        if classes is None:
            return list(zip(b.slices, b.offsets))
        rank = {kind: i for i, kind in enumerate(dict.fromkeys(classes[n] for n in self.names))}
        out, at = [], 0
        for s in sorted(b.slices, key=lambda s: rank[classes[s.param]]):
            out.append((s, at))
            at += s.size
        return out

    def _made_runs(self, b: Bucket, classes: dict[str, tuple]) -> list[_Run]:
        """Owned bucket b's runs: maximal stretches of its layout of one class, each registered with the updater."""
        runs: list[_Run] = []
        for s, at in self._layout[b.index]:
            if runs and classes[runs[-1].slices[-1].param] == classes[s.param]:
                runs[-1].slices.append(s)
            else:
                runs.append(_Run(at, [s], None, None, self.store.info[s.param].lr_scale, self.store.info[s.param].wd_scale))
        master = self._master.get(b.index)
        for run in runs:
            run.value = master[run.at : run.at + sum(s.size for s in run.slices)] if master is not None else self._value(run.slices[0])
            keys = [self._key(s) for s in run.slices]
            run.state, views = self.updater.init_run_state(run.value, keys)
            self.state.update(zip(keys, views))
        return runs

    @staticmethod
    def _key(s: ParamSlice) -> tuple[str, int, int]:
        return (s.param, s.start, s.stop)

    def _value(self, s: ParamSlice) -> torch.Tensor:
        return self.store.values[s.param].view(-1)[s.start : s.stop]

    def _message_numel(self, b: Bucket) -> int:
        """Elements of bucket b's gradient message: its slices, then its flags (an owner's last bucket)."""
        return b.numel + len(self.flagged.get(b.index, ()))

    def _copied(self, b: Bucket) -> bool:
        """Whether bucket b's message is a copy into a buffer (several slices, or flags behind one)."""
        return len(b.slices) > 1 or b.index in self.flagged

    def _dtype(self, b: Bucket) -> torch.dtype:
        """The dtype of bucket b's message: its one param's where it travels as a view, else the buffers'."""
        return torch.get_default_dtype() if self._copied(b) else self.store.values[b.slices[0].param].dtype

    def _peers(self, owner: int) -> int:
        """How many members of an owner's group get its values: every other one (they all have workers)."""
        return len(self.group_of[owner].ranks) - 1

    # -- one step -----------------------------------------------------------
    def begin(self, step: int) -> None:
        """Open the step's round (a process without workers has its part at once: zeros)."""
        if self._round is not None:
            raise RuntimeError(f"step {step} began before step {self._round.step} finished its exchange")
        comm.enter_round()
        r = _Round(step)
        r.pending = {b.index: len(b.params) for b in self.buckets}
        self._round = r
        if not self.shares:
            with self._lock:
                for b in self.buckets:
                    self._complete(r, b)

    def step(self, step: int, parts: list[tuple[Grads, int]]) -> None:
        """Finish the step: hand over what the hooks did not, update the owned slices, receive every new value."""
        r = self._round
        try:
            for i, (grads, _) in enumerate(parts):
                for name in reversed(self.names):  # in backward order, as the buckets are
                    if (i, name) not in r.arrived:
                        self._arrive(i, name, grads.get(name))
            if r.launched != len(self.buckets):
                raise RuntimeError(f"step {step}: {len(self.buckets) - r.launched} buckets never completed")
            if self.codecs is not None:
                self._finish_compressed(r, self._flags_round(r))
            else:
                self._finish(r)
        finally:
            self._round = None

    def _flags_round(self, r: _Round) -> set[str]:
        """Compressed: per owner, the max of every member's byte per param, broadcast back (every process applies
        the sums): the params anyone had a gradient for."""
        handles = {}
        for o in self.owners:
            flags = self._flags[o]
            flags.copy_(torch.tensor([name in r.has_grad for name in self.params_of[o]], dtype=torch.uint8, device=self.device))
            handles[o] = self.group_of[o].reduce_sum(flags, o, op="max")
            if o != self.rank:
                self.sent_bytes += flags.numel()
        for o in self.owners:
            if o == self.rank:
                handles[o].wait()
            handles[o] = self.group_of[o].broadcast(self._flags[o], o)
            if o == self.rank:
                self.sent_bytes += self._flags[o].numel() * self._peers(o)
        anyone_has = set()
        for o in self.owners:
            handles[o].wait()
            anyone_has.update(n for n, flag in zip(self.params_of[o], self._flags[o].tolist()) if flag)
        return anyone_has

    def _summed(self, b: Bucket) -> torch.Tensor:
        """The sum of every member's message of owned bucket b, in rank order (so every run sums alike); a separate
        server's own part (zeros) is left out."""
        mine = self.group_of[self.rank].index(self.rank)
        parts = [self._own[b.index] if m == mine else p for m, p in enumerate(self._parts[b.index])]
        members = [p for m, p in enumerate(parts) if self.shares or m != mine]
        total = members[0]
        for part in members[1:]:
            total.add_(part)
        return total

    def _finish(self, r: _Round) -> None:
        """Owners sum their buckets, update them and broadcast the values; the others receive them, in bucket order."""
        sums, anyone_has = {}, set()
        for b in self.owned:
            r.reducing[b.index].wait()
            sums[b.index] = self._summed(b)
            if b.index in self.flagged:  # how many members had a gradient of each of this owner's params
                counts = sums[b.index][b.numel:].tolist()
                anyone_has.update(n for n, count in zip(self.flagged[b.index], counts) if count > 0)
        updates = {b.index: self._run_updates(b, sums[b.index], anyone_has) if b.index in self._runs
                   else self._updates(r.step, b, sums[b.index], anyone_has) for b in self.owned}
        scale = 1.0
        if self.max_norm is not None:  # every owned gradient first: one scale before any slice updates
            # each owned bucket's sum is one flat tensor (a param nobody had a gradient for is zeros in it): one norm each
            scale = self._clip_scale([sums[b.index][: b.numel] for b in self.owned])
        receiving, staged = [], []
        for b in self.buckets:
            group = self.group_of[b.owner]
            if b.owner == self.rank:
                if scale != 1.0:  # in place on the scratch sums (what the updater would do to a copy of them)
                    sums[b.index][: b.numel].mul_(scale)
                self.updater.update_many(r.step, updates[b.index])
                values = self._master[b.index] if b.index in self._master else self._gather(b, self._value)
                receiving.append(group.broadcast(values, self.rank))
                self.sent_bytes += wire_bytes([values]) * self._peers(b.owner)
                if b.index in self._master:  # while the values travel: the store gets them too
                    self._copy_out(b)
                continue
            r.reducing[b.index].wait()  # the sent gradients' buffers are scratch from here
            if len(b.slices) == 1:
                target = self._value(b.slices[0])  # straight into the param: it is no longer read this step
            else:
                target = self._arriving[b.index]
                staged.append(b)
            receiving.append(group.broadcast(target, b.owner))
        for handle in receiving:
            handle.wait()
        for b in staged:
            flat = self._arriving[b.index]
            for s, at in self._layout[b.index]:
                self._value(s).copy_(flat[at : at + s.size])

    def _run_updates(self, b: Bucket, grad: torch.Tensor, anyone_has: set[str]) -> list[ParamUpdate]:
        """Owned bucket b's run updates from its flat summed gradient, its master copy (if any) first made equal to
        the store. A run whose params nobody had a gradient for stays; a run where only some had one is split for good
        into one shard per slice (a param without a gradient is not updated: its per-param slots fall behind)."""
        if b.index in self._master:
            self._copy_in(b)
        runs = []
        for run in self._runs[b.index]:
            having = [s.param in anyone_has for s in run.slices]
            if all(having) or not any(having) or len(run.slices) == 1:
                runs.append(run)
            else:
                runs += self._split(run)
        self._runs[b.index] = runs
        return [ParamUpdate(run.value, grad[run.at : run.at + run.numel], run.state, run.lr_scale, run.wd_scale)
                for run in runs if run.slices[0].param in anyone_has]

    def _split(self, run: _Run) -> list[_Run]:
        """`run` as one run per slice, each its own optimizer shard (a view of the same master copy)."""
        offsets = list(itertools.accumulate((s.size for s in run.slices[:-1]), initial=0))  # in the run
        parts = [(run.value[o : o + s.size], self.state[self._key(s)], self._key(s)) for s, o in zip(run.slices, offsets)]
        states = self.updater.split_run(run.value, parts)
        out = []
        for s, o, (piece, _, key), state in zip(run.slices, offsets, parts, states):
            self.state[key] = state
            out.append(_Run(run.at + o, [s], piece, state, run.lr_scale, run.wd_scale))
        return out

    def _copy_in(self, b: Bucket) -> None:
        """The master copy of owned bucket b made equal to the store where the store changed since (a load, a
        received slice of a param it shares)."""
        master = self._master[b.index]
        for s, at in self._layout[b.index]:
            version = self.store.values[s.param]._version
            if self._synced.get(self._key(s)) != version:
                master[at : at + s.size].copy_(self._value(s))
                self._synced[self._key(s)] = version

    def _copy_out(self, b: Bucket) -> None:
        master = self._master[b.index]
        for s, at in self._layout[b.index]:
            self._value(s).copy_(master[at : at + s.size])
            self._synced[self._key(s)] = self.store.values[s.param]._version

    def _finish_compressed(self, r: _Round, anyone_has: set[str]) -> None:
        """Owners sum the decoded gradients, encode the sum and broadcast it; every process applies its decoding.

        Clipped (clip_grad_norm), the norm is that of the owners' dense sums before they are encoded (every rank's
        sum of squares of the sums it owns, one scalar all-reduce), and each owner scales its sums before encoding
        them: every process applies the decoding of a clipped sum (top-k's residual keeps what is not sent)."""
        totals = {}
        for b in self.owned:
            r.reducing[b.index].wait()
            total = (self._gather(b, lambda s: r.grad[s.param][s.start : s.stop]).clone() if self.shares
                     else torch.zeros(b.numel, device=self.device))
            for m, member in enumerate(self.group_of[b.owner].ranks):  # in rank order, so every run sums alike
                if member != self.rank:
                    total += self._sum_codec[b.index].decode([part[m] for part in self._gathered[b.index]], b.numel)
            totals[b.index] = total
        if self.max_norm is not None:  # every rank takes part in the scalar all-reduce, owner or not
            scale = self._clip_scale(list(totals.values()))
            for total in totals.values():
                total.mul_(scale)
        receiving, applying = [], []
        for b in self.buckets:
            group = self.group_of[b.owner]
            if b.owner == self.rank:
                codec = self._sum_codec[b.index]
                sent = codec.encode(totals[b.index])
                r.keep += sent
                receiving += [group.broadcast(part, self.rank) for part in sent]
                self.sent_bytes += wire_bytes(sent) * self._peers(b.owner)
                self._apply(r.step, b, codec.decode(sent, b.numel), anyone_has)
                continue
            receiving += [group.broadcast(part, b.owner) for part in self._summed_parts[b.index]]
            applying.append(b)
        for handle in receiving + [r.reducing[b.index] for b in applying]:
            handle.wait()
        for b in applying:
            summed = self._send_codec[b.index].decode(self._summed_parts[b.index], b.numel)
            self._apply(r.step, b, summed, anyone_has)

    def _hook(self, worker: int) -> Callable[[str, Optional[torch.Tensor]], None]:
        return lambda name, grad: self._arrive(worker, name, grad)

    def _arrive(self, worker: int, name: str, grad: Optional[torch.Tensor]) -> None:
        """A local worker's gradient of `name` (None: it has none; counts as zeros if another has one)."""
        r = self._round
        if name not in self.buckets_of or r is None:
            return  # not trained by gradient (running statistics), or outside a step
        with self._lock:
            if (worker, name) in r.arrived:
                raise RuntimeError(f"param {name}: worker {worker} produced its gradient twice in step {r.step}")
            r.arrived.add((worker, name))
            if grad is not None:
                r.has_grad.add(name)
                weight = self.shares[worker] / self.global_batch  # each loss is a mean over its share
                # a worker on another device than the process's store hands its gradient over there
                flat = grad.detach().reshape(-1).to(self.device)
                if name in r.grad:
                    if name in r.weight:
                        r.grad[name].mul_(r.weight.pop(name))
                    r.grad[name].add_(flat, alpha=weight)
                elif self.codecs is None:  # weighted in the pass that copies it into its message (_gather)
                    r.grad[name], r.weight[name] = flat, weight
                else:  # in place: workers make fresh gradients every step
                    r.grad[name] = flat.mul_(weight)
            r.count[name] = r.count.get(name, 0) + 1
            if r.count[name] < len(self.shares):
                return
            if name not in r.grad:
                r.grad[name] = torch.zeros(self.store.info[name].numel, device=self.device)
            for b in self.buckets_of[name]:
                r.pending[b.index] -= 1
                if r.pending[b.index] == 0:
                    self._complete(r, b)

    def _complete(self, r: _Round, b: Bucket) -> None:
        """Bucket b's local part is complete: launch it and every complete one after it, in index order."""
        r.complete.add(b.index)
        while r.launched < len(self.buckets) and self.buckets[r.launched].index in r.complete:
            self._send_gradients(r, self.buckets[r.launched])
            r.launched += 1

    def _send_gradients(self, r: _Round, b: Bucket) -> None:
        """Launch bucket b's gradients to its owner: a gather of every member's message (compressed: of the encodings)."""
        group = self.group_of[b.owner]
        if self.codecs is None:
            if not self.shares:  # a separate server (always the owner here) adds nothing
                message = self._zeros[b.index]
            else:
                message = self._gather(b, lambda s: r.grad[s.param][s.start : s.stop], flags=True, weights=r.weight)
                if b.index in self.flagged:
                    message[b.numel:].copy_(torch.tensor([name in r.has_grad for name in self.flagged[b.index]],
                                                         dtype=message.dtype, device=self.device))
            if b.owner == self.rank:  # its own part stays where it is: the others' arrive beside it
                self._own[b.index] = message
                r.reducing[b.index] = group.gather_others(message, self._parts[b.index], self.rank)
            else:
                r.reducing[b.index] = group.gather_others(message, None, b.owner)
                self.sent_bytes += wire_bytes([message])
            return
        if self.shares:
            payload = self._gather(b, lambda s: r.grad[s.param][s.start : s.stop])
        else:  # a separate server adds nothing to the sum
            payload = torch.zeros(b.numel, device=self.device)
        if b.owner == self.rank:
            gathered = self._gathered[b.index]
            mine = group.index(self.rank)
            handles = [group.gather(part[mine].clone(), part, self.rank) for part in gathered]  # own slot: a placeholder
        else:
            sent = self._send_codec[b.index].encode(payload)
            r.keep += sent
            handles = [group.gather(part, None, b.owner) for part in sent]
            self.sent_bytes += wire_bytes(sent)
        r.reducing[b.index] = _All(handles)

    def _gather(self, b: Bucket, part: Callable[[ParamSlice], torch.Tensor], flags: bool = False,
                weights: Optional[dict[str, float]] = None) -> torch.Tensor:
        """The bucket's flat message: the slice itself when alone, else a copy into its buffer; with `flags`, the whole
        buffer (its flags filled by the caller) where the bucket carries them. A param in `weights` is multiplied by
        its weight on the way (each of its slices is in one bucket: each is weighted once)."""
        weights = weights or {}
        if len(b.slices) == 1 and not (flags and b.index in self.flagged):
            s = b.slices[0]
            return part(s).mul_(weights[s.param]) if s.param in weights else part(s)
        flat = self._outgoing[b.index]
        for s, at in self._layout[b.index]:
            if s.param in weights:
                torch.mul(part(s), weights[s.param], out=flat[at : at + s.size])
            else:
                flat[at : at + s.size].copy_(part(s))
        return flat if flags else flat[: b.numel]

    def _clip_scale(self, grads: list[torch.Tensor]) -> float:
        """min(max_norm / (global norm + eps), 1): every rank's sum of squares of what it owns (zero where nothing),
        summed in one scalar all-reduce, so every owner computes the same scale."""
        total = sum_of_squares(grads, torch.device("cpu"))  # one scalar: over the host's gloo
        comm.all_reduce_sum(total, self.job)
        world = len(self.job.ranks)
        self.sent_bytes += int(8 * 2 * (world - 1) / world)  # a ring all-reduce of one float64
        return float(scale_for(total.sqrt().float(), self.max_norm))

    def _updates(self, step: int, b: Bucket, grad: torch.Tensor, anyone_has: set[str]) -> list[ParamUpdate]:
        """Bucket b's slice updates from its flat summed gradient (a param nobody had a gradient for stays)."""
        return [self._update_of(s, grad[at : at + s.size]) for s, at in self._layout[b.index] if s.param in anyone_has]

    def _apply(self, step: int, b: Bucket, grad: torch.Tensor, anyone_has: set[str]) -> None:
        self.updater.update_many(step, self._updates(step, b, grad, anyone_has))

    def _update_of(self, s: ParamSlice, grad: torch.Tensor) -> ParamUpdate:
        info = self.store.info[s.param]
        return ParamUpdate(self._value(s), grad, self.state[self._key(s)], info.lr_scale, info.wd_scale)

    def metrics(self, window: MetricWindow) -> dict[str, float]:
        """Sample-weighted averages over every worker of the group (rank 0 decides the names)."""
        state = window.state()
        names = sorted(state["sums"]) if self.chief else []
        # host tensors: the metrics are a small host protocol over the whole job's gloo
        encoded = torch.tensor(list(",".join(names).encode()), dtype=torch.uint8, device="cpu")
        length = torch.tensor([len(encoded)], device="cpu")
        comm.broadcast(length, 0, self.job)
        if not self.chief:
            encoded = torch.zeros(int(length), dtype=torch.uint8, device="cpu")
        comm.broadcast(encoded, 0, self.job)
        names = [n for n in bytes(encoded.tolist()).decode().split(",") if n]
        values = torch.tensor([[state["sums"].get(n, 0.0), state["counts"].get(n, 0)] for n in names], dtype=torch.float64, device="cpu").reshape(-1, 2)
        comm.all_reduce_sum(values, self.job)
        averages = {n: float(s / c) for n, (s, c) in zip(names, values.tolist()) if c}
        averages["sent_bytes"], self.sent_bytes = self.sent_bytes, 0  # this process's, as Downpour's pushed_bytes
        self._shown_bytes += averages["sent_bytes"]
        return averages

    def view_updater(self):
        """Servers are spread over processes: every gradient goes through them."""
        return None

    def finish(self) -> None:
        """Every step ended with its values back: nothing outstanding. The processes sum what each sent in the whole
        run, the steps after the last display too (one 8-byte all-reduce: the group is synchronous, every process is here)."""
        total = torch.tensor([float(self._shown_bytes + self.sent_bytes)], dtype=torch.float64, device="cpu")
        comm.all_reduce_sum(total, self.job)
        self.job_bytes_sent = int(total.item())

    def updater_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The whole updater state, assembled on every rank from the servers' slices (collective; in host memory,
        where checkpoints are written)."""
        full = {name: {slot: torch.zeros(shape, device="cpu") for slot, shape in self.updater.state_shapes(name, tuple(self.store.info[name].shape)).items()}
                for name in self.names}
        for key, state in self.state.items():
            if key not in self._owned_keys:  # compressed: every process holds every slice's state; owners count it once
                continue
            name, start, stop = key
            for slot, value in state.items():
                if full[name][slot].numel() == self.store.info[name].numel:
                    full[name][slot].view(-1)[start:stop] = value
                elif start == 0:  # a per-param slot (torch's Adam step): every slice holds it, the first one counts
                    full[name][slot].copy_(value.reshape(full[name][slot].shape))
        for name in self.names:
            for slot in full[name]:
                comm.all_reduce_sum(full[name][slot], self.job)
        return full

    def load_updater_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        for b_index, runs in self._runs.items():  # a run's params share its per-param slots: split where they differ
            self._runs[b_index] = [piece for run in runs
                                   for piece in (self._split(run) if self._slots_differ(run, state) else [run])]
        for (name, start, stop), slots in self.state.items():
            for slot, value in slots.items():
                if name in state and slot in state[name]:
                    whole = state[name][slot].reshape(-1)
                    value.copy_(whole[start:stop] if whole.numel() == self.store.info[name].numel else whole.reshape(value.shape))

    def _slots_differ(self, run: _Run, state: dict[str, dict[str, torch.Tensor]]) -> bool:
        """Whether `state` (a checkpoint's) holds different per-param slots (Adam's step) for params of one run:
        one of them missed updates the others had, so they cannot go on as one shard."""
        if len(run.slices) == 1:
            return False
        for slot, value in run.state.items():
            if value.numel() == run.numel:  # element-wise
                continue
            saved = [state[s.param][slot] for s in run.slices if s.param in state and slot in state[s.param]]
            if any(not torch.equal(saved[0], other) for other in saved[1:]):
                return True
        return False

    def own_state(self) -> dict[str, torch.Tensor]:
        """This process's compression residuals: per bucket it sends, and per bucket whose sum it sends back; the
        bytes it sent so far (a resumed run counts on from them)."""
        count = {"count/bytes_sent": torch.tensor(self._shown_bytes + self.sent_bytes, device="cpu")}
        if self.codecs is None:
            return count
        return count | codecs_state("send", self._send_codec) | codecs_state("sum", self._sum_codec)

    def load_own_state(self, tensors: dict[str, torch.Tensor]) -> None:
        if "count/bytes_sent" in tensors:
            self._shown_bytes, self.sent_bytes = int(tensors["count/bytes_sent"]), 0
        if self.codecs is not None:
            load_codecs_state("send", self._send_codec, tensors)
            load_codecs_state("sum", self._sum_codec, tensors)


class _All:
    """Several launched collectives waited as one (a bucket's encoding is one gather per tensor)."""

    def __init__(self, handles: list):
        self.handles = handles

    def wait(self) -> None:
        for handle in self.handles:
            handle.wait()
