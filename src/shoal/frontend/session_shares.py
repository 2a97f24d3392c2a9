"""Measured batch shares in a user's loop (cluster.auto_batch_shares: Caffe con Troll's CPU+GPU split, measured): the
job path's balancer (planning/balance.py's ShareBalancer, as runtime/trainer.py's Trainer runs it) over the workers of
one group in this process, which re-splits the group's batch between them by their measured compute times.

A worker's compute time is its loop body's from the batch it was handed (SessionWorker.handed) to its gradient's
arrival at the group's mean (session_worker.LocalMean): its forward and backward, as the Trainer times `Worker.compute`.
The group's workers are all at the mean's meeting when the balancer looks: it observes that step's times, and a new
split lands in each worker's `pending` share, which the worker takes as its next step starts (SessionWorker._steps), so
that the step's loss is still logged with the rows it was computed on. Shares only decide who computes which rows of the
same group batch: the mean weighs each worker's gradient by its rows, so the step is one worker's on the whole batch.

Unlike the job path, every worker keeps at least one row (`every_worker_a_row`): its loop's body runs each step and
calls backward (a module need not take an empty batch), where the job path's Trainer leaves a worker the balancer gave
no share out of the step. SHOAL_SLOW_WORKER, a fault hook the launcher hands a job file's workers, does not act on a
user's loop: a test slows a worker from the loop itself (tests/test_fit_remaining_layouts.py).
"""
from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

from shoal.frontend.session_start import measures_shares
from shoal.frontend.session_worker import LocalMean, LocalMeans
from shoal.planning.balance import ShareBalancer, shares_line
from shoal.runtime.replicas import usable_device_names


def every_worker_a_row(shares: Sequence[int]) -> list[int]:
    """`shares` with every worker given at least one row, each taken from the largest share (the total kept)."""
    shares = list(shares)
    for k, share in enumerate(shares):
        if share < 1:
            largest = max(range(len(shares)), key=lambda i: shares[i])
            shares[largest] -= 1 - share
            shares[k] = 1
    return shares


class MeasuredShares:
    """One group's workers in this process (`workers`: SessionWorkers, each with `share`, `handed` and `pending`), their
    batch re-split every `every` steps by the balancer; `devices`: each worker's device name (the line says where each
    share runs)."""

    def __init__(self, workers: Sequence, every: int, devices: Sequence[str], say: Callable[[str], None]):
        self.workers, self.devices, self.say = list(workers), list(devices), say
        self.balancer = ShareBalancer([w.share for w in self.workers], every)
        self._seconds: list[Optional[float]] = [None] * len(self.workers)

    @property
    def shares(self) -> list[int]:
        """The group's split from the next step on (the train records' `batch_shares`, as the job path's)."""
        return list(self.balancer.shares)

    def set_shares(self, shares: Sequence[int]) -> None:
        """Re-split the group's batch from the next step (the same rows in the same order: only who computes them)."""
        offset = 0
        for worker, share in zip(self.workers, shares):
            worker.pending = (offset, share)
            offset += share
        self.balancer.shares = list(shares)

    def computed(self, position: int) -> None:
        """Worker `position`'s gradient reached the group's mean (in its own thread): its compute time."""
        self._seconds[position] = time.perf_counter() - self.workers[position].handed

    def observe(self, step: int) -> None:
        """Every worker's gradient of step `step` is in (the mean's meeting): the balancer sees their times and, every
        `every` steps, may move the split; the line is the job path's Trainer's."""
        seconds, self._seconds = self._seconds, [None] * len(self.workers)
        self.balancer.observe(seconds)
        now = self.shares
        proposal = self.balancer.propose()
        if proposal is None:
            return
        costs = self.balancer.costs()
        shares = every_worker_a_row(proposal)
        if shares == now:  # (it would leave a worker no row, which it keeps: no change)
            self.balancer.shares = now
            return
        self.set_shares(shares)
        self.say(shares_line(step + 1, shares, self.devices, costs))  # (the job path's Trainer's line)


def measure(run) -> list[MeasuredShares]:
    """At run.each_worker's loop start (every worker's first share set): under cluster.auto_batch_shares over groups of
    several workers (session_start.measures_shares; the plan keeps each group's workers in one process) a balancer over
    each group's workers here (each LocalMean's), from the checkpoint's split on a resume, as the job path's Trainer
    restores it; [] elsewhere."""
    if not measures_shares(run.plan):
        return []
    means = run.mean.means if isinstance(run.mean, LocalMeans) else [run.mean] if isinstance(run.mean, LocalMean) else []
    names = usable_device_names(run.plan.devices_of(run.rank), warn=lambda _: None)  # (said when the workers started)
    saved = run._mine.trainer.get("batch_shares", []) if run._mine is not None else []
    measured = []
    for k, mean in enumerate(means):
        workers = mean.workers
        mean.measured = MeasuredShares(workers, run.plan.balance_freq, [names[w.index] for w in workers], run.say)
        shares = [int(n) for n in saved[k]] if k < len(saved) and isinstance(saved[k], list) else []
        if len(shares) == len(workers) and sum(shares) == sum(w.share for w in workers) and min(shares) >= 1:
            mean.measured.set_shares(shares)  # (resumed: the split the run had reached, from its first step)
        measured.append(mean.measured)
    return measured


def record_shares(run, measured: Sequence[MeasuredShares]) -> dict:
    """The train record's `batch_shares` (the job path's Trainer writes them where its group has several workers): the
    split of the chief process's first group here, from the next step on; {} where that group has one worker here."""
    workers = [w for w in run._workers if w.group == run.group]
    if len(workers) < 2:
        return {}
    for group in measured:
        if group.workers[0].group == run.group:
            return {"batch_shares": group.shares}
    return {"batch_shares": [w.share for w in workers]}
