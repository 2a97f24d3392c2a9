"""Several workers in one process in a user's loop: `run.each_worker(train)` runs `train(worker)` once per worker of
this process, each in a thread of its own, as the job path's Trainer runs its workers (runtime/trainer.py).

    run = shoal.session()                           # e.g. --set cluster.nworkers_per_group=2 --set cluster.nworkers_per_procs=2
    def train(worker):                              # the loop's body, once per worker of this process
        model = worker.model(make_model())          # this worker's replica, on its device, equal to worker 0's
        opt = worker.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        for step, batch in worker.batches(train_set, batch_size=12):   # this worker's rows of the group's batch
            loss = loss_fn(model, batch); loss.backward()              # the group's mean gradient in .grad
            opt.step(); opt.zero_grad()
            worker.log(step, loss=loss)
            if step % 100 == 0: worker.checkpoint()                    # every worker calls it; one file is written
    run.each_worker(train)

A `SessionWorker` has the session's loop calls (model, optimizer, batches, steps, log, evaluate, checkpoint,
accumulating, scheduler) for one worker; the process's `Session` keeps what is per process (the exchange, the run log,
checkpoints), and its calls are made once, from the worker threads' meetings (`LocalWorkers.meet`: the last worker to
arrive runs the process's part). With one worker in the process, `each_worker(train)` calls `train(run)` here: the
same body runs every layout. Layouts (session_start.several_workers_in_a_process): one synchronous group, in-memory
or AllReduce over processes, Local SGD / DiLoCo and Distributed Hogwild with one group per process (Hogwild's threads
on the group's one copy, which worker 0's optimizer updates and its syncs reach), in-memory Downpour and Hogwild (each
group's workers' gradients meet in their mean, which their opt.step()s push once to the process's in-process server,
`_push`; the groups run freely, meeting only at a checkpoint's step), and Downpour's groups and Sandblaster's group with server processes
(each process one group's workers: their mean, Sandblaster's over the group's processes, pushed once by the process,
`_push_process`; the process's workers share one copy of the params, which takes the servers' answer, as a job
file's group's workers share its store). Under the others each worker's gradients meet in
`LocalMean`, which hands every local worker's (gradients, rows) to the exchange's `mean_gradients(step, parts)` as
the Trainer does (one process, or a Local SGD group between meetings: their mean here), and puts the group's mean in
every replica's `.grad`; every replica then applies its own copy of the user's update to the same mean, so the
replicas stay equal (a Local SGD meeting, inside the workers' opt.step(), copies its anchor into each:
WorkerThreads.boundary). The process's part of its workers' loop, which they meet to run once: session_threads.py.
"""
from __future__ import annotations

import copy
import functools
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch

from shoal.data.in_place import reader_for, to_device
from shoal.frontend import session_state
from shoal.frontend.fit_inputs import as_dataset
from shoal.frontend.session_start import SessionError, group_shares, measures_shares
from shoal.runtime import session_exchange
from shoal.runtime.exchanges.local import aggregate


class WorkerFailed(SessionError):
    """Another worker of this process stopped: this one stops too (the first one's error is the one raised)."""


class LocalWorkers:
    """The meeting point of one process's worker threads: `meet(action)` returns once every worker arrived, the last
    one having run `action()` (the process's part: its result is returned to every worker); a worker that fails breaks
    every meeting, present and future, so that no thread waits for it."""

    def __init__(self, count: int):
        self.count = count
        self.linked: list["LocalWorkers"] = []  # a group's own meetings in this process: they fail with this one
        self._cond = threading.Condition()
        self._arrived = 0
        self._generation = 0
        self._result: Any = None
        self.broken: Optional[BaseException] = None
        self._excused = 0  # workers whose group has not started yet (a warm-up's): no meeting waits for them

    def excuse(self, count: int) -> None:
        """`count` workers whose group starts after group 0's warm-up miss the meetings until `admit()`: group 0 trains
        (and checkpoints) alone meanwhile. Called from a meeting's action (every worker there), so none is under way."""
        with self._cond:
            self.count -= count
            self._excused += count

    def admit(self) -> None:
        """The excused workers meet again from now (called from group 0's step boundary where its warm-up ends)."""
        with self._cond:
            self.count += self._excused
            self._excused = 0
            self._cond.notify_all()

    def wait_admitted(self) -> None:
        """An excused worker waits here for `admit()` (or for another worker's failure, which it raises)."""
        with self._cond:
            while self._excused and self.broken is None:
                self._cond.wait()
            if self.broken is not None:
                raise WorkerFailed("another worker of this process stopped")

    def meet(self, action: Optional[Callable[[], Any]] = None) -> Any:
        with self._cond:
            if self.broken is not None:
                raise WorkerFailed("another worker of this process stopped")
            generation = self._generation
            self._arrived += 1
            if self._arrived == self.count:
                try:
                    self._result = action() if action is not None else None
                except BaseException as err:
                    self.fail(err)
                    raise
                self._arrived, self._generation = 0, generation + 1
                self._cond.notify_all()
                return self._result
            while self._generation == generation and self.broken is None:
                self._cond.wait()
            if self._generation == generation:
                raise WorkerFailed("another worker of this process stopped")
            return self._result

    def fail(self, err: BaseException) -> None:
        with self._cond:
            if self.broken is None:
                self.broken = err
            self._cond.notify_all()
        for linked in self.linked:
            linked.fail(err)


class StopsMeetings:
    """Linked to the process's LocalWorkers under Local SGD / DiLoCo's groups in one process: a worker's failure abandons
    the groups' meeting too (runtime/exchanges/periodic.py's InMemoryMeeting), so that no group's thread waits there."""

    def __init__(self, meeting):
        self.meeting = meeting

    def fail(self, err: BaseException) -> None:
        self.meeting.abandon()


class LocalMean:
    """The group's mean gradient for every worker of this process (the session's `mean`): each worker's backward ends
    in `mean_gradients(step, [(its grads, its rows)])`; the last to arrive hands all of them to the exchange (over
    processes: the replicated exchange, as the Trainer hands its workers' parts) or takes their mean here (one
    process), and each worker gets its own copy on its device (its clip_grad_norm_ scales it in place)."""

    def __init__(self, workers: "list[SessionWorker]", local: LocalWorkers, exchange):
        self.workers, self.local, self.exchange = workers, local, exchange
        self.parts: dict[int, tuple[dict, int]] = {}
        self.seconds = 0.0  # (the session's display reads and resets it)
        self.measured = None  # cluster.auto_batch_shares: the group's balancer (session_shares.MeasuredShares)

    def mean_gradients(self, index: int, step: int, parts: list[tuple[dict, int]]) -> dict:
        """Worker `index`'s part in, once every worker's is: the group's mean, as worker `index`'s own copy."""
        (self.parts[index],) = parts
        if self.measured is not None:  # (its compute time: from the batch it was handed to here)
            self.measured.computed(index)
        together = self.local.meet(lambda: self._mean(step))
        device = self.workers[index].device
        return {n: None if g is None else g.to(device, copy=True) for n, g in together.items()}

    def _mean(self, step: int) -> dict:
        started = time.perf_counter()
        parts = [self.parts[k] for k in range(len(self.workers))]
        self.parts = {}
        if self.exchange is not None:
            mean = self.exchange.mean_gradients(step, parts)
        else:  # one process: Σ rows_w · g_w / Σ rows_w, in Caffe's tree order (the in-memory Trainer's sum), on worker
            mean = aggregate(parts, target=self.workers[0].device)  # 0's device (the job path's root, where it updates)
            mean = {n: mean.get(n) for n in parts[0][0]}
        self.seconds += time.perf_counter() - started
        if self.measured is not None:  # (every worker's time of this step is in)
            self.measured.observe(step)
        return mean

    @contextmanager
    def accumulating(self) -> Iterator[None]:  # (each worker pauses its own hooks: SessionWorker.accumulating)
        yield

    def remove(self) -> None:
        for worker in self.workers:
            if worker.mean is not None:
                worker.mean.remove()


class LocalMeans:
    """In-memory groups of several workers: each group's LocalMean, as the session's one `mean` (its display's
    seconds, the hooks removed at the end)."""

    def __init__(self, means: list[LocalMean]):
        self.means = means

    @property
    def seconds(self) -> float:
        return sum(mean.seconds for mean in self.means)

    @seconds.setter
    def seconds(self, value: float) -> None:
        for mean in self.means:
            mean.seconds = value

    def remove(self) -> None:
        for mean in self.means:
            mean.remove()


def refresh_replicas(workers: "list[SessionWorker]") -> None:
    """A group's workers on devices of different kinds (a device list's CPU+GPU split, each worker its own replica that
    its optimizer updates): after the step's update every replica off its group's first worker's device takes that
    worker's values, as the job path refreshes its replicas from the group's root before each step
    (runtime/replicas.DeviceReplicas), so that the replicas stay equal where two devices round an update differently."""
    firsts: dict[int, SessionWorker] = {}
    with torch.no_grad():
        for worker in workers:
            first = firsts.setdefault(worker.group, worker)
            if worker.device != first.device:
                for mine, theirs in zip(worker.module.parameters(), first.module.parameters()):
                    mine.copy_(theirs)


def drop_grads(optimizer: torch.optim.Optimizer) -> None:
    """After a push: `.grad` None, so the user's optimizer, which runs next, updates nothing here (the servers did)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None


def own_copy(state: dict) -> dict:
    """A saved state's copy for one replica's optimizer (load_state_dict keeps tensors already on the param's device
    and dtype: two replicas loading one dict would update the same moments in place, twice a step)."""
    return copy.deepcopy(state)


def restore_worker(mine, optimizers: list, schedulers: list, saved_state: Callable[[int], dict]) -> None:
    """On a resume, at the loop's start, a worker other than 0: session_state.restore_resumed's schedulers and
    optimizers (the random generators are the process's: worker 0's restore set them), each from its own copy;
    `saved_state(index)`: optimizer `index`'s state_dict as the session gives it (Session._saved_optimizer_state)."""
    saved = mine.trainer.get("schedulers", [])
    if len(saved) != len(schedulers):
        raise SessionError(f"--resume: the checkpoint holds {len(saved)} scheduler(s), this worker's loop has {len(schedulers)}")
    for scheduler, state in zip(schedulers, saved):
        scheduler.load_state_dict(own_copy(state))
    for index, optimizer in enumerate(optimizers):
        optimizer.load_state_dict(own_copy(saved_state(index)))


class WorkerMean:
    """What one worker's GradientMean hands its gradients to: the process's LocalMean, as worker `index`."""

    def __init__(self, mean: LocalMean, index: int):
        self.mean, self.index = mean, index

    def mean_gradients(self, step: int, parts: list[tuple[dict, int]]) -> dict:
        return self.mean.mean_gradients(self.index, step, parts)


class FreeRunningInterval:
    """checkpoint_interval_s for in-memory asynchronous groups, which run freely: their checkpoint is a meeting of every
    worker of the process, and the workers may be many steps apart, so once the time is up the first to ask sets it at
    the step after the furthest any worker is at (`furthest`), which none has ended yet."""

    def __init__(self, seconds: float, furthest: Callable[[], int]):
        self.seconds, self.last, self.furthest = seconds, time.monotonic(), furthest
        self._lock = threading.Lock()
        self._at: Optional[int] = None  # the step after which the next checkpoint is written

    def due_after(self, step: int) -> bool:
        """Whether the checkpoint comes after `step` (asked by every worker at the end of each step, and by the meeting)."""
        with self._lock:
            if self._at is None and time.monotonic() - self.last >= self.seconds:
                self._at = self.furthest() + 1
            return step == self._at

    def written(self) -> None:
        """The meeting wrote it (every worker is there): the next interval counts from now."""
        with self._lock:
            self.last, self._at = time.monotonic(), None


class SessionWorker:
    """One worker of this process in a user's loop: the session's loop calls for this worker's replica (on its device),
    its rows and its optimizers. `index`: its place in this process (0 holds what the process checkpoints);
    `worker`, `group`: its place in the job; `rank`: the process's."""

    def __init__(self, run, index: int, hosted, device: torch.device, local: LocalWorkers):
        self.run, self.index, self.local, self.device = run, index, local, device
        self.group, self.worker, self.rank = hosted.group, hosted.id, run.rank
        self.module: Optional[torch.nn.Module] = None
        self.optimizers: list[torch.optim.Optimizer] = []
        self.schedulers: list = []
        self.mean: Optional[session_exchange.GradientMean] = None
        self.pushes_to = None  # in-memory Downpour / Hogwild: this worker's group's exchange to the in-process server
        # in-memory groups and pushes to server processes: the workers of this worker's group in this process (the
        # first's params are the group's copy, which the others share) and their meetings
        self.group_workers: list["SessionWorker"] = [self]
        self.group_local = local
        self.share = 0
        self.offset = 0  # its first row in the group's batch (run.batches)
        # cluster.auto_batch_shares: the (offset, share) the group's balancer gave it, taken as its next step starts, and
        # when that step's batch was handed to it (its compute time runs from there: session_shares.MeasuredShares)
        self.pending: Optional[tuple[int, int]] = None
        self.handed = 0.0
        self.global_batch = 0  # the group's batch (pushes to server processes: the stub's weights)
        self.at = run.start_step  # the step this worker's loop is at
        self.first_step = run.start_step  # its loop's first (in-memory groups other than 0: after group 0's warm-up)

    @property
    def chief(self) -> bool:
        """The job's first worker (the chief process's worker 0): it writes the metrics and evaluates."""
        return self.run.chief and self.index == 0

    @property
    def label(self) -> str:
        return self.run.label

    @property
    def processes(self) -> int:
        return self.run.processes

    @property
    def step(self) -> int:
        """The step this worker trains (in-memory asynchronous groups run freely: each group at its own)."""
        return self.at if self.run.groups_in_memory else self.run.step

    @property
    def exchange(self):
        return self.run.exchange

    # -- the user's objects ------------------------------------------------------------------------------
    def model(self, module: torch.nn.Module) -> torch.nn.Module:
        """The module itself, on this worker's device, its values worker 0's (the checkpoint's, or rank 0's over
        processes) on every replica; its gradients become the group's mean at the end of each backward."""
        if not isinstance(module, torch.nn.Module):
            raise SessionError(f"worker.model: expected a torch.nn.Module, got {type(module).__name__}")
        if self.module is not None:
            raise SessionError("worker.model: one module per worker")
        self.module = module.to(self.device)
        self.local.meet(self.run._threads.adopt_modules)
        return module

    def optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The user's optimizer itself, over this worker's replica: each replica applies the same mean gradient."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise SessionError(f"worker.optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if self.index == 0:  # the process's: checkpointed, its step the step boundary
            self.run.optimizer(optimizer)
        elif self.run._mine is not None:
            optimizer.load_state_dict(own_copy(self.run._saved_optimizer_state(len(self.optimizers), optimizer, self.module,
                                                                               self.group)))
        if not self.optimizers and self.run.distributed and self.run.plan.strategy.meets:
            # Local SGD / DiLoCo meet inside opt.step(), as for one worker: once every worker's replica is updated (not
            # at the zero-gradient step that makes a restarted process's optimizer state, inside the loop start's meeting)
            optimizer.register_step_post_hook(lambda *_: self.run._receiving or self.local.meet(
                lambda: self.run._threads.boundary(self.run.step)))
        elif not self.optimizers and self.run.meets_in_memory:  # (its groups in this process: each meets in its threads)
            optimizer.register_step_post_hook(lambda *_: self.group_local.meet(
                lambda: self.run._threads.group_boundary(self.group, self.run.step)))
        self.optimizers.append(optimizer)
        if self.run.groups_in_memory or self.run.pushes:
            if len(self.optimizers) > 1:
                raise SessionError(f"worker.optimizer: {self.label}'s server runs one optimizer over the module: give "
                                   "worker.optimizer one optimizer holding every trained param")
        if self.index and self.run._update_lock is not None:  # Distributed Hogwild: worker 0's optimizer updates the
            optimizer.register_step_pre_hook(lambda opt, *_: drop_grads(opt))  # group's one copy, which they all share
        if self.run.groups_in_memory:
            optimizer.register_step_pre_hook(self._push)
            self.local.meet(self.run._threads.start_groups)
        elif self.run.pushes:  # (worker 0's run.optimizer made the exchange to the servers, from its recipe)
            optimizer.register_step_pre_hook(self._push_process)
            self.local.meet(self.run._threads.pushing)
        elif self.run.sliced:  # server slices: the process updates its slices once, when every worker got here
            optimizer.register_step_pre_hook(functools.partial(self._update_slices, len(self.optimizers) - 1))
        return optimizer

    def _update_slices(self, index: int, optimizer, args, kwargs) -> None:
        """Server slices: once every worker reached its optimizer `index`'s step, the process's one update of its slices
        (WorkerThreads.slices_step: every replica then holds the new values); `.grad` is left None, so the user's
        optimizer, which runs next, updates nothing here."""
        self.local.meet(lambda: self.run._threads.slices_step(index))
        drop_grads(optimizer)

    def _push(self, optimizer, args, kwargs) -> None:
        """In-memory Downpour's and Hogwild's step: this group's gradients (after the loop's clip_grad_norm_; several
        workers: their mean, which every worker of the group holds, pushed once, when they all got here) to the
        in-process server with the group's optimizer's hyper-parameters; the server's new values are then in the
        group's params (Downpour: its copy takes them; Hogwild: the server updated the one copy in place); `.grad` is
        left None, so the user's optimizer, which runs next, updates nothing here (session_pushes.push over processes)."""
        self.group_local.meet(self._push_group)
        drop_grads(optimizer)

    def _push_group(self) -> None:
        first = self.group_workers[0]
        grads = {n: p.grad for n, p in first.module.named_parameters() if p.requires_grad}
        started = time.perf_counter()
        self.pushes_to.step(first.at, [(grads, sum(worker.share for worker in self.group_workers))])
        with self.run._window_lock:
            self.run.exchange_seconds += time.perf_counter() - started

    def _push_process(self, optimizer, args, kwargs) -> None:
        """Downpour's and Sandblaster's step with several workers in the process (one group's): once every worker got
        here, the process's push of their mean (every worker holds it: Sandblaster's the group's, the stub's pushed
        whole) to the servers, whose answer lands in the params the workers share (session_pushes.push for one worker); not at
        the zero-gradient step that makes a restarted process's optimizer state (inside the loop start's meeting)."""
        if self.run._receiving:
            return
        self.local.meet(self.run._threads.push)
        drop_grads(optimizer)

    def scheduler(self, scheduler, steps: str = "group"):
        """Checkpoint a scheduler made after the loop started (those made before are found by themselves); `steps`:
        run.scheduler's (worker 0's schedule by update sets every group's)."""
        if steps not in session_exchange.SCHEDULER_STEPS:
            raise SessionError(f"worker.scheduler: steps is 'group' (each asynchronous group's own steps) or 'update' "
                               f"(the servers' updates, every group's), got {steps!r}")
        if self.index == 0:
            self.run.scheduler(scheduler, steps)
        if scheduler not in self.schedulers:
            self.schedulers.append(scheduler)
        return scheduler

    @contextmanager
    def accumulating(self) -> Iterator[None]:
        """Backward passes inside add to `.grad` without the group's mean (as DDP's no_sync); every worker of the
        group accumulates alike."""
        if self.mean is None:
            yield
            return
        with self.mean.accumulating():
            yield

    # -- data --------------------------------------------------------------------------------------------
    def batches(self, dataset, batch_size, shuffle: bool = True, seed: Optional[int] = None) -> Iterator[tuple[int, Any]]:
        """(step, this worker's rows of the group's batch of `batch_size`) for each step to train_steps, on its device:
        the rows one worker with the whole batch reads, split over the group's workers evenly or as a list of one
        share per worker says (`session_start.group_shares`: [12, 4], Caffe con Troll's split by hand; planning/shares.py; under
        cluster.auto_batch_shares re-split by their measured speeds as the loop goes: session_shares.py)."""
        shares = group_shares(batch_size, self.run.plan.nworkers_per_group, "worker.batches")
        if self.module is None:
            raise SessionError("worker.batches: give the module to worker.model(...) first")
        data = as_dataset(dataset, "worker.batches")
        offset, share, batch_size = sum(shares[: self.worker]), shares[self.worker], sum(shares)
        skip = self.run.plan.group_shards.offset(self.group, 0, len(data))  # (Local SGD's groups: disjoint shards)
        reader = reader_for(data, self.run.job.seed if seed is None else seed, shuffle, batch_size)
        self.global_batch, self.offset = batch_size, offset
        yield from self._steps(share, lambda step: (step, to_device(
            reader.batch(skip + step * batch_size + self.offset, self.share), self.device)))  # (its rows this step)

    def steps(self, rows: int = 1) -> Iterator[int]:
        """Each step to train_steps, for a loop that reads its own data (each worker draws its own rows)."""
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise SessionError(f"worker.steps: rows must be a whole number from 1, got {rows!r}")
        if self.module is None:
            raise SessionError("worker.steps: give the module to worker.model(...) first")
        if measures_shares(self.run.plan):
            raise SessionError("worker.steps: cluster.auto_batch_shares re-splits the group's batch that worker.batches "
                               "reads, not rows your loop reads itself: use worker.batches, or leave auto_batch_shares unset")
        self.global_batch = rows * self.run.plan.nworkers_per_group
        yield from self._steps(rows, lambda step: step)

    def _steps(self, share: int, item: Callable[[int], Any]) -> Iterator[Any]:
        self.share = share
        if self.mean is not None:
            self.mean.share = share
        self.local.meet(self.run._threads.start_loop)
        if self.first_step > self.run.start_step:  # its group starts once group 0's warm-up (cluster.warmup_steps) ended
            self.local.wait_admitted()
        step, end = self.first_step, self.run.job.train_steps
        # under restarts, past train_steps a Distributed Hogwild group trains its share of the steps restarted groups
        # skipped (asked once for the process's workers: WorkerThreads.steps_to_train)
        retrains = self.run.plan.strategy.retrains_skipped_steps and self.run.plan.max_restarts > 0
        while step < end or (retrains and (end := self._steps_to_train(step)) > step):
            self.at = step
            if self.pushes_to is not None and self is self.group_workers[0]:  # (in-memory groups: the board's turn,
                self.pushes_to.begin(step)                                      # and the server's version read)
            if self.pending is not None:  # (the group's balancer re-split its batch at the last step's mean)
                (self.offset, self.share), self.pending = self.pending, None
                if self.mean is not None:
                    self.mean.share = self.share
            self.handed = time.perf_counter()
            try:
                yield item(step)
            except GeneratorExit:  # the loop broke out: before the last step the others must not wait for this worker
                if step + 1 < end:
                    self.local.fail(WorkerFailed(f"worker {self.index} left its loop at step {step}"))
                    raise
                self._step_done(step)
                self.local.meet(self.run._finish)
                raise
            self._step_done(step)
            step += 1
        self.local.meet(self.run._finish)

    def _steps_to_train(self, step: int) -> int:
        self.local.meet(lambda: self.run._threads.steps_to_train(step))
        return self.run._threads.end

    def _step_done(self, step: int) -> None:
        """The end of this worker's step. In-memory Downpour's and Hogwild's groups run freely, as a job file's group
        threads do (SINGA: the workers of a group are synchronous, groups asynchronous to each other): only the group's
        own workers meet, and group 0's meeting is the process's step boundary (its displays, as a job file's chief
        group); every worker meets at a checkpoint's step, so the file holds every group at one step, and at the last,
        so the last display counts every group's rows. Elsewhere the process's workers end each step together."""
        last = step + 1 == self.run.job.train_steps
        if self.run.meets_in_memory:  # (a group whose update the loop skipped meets here: every group counts each step)
            self.group_local.meet(lambda: self.run._threads.group_boundary(self.group, step))
        if self.run.groups_in_memory and not last and not self.run.checkpoints_after(step):
            self.group_local.meet(lambda: self.run._threads.group_step_done(self.group, step))
        else:
            self.local.meet(lambda: self.run._threads.step_done(step))

    # -- metrics and checkpoints -------------------------------------------------------------------------
    def log(self, step: int, **values) -> None:
        """Metrics of this step (means over this worker's rows): averaged over the process's workers by their rows. In-memory
        asynchronous groups run freely, and their displays are group 0's losses (a job file's chief group's; every
        group's rows): the other groups' values are not averaged in at whatever step each has reached."""
        if (self.run.groups_in_memory or self.run.meets_in_memory) and self.group != 0:
            return
        with self.run._window_lock:
            for name, value in values.items():
                if isinstance(value, torch.Tensor):
                    value = value.detach()
                self.run.window.report(name, value, self.share)

    def evaluate(self, dataset, loss_fn: Callable, **options) -> dict:
        """run.evaluate on the chief's worker 0's replica (the replicas are equal); the other workers return {}."""
        if self.index != 0:
            return {}
        return self.run.evaluate(dataset, loss_fn, **{"model": self.module, **options})

    def checkpoint(self):
        """The session's checkpoint after this step's update (worker 0's replica, optimizers and schedulers: every
        replica holds the same); every worker of the process calls it (the loop's body is the same), and it is written
        once they all did, so the display window it closes holds every worker's rows."""
        return self.local.meet(self.run._checkpoint)
