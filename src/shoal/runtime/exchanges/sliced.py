"""SlicedExchange: one synchronous worker group over processes (AllReduce, Sandblaster).

SlicedExchange: the group spans processes and params are sliced over servers
(SINGA's lcm slicing decides which rank owns which elements). Gradients
travel while backward still runs: a hook on each param leaf hands its
gradient over as soon as autograd has accumulated it; once every worker of
this process has (threads sum in memory first), the buckets holding that
param are complete and their gradients go to the owning rank (an isend).
The owner's server thread sums what its peers sent, applies the updater to
its slices (updater state lives with the slice) and sends the new values
back to every worker process. A slice no process has a gradient for is not
updated (SINGA's servers update on received gradients only; momentum and
weight decay would otherwise move a param nothing trains), so with each
bucket's gradients goes one byte per param: whether the sender had one.
Over all buckets this is a direct
reduce-scatter + slice update + all-gather, moving the analytic bytes
and the flags (benchmarks/gloo_primitives.py measured gloo's own reduce_scatter,
reduce and broadcast moving 1.2-1.5x that, and slower): the AllReduce framework when
servers share the workers' processes, Sandblaster when they have processes
of their own (those contribute no gradients and receive no values).

Compressed (cluster.compression) it is a compressed reduce-scatter + all-gather of the gradient,
as torch DDP's fp16/bf16/PowerSGD hooks and SINGA 4's DistOpt compress the gradient rather than the
params: each process sends the owner of a bucket its encoded gradient (top-k: with its residual,
error feedback), the owner sums what it decodes, encodes the sum (top-k: with a residual of its
own, the server-side error feedback of DoubleSqueeze and 1-bit Adam) and sends that back, not the
values; every process, the owner too, applies the decoded sum with the updater, so every process
holds an updater state for every param it trains and all replicas stay equal. Values cannot be
compressed this way: a rounded or sparse value is a different model.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from shoal.neuralnet.algorithms import Grads
from shoal.planning.placement import ParamSlice, Placement
from shoal.comm import dist as comm
from shoal.report.metrics import MetricWindow
from shoal.neuralnet.params import ParamStore
from shoal.planning.buckets import Bucket, cap_from_env, plan_buckets
from shoal.neuralnet.updaters import ParamUpdate, Updater
from shoal.runtime.exchanges.clipping import max_norm_of, scale_for, sum_of_squares
from shoal.runtime.exchanges.compression import Codec, codecs_state, load_codecs_state, wire_bytes


@dataclass
class _Round:
    """One training step's exchange, from `begin` to the end of `step`."""

    step: int
    arrived: set[tuple[int, str]] = field(default_factory=set)  # (local worker, param) handed over
    count: dict[str, int] = field(default_factory=dict)  # local workers that handed a param over
    grad: dict[str, torch.Tensor] = field(default_factory=dict)  # this process's weighted sum, flat (zeros if none)
    has_grad: set[str] = field(default_factory=set)  # params some local worker had a gradient for
    pending: dict[int, int] = field(default_factory=dict)  # bucket -> params not complete yet
    ready: dict[int, threading.Event] = field(default_factory=dict)  # owned bucket -> local part complete
    works: list = field(default_factory=list)  # handles of this round's messages (main side)
    staged: list[Bucket] = field(default_factory=list)  # buckets whose values arrive in a staging buffer
    summed: list[Bucket] = field(default_factory=list)  # compressed: buckets whose encoded sum arrives
    keep: list = field(default_factory=list)  # encoded tensors being sent (alive until their sends end)
    server: Optional[threading.Thread] = None
    error: Optional[BaseException] = None


class SlicedExchange:
    """A worker group spread over processes, its params sliced over the servers' ranks."""

    def __init__(
        self,
        store: ParamStore,
        updater: Updater,
        placement: Placement,
        rank: int,
        global_batch: int,
        workers: Sequence = (),
        bucket_cap: Optional[int] = None,  # elements; None: SHOAL_BUCKET_MB or 4 MB
        codecs: Optional[Callable[[], Codec]] = None,  # cluster.compression: a fresh codec per (bucket, sender)
    ):
        self.store, self.updater, self.rank, self.global_batch = store, updater, rank, global_batch
        self.chief = rank == 0
        self.names = store.trainable_names()
        trainable = set(self.names)
        slices = [s for s in placement.slices if s.param in trainable]
        # every server group holds a full replica; one group here (synchronous), group 0
        owner = {s.index: placement.process_of(placement.server_of_slice(s.index, 0)) for s in slices}
        self.buckets = plan_buckets(slices, owner, bucket_cap or cap_from_env())
        self.owned = [b for b in self.buckets if b.owner == rank]
        self.worker_ranks = [p.rank for p in placement.processes if p.workers]
        # an owner's peers: the other processes with workers (they send gradients, get values)
        self.peers = [r for r in self.worker_ranks if r != rank]
        self.buckets_of: dict[str, list[Bucket]] = {name: [] for name in self.names}
        for b in self.buckets:
            for name in b.params:
                self.buckets_of[name].append(b)
        hosts_workers = rank in self.worker_ranks
        self.codecs = codecs
        updated = self.buckets if codecs is not None and hosts_workers else self.owned  # compressed: replicated updates
        self.state = {self._key(s): updater.init_shard_state(self._value(s), self._key(s)) for b in updated for s in b.slices}
        self._owned_keys = {self._key(s) for b in self.owned for s in b.slices}
        self.sent_bytes = 0  # what this process sent since the last display (gradients, flags, sums or values)
        if codecs is not None:
            self._send_codec = {b.index: codecs() for b in self.buckets if b.owner != rank and hosts_workers}
            self._sum_codec = {b.index: codecs() for b in self.owned}
            self._incoming_parts = {(b.index, p): codecs().buffers(b.numel) for b in self.owned for p in self.peers}
            self._summed_parts = {b.index: codecs().buffers(b.numel) for b in self.buckets if b.owner != rank and hosts_workers}
            self._union = {b.index: torch.empty(len(b.params), dtype=torch.uint8) for b in self.buckets if b.owner == rank or hosts_workers}
        # staging: what peers send to this owner, and multi-slice messages (one flat buffer each way)
        self._incoming = {(b.index, p): torch.empty(b.numel) for b in self.owned for p in self.peers} if codecs is None else {}
        self._outgoing = {b.index: torch.empty(b.numel) for b in self.buckets if len(b.slices) > 1 and (b.owner == rank or hosts_workers)}
        self._arriving = {b.index: torch.empty(b.numel) for b in self.buckets
                          if len(b.slices) > 1 and b.owner != rank and hosts_workers and codecs is None}
        # per bucket, one byte per param: whether the sender had a gradient for it, so that an owner
        # skips a param no process has one for. In a message of its own, because a big slice's
        # gradients travel as a view of the gradient itself: appending a flag would copy up to the
        # bucket cap (4 MB) per message, where this costs len(params) bytes and one small message
        self._flags_in = {(b.index, p): torch.empty(len(b.params), dtype=torch.uint8) for b in self.owned for p in self.peers}
        self._flags_out = {b.index: torch.empty(len(b.params), dtype=torch.uint8) for b in self.buckets if b.owner != rank and hosts_workers}
        # clipping by the global norm: the owners (in rank order) trade their sums of squares
        self.max_norm = max_norm_of(updater)
        self.owner_ranks = sorted({b.owner for b in self.buckets})
        self.shares = [w.share for w in workers]
        # per local worker: whether its gradients leave during backward (kBP) or after compute
        self.streaming = [w.stream_gradients(self._hook(i)) for i, w in enumerate(workers)]
        self._lock = threading.Lock()
        self._round: Optional[_Round] = None

    # message tags of bucket b: its gradients (to the owner), its new values (back), its gradient flags;
    # compressed: an encoding's second tensor each way, and whether anyone had a gradient (back)
    GRADS, VALUES, FLAGS, GRADS_2, SUMS_2, UNION = range(6)
    SUMS = VALUES  # compressed: the encoded sum goes back where the values would

    @staticmethod
    def _tag(b: Bucket, kind: int) -> int:
        return 6 * b.index + kind

    @staticmethod
    def _key(s: ParamSlice) -> tuple[str, int, int]:
        return (s.param, s.start, s.stop)

    def _value(self, s: ParamSlice) -> torch.Tensor:
        return self.store.values[s.param].view(-1)[s.start : s.stop]

    # -- one step -----------------------------------------------------------
    def begin(self, step: int) -> None:
        """Open the step's round: owners start receiving before the workers start computing."""
        if self._round is not None:
            raise RuntimeError(f"step {step} began before step {self._round.step} finished its exchange")
        comm.enter_round()
        r = _Round(step)
        r.pending = {b.index: len(b.params) for b in self.buckets}
        r.ready = {b.index: threading.Event() for b in self.owned}
        if not self.shares:  # no workers here: no local part to wait for
            for event in r.ready.values():
                event.set()
        if self.owned:
            r.server = threading.Thread(target=self._serve, args=(r,), name=f"shoal-server-{self.rank}", daemon=True)
            r.server.start()
        self._round = r

    def step(self, step: int, parts: list[tuple[Grads, int]]) -> None:
        """Finish the step: hand over what the hooks did not, wait for every new value."""
        r = self._round
        for i, (grads, _) in enumerate(parts):
            for name in reversed(self.names):  # in backward order, as the buckets are
                if (i, name) not in r.arrived:
                    self._arrive(i, name, grads.get(name))
        try:
            if r.server is not None:
                r.server.join()
                if r.error is not None:
                    raise r.error
            for work in r.works:
                work.wait()
        finally:
            self._round = None
        for b in r.staged:
            flat = self._arriving[b.index]
            for s, at in zip(b.slices, b.offsets):
                self._value(s).copy_(flat[at : at + s.size])
        for b in r.summed:  # compressed: the owner's encoded sum, applied here as the owner applied it
            summed = self._send_codec[b.index].decode(self._summed_parts[b.index], b.numel)
            self._apply(step, b, summed, {n for n, flag in zip(b.params, self._union[b.index].tolist()) if flag})

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
                # gloo moves host memory: a worker on a GPU hands its gradient to the process's store there
                flat = grad.detach().reshape(-1).to(self.store.device)
                if name in r.grad:
                    r.grad[name].add_(flat, alpha=weight)
                else:  # in place: workers make fresh gradients every step
                    r.grad[name] = flat.mul_(weight)
            r.count[name] = r.count.get(name, 0) + 1
            if r.count[name] < len(self.shares):
                return
            if name not in r.grad:
                r.grad[name] = torch.zeros(self.store.info[name].numel)
            complete = []
            for b in self.buckets_of[name]:
                r.pending[b.index] -= 1
                if r.pending[b.index] == 0:
                    complete.append(b)
            for b in complete:
                self._send_gradients(r, b)

    def _send_gradients(self, r: _Round, b: Bucket) -> None:
        if b.owner == self.rank:
            r.ready[b.index].set()
            return
        payload = self._gather(b, lambda s: r.grad[s.param][s.start : s.stop])
        if self.codecs is None:
            r.works.append(comm.isend(payload, b.owner, tag=self._tag(b, self.GRADS)))
            self.sent_bytes += wire_bytes([payload])
        else:
            parts = self._send_codec[b.index].encode(payload)
            r.keep += parts
            r.works += [comm.isend(part, b.owner, tag=self._tag(b, kind)) for part, kind in zip(parts, (self.GRADS, self.GRADS_2))]
            self.sent_bytes += wire_bytes(parts)
        flags = self._flags_out[b.index]
        for k, name in enumerate(b.params):
            flags[k] = name in r.has_grad
        r.works.append(comm.isend(flags, b.owner, tag=self._tag(b, self.FLAGS)))
        self.sent_bytes += flags.numel()
        if self.codecs is not None:
            parts = self._summed_parts[b.index]
            r.works += [comm.irecv(part, b.owner, tag=self._tag(b, kind)) for part, kind in zip(parts, (self.SUMS, self.SUMS_2))]
            r.works.append(comm.irecv(self._union[b.index], b.owner, tag=self._tag(b, self.UNION)))
            r.summed.append(b)
            return
        if len(b.slices) == 1:
            target = self._value(b.slices[0])  # straight into the param: it is no longer read this step
        else:
            target = self._arriving[b.index]
            r.staged.append(b)
        r.works.append(comm.irecv(target, b.owner, tag=self._tag(b, self.VALUES)))

    def _gather(self, b: Bucket, part: Callable[[ParamSlice], torch.Tensor]) -> torch.Tensor:
        """The bucket's flat message: the slice itself when alone, else a copy into its buffer."""
        if len(b.slices) == 1:
            return part(b.slices[0])
        flat = self._outgoing[b.index]
        for s, at in zip(b.slices, b.offsets):
            flat[at : at + s.size].copy_(part(s))
        return flat

    def _serve(self, r: _Round) -> None:
        """The server of this rank: per owned bucket, sum, update, send the values back."""
        if self.codecs is not None:
            return self._serve_compressed(r)
        try:
            receiving = {
                b.index: [comm.irecv(self._incoming[b.index, p], p, tag=self._tag(b, self.GRADS)) for p in self.peers]
                + [comm.irecv(self._flags_in[b.index, p], p, tag=self._tag(b, self.FLAGS)) for p in self.peers]
                for b in self.owned
            }
            sending, summed = [], []
            for b in self.owned:
                anyone_has = self._arrived(r, b, receiving[b.index])
                updates = []
                for s, at in zip(b.slices, b.offsets):
                    if s.param not in anyone_has:  # as Server.update: no gradient anywhere, no update
                        continue
                    grad = r.grad[s.param][s.start : s.stop] if self.shares else None
                    for p in self.peers:  # in rank order, so every run sums alike
                        part = self._incoming[b.index, p][at : at + s.size]
                        grad = part if grad is None else grad.add_(part)
                    updates.append(self._update_of(s, grad))
                if self.max_norm is not None:  # every owned gradient first: one scale before any slice updates
                    summed.append((b, updates))
                    continue
                self.updater.update_many(r.step, updates)
                sending += self._send_values(b)
            if self.max_norm is not None:
                scale = self._clip_scale(r, [u.grad for _, updates in summed for u in updates])
                for b, updates in summed:
                    self.updater.update_many(r.step, updates, scale)
                    sending += self._send_values(b)
            for work in sending:
                work.wait()
        except BaseException as err:  # handed to the training thread by step()
            r.error = err

    def _send_values(self, b: Bucket) -> list:
        """An owned bucket's new values, to every peer."""
        values = self._gather(b, self._value)
        self.sent_bytes += wire_bytes([values]) * len(self.peers)
        return [comm.isend(values, p, tag=self._tag(b, self.VALUES)) for p in self.peers]

    def _clip_scale(self, r: _Round, grads: list[torch.Tensor]) -> float:
        """min(max_norm / (global norm + eps), 1): this owner's sum of squares, traded with the other owners (one scalar
        each way), summed in rank order so every owner computes the same scale."""
        mine = sum_of_squares(grads)
        others = [o for o in self.owner_ranks if o != self.rank]
        parts = {o: torch.zeros((), dtype=torch.float64) for o in others}
        tag = 6 * len(self.buckets)  # after every bucket's tags
        works = [comm.isend(mine, o, tag=tag) for o in others] + [comm.irecv(parts[o], o, tag=tag) for o in others]
        for work in works:
            work.wait()
        self.sent_bytes += 8 * len(others)
        parts[self.rank] = mine
        total = torch.zeros((), dtype=torch.float64)
        for o in self.owner_ranks:
            total += parts[o]
        return float(scale_for(total.sqrt().float(), self.max_norm))

    def _arrived(self, r: _Round, b: Bucket, receiving: list) -> set[str]:
        """Wait for this process's gradients of owned bucket `b` and for the peers' messages; the params anyone has one for."""
        if not r.ready[b.index].wait(comm.timeout_seconds()):
            raise RuntimeError(f"the workers of process {self.rank} produced no gradients for {comm.timeout_seconds():.0f} s")
        for work in receiving:
            work.wait()
        anyone_has = {name for name in b.params if name in r.has_grad}
        for p in self.peers:
            anyone_has.update(name for name, flag in zip(b.params, self._flags_in[b.index, p].tolist()) if flag)
        return anyone_has

    def _serve_compressed(self, r: _Round) -> None:
        """Per owned bucket: sum the decoded gradients, encode the sum, apply its decoding here, send it back."""
        try:
            receiving = {
                b.index: [comm.irecv(part, p, tag=self._tag(b, kind))
                          for p in self.peers for part, kind in zip(self._incoming_parts[b.index, p], (self.GRADS, self.GRADS_2))]
                + [comm.irecv(self._flags_in[b.index, p], p, tag=self._tag(b, self.FLAGS)) for p in self.peers]
                for b in self.owned
            }
            sending, keep, summed = [], [], []
            for b in self.owned:
                anyone_has = self._arrived(r, b, receiving[b.index])
                codec = self._sum_codec[b.index]
                total = self._gather(b, lambda s: r.grad[s.param][s.start : s.stop]).clone() if self.shares else torch.zeros(b.numel)
                for p in self.peers:  # in rank order, so every run sums alike
                    total += codec.decode(self._incoming_parts[b.index, p], b.numel)
                summed.append((b, total, anyone_has))
                if self.max_norm is None:  # sent at once; clipped, every owned sum first
                    self._send_sum(r, b, total, anyone_has, sending, keep)
            if self.max_norm is not None:
                # the global norm of the dense sums before they are encoded (each owner's, traded), one scale applied
                # to them: every process applies the decoding of a clipped sum (the residual keeps what is not sent)
                scale = self._clip_scale(r, [total for _, total, _ in summed])
                for b, total, anyone_has in summed:
                    self._send_sum(r, b, total.mul_(scale), anyone_has, sending, keep)
            for work in sending:
                work.wait()
        except BaseException as err:  # handed to the training thread by step()
            r.error = err

    def _send_sum(self, r: _Round, b: Bucket, total: torch.Tensor, anyone_has: set[str], sending: list, keep: list) -> None:
        """An owned bucket's summed gradient: encoded, applied here as decoded, and sent to every peer."""
        codec = self._sum_codec[b.index]
        parts = codec.encode(total)
        self._apply(r.step, b, codec.decode(parts, b.numel), anyone_has)
        union = self._union[b.index]
        for k, name in enumerate(b.params):
            union[k] = name in anyone_has
        keep += parts
        for p in self.peers:
            sending += [comm.isend(part, p, tag=self._tag(b, kind)) for part, kind in zip(parts, (self.SUMS, self.SUMS_2))]
            sending.append(comm.isend(union, p, tag=self._tag(b, self.UNION)))
        self.sent_bytes += (wire_bytes(parts) + union.numel()) * len(self.peers)

    def _apply(self, step: int, b: Bucket, grad: torch.Tensor, anyone_has: set[str]) -> None:
        """The updater on bucket b's slices, from its flat summed gradient (a param nobody had a gradient for stays)."""
        self.updater.update_many(step, [self._update_of(s, grad[at : at + s.size])
                                        for s, at in zip(b.slices, b.offsets) if s.param in anyone_has])

    def _update_of(self, s: ParamSlice, grad: torch.Tensor) -> ParamUpdate:
        info = self.store.info[s.param]
        return ParamUpdate(self._value(s), grad, self.state[self._key(s)], info.lr_scale, info.wd_scale)

    def metrics(self, window: MetricWindow) -> dict[str, float]:
        """Sample-weighted averages over every worker of the group (rank 0 decides the names)."""
        state = window.state()
        names = sorted(state["sums"]) if self.chief else []
        encoded = torch.tensor(list(",".join(names).encode()), dtype=torch.uint8)
        length = torch.tensor([len(encoded)])
        comm.broadcast(length, 0)
        if not self.chief:
            encoded = torch.zeros(int(length), dtype=torch.uint8)
        comm.broadcast(encoded, 0)
        names = [n for n in bytes(encoded.tolist()).decode().split(",") if n]
        values = torch.tensor([[state["sums"].get(n, 0.0), state["counts"].get(n, 0)] for n in names], dtype=torch.float64).reshape(-1, 2)
        comm.all_reduce_sum(values)
        averages = {n: float(s / c) for n, (s, c) in zip(names, values.tolist()) if c}
        averages["sent_bytes"], self.sent_bytes = self.sent_bytes, 0  # this process's, as Downpour's pushed_bytes
        return averages

    def view_updater(self):
        """Servers are spread over processes: every gradient goes through them."""
        return None

    def finish(self) -> None:
        """Every step ended with its values back: nothing outstanding."""

    def updater_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The whole updater state, assembled on every rank from the servers' slices (collective)."""
        full = {name: {slot: torch.zeros(shape) for slot, shape in self.updater.state_shapes(name, tuple(self.store.info[name].shape)).items()}
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
                comm.all_reduce_sum(full[name][slot])
        return full

    def load_updater_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        for (name, start, stop), slots in self.state.items():
            for slot, value in slots.items():
                if name in state and slot in state[name]:
                    whole = state[name][slot].reshape(-1)
                    value.copy_(whole[start:stop] if whole.numel() == self.store.info[name].numel else whole.reshape(value.shape))

    def own_state(self) -> dict[str, torch.Tensor]:
        """This process's compression residuals: per bucket it sends, and per bucket whose sum it sends back."""
        if self.codecs is None:
            return {}
        return codecs_state("send", self._send_codec) | codecs_state("sum", self._sum_codec)

    def load_own_state(self, tensors: dict[str, torch.Tensor]) -> None:
        if self.codecs is not None:
            load_codecs_state("send", self._send_codec, tensors)
            load_codecs_state("sum", self._sum_codec, tensors)
