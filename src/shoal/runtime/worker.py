"""Worker: one member of a worker group, computing gradients on its share of each batch.

A worker owns its train net (leaf views of the shared param store, its own
gradients), the feeds of its share of the batch, and its own random
generator. It never updates params: the group aggregates the gradients of
its workers and hands them to the servers, as SINGA's workers hand theirs to
the stub.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from shoal.neuralnet.algorithms import Grads, train_one_batch
from shoal.config import job_pb2
from shoal.neuralnet.layers.base import Context
from shoal.neuralnet.net import NeuralNet
from shoal.neuralnet.params import ParamStore
from shoal.runtime import faults
from shoal.runtime.feed import InputFeed, make_feeds


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
    ):
        """`device_name`: shoal's name of the device ("cpu:1" is torch's CPU with a replica of its own)."""
        self.job, self.index, self.group, self.device = job, index, group, device
        self.device_name = device_name or str(device)
        self.net = net if net is not None else NeuralNet(job.neuralnet, job_pb2.kTrain, store, init_generator or torch.Generator().manual_seed(job.seed))
        # every worker of a group draws the same random_skip, so shares tile one global batch;
        # groups draw their own, so asynchronous groups read different data
        rng = np.random.default_rng(job.seed if group == 0 else [job.seed, group])
        self.feeds: dict[str, InputFeed] = make_feeds(self.net, base_dirs, index, npartitions, rng, device)
        if group > 0:
            ngroups = max(job.cluster.nworker_groups, group + 1)
            for feed in self.feeds.values():
                # without random_skip, groups start at evenly spaced offsets: disjoint shards of one epoch.
                # Local SGD's groups always do (after their draw): overlapping windows would train them on the same records
                if feed.skip == 0 or job.cluster.local_steps > 0:
                    feed.skip += group * (len(feed.dataset) // ngroups)
        # one seed for the whole group: per-sample draws are made for the whole batch and sliced
        # (Context.rows), so a group draws, row for row, what one worker would; groups differ.
        # Draws are made on the CPU whatever the device: a mixed CPU+GPU group draws what one device would
        self.generator = torch.Generator().manual_seed(job.seed + 1 + 7919 * group)
        self.slowdown = faults.slowdown(index, group)

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
        """Gradients of the loss (mean over this worker's share) on batch `step`."""
        cursor = step * self.global_batch
        ctx = Context(
            phase=job_pb2.kTrain,
            generator=self.generator,
            feeds={name: feed.batch(cursor, self.device) for name, feed in self.feeds.items()},
            report=report,
            device=self.device,
            rows=(self.offset, self.share, self.global_batch),
        )
        started = time.perf_counter()
        grads = train_one_batch(self.job.train_one_batch, self.net, ctx)
        if self.device.type == "cuda":  # the step's time is the kernels' time, not their launch's
            torch.cuda.synchronize(self.device)
        if self.slowdown:
            time.sleep(self.slowdown.extra_seconds(time.perf_counter() - started, self.share))
        return grads

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
        if self.job.train_one_batch.alg != job_pb2.kBP:
            return False
        for name, leaf in self.net.param_leaves().items():
            if leaf.requires_grad:
                leaf.register_post_accumulate_grad_hook(lambda leaf, name=name: ready(name, leaf.grad))
        return True
