"""Worker: one member of a worker group, computing gradients on its share of each batch.

A worker owns its train net (leaf views of the shared param store, its own
gradients), the feeds of its share of the batch, and its own random
generator. It never updates params: the group aggregates the gradients of
its workers and hands them to the servers, as SINGA's workers hand theirs to
the stub.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from shoal.neuralnet.algorithms import Grads, train_one_batch
from shoal.config import job_pb2
from shoal.neuralnet.layers.base import Context
from shoal.neuralnet.net import NeuralNet
from shoal.neuralnet.params import ParamStore
from shoal.planning.shares import GroupShards
from shoal.runtime.feed import InputFeed, make_feeds
from shoal.runtime.interfaces import ComputeDelay


class Worker:
    def __init__(
        self,
        job: job_pb2.JobProto,
        store: ParamStore,
        base_dirs: list[Path],
        device: torch.device,
        index: int = 0,
        npartitions: int = 1,
        init_generator: Optional[torch.Generator] = None,
        group: int = 0,
        device_name: Optional[str] = None,
        net: Optional[NeuralNet] = None,
        shards: GroupShards = GroupShards(),
    ):
        """`device_name`: shoal's name of the device ("cpu:1" is torch's CPU with a replica of its own)."""
        self.job, self.index, self.group, self.device = job, index, group, device
        self.device_name = device_name or str(device)
        self.net = net if net is not None else NeuralNet(job.neuralnet, job_pb2.kTrain, store, init_generator or torch.Generator().manual_seed(job.seed))
        # every worker of a group draws the same random_skip, so shares tile one global batch;
        # groups draw their own, so asynchronous groups read different data
        rng = np.random.default_rng(job.seed if group == 0 else [job.seed, group])
        self.feeds: dict[str, InputFeed] = make_feeds(self.net, base_dirs, index, npartitions, rng, device)
        if group > 0:  # the plan's rule: groups read disjoint shards (planning/shares.py); group 0 from its draw
            for feed in self.feeds.values():
                feed.skip += shards.offset(group, feed.skip, len(feed.dataset))
        # one seed for the whole group: per-sample draws are made for the whole batch and sliced
        # (Context.rows), so a group draws, row for row, what one worker would; groups differ.
        # Draws are made on the CPU whatever the device: a mixed CPU+GPU group draws what one device would
        self.generator = torch.Generator().manual_seed(job.seed + 1 + 7919 * group)
        self.slowdown: Optional[ComputeDelay] = None  # injected by a test (slow_down), as a slower device
        # gradient accumulation: an input layer may ask for its batch share in micro-batches (shoal.fit's grad_accum_steps)
        self.micro_batches = max((n.layer.micro_batches for n in self.net.input_nodes()), default=1)

    @property
    def global_batch(self) -> int:
        return max((f.global_batch for f in self.feeds.values()), default=0)

    @property
    def offset(self) -> int:
        """This worker's first row within the group's batch."""
        return max((f.offset for f in self.feeds.values()), default=0)

    @property
    def share(self) -> int:
        return max((f.share for f in self.feeds.values()), default=0)

    def take_rows(self, offset: int, share: int) -> None:
        """Compute rows offset .. offset + share of each batch from now on (balanced shares)."""
        for feed in self.feeds.values():
            feed.offset, feed.share = offset, share

    def compute(self, step: int, report: Callable[[str, float, int], None]) -> Grads:
        """Gradients of the loss (mean over this worker's share) on batch `step`.

        With micro_batches k > 1 the share is computed as k consecutive micro-batches of about share/k rows,
        one forward and backward each, and the gradients are their row-weighted mean: the mean over the
        whole share, as one pass would give (for losses that are means over rows), in a k-th of the memory.
        """
        cursor = step * self.global_batch
        started = time.perf_counter()
        parts = micro_batch_rows(self.offset, self.share, self.micro_batches)
        if len(parts) <= 1:
            grads = self._pass(cursor, self.offset, self.share, report)
        else:
            grads = {}
            for offset, rows in parts:
                weight = rows / self.share
                for name, grad in self._pass(cursor, offset, rows, report).items():
                    if grad is None:
                        grads.setdefault(name, None)
                    elif grads.get(name) is None:
                        grads[name] = grad * weight  # a new tensor: the next pass's zero_grad leaves it alone
                    else:
                        grads[name].add_(grad, alpha=weight)
        if self.device.type == "cuda":  # the step's time is the kernels' time, not their launch's
            torch.cuda.synchronize(self.device)
        if self.slowdown:
            time.sleep(self.slowdown.extra_seconds(time.perf_counter() - started, self.share))
        return grads

    def _pass(self, cursor: int, offset: int, rows: int, report: Callable[[str, float, int], None]) -> Grads:
        """One forward and backward over rows offset .. offset + rows of the batch at `cursor`."""
        with _reading_rows(self.feeds.values(), offset, rows):
            ctx = Context(
                phase=job_pb2.kTrain,
                generator=self.generator,
                feeds={name: feed.batch(cursor, self.device) for name, feed in self.feeds.items()},
                report=report,
                device=self.device,
                rows=(offset, rows, self.global_batch),
            )
        return train_one_batch(self.job.train_one_batch, self.net, ctx)

    def slow_down(self, delay: Optional[ComputeDelay]) -> None:
        """Compute slower from now on, as a slower device would (fault injection: shoal.launcher.faults)."""
        self.slowdown = delay

    def use_view_updater(self, update_view) -> None:
        """A worker computes every param whole on its share of the batch: no view is its own."""

    def placed_workers(self) -> list[tuple[int, str]]:
        return [(self.index, self.device_name)]

    def computed_nodes(self):
        """The whole net on a share of the batch: train_net.json names these nodes NAME@WORKER."""
        for node in self.net.nodes:
            yield self.index, f"{node.name}@{self.index}", node

    def stream_gradients(self, ready: Callable[[str, torch.Tensor], None]) -> bool:
        """Hand each param's gradient to `ready(name, grad)` as soon as backward has accumulated it.

        Only for kBP, whose one backward pass accumulates every gradient exactly once;
        other algorithms' gradients are taken from compute's result (return False).
        Hooks live on the net's current leaves: call after any `net.bind()`.
        """
        if self.job.train_one_batch.alg != job_pb2.kBP or self.micro_batches > 1:  # micro-batches: one sum of several backwards
            return False
        for name, leaf in self.net.param_leaves().items():
            if leaf.requires_grad:
                leaf.register_post_accumulate_grad_hook(lambda leaf, name=name: ready(name, leaf.grad))
        return True


def micro_batch_rows(offset: int, share: int, micro_batches: int) -> list[tuple[int, int]]:
    """(offset, rows) of each micro-batch of a share: consecutive, sizes differing by at most one, none empty."""
    k = max(1, min(micro_batches, share))
    base, extra = divmod(share, k)
    parts, start = [], offset
    for i in range(k):
        rows = base + (1 if i < extra else 0)
        parts.append((start, rows))
        start += rows
    return parts


@contextmanager
def _reading_rows(feeds, offset: int, rows: int):
    """The feeds read rows offset .. offset + rows of each batch while inside (a worker's own feeds: no other thread reads them)."""
    saved = [(f.offset, f.share) for f in feeds]
    for f in feeds:
        f.offset, f.share = offset, rows
    try:
        yield
    finally:
        for f, (o, s) in zip(feeds, saved):
            f.offset, f.share = o, s
