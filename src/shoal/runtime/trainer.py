"""Trainer: SINGA's training loop, driving one worker group and its server.

The workers of the group that live in this process (threads) each compute
the gradients of their share of the batch; the exchange (shoal.runtime.exchanges.sliced)
turns them into one update per step, in memory or through the servers of
other processes, so the group computes exactly what one worker with the whole
batch would.

Per step, in SINGA 0.3's order: validate → test → checkpoint → train one batch
→ display. Each of these fires when `freq > 0 and step >= after and
(step - after) % freq == 0`; training stops at `train_steps`, after which a
final checkpoint is written (and, unlike SINGA, a final validation and a final test
when they are configured, so every run ends with the trained model's numbers). A job
without a checkpoint_freq checkpoints about every checkpoint_interval_s instead, every
trainer at the step the chief chooses (shoal.runtime.checkpoint_schedule).
"""
from __future__ import annotations

import copy
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from shoal.neuralnet import checkpoint as ckpt_io
from shoal.planning.balance import ShareBalancer, shares_line
from shoal.config import job_pb2
from shoal.config.phases import fires
from shoal.errors import ShoalError
from shoal.neuralnet.layers.base import Context
from shoal.report import succession
from shoal.report.metrics import MetricsLog, MetricWindow, display_line
from shoal.neuralnet.net import NeuralNet
from shoal.neuralnet.params import ParamStore
from shoal.planning.plan import JobPlan
from shoal.runtime.checkpoint_schedule import CheckpointSchedule, checkpoint_parts  # noqa: F401 - re-exported
from shoal.runtime.feed import InputFeed, make_feeds
from shoal.runtime.interfaces import JOB_COUNTS, Exchange, GroupMember, TrainerHook, summary_annotator
from shoal.runtime.partitioned import PartitionedGroup
from shoal.runtime.replicas import DeviceReplicas, torch_device, usable_device_names
from shoal.runtime.worker import Worker


class Diverged(ShoalError, RuntimeError):
    """The loss or the params became NaN or infinite: the run stops instead of training on (or saving) them."""


@dataclass
class StepTimings:
    """Seconds this process spent computing gradients and exchanging them, since the last display.

    compute is the wall time of the group's (parallel) backward passes including input feeding;
    exchange the wall time of aggregation, server updates and, across processes, communication.
    """

    compute: float = 0.0
    exchange: float = 0.0
    paused: float = 0.0  # tests, validation and checkpoints: not training time
    workers: dict[int, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_worker(self, index: int, seconds: float) -> None:
        with self._lock:  # workers of a group finish on their own threads
            self.workers[index] = self.workers.get(index, 0.0) + seconds

    def fields(self) -> dict:
        return {
            "compute_sec": round(self.compute, 6),
            "exchange_sec": round(self.exchange, 6),
            "worker_compute_sec": {str(i): round(s, 6) for i, s in sorted(self.workers.items())},
        }


@dataclass
class History:
    """What a run produced: every metrics record, plus where it lives."""

    workspace: Path
    records: list[dict] = field(default_factory=list)
    failed_groups: list[str] = field(default_factory=list)  # asynchronous groups dropped during the run

    def phase(self, name: str) -> list[dict]:
        return [r for r in self.records if r["phase"] == name]

    @property
    def final_test(self) -> Optional[dict]:
        tests = self.phase("test")
        return tests[-1] if tests else None


class Trainer:
    """Runs SINGA's loop for one worker group (its workers as threads) against its Server."""

    def __init__(
        self,
        plan: JobPlan,
        workspace: Path,
        base_dirs: list[Path],
        device: torch.device,
        log: Callable[[str], None] = print,
        progress: Optional[bool] = None,
        train: bool = True,
        worker_indices: Optional[list[int]] = None,
        chief: bool = True,
        store: Optional[ParamStore] = None,
        group: int = 0,
        worker_devices: Optional[list[str]] = None,
        hooks: tuple[TrainerHook, ...] = (),
        rank: int = 0,
        process_groups: Optional[dict] = None,
        checkpoint_schedule: Optional[CheckpointSchedule] = None,
    ):
        """`device`: where the group's params live and its server updates them (and tests run);
        `worker_devices`: the device of each of `worker_indices` (default: all on `device`);
        `rank`: the process this trainer runs in (names its checkpoint part); `process_groups`: the plan's, made
        (a partitioned group's bridges to other processes run over them); `checkpoint_schedule`: the interval
        checkpoints' steps, one schedule shared by the trainers of a process (None: checkpoint_freq's only)."""
        job = plan.job
        self.plan, self.job, self.rank = plan, job, rank
        self.workspace = Path(workspace)
        self.device = device
        # the chief (worker 0 of group 0) tests, validates, displays and writes; other processes only train, unless
        # one takes a dead chief's place (`may_take_over`, set by the strategy: report/succession.py)
        self.chief = chief
        self.say = log  # how this process says a line (a successor's lines reach the terminal too)
        self.log = log if chief else (lambda *_: None)
        self.may_take_over = False  # (attach_exchange)
        self.progress = chief and (sys.stderr.isatty() if progress is None else progress)

        # params are initialised in layer order by the first net built, so every layout starts alike;
        # asynchronous groups of one process may share one store (SINGA's share_memory)
        init_gen = torch.Generator().manual_seed(job.seed)
        self.store = store if store is not None else ParamStore()
        self.group = group
        npartitions = plan.partition.nworkers
        partitioned = plan.partition.partitioned  # a layer cut on features or placed (even on one worker)
        if worker_indices is None:
            worker_indices = list(range(npartitions)) if train else []
        # the first net built declares and initialises the params, in layer order
        first_net = None  # the first worker computing on the store itself computes with this net
        if store is None:
            first_net = NeuralNet(job.neuralnet, job_pb2.kTrain, self.store, init_gen)
            self.store.move_to(device)
            first_net.bind()  # its leaves on the values where they now live
        worker_devices = worker_devices or [str(device)] * len(worker_indices)
        # the store's device is the root of the group's device tree; workers elsewhere compute on replicas
        home = worker_devices[0] if worker_devices and torch_device(worker_devices[0]) == device else str(device)
        self.replicas = DeviceReplicas(self.store, home, [] if partitioned else worker_devices)
        self.workers: list[GroupMember]
        if partitioned and worker_indices:
            on = dict(zip(worker_indices, worker_devices))  # a part's device; parts copy their slices there
            part_devices = [torch_device(on.get(k, str(device))) for k in range(npartitions)]
            # a group's own copy of the plan's nodes: hooks (debug norms) wrap their layers
            nodes = copy.deepcopy(plan.partition)
            self.workers = [PartitionedGroup(job, nodes, self.store, base_dirs, part_devices, group, worker_indices, plan.group_ranks(group),
                                             shards=plan.group_shards, process_groups=process_groups)]
        else:
            self.workers = []
            for i, d in zip(worker_indices, worker_devices):
                worker_store = self.replicas.store_of(d)
                net = first_net if worker_store is self.store and first_net is not None else None
                first_net = None if net is not None else first_net
                self.workers.append(Worker(job, worker_store, base_dirs, torch_device(d), i, npartitions, init_gen, group,
                                           device_name=d, net=net, shards=plan.group_shards))
        self.global_batch = plan.global_batch
        self.balancer = self._balancer(plan.balance_freq, partitioned)
        # test and validation run on worker 0 of group 0, on the whole (unpartitioned) net, as SINGA's
        self.nets: dict[int, NeuralNet] = {}
        self.feeds: dict[int, dict[str, InputFeed]] = {}
        self.base_dirs, self.train = base_dirs, train
        self.owed: dict[int, int] = {job_pb2.kTest: 0, job_pb2.kVal: 0}  # evaluation batches the chief ran, not this trainer
        self.cursors: dict[int, int] = {job_pb2.kTest: 0, job_pb2.kVal: 0}
        if chief:
            self._build_evaluation(init_gen)
        self.generator = self.workers[0].generator if self.workers else torch.Generator(device=device).manual_seed(job.seed + 1)
        self.pool = ThreadPoolExecutor(max_workers=len(self.workers), thread_name_prefix="shoal-worker") if len(self.workers) > 1 else None
        self.exchange: Optional[Exchange] = None  # attached by the assembly (shoal.runtime.assemble)
        self.checkpoint_schedule = checkpoint_schedule
        self.interval_steps: set[int] = set()  # the steps whose checkpoint checkpoint_interval_s wrote in this start
        self.hooks: list[TrainerHook] = list(hooks)
        self.metrics: Optional[MetricsLog] = None
        # (step, cursor) of the last test: `--test` of the checkpoint at that step tests the same samples
        self.last_test: Optional[tuple[int, int]] = None
        self.loaded_trainer_state: dict = {}  # the trainer part of the last checkpoint load_params read
        self.window = MetricWindow()
        self.window_samples = 0  # samples trained since the last display (checkpointed with the window)
        self.timings = StepTimings()
        self.start_step = 0
        self.resumed = False
        self.elapsed_before = 0.0

    def _build_evaluation(self, init_gen: torch.Generator) -> None:
        """The test and validation nets and their feeds (the chief's, or a successor's when it takes over: its cursors
        then move on by the batches the chief evaluated meanwhile, `owed`, so that it reads what the chief would have)."""
        job = self.job
        for phase, steps in ((job_pb2.kTest, job.test_steps), (job_pb2.kVal, job.validate_steps if self.train else 0)):
            if steps > 0:
                self.nets[phase] = NeuralNet(job.neuralnet, phase, self.store, init_gen)
        eval_rng = np.random.default_rng(job.seed + 1)
        self.feeds = {phase: make_feeds(net, self.base_dirs, 0, 1, eval_rng, self.device) for phase, net in self.nets.items()}
        for phase in self.feeds:
            self.cursors[phase] += self.owed[phase] * self._eval_batch(phase)
            self.owed[phase] = 0

    def _eval_batch(self, phase: int) -> int:
        return max((f.global_batch for f in self.feeds[phase].values()), default=0)

    def _balancer(self, every: int, partitioned: bool) -> Optional[ShareBalancer]:
        """auto_batch_shares (`every` steps; 0: never): a balancer over this group's workers (all in this process, cut on the batch)."""
        if not every or len(self.workers) < 2 or partitioned:
            return None
        return ShareBalancer([w.share for w in self.workers], every)

    @property
    def shares(self) -> list[int]:
        return [w.share for w in self.workers]

    def set_shares(self, shares: list[int]) -> None:
        """Re-split the group's batch (the same rows in the same order: only who computes them changes)."""
        offset = 0
        for w, share in zip(self.workers, shares):
            w.take_rows(offset, share)
            offset += share
        if self.balancer is not None:
            self.balancer.shares = list(shares)

    def _rebalance(self, step: int, seconds: list[Optional[float]]) -> None:
        self.balancer.observe(seconds)
        proposal = self.balancer.propose()
        if proposal is None:
            return
        costs = self.balancer.costs()
        self.set_shares(proposal)
        self.log(shares_line(step + 1, proposal, [w.device_name for w in self.workers], costs))

    # -- state ------------------------------------------------------------
    def attach_exchange(self, exchange: Exchange, may_take_over: bool = False) -> None:
        """`may_take_over`: the exchange's quorum makes this process the decider when the chief dies (a group of
        replicas: its `chief` and `speak_for_the_job`), and this trainer then takes over the chief's duties."""
        self.exchange = exchange
        self.may_take_over = may_take_over
        view_updater = exchange.view_updater()  # feature slices and placed layers: updated by their worker
        for member in self.workers:
            member.use_view_updater(view_updater)

    def add_hook(self, hook: TrainerHook) -> None:
        self.hooks.append(hook)

    def start_at(self, step: int) -> None:
        """Begin (or go on) training at `step`: an asynchronous group joining after group 0's warm-up."""
        self.start_step = step

    def load_params(self, paths: list[Path]) -> int:
        """Initialise params by name from earlier checkpoints (SINGA's checkpoint_path); return the last one's step."""
        step = 0
        for path in paths:
            ckpt = ckpt_io.load(path, parts=False)
            loaded = self.store.load(ckpt.params, source=str(path))
            self.log(f"Load from checkpoint file {path} ({len(loaded)} params)")
            step, self.loaded_trainer_state = ckpt.step, ckpt.trainer
        return step

    def tested_from(self, step: int) -> Optional[int]:
        """Where this job's test at `step` began, when the checkpoint load_params read last says (it was taken
        at that step, by this job, after testing): testing from there reproduces that test exactly."""
        t = self.loaded_trainer_state
        last = t.get("last_test") if t.get("job") == self.job.name else None
        if isinstance(last, dict) and last.get("step") == step and isinstance(last.get("cursor"), int):
            return last["cursor"]
        return None

    def eval_samples(self, phase: int, steps: int) -> int:
        """Samples `steps` batches of the test or validation net read."""
        return steps * self._eval_batch(phase)

    def save_checkpoint(self, step: int) -> Optional[Path]:
        """Collective when servers are spread over processes. The chief writes the checkpoint; every other
        trainer (a group of threads, or a process) writes its own part beside it (checkpoint_parts)."""
        ckpt = self.checkpoint_state(step)
        if not self.chief:
            return ckpt_io.save(ckpt_io.part_file(self.workspace, step, self.group, self.rank), ckpt)
        return ckpt_io.save(ckpt_io.checkpoint_file(self.workspace, step), ckpt)

    def checkpoint_state(self, step: int) -> ckpt_io.Checkpoint:
        """What this trainer writes at `step`: the chief the whole checkpoint, another trainer its own part."""
        updater_state = self.exchange.updater_state() if self.exchange else {}
        own = self.exchange.own_state() if hasattr(self.exchange, "own_state") else {}
        absent = self.exchange.absent_groups if self.exchange is not None else frozenset()
        bad = [name for name, value in self.store.values.items() if not torch.isfinite(value).all()]
        if bad and (self.chief or "value/" + bad[0] in own):
            raise Diverged(f"step {step}: param {bad[0]} holds NaN or infinite values; no checkpoint written")
        rng = {f"worker{w.index}": w.generator.get_state() for w in self.workers}
        if not self.chief:
            return ckpt_io.Checkpoint(step=step, params={}, rng=rng, trainer={"skips": self._skips()}, exchange=own)
        trainer = {
            "job": self.job.name,
            "writer": self.rank,  # (a successor of a dead chief writes the file with its own state: restore)
            "writer_group": self.group,
            "cursors": {str(k): v for k, v in self.cursors.items()},
            "skips": self._skips(),
            "window": self.window.state(),
            "window_samples": self.window_samples,
            "batch_shares": self.shares,  # balanced shares go on where they were (same maths either way)
            **({"last_test": {"step": self.last_test[0], "cursor": self.last_test[1]}} if self.last_test else {}),
            "elapsed": self.metrics.elapsed() if self.metrics is not None else self.elapsed_before,
        }
        return ckpt_io.Checkpoint(
            step=step,
            params=self.store.state_dict(),
            updater_state=updater_state,
            rng=rng,
            trainer=trainer,
            exchange=own,
            # a group the meetings went on without (Local SGD) writes no part: a resume starts it from the chief's values
            part_names={ckpt_io.part_name(step, g, r): required and g not in absent
                        for (g, r), required in checkpoint_parts(self.plan, writer=(self.group, self.rank)).items()},
        )

    def _skips(self) -> dict:
        return {str(phase): {n: f.skip for n, f in feeds.items()} for phase, feeds in self._all_feeds().items()}

    def restore(self, path: Path, ckpt: Optional[ckpt_io.Checkpoint] = None) -> None:
        """Continue from a checkpoint exactly where the run that wrote it stood: the chief's file, and this
        trainer's own part where it has one (a checkpoint of another layout, or an older one, has none: then
        this group starts from the chief's values, RNG and data position, its own shard of the data kept)."""
        ckpt = ckpt if ckpt is not None else ckpt_io.load(path, parts=True)
        self.store.load(ckpt.params, strict=True, source=str(path))
        if self.exchange is not None:
            self.exchange.load_updater_state(ckpt.updater_state)
        name = ckpt_io.part_name(ckpt.step, self.group, self.rank)
        t = ckpt.trainer
        # the file is its writer's own: the chief's, or a successor's that took a dead chief's place (report/succession.py)
        own = ckpt if (self.rank, self.group) == (t.get("writer", 0), t.get("writer_group", 0)) else ckpt.parts.get(name)
        rng = own.rng if own is not None else ckpt.rng
        for w in self.workers:
            if f"worker{w.index}" in rng:
                w.generator.set_state(rng[f"worker{w.index}"])
        if hasattr(self.exchange, "load_own_state"):
            # the job's counts for every process (any may take the chief's place after the resume, and count on); the
            # chief takes the file's whole state wherever its own part is
            counts = {k: v for k, v in ckpt.exchange.items() if k in JOB_COUNTS}
            if own is not None or self.chief:
                self.exchange.load_own_state({**counts, **(ckpt.exchange if self.chief else {}),
                                              **(own.exchange if own is not None else {})})
            elif counts:
                self.exchange.load_own_state(counts)
        self.cursors.update({int(k): int(v) for k, v in t.get("cursors", {}).items()})
        self._load_skips(t.get("skips", {}), own_train=own is not None)
        if own is not None and own is not ckpt:
            self._load_skips(own.trainer.get("skips", {}), own_train=True)
        last = t.get("last_test")
        if isinstance(last, dict) and isinstance(last.get("step"), int) and isinstance(last.get("cursor"), int):
            self.last_test = (last["step"], last["cursor"])
        self.window.load_state(t.get("window", {}))
        self.window_samples = int(t.get("window_samples", 0))
        shares = [int(n) for n in t.get("batch_shares", [])]
        if self.balancer is not None and len(shares) == len(self.workers) and sum(shares) == sum(self.shares):
            self.set_shares(shares)
        self.start_step = ckpt.step
        self.resumed = True
        self.elapsed_before = float(t.get("elapsed", 0.0))
        self.log(f"Resume from checkpoint file {path} at step {ckpt.step}")

    def _load_skips(self, skips: dict, own_train: bool) -> None:
        for phase, by_name in skips.items():
            if int(phase) == job_pb2.kTrain and self.group != 0 and not own_train:
                continue  # group 0's draw: another group keeps its own (its own shard of the data)
            for name, skip in by_name.items():
                feeds = [w.feeds for w in self.workers] if int(phase) == job_pb2.kTrain else [self.feeds.get(int(phase), {})]
                for f in feeds:
                    if name in f:
                        f[name].skip = int(skip)

    def _all_feeds(self) -> dict[int, dict[str, InputFeed]]:
        feeds = dict(self.feeds)
        if self.workers:
            feeds[job_pb2.kTrain] = self.workers[0].feeds
        return feeds

    # -- phases -----------------------------------------------------------
    def _context(self, phase: int, feeds: dict[str, InputFeed], cursor: int, window: MetricWindow) -> Context:
        return Context(
            phase=phase,
            generator=self.generator,
            feeds={name: feed.batch(cursor, self.device) for name, feed in feeds.items()},
            report=window.report,
            device=self.device,
        )

    def evaluate(self, phase: int, steps: int) -> dict[str, float]:
        """Run `steps` batches of the test or validation net; the store cursor moves on as SINGA's does."""
        net, feeds = self.nets[phase], self.feeds[phase]
        batch = self._eval_batch(phase)
        window = MetricWindow()
        carry = {} if net.samples else None  # a sampling net continues one sequence over its steps
        with torch.no_grad():
            for _ in range(steps):
                ctx = self._context(phase, feeds, self.cursors[phase], window)
                ctx.carry = carry
                net.forward(ctx)
                self.cursors[phase] += batch
        return window.averages()

    def train_step(self, step: int) -> int:
        """Train one batch on the whole group; return the number of samples it used."""
        # gradients may leave while backward still runs; asynchronous groups wait for their turn here
        self.exchange.begin(step)
        timings = self.timings

        seconds_of: dict[int, float] = {}  # worker index -> compute seconds this step

        def compute(w: Worker):
            if w.share == 0:  # balanced out of this step: its device only slowed the group down
                return {}, 0
            start = time.perf_counter()
            grads = w.compute(step, self.window.report)
            seconds_of[w.index] = time.perf_counter() - start
            timings.add_worker(w.index, seconds_of[w.index])
            return grads, w.share

        start = time.perf_counter()
        self.replicas.refresh()  # the root's values down the device tree: part of the exchange
        timings.exchange += time.perf_counter() - start
        start = time.perf_counter()
        parts = list(self.pool.map(compute, self.workers)) if self.pool else [compute(w) for w in self.workers]
        computed = time.perf_counter()
        self.exchange.step(step, parts)
        timings.compute += computed - start
        timings.exchange += time.perf_counter() - computed
        if self.balancer is not None:
            self._rebalance(step, [seconds_of.get(w.index) for w in self.workers])
        return self.global_batch

    # -- the loop ---------------------------------------------------------
    def run(self, metrics: Optional[MetricsLog]) -> History:
        """The loop; `metrics` is None on processes other than the chief."""
        job, history = self.job, History(self.workspace)
        self.metrics = metrics

        def record(step, phase, values, **kw):
            if self.metrics is not None:  # (a successor's, once it took a dead chief's place)
                history.records.append(self.metrics.write(step, phase, values, **kw))

        def run_phase(step: int, phase: int, steps: int, label: str) -> None:
            if not self.chief:
                self.owed[phase] += steps
                return
            if phase == job_pb2.kTest:
                self.last_test = (step, self.cursors[phase])
            values = self.evaluate(phase, steps)
            self.log(display_line(label, step, values))
            record(step, label.lower(), values, samples=self.eval_samples(phase, steps))

        bar = None
        if self.progress:
            from shoal.report.progress import TrainingBar

            bar = TrainingBar(job.train_steps, initial=self.start_step)
            self.log = bar.above(self.log)
        window_start = time.perf_counter()
        step, end = self.start_step, job.train_steps
        # past train_steps, Distributed Hogwild's groups train their share of the steps restarted groups skipped
        while step < end or (end := self._steps_to_train(end)) > step:
            resumed_here = self.resumed and step == self.start_step
            # (past train_steps, re-training skipped steps, the phases wait for the group's own last step: below)
            if not resumed_here and step < job.train_steps:  # the checkpoint we resumed from was taken after these ran
                paused = time.perf_counter()
                if job.validate_steps > 0 and fires(job.validate_freq, job.validate_after, step):
                    run_phase(step, job_pb2.kVal, job.validate_steps, "Validate")
                if job.test_steps > 0 and fires(job.test_freq, job.test_after, step):
                    run_phase(step, job_pb2.kTest, job.test_steps, "Test")
                if fires(job.checkpoint_freq, job.checkpoint_after, step):
                    self._stop_if_diverged(step - 1, read=True)
                    self.save_checkpoint(step)
                elif self.checkpoint_schedule is not None and self.checkpoint_schedule.due(self.group, step, self.chief):
                    self._interval_checkpoint(step)
                self.timings.paused += time.perf_counter() - paused
            for hook in self.hooks:
                hook.before_step(step)
            self.window_samples += self.train_step(step)
            for hook in self.hooks:
                hook.after_step(step)
            if self.may_take_over and not self.chief and self.exchange.chief:  # the chief died: this process decides now
                self._take_over(step)
            displays = fires(job.disp_freq, job.disp_after, step)
            self._stop_if_diverged(step, read=displays)
            if bar is not None:  # before a display resets the window: the bar's loss is never read from an empty one
                bar.advance(self.window)
            if displays:
                now = time.perf_counter()
                values = self.exchange.metrics(self.window)
                # asynchronous groups: throughput of the whole job, not of this group
                window_samples = values.pop("samples", self.window_samples)
                self.log(display_line("Train", step, values))
                seconds = max(now - window_start - self.timings.paused, 1e-9)  # training time only
                shares = {"batch_shares": self.shares} if len(self.workers) > 1 else {}
                record(step, "train", values, samples=window_samples, samples_per_sec=round(window_samples / seconds, 2),
                       window_sec=round(seconds, 6), **self.timings.fields(), **shares)
                self.window.reset()
                self.timings = StepTimings()
                window_start, self.window_samples = now, 0
            step += 1
        if bar is not None:
            bar.close()
        self._stop_if_diverged(step - 1, read=True)  # the steps since the last display
        self.exchange.finish()
        if self.may_take_over and not self.chief and self.exchange.chief:  # the chief died before its last word (Downpour,
            self._take_over(step - 1)  # Distributed Hogwild: shoal.comm.succession): the final test and checkpoint are this one's
        sent = self.exchange.job_bytes_sent  # the job's bytes to the last message (after the last display too)
        if self.metrics is not None and sent is not None:
            self.metrics.annotate(bytes_sent=sent)
        for hook in self.hooks:
            hook.before_final_test()
        if self.resumed and self.start_step >= job.train_steps:
            return history  # resumed from the final checkpoint: nothing left to do
        if self.metrics is not None and self.plan.strategy.retrains_skipped_steps and self.exchange.job_notes:
            self.metrics.annotate(**self.exchange.job_notes)  # the skipped steps, who re-trained them
        # at the group's own last step: train_steps, or past it where it re-trained skipped steps (Distributed Hogwild)
        last = max(step, job.train_steps)
        if job.validate_steps > 0 and job.validate_freq > 0:  # the trained model's validation, as its test below
            run_phase(last, job_pb2.kVal, job.validate_steps, "Validate")
        if job.test_steps > 0 and job.test_freq > 0:
            run_phase(last, job_pb2.kTest, job.test_steps, "Test")
        path = self.save_checkpoint(last)
        self.log(f"Checkpoint written to {path}")
        return history

    def _take_over(self, step: int) -> None:
        """A dead chief's duties, from the step after `step` (report/succession.py): its tests and validations, its run
        log and checkpoints, its interval checkpoints' schedule; its lines on the terminal too."""
        self.chief = True
        self.log = succession.on_the_terminal_too(self.say)
        self._build_evaluation(torch.Generator().manual_seed(self.job.seed))  # (the params exist: nothing is drawn)
        self.metrics = succession.take_over_run_log(self.plan, self.workspace, usable_device_names(self.plan.all_devices()),
                                                    self.rank, step)
        if self.checkpoint_schedule is not None:
            self.checkpoint_schedule.take_over()
        self.log(f"Process {self.rank} took the chief's place after step {step}: {self.exchange.duties_taken_over}")
        self.exchange.speak_for_the_job(self.log, summary_annotator(self))

    def _steps_to_train(self, end: int) -> int:
        """Where the loop ends, asked once it reached `end`: `end`, or where the exchange says this group trains to
        (Distributed Hogwild: its share of the steps restarted groups skipped, beyond train_steps)."""
        return self.exchange.steps_to_train(self.job.train_steps) if self.plan.strategy.retrains_skipped_steps else end

    def _interval_checkpoint(self, step: int) -> None:
        """The checkpoint (or this trainer's part) of `step`, which the chief chose when checkpoint_interval_s had passed."""
        self._stop_if_diverged(step - 1, read=True)
        path = self.save_checkpoint(step)
        self.interval_steps.add(step)  # (the job's own: a partitioned group's mirror never removes it)
        if self.chief:
            self.checkpoint_schedule.written(step)
            self.log(f"Checkpoint written to {path} (every {self.plan.checkpoint_interval_s:g} s: checkpoint_interval_s)")

    def _stop_if_diverged(self, step: int, read: bool) -> None:
        """A non-finite loss stops the run. Losses on the host are checked every step; a device's are read (a wait
        for the device) only when `read`: at a display, a checkpoint and the end of training."""
        diverged = self.window.non_finite(read=read)
        if diverged:
            name, value = next(iter(diverged.items()))
            raise Diverged(f"step {step}: {name} is {value} (group {self.group}); stopped before training on or saving "
                           "non-finite params: lower the learning rate or check the data")

    def test_only(self, metrics: Optional[MetricsLog], step: int, cursor: int = 0) -> dict[str, float]:
        """test_steps batches of the test net from `cursor` (samples into the test data)."""
        self.cursors[job_pb2.kTest] = cursor
        values = self.evaluate(job_pb2.kTest, self.job.test_steps)
        if self.nets[job_pb2.kTest].samples:
            self.log("")  # end the line of generated text
        self.log(display_line("Test", step, values))
        if metrics is not None:
            metrics.write(step, "test", values, mode="test-only")
        return values
