"""A worker group whose net is partitioned (shoal.planning.partition): one thread per worker, bridges between them.

Each worker runs its own nodes of the partitioned net in the plan's global
topological order. A kBridgeSrc hands its blob to the bridge's channel (queues
between threads; between processes a broadcast over the plan's group of the two
workers, RemoteChannel); the kBridgeDst on the other worker takes it (on its
device) as a leaf of its own autograd graph, as SINGA's bridge layers block
until the data arrives.

Backward runs in *segments*: a worker's nodes between two bridge_dst nodes. A
value used in a later segment is cut (a detached leaf there), so a segment's
backward never needs a gradient from outside it. Segments run last to first;
each waits for the gradients of the blobs it sent (from the workers that
received them), then sends back the gradient of the blob it received. Every
wait is on a segment that comes later in the global order, so the group
cannot deadlock; gradients flow back through the same bridges, slices and
concates, and each param leaf gets its gradient exactly once.

The loss of a batch-partitioned loss layer is the mean over its worker's rows:
its backward is scaled by rows / batch, so every worker's gradients are parts
of the whole batch's gradient. The group's gradient of a param is the sum of
its workers' parts, each added at its view (a replica adds everywhere, a
feature-partitioned slice only at its rows or columns).
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Mapping, Optional

import numpy as np
import torch

from shoal.neuralnet.algorithms import Grads
from shoal.comm.collectives import Group
from shoal.config import job_pb2
from shoal.neuralnet.layers.base import Context
from shoal.neuralnet.params import ParamStore
from shoal.planning.partition import BATCH, ParamView, PartitionPlan, PartNode
from shoal.planning.process_groups import bridge_group_name
from shoal.planning.shares import GroupShards
from shoal.neuralnet.layers.connection import split_sizes
from shoal.runtime.feed import InputFeed, batch_conf, batch_shares, make_feeds

POLL_SEC = 0.05  # how often a waiting worker checks whether another one failed


class GroupAborted(RuntimeError):
    """Another worker of the group failed; this one stops waiting for it."""


class Channel:
    """One bridge inside a process: blobs go forward from bridge_src to bridge_dst, their gradients come back."""

    def __init__(self, abort: threading.Event):
        self.abort = abort
        self._forward: queue.SimpleQueue = queue.SimpleQueue()
        self._backward: queue.SimpleQueue = queue.SimpleQueue()
        self.bytes = 0  # moved this step, both ways

    def send_blob(self, blob: torch.Tensor, labels: Optional[torch.Tensor], wants_grad: bool) -> None:
        self.bytes += _nbytes(blob)
        self._forward.put((blob, labels, wants_grad))

    def recv_blob(self) -> tuple[torch.Tensor, Optional[torch.Tensor], bool]:
        return self._get(self._forward)

    def send_grad(self, grad: Optional[torch.Tensor]) -> None:
        self.bytes += _nbytes(grad)
        self._backward.put(grad)

    def recv_grad(self) -> Optional[torch.Tensor]:
        return self._get(self._backward)

    def finish(self) -> None:
        """Nothing in flight once both ends ran."""

    def _get(self, which: queue.SimpleQueue):
        while True:
            try:
                return which.get(timeout=POLL_SEC)
            except queue.Empty:
                if self.abort.is_set():
                    raise GroupAborted("another worker of the group failed") from None


class RemoteChannel:
    """One bridge between processes: a broadcast from the producer within its pair of workers' process group.

    The plan names one two-process group per pair of workers a bridge joins across processes
    (planning/process_groups.py::bridge_groups); only the pair's two threads use it. A message is
    matched by its place in the pair's order, not by a tag (NCCL has none): both threads issue the
    pair's messages in the partitioned net's node order forward and in its exact reverse backward
    (a worker's backward visits its bridges last to first), so the two ends always agree. Why
    broadcast: with two members it puts the tensor on the wire once, as a send would; every backend
    has it (NCCL for CUDA tensors of GPUs of their own, gloo otherwise); and the Group stages CUDA
    tensors through the host where its backend is gloo. Tensors stay on their worker's device; the
    small header (rows, labels?, wants a gradient?) is a host tensor, which gloo carries in either case.
    Sends never block (launched, waited at the end of the step): a blocking send to a worker that is
    itself blocked sending would deadlock two processes.
    """

    def __init__(self, group: Group, peer_rank: int, shape: tuple[int, ...], device: torch.device):
        self.group, self.peer, self.shape, self.device = group, peer_rank, shape, device
        self.rank = next(r for r in group.ranks if r != peer_rank)  # this end's process
        self.bytes = 0
        self._sends: list = []  # launched broadcasts of this end, waited in finish
        self._keep: list[torch.Tensor] = []  # what they read until they finished
        self._sent_rows = 0

    def _send(self, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().contiguous()
        self._keep.append(tensor)
        self._sends.append(self.group.broadcast(tensor, src=self.rank))

    def _recv(self, tensor: torch.Tensor) -> torch.Tensor:
        self.group.broadcast(tensor, src=self.peer).wait()
        return tensor

    def send_blob(self, blob: torch.Tensor, labels: Optional[torch.Tensor], wants_grad: bool) -> None:
        self._sent_rows = blob.shape[0]
        self._send(torch.tensor([blob.shape[0], labels is not None, wants_grad], dtype=torch.int64, device="cpu"))
        self._send(blob.to(torch.float32))
        if labels is not None:
            self._send(labels.to(torch.int64))
        self.bytes += _nbytes(blob)

    def recv_blob(self) -> tuple[torch.Tensor, Optional[torch.Tensor], bool]:
        rows, has_labels, wants_grad = self._recv(torch.zeros(3, dtype=torch.int64, device="cpu")).tolist()
        blob = self._recv(torch.empty((rows,) + self.shape, dtype=torch.float32, device=self.device))
        labels = self._recv(torch.empty(rows, dtype=torch.int64, device=self.device)) if has_labels else None
        self._sent_rows = rows
        self.bytes += _nbytes(blob)
        return blob, labels, bool(wants_grad)

    def send_grad(self, grad: Optional[torch.Tensor]) -> None:
        self._send(torch.tensor([grad is not None], dtype=torch.int64, device="cpu"))
        if grad is not None:
            self._send(grad.to(torch.float32))
            self.bytes += _nbytes(grad)

    def recv_grad(self) -> Optional[torch.Tensor]:
        (has_grad,) = self._recv(torch.zeros(1, dtype=torch.int64, device="cpu")).tolist()
        if not has_grad:
            return None
        grad = self._recv(torch.empty((self._sent_rows,) + self.shape, dtype=torch.float32, device=self.device))
        self.bytes += _nbytes(grad)
        return grad

    def finish(self) -> None:
        for handle in self._sends:
            handle.wait()
        self._sends, self._keep = [], []


def _nbytes(tensor: Optional[torch.Tensor]) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


@dataclass
class _Segment:
    """A worker's nodes after one bridge_dst (or from the start) until the next."""

    received: Optional[tuple[torch.Tensor, Channel]] = None  # the bridge_dst leaf that opens it
    sent: list[tuple[torch.Tensor, Channel]] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)  # scaled to their share of the batch
    cuts: list[tuple[str, torch.Tensor]] = field(default_factory=list)  # (producer, leaf) of values from earlier segments
    pending: dict[str, torch.Tensor] = field(default_factory=dict)  # producer -> gradient from later segments


class PartWorker:
    """One worker of a partitioned group: its nodes, feeds, random stream and param leaves."""

    def __init__(self, plan: PartitionPlan, index: int, store: ParamStore, device: torch.device,
                 feeds: dict[str, InputFeed], generator: torch.Generator, channels: dict[str, Channel]):
        self.index, self.store, self.device = index, store, device
        self.nodes = plan.worker_nodes(index)
        self.feeds, self.generator, self.channels = feeds, generator, channels
        self.leaves: dict[ParamView, torch.Tensor] = {}

    def bind(self) -> None:
        """Fresh leaves on the store's current values: a replica's whole param, a slice's view (copied when on another device)."""
        self.leaves = {}
        for node in self.nodes:
            for view in node.params:
                if view not in self.leaves:
                    value = self.store.values[view.name].data
                    if view.axis >= 0:
                        value = value.narrow(view.axis, view.start, view.size)
                    value = value.to(self.device) if value.device != self.device else value.detach()
                    self.leaves[view] = value.requires_grad_(self.store.info[view.name].trainable)

    def run(self, cursor: int, rows: list[tuple[int, int]], batch: int, shares: list[int], report) -> dict[ParamView, torch.Tensor]:
        """Forward and backward of this worker's nodes on the batch at `cursor`; the gradient of each leaf."""
        self.bind()
        base = Context(
            phase=job_pb2.kTrain, generator=self.generator, report=report, device=self.device,
            feeds={name: feed.batch(cursor, self.device) for name, feed in self.feeds.items()}, batch_shares=shares,
        )
        state = _Pass(by_part=[replace(base, rows=(offset, share, batch)) for offset, share in rows], whole=replace(base, rows=None))
        for node in self.nodes:
            self._forward(node, state, rows, batch)
        for segment in reversed(state.segments):
            self._backward(segment, state)
        return {view: leaf.grad for view, leaf in self.leaves.items() if leaf.grad is not None}

    def _forward(self, node: PartNode, state: "_Pass", rows: list[tuple[int, int]], batch: int) -> None:
        kind = node.layer.conf.type
        if kind == job_pb2.kBridgeDst:  # a blob from another worker opens a new segment
            channel = self.channels[node.name]
            value, label, wants_grad = channel.recv_blob()
            leaf = value.to(self.device).detach().requires_grad_(wants_grad)
            state.segments.append(_Segment(received=(leaf, channel)))
            state.put(node.name, leaf, None if label is None else label.to(self.device))
            return
        xs = [state.read(s) for s in node.srcs]
        labels = [state.aux[s] for s in node.srcs]
        if kind == job_pb2.kBridgeSrc:
            channel = self.channels[node.peer]
            channel.send_blob(xs[0].detach(), labels[0], xs[0].requires_grad)
            if xs[0].requires_grad:
                state.segments[-1].sent.append((xs[0], channel))
            state.put(node.name, xs[0], labels[0])
            return
        ctx = state.by_part[node.part] if node.partitioning == BATCH else state.whole
        result = node.layer.forward(xs, [self.leaves[v] for v in node.params], labels, ctx)
        output, aux = result if isinstance(result, tuple) else (result, labels[0] if labels else None)
        state.put(node.name, output, aux)
        if node.layer.category == "loss":  # a mean over this part's rows: its share of the batch's mean
            rows_here = rows[node.part][1] if node.partitioning == BATCH else batch
            state.segments[-1].losses.append(output * (rows_here / batch))

    def _backward(self, segment: "_Segment", state: "_Pass") -> None:
        roots, grads = [], []
        for loss in segment.losses:
            roots.append(loss)
            grads.append(None)
        for value, channel in reversed(segment.sent):
            grad = channel.recv_grad()
            if grad is not None:
                roots.append(value)
                grads.append(grad.to(value.device))
        for producer, grad in segment.pending.items():
            if state.outputs[producer].requires_grad:
                roots.append(state.outputs[producer])
                grads.append(grad)
        if roots:
            torch.autograd.backward(roots, grads)
        for producer, leaf in segment.cuts:  # hand what flowed into the cut leaves to their segments
            if leaf.grad is not None:
                earlier = state.segments[state.home[producer]].pending
                earlier[producer] = leaf.grad if producer not in earlier else earlier[producer] + leaf.grad
        if segment.received is not None and segment.received[0].requires_grad:  # the sender waits for it
            leaf, channel = segment.received
            channel.send_grad(leaf.grad)


@dataclass
class _Pass:
    """One forward and backward pass of a worker: outputs by node, their segments, the cut leaves."""

    by_part: list[Context]  # the context a batch part's node sees (its rows)
    whole: Context
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    aux: dict[str, Optional[torch.Tensor]] = field(default_factory=dict)
    home: dict[str, int] = field(default_factory=dict)  # node -> its segment
    segments: list[_Segment] = field(default_factory=lambda: [_Segment()])
    cut: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)

    def put(self, name: str, output: torch.Tensor, aux: Optional[torch.Tensor]) -> None:
        self.outputs[name], self.aux[name], self.home[name] = output, aux, len(self.segments) - 1

    def read(self, src: str) -> torch.Tensor:
        """`src`'s output as this segment sees it: itself, or (from an earlier segment) a leaf cut from it."""
        here = len(self.segments) - 1
        if self.home[src] == here:
            return self.outputs[src]
        if (src, here) not in self.cut:
            value = self.outputs[src]
            leaf = value.detach().requires_grad_(value.requires_grad)
            self.cut[(src, here)] = leaf
            self.segments[here].cuts.append((src, leaf))
        return self.cut[(src, here)]


class _FeedSkips:
    """One input layer's feeds on every worker, as one: a checkpoint's random skip applies to all of them."""

    def __init__(self, feeds: list[InputFeed]):
        self.feeds = feeds

    @property
    def skip(self) -> int:
        return self.feeds[0].skip

    @skip.setter
    def skip(self, value: int) -> None:
        for feed in self.feeds:
            feed.skip = value


class PartitionedGroup:
    """The workers of one partitioned group, presented to the Trainer as one worker computing the group's gradient."""

    index = 0

    def __init__(self, job: job_pb2.JobProto, plan: PartitionPlan, store: ParamStore, base_dirs: list[Path],
                 devices: list[torch.device], group: int = 0, hosted: Optional[list[int]] = None, ranks: Optional[dict[int, int]] = None,
                 shards: GroupShards = GroupShards(), process_groups: Optional[Mapping[str, Group]] = None):
        """`hosted`: the workers of the group this process runs (all by default); `ranks`: the process of each worker;
        `shards`: where each group starts reading (the JobPlan's); `process_groups`: the plan's, made (the bridges
        to workers of other processes run over theirs)."""
        self.job, self.plan, self.store, self.group, self.shards = job, plan, store, group, shards
        hosted = list(range(plan.nworkers)) if hosted is None else sorted(hosted)
        self.device = devices[0]
        self.abort = threading.Event()
        self.channels = self._channels(hosted, ranks or {}, devices, process_groups or {})
        seed = job.seed + 1 + 7919 * group  # the group's random stream, as Worker's
        self.generator = torch.Generator().manual_seed(seed)  # draws on the CPU whatever the device (see Worker)
        self.parts: list[PartWorker] = []
        by_layer: dict[str, list[InputFeed]] = {}
        for k in hosted:
            feeds = self._feeds(plan.worker_nodes(k), base_dirs, devices[k])
            for node in plan.worker_nodes(k):
                if node.name in feeds:
                    by_layer.setdefault(node.origin, []).append(feeds[node.name])
            generator = torch.Generator().manual_seed(seed)
            self.parts.append(PartWorker(plan, k, store, devices[k], feeds, generator, self.channels))
        self.feeds = {name: _FeedSkips(feeds) for name, feeds in by_layer.items()}
        self.configured_shares = self._configured_shares()
        self.global_batch = sum(self.configured_shares)
        self.share = self.global_batch  # the group's gradient is of the whole batch: weight 1
        self.pool = ThreadPoolExecutor(max_workers=len(self.parts), thread_name_prefix="shoal-part")
        self.bytes_per_step = 0  # bridges plus the gradients of workers other than worker 0 (the last step)
        # views no other worker computes with, on the store's device: their worker may update them itself
        on_store = {part.index for part in self.parts if part.device == store.device}
        self.owned = {view: k for view, k in plan.updated_where_computed().items() if k in on_store}
        self.update_view: Optional[Callable] = None

    def placed_workers(self) -> list[tuple[int, str]]:
        return [(part.index, str(part.device)) for part in self.parts]

    def computed_nodes(self):
        """The plan's own nodes, on the worker computing each."""
        for part in self.parts:
            for node in part.nodes:
                yield part.index, node.name, node

    def use_view_updater(self, update_view: Optional[Callable]) -> None:
        """`update_view(step, view, grad)` (the exchange's server, in place): each worker then updates the views
        it alone computes with as soon as its backward ends, in its own thread, and their gradients never leave
        it; None (servers elsewhere, or a group working on a copy): every gradient goes to the exchange."""
        self.update_view = update_view

    def _channels(self, hosted: list[int], ranks: dict[int, int], devices: list[torch.device],
                  process_groups: Mapping[str, Group]) -> dict[str, object]:
        """A channel per bridge with an end here, by bridge_dst name: in memory, or over the process group of its
        pair of workers (on this end's device)."""
        channels: dict[str, object] = {}
        by_name = {n.name: n for n in self.plan.nodes}
        bridges = [n for n in self.plan.nodes if n.layer.conf.type == job_pb2.kBridgeDst]
        for dst in bridges:
            src = by_name[dst.peer]
            here = (src.worker in hosted, dst.worker in hosted)
            if all(here):
                channels[dst.name] = Channel(self.abort)
            elif any(here):
                mine, other = (src.worker, dst.worker) if here[0] else (dst.worker, src.worker)
                group = process_groups[bridge_group_name(self.group, src.worker, dst.worker)]
                channels[dst.name] = RemoteChannel(group, ranks[other], tuple(dst.shape), devices[mine])
        return channels

    def _configured_shares(self) -> list[int]:
        """The rows of each batch part as the job configures them (one batchsize split evenly, or one per part)."""
        for node in self.plan.nodes:
            conf = batch_conf(node.layer.conf) if node.layer.category == "input" and not node.srcs else None
            if conf is not None:
                shares = batch_shares(conf, self.plan.nworkers)
                return shares if node.partitioning == BATCH else split_sizes(sum(shares), self.plan.nworkers)
        return [0] * self.plan.nworkers

    def _feeds(self, nodes: list[PartNode], base_dirs: list[Path], device: torch.device) -> dict[str, InputFeed]:
        """The feeds of a worker's input nodes: a batch-partitioned copy reads its part, a whole one the whole batch."""
        job, feeds = self.job, {}
        for node in nodes:
            if node.layer.category != "input" or node.srcs:
                continue
            view = _Inputs([node])
            # every worker draws the same random_skip; groups draw their own (as Worker)
            rng = np.random.default_rng(job.seed if self.group == 0 else [job.seed, self.group])
            part, parts = (node.part, self.plan.nworkers) if node.partitioning == BATCH else (0, 1)
            made = make_feeds(view, base_dirs, part, parts, rng, device)
            for feed in made.values() if self.group > 0 else ():  # disjoint shards, as Worker
                feed.skip += self.shards.offset(self.group, feed.skip, len(feed.dataset))
            feeds.update(made)
        return feeds

    def rows(self) -> list[tuple[int, int]]:
        """(offset, share) of each part of the batch: this process's feeds' shares, the configured ones elsewhere."""
        shares = list(self.configured_shares)
        for part in self.parts:
            for name, feed in part.feeds.items():
                node = next(n for n in part.nodes if n.name == name)
                if node.partitioning == BATCH:
                    shares[node.part] = feed.share
        offsets = [sum(shares[:k]) for k in range(len(shares))]
        return list(zip(offsets, shares))

    def compute(self, step: int, report: Callable[[str, float, int], None]) -> Grads:
        """The group's gradient of the loss (mean over the whole batch) on batch `step`."""
        state = self.generator.get_state()
        for part in self.parts:
            part.generator.set_state(state)
        for channel in self.channels.values():
            channel.bytes = 0
        rows, batch = self.rows(), self.global_batch
        shares = [share for _, share in rows]
        self.abort.clear()

        def run(part: PartWorker):
            try:
                grads = part.run(step * batch, rows, batch, shares, report)
            except BaseException:
                self.abort.set()
                raise
            if self.update_view is None:
                return grads
            for view in [v for v in grads if self.owned.get(v) == part.index]:
                self.update_view(step, view, grads.pop(view))
            return grads

        futures = [self.pool.submit(run, part) for part in self.parts]
        results, errors = [], []
        for future in futures:
            try:
                results.append(future.result())
            except GroupAborted:
                results.append({})
            except BaseException as err:  # noqa: BLE001 - re-raised below, after every worker stopped
                errors.append(err)
        for channel in self.channels.values():
            channel.finish()
        if errors:
            raise errors[0]
        drawing = [p for p in self.parts if any(n.layer.draws_random for n in p.nodes)]
        self.generator.set_state((drawing[0] if drawing else self.parts[0]).generator.get_state())
        grads: Grads = {}
        moved = sum(c.bytes for c in self.channels.values())
        for part, part_grads in zip(self.parts, results):
            for view, grad in part_grads.items():
                value = self.store.values[view.name]
                grad = grad.to(value.device)
                if part.index > 0:
                    moved += 2 * grad.numel() * grad.element_size()  # gradient up to worker 0, new values back
                if view.axis < 0 and grads.get(view.name) is None:
                    grads[view.name] = grad
                    continue
                if grads.get(view.name) is None:
                    grads[view.name] = torch.zeros_like(value)
                target = grads[view.name] if view.axis < 0 else grads[view.name].narrow(view.axis, view.start, view.size)
                target.add_(grad)
        self.bytes_per_step = moved
        for name in self.store.values:
            grads.setdefault(name, None)
        return grads

    def stream_gradients(self, ready) -> bool:
        """The group's gradient exists only once every part finished: the exchange takes it from compute."""
        return False


@dataclass
class _Inputs:
    """What make_feeds reads of a net: its nodes and input nodes."""

    nodes: list[PartNode]

    def input_nodes(self) -> list[PartNode]:
        return [n for n in self.nodes if n.layer.category == "input" and not n.srcs]
