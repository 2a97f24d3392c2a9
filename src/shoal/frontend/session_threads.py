"""Several workers in one process in a user's loop: the process's part of its worker threads (`WorkerThreads`).

`run.each_worker(train)` runs `train(worker)` once per worker of this process, each in a thread of its own
(`WorkerThreads.run_each`); each `SessionWorker` (session_worker.py) has the loop's calls for its replica, and where the
process acts once for all of them its threads meet (`LocalWorkers.meet`) and the last to arrive runs the process's
part here: the modules adopted (worker 0's the process's; the workers of a group on one copy, or each on its replica
with their mean gradient: `adopt_modules`, `form_groups`), the exchanges made once every worker gave its optimizer (the
in-memory groups' server, `start_groups`; Local SGD / DiLoCo's groups meeting in memory, `start_meetings`; the pushes
to server processes, `pushing`, `push`), the loop's start (`start_loop`: a resume's state, a restarted process's
handover, the warm-up), and each step's end (`boundary`, `group_boundary`, `step_done`, `group_step_done`). The
`Session` (frontend/session.py) keeps what is per process: the exchange, the run log, the display window, checkpoints.
"""
from __future__ import annotations

import threading
import time
import warnings
from typing import Any, Callable, Optional

import torch

from shoal.comm.succession import say_chief_started
from shoal.frontend import (session_healing, session_pushes, session_server_slices, session_shares, session_state,
                            session_worker)
from shoal.frontend.session_start import SessionError
from shoal.neuralnet import checkpoint as ckpt_io
from shoal.neuralnet.params import ParamStore
from shoal.report.metrics import MetricWindow
from shoal.runtime import session_exchange
from shoal.runtime.replicas import torch_device, usable_device_names


class WorkerThreads:
    """This process's workers (one `SessionWorker` each, on its device) and the process's part of their loop."""

    def __init__(self, run):
        self.run = run
        local = session_worker.LocalWorkers(run.local_workers)
        devices = usable_device_names(run.plan.devices_of(run.rank))
        self.workers = [session_worker.SessionWorker(run, k, hosted, torch_device(devices[k]), local)
                        for k, hosted in enumerate(run.plan.process(run.rank).workers)]
        self.meetings: list = []  # Local SGD / DiLoCo's groups in this process: each group's PeriodicExchange (group order)
        self.group_met_at: dict[int, int] = {}  # (their groups: the step whose boundary each group's threads ran)
        self.met_at = -1  # under Local SGD / DiLoCo over processes: the step whose boundary ran (`boundary`)
        self.warmup_ends = 0  # in-memory groups with a warm-up: the step after whose boundary the other groups start
        self.end = run.plan.job.train_steps  # the step they train to (Distributed Hogwild's retraining moves it)

    def run_each(self, train: Callable[[Any], Any]) -> list:
        """`train(worker)` in one thread per worker, their results in worker order; a worker's error stops the others
        and is raised here (the first that is not another's WorkerFailed)."""
        local = self.workers[0].local
        results: list = [None] * len(self.workers)
        errors: list[Optional[BaseException]] = [None] * len(self.workers)

        def body(k: int) -> None:
            try:
                results[k] = train(self.workers[k])
            except BaseException as err:  # (SystemExit too: it ends this thread only; the process ends it below)
                errors[k] = err
                local.fail(err)

        threads = [threading.Thread(target=body, args=(k,), name=f"shoal worker {k}", daemon=True)
                   for k in range(len(self.workers))]
        for thread in threads:
            thread.start()
        try:
            for thread in threads:
                while thread.is_alive():
                    thread.join(0.2)
        except BaseException as err:  # (Ctrl-C): the workers stop at their next meeting
            local.fail(err)
            raise
        first = next((e for e in errors if e is not None and not isinstance(e, session_worker.WorkerFailed)),
                     next((e for e in errors if e is not None), None))
        if first is not None:
            raise first
        return results

    def adopt_modules(self) -> None:
        """Every worker gave its module (run by the last to arrive): worker 0's is the process's (checkpoint, exchange,
        rank 0's values), copied into the others; each worker's gradients go to the process's LocalMean."""
        run = self.run
        if len({id(worker.module) for worker in self.workers}) < len(self.workers):
            raise SessionError("worker.model: each worker trains a replica of its own: build the module inside the "
                               "function run.each_worker runs (or give it copy.deepcopy(model))")
        first = self.workers[0].module
        run._model(first, own_mean=False)
        values = first.state_dict()
        for worker in self.workers[1:]:
            worker.module.load_state_dict(values)
        if run.groups_in_memory or run.pushes:  # each group's pushes start at worker.optimizer
            self.form_groups()
            return
        if run.meets_in_memory:  # Local SGD / DiLoCo's groups in this process: each group's workers' mean, its meetings
            self.form_groups()
            self.start_meetings()
            return
        if run._update_lock is not None:  # Distributed Hogwild: the group's workers compute on its one copy (worker
            for worker in self.workers[1:]:  # 0's params, which its masters' syncs reach), which worker 0's optimizer
                for mine, theirs in zip(worker.module.parameters(), first.parameters()):  # updates (the group's store
                    mine.data = theirs.data                                               # of a job file's threads)
        # a synchronous group's mean goes through its exchange; a Local SGD or Hogwild group's workers' mean stays here
        # (the groups meet, or sync, at the step boundary)
        run.mean = session_worker.LocalMean(self.workers, self.workers[0].local,
                                            run.exchange if run.plan.strategy.synchronous else None)
        for k, worker in enumerate(self.workers):
            trained = [(n, p) for n, p in worker.module.named_parameters() if p.requires_grad]
            worker.mean = session_exchange.GradientMean(trained, session_worker.WorkerMean(run.mean, k), worker.share,
                                                        lambda: run.step)

    def form_groups(self) -> None:
        """In-memory Downpour and Hogwild, and Downpour's and Sandblaster's pushes to server processes: the workers of a
        group in this process compute on the group's one copy (its first worker's params, as the job path's group's
        workers view its store; in-memory Hogwild's groups all on worker 0's, the server's), and with several of them
        their gradients meet in one LocalMean (a group's synchronous inside): when backward ends each holds the group's
        mean (Sandblaster's over the group's processes, from worker.optimizer on: `pushing`), which their
        opt.step()s push once (session_worker.py's _push, _push_process). Local SGD / DiLoCo's groups in one process
        group their workers alike, each worker on a replica of its own that its optimizer updates with the group's mean
        (as a group's threads over processes: the replicas stay equal)."""
        run = self.run
        groups: dict[int, list[session_worker.SessionWorker]] = {}
        for worker in self.workers:
            groups.setdefault(worker.group, []).append(worker)
        one_copy = run.groups_in_memory and run.plan.strategy.shares_one_store()
        means = []
        for members in groups.values():
            copy_of = self.workers[0] if one_copy else members[0]
            for worker in members:
                if worker is not copy_of and not run.meets_in_memory:
                    for mine, theirs in zip(worker.module.parameters(), copy_of.module.parameters()):
                        mine.data = theirs.data
            # the group's meetings (over processes the process's: it hosts one group's workers)
            local = members[0].local if run.pushes else session_worker.LocalWorkers(len(members))
            if local is not members[0].local:
                members[0].local.linked.append(local)  # (a worker that fails stops its group's meetings too)
            for worker in members:
                worker.group_workers, worker.group_local = members, local
            if len(members) > 1:
                mean = session_worker.LocalMean(members, local, None)
                means.append(mean)
                for k, worker in enumerate(members):
                    trained = [(n, p) for n, p in worker.module.named_parameters() if p.requires_grad]
                    worker.mean = session_exchange.GradientMean(trained, session_worker.WorkerMean(mean, k), worker.share,
                                                                lambda worker=worker: worker.step)
        if means:
            run.mean = means[0] if run.pushes else session_worker.LocalMeans(means)

    def start_meetings(self) -> None:
        """Local SGD / DiLoCo's groups as this process's threads (run by the last worker to give its module): each group's
        replicas take its checkpoint part's values (resumed), and the strategy's PeriodicExchange of each group views its
        first worker's params and meets the others in memory (session_exchange.meeting_exchanges); group 0's is the
        session's exchange (the chief's checkpoint file, summary.json). A worker's failure abandons the meetings, so that
        no group's thread waits there for a group that stopped."""
        run = self.run
        firsts = sorted({id(w.group_workers[0]): w.group_workers[0] for w in self.workers}.values(), key=lambda w: w.group)
        if run._mine is not None:
            for worker in self.workers:
                if worker.group:  # (group 0's took the chief's file in _model)
                    session_state.load_module(worker.module, run._group_part(worker.group).params)
        if run.plan.job.cluster.outer_updater.user_type:  # (outer_optimizer=: a torch optimizer over these params)
            from shoal.frontend import session_outer

            session_outer.bind(run.plan, firsts[0].module)
        stores = [ParamStore.viewing([(n, p.data) for n, p in first.module.named_parameters() if p.requires_grad])
                  for first in firsts]
        saved = [dict(run._group_part(first.group).exchange) if run._mine is not None else None for first in firsts]
        self.meetings = session_exchange.meeting_exchanges(run.plan, stores, run.start_step, saved, run.metrics)
        run.exchange = self.meetings[0]
        self.workers[0].local.linked.append(session_worker.StopsMeetings(run.exchange.meeting))

    def group_boundary(self, group: int, step: int) -> None:
        """Local SGD / DiLoCo's groups in one process: every worker of group `group` updated after step `step` (run by
        the last of them to arrive, in their thread, inside its opt.step() as one worker's post-hook over processes; or
        at the step's end where the loop skipped the update): the group's exchange steps, meeting the other groups'
        threads in memory when due, and its new anchor is then in every replica of the group."""
        run = self.run
        if self.group_met_at.get(group) == step:
            return
        self.group_met_at[group] = step
        exchange, members = self.meetings[group], [w for w in self.workers if w.group == group]
        started = time.perf_counter()
        try:  # (the user's optimizers made the inner update: the exchange's own applies nothing)
            exchange.step(step, [({}, sum(worker.share for worker in members))])
        except Exception:  # (GroupsAborted) another worker stopped and abandoned the meetings: its error is the one raised
            if self.workers[0].local.broken is not None:
                raise session_worker.WorkerFailed("another worker of this process stopped") from None
            raise
        with run._window_lock:
            run.exchange_seconds += time.perf_counter() - started
        if exchange.meets_after(step):
            with torch.no_grad():
                for worker in members[1:]:
                    for mine, theirs in zip(worker.module.parameters(), members[0].module.parameters()):
                        mine.copy_(theirs)

    def write_group_parts(self, done: int) -> dict[str, bool]:
        """Local SGD / DiLoCo's groups in one process, at a checkpoint: every group but 0 writes its part, as its process
        would over processes (its first worker's module, optimizers and schedulers, its exchange's values, anchor and
        outer state; its data position is the step's); returns them as the chief's file lists them (required)."""
        run = self.run
        parts = {}
        for exchange in self.meetings[1:]:
            first = next(w for w in self.workers if w.group == exchange.group)
            state = session_state.checkpoint_state(done, first.module, first.optimizers, first.schedulers, run.device,
                                                   MetricWindow(), None, exchange)
            ckpt_io.save(ckpt_io.part_file(run.workspace, done, exchange.group, run.rank), state)
            parts[ckpt_io.part_name(done, exchange.group, run.rank)] = True
        return parts

    def pushing(self) -> None:
        """Downpour and Sandblaster, several workers in this process: every worker gave its optimizer (worker 0's
        run.optimizer made the exchange to the servers): Sandblaster's mean is the group's, over its processes, as one
        worker's (StubGroupMean)."""
        run = self.run
        if run.plan.strategy.synchronous:  # (--max-restarts: the worker processes' quorum's, as for one worker)
            named = [(n, p) for n, p in run.module.named_parameters() if p.requires_grad]
            run.mean.exchange = run.exchange if run._served_replicas else session_exchange.StubGroupMean(named, run.exchange)
            run._group_window = run._served_replicas

    def push(self) -> None:
        """Every worker of this process reached its opt.step() (run by the last to arrive): the process's one push of
        worker 0's `.grad` (every worker holds the same mean, clipped alike), with the process's rows."""
        session_pushes.push(self.run, self.run.optimizers[0], (), {})

    def start_groups(self) -> None:
        """In-memory Downpour and Hogwild: every worker gave its optimizer (run by the last to arrive): the groups'
        exchanges around one in-process server that runs worker 0's optimizer, built from its recipe (as Downpour's
        server processes do), from worker 0's values (or the checkpoint's server values and optimizer state); each
        group's store views its copy (its first worker's params), its pushes carry its first worker's optimizer's
        hyper-parameters."""
        run = self.run
        for worker in self.workers:
            named = [(n, p) for n, p in worker.module.named_parameters() if p.requires_grad]
            held = {id(p) for group in worker.optimizers[0].param_groups for p in group["params"]}
            left = [n for n, p in named if id(p) not in held]
            if left:
                raise SessionError(f"worker.optimizer: {run.plan.label}'s server updates every trained param of the "
                                   f"module, and worker {worker.index}'s optimizer does not hold {left[0]!r}")
        firsts = sorted({id(w.group_workers[0]): w.group_workers[0] for w in self.workers}.values(), key=lambda w: w.group)
        stores = [ParamStore.viewing([(n, p.data) for n, p in first.module.named_parameters() if p.requires_grad])
                  for first in firsts]
        try:
            recipe = session_exchange.optimizer_recipe(self.workers[0].optimizers[0], [
                (n, p) for n, p in self.workers[0].module.named_parameters() if p.requires_grad])
        except session_exchange.RecipeError as err:
            raise SessionError(str(err)) from None
        recipe = session_pushes.compensated(run, recipe)
        saved = dict(run._mine.exchange) if run._mine is not None else None
        run.exchange = session_exchange.group_exchanges(run.plan, stores, recipe, [w.optimizers[0] for w in firsts],
                                                        run.start_step, saved, run.metrics,
                                                        schedule=lambda: run._update_schedule)
        for worker in self.workers:
            worker.pushes_to = run.exchange.exchanges[worker.group]

    def start_loop(self) -> None:
        """Every worker reached its batches() (run by the last to arrive): the loop's start, once for the process; on a
        resume every worker's schedulers and optimizers take the checkpoint's state (worker 0's, as every replica's)."""
        run = self.run
        run._restore_loop_state()
        for worker in self.workers[1:]:
            for found in session_state.schedulers_of(worker.optimizers):
                if found not in worker.schedulers:
                    worker.schedulers.append(found)
            if run._mine is not None:
                session_worker.restore_worker(run._group_part(worker.group), worker.optimizers, worker.schedulers,
                                              lambda i, worker=worker: run._saved_optimizer_state(i, worker.optimizers[i],
                                                                                                  worker.module, worker.group))
        run._share = sum(worker.share for worker in self.workers)  # the process's rows per step
        run._measured = session_shares.measure(run)  # (cluster.auto_batch_shares: re-split as the loop goes)
        if run.rejoin is not None and (run.plan.strategy.synchronous or run.plan.strategy.meets) and not run.pushes:
            session_healing.workers_take_chiefs_state(run)  # (restarted: the chief's state, or a live group's)
        if run.groups_in_memory:
            self.start_after_warmup()
        if run.pushes:  # Downpour / Sandblaster: the chief's FIRST to the servers, the other groups' pull, where they start
            session_pushes.pushing(run).global_batch = self.workers[0].global_batch
            start = run.start_step
            session_pushes.start_pushing(run)  # (worker 0's schedulers stepped to where the group starts; the others' here)
            self.step_other_schedulers(run.start_step - start)
            if run.rejoin is not None:  # (restarted: every worker goes on from the group's step the servers said, or,
                if run._served_replicas:  # Sandblaster's replicas, from the chief's state, which worker 0 took)
                    session_healing.workers_copy_first(run)
                for worker in self.workers:
                    worker.first_step = worker.at = run.start_step
        if run.rejoin is not None and run._update_lock is not None:  # Distributed Hogwild's restarted group: the live
            start = run.start_step                                     # values in the copy its threads share
            session_healing.take_live_values(run)  # (worker 0's schedulers stepped to the peers' step; the others' here)
            self.step_other_schedulers(run.start_step - start)
            for worker in self.workers:
                worker.first_step = worker.at = run.start_step
        run.step = run.start_step
        if run._update_lock is not None:  # Distributed Hogwild: the values the groups start from are set: its masters serve
            run.exchange.begin(run.start_step)
        if run.chief and run.distributed and run.plan.strategy.chief_succeeded_by_a_group(run.plan):
            say_chief_started()  # (as one worker's loop start: a chief dead after it is succeeded, not the whole job restarted)
        if run.distributed:
            session_exchange.note_step(run.step)
        run._window_start = time.perf_counter()

    def start_after_warmup(self) -> None:
        """In-memory groups with a warm-up (cluster.warmup_steps N; SINGA's): group 0 trains alone to step N, then the
        other groups start there (a resumed run at its checkpoint's step, if later), as the board says
        (`GroupBoard.start_at`, a job file's groups too); their schedulers stepped to that step, as a job file's group's
        schedule starts at its first step. Until then their workers are excused from the process's meetings, so that
        group 0 checkpoints alone (the file holds the others' unstarted state: a resume starts them at N again)."""
        run = self.run
        late = [w for w in self.workers if run.exchange.first_step(w.group) > run.start_step]
        for worker in late:
            worker.first_step = run.exchange.first_step(worker.group)  # (its `at` stays: an interval's step is group 0's)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # ("scheduler.step() before optimizer.step()")
                for scheduler in worker.schedulers:
                    for _ in range(worker.first_step - run.start_step):
                        scheduler.step()
        if late:
            self.warmup_ends = min(max(w.first_step for w in late), run.job.train_steps)
            self.workers[0].local.excuse(len(late))

    def boundary(self, step: int) -> None:
        """Every worker's first optimizer stepped (run by the last to arrive, inside its opt.step(), as one worker's
        post-hook does): Local SGD / DiLoCo's meeting when due, its new anchor then in every worker's replica."""
        run = self.run
        self.met_at = step
        run._boundary(step)
        if run.exchange.meets_after(step):
            with torch.no_grad():
                for worker in self.workers[1:]:
                    for mine, theirs in zip(worker.module.parameters(), self.workers[0].module.parameters()):
                        mine.copy_(theirs)

    def step_done(self, step: int) -> None:
        """Every worker ended step `step`'s body (run by the last to arrive): the process's step boundary, once (a
        meeting the loop's skipped update did not reach comes here, as _step_done's for one worker)."""
        run = self.run
        if not (run.groups_in_memory or run.pushes or run._update_lock is not None):  # (each worker its own replica)
            session_worker.refresh_replicas(self.workers)  # (a device list's CPU+GPU split: equal after the update)
        if run.meets_in_memory:  # (every group met in its own threads before this: group_boundary)
            run._updated_at = step
        elif run.distributed and run.plan.strategy.meets:
            if self.met_at != step:
                self.boundary(step)
            run._updated_at = step  # (the boundary is done: _step_done does not meet again)
        elif run._update_lock is not None:  # Distributed Hogwild: the sync when due, once the group's copy is updated
            run._boundary(step)
            run._updated_at = step
        run._step_done(step)
        if step + 1 < max(run.job.train_steps, self.end):
            run.step = step + 1
            if run.distributed:
                session_exchange.note_step(run.step)
        if self.warmup_ends and step + 1 >= self.warmup_ends:  # group 0's warm-up ended: the other groups start
            self.warmup_ends = 0
            self.workers[0].local.admit()

    def steps_to_train(self, step: int) -> None:
        """Distributed Hogwild under restarts, every worker past its last step (run by the last to arrive): the step the
        group trains to, its share of the steps restarted groups skipped past train_steps (as one worker's loop asks)."""
        run = self.run
        self.end = run.exchange.steps_to_train(run.job.train_steps)
        if self.end > step:
            run.step = step
            session_exchange.note_step(step)

    def group_step_done(self, group: int, step: int) -> None:
        """In-memory asynchronous groups, running freely: group `group`'s workers ended step `step` (run by the last to
        arrive). Group 0's step is the process's step boundary (its displays, as a job file's chief group's trainer),
        its window closed under the lock the other groups report through."""
        run = self.run
        if group == 0:
            with run._window_lock:
                self.step_done(step)

    def step_other_schedulers(self, steps: int) -> None:
        """Workers 1.. of this process's group step their schedulers `steps` times: worker 0's were stepped to where the
        group starts (torch warns of a scheduler stepped before its optimizer: none of these has stepped yet)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for worker in self.workers[1:]:
                for scheduler in worker.schedulers:
                    for _ in range(steps):
                        scheduler.step()

    def slices_step(self, index: int) -> None:
        """Server slices (run by the last worker to reach its optimizer `index`'s step): the process's one update of its
        slices from worker 0's `.grad` (every worker holds the group's mean, clipped alike), every value then copied
        into the other workers' replicas, whose optimizers update nothing (as worker 0's)."""
        session_server_slices.slices_step(self.run, index)
        with torch.no_grad():
            theirs = [p for group in self.workers[0].optimizers[index].param_groups for p in group["params"]]
            for worker in self.workers[1:]:
                mine = [p for group in worker.optimizers[index].param_groups for p in group["params"]]
                for value, source in zip(mine, theirs):
                    value.copy_(source)
