"""`shoal.session()`: shoal's layouts, data sharding, checkpoints and metrics as a few calls inside the user's own loop.

    run = shoal.session()                       # the cluster from `shoal run script.py --set cluster.…`, or keywords
    model = run.model(model)                    # the same module, on this worker's device, equal on every replica
    opt = run.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, f)
    for step, batch in run.batches(train_set, batch_size=12):   # this worker's rows, reshuffled per epoch, resumable
        loss = loss_fn(model, batch); loss.backward()          # under AllReduce: the group's mean gradient in .grad
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(); opt.zero_grad(); sched.step()              # Local SGD / DiLoCo: the meeting inside opt.step()
        run.log(step, loss=loss)                               # metrics.jsonl, display lines, TensorBoard
        if step % 100 == 0: run.evaluate(val_set, loss_fn); run.checkpoint()   # `--resume` continues exactly

Nothing of the loop is copied or re-run: the module, its optimizer and the scheduler stay the user's objects.
Session holds the loop's calls and the order of a step; each layout's detail is one call away:
- where the process comes from (one process here, one per rank under `shoal run script.py`): session_start.py;
- several workers in one process (threads): `run.each_worker(body)` runs the loop's body once per worker, each with a
  worker's view of these calls (session_worker.py), the process's part of their loop run once (session_threads.py);
- what runs inside backward and opt.step(): runtime/session_exchange.py; Downpour's and Sandblaster's pushes to the
  servers that run the user's optimizer: session_pushes.py; each process's update of its server slices:
  session_server_slices.py;
- a restarted process taking the chief's state, and a living one taking a dead chief's place (--max-restarts):
  session_healing.py;
- the display window's Train lines and train records: session_display.py;
- run.evaluate: session_eval.py; which process writes what of run.checkpoint, and when: session_checkpoint.py; what a
  checkpoint and a restarted process's handover hold, built and loaded back: session_state.py.
docs/python.md, "Your own loop".
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import torch

from shoal.config import job_pb2
from shoal.config.phases import fires
from shoal.data.in_place import reader_for, to_device
from shoal.frontend import (script, session_checkpoint, session_display, session_eval, session_healing, session_partition,
                            session_pushes, session_server_slices, session_shares, session_state, session_threads,
                            session_worker)
from shoal.frontend.fit_inputs import as_dataset
from shoal.frontend.session_start import (SessionError, check_layout, group_shares, groups_in_memory, meets_in_memory,
                                          plan_session, pushes_to_servers, rank_context, refuse_unstarted, same_job,
                                          serve_if_server, serves_only, session_job, start_ranks, started_by_a_launcher,
                                          supervise_if_restartable, syncs_with_peers)
from shoal.neuralnet import checkpoint as ckpt_io
from shoal.neuralnet.params import ParamStore
from shoal.planning.plan import JobPlan, sliced_for
from shoal.report.metrics import MetricsLog, MetricWindow
from shoal.report.run_log import open_run_log
from shoal.comm import dist as comm
from shoal.comm.succession import say_chief_started
from shoal.runtime import checkpoint_schedule, session_exchange, session_slices
from shoal.runtime.replicas import device_label, torch_device, usable_device_names
from shoal.report.terminal import write_line


def session(cluster: Optional[job_pb2.ClusterProto] = None, *, train_steps: int = 100, seed: int = 0, disp_freq: int = 10,
            checkpoint_freq: int = 0, checkpoint_interval_s: float = 0.0, workspace: Optional[Union[str, Path]] = None,
            resume: bool = False, name: str = "session", tensorboard: bool = False, partition_dim: int = 0,
            outer_optimizer=None, device=None, log: Callable[[str], None] = write_line) -> "Session":
    """This process's part of the user's own training loop (docs/python.md, "Your own loop").

    cluster: shoal.Cluster(...) (the layout: single worker, AllReduce over processes, Local SGD / DiLoCo,
    Distributed Hogwild, Downpour or Sandblaster over processes); `shoal run script.py --set cluster.…` overrides it, as --set train_steps=, --workspace and --resume do.
    train_steps: where run.batches() stops. seed: the data order's. disp_freq: a display line and a metrics record
    every this many steps. checkpoint_freq: also checkpoint every this many steps (run.checkpoint() any time).
    checkpoint_interval_s: without checkpoint_freq, also checkpoint about every this many seconds (0, the default: only
    where the loop calls run.checkpoint(); over processes the chief picks the step, every process writes its part).
    tensorboard: also write the records (run.log's, run.evaluate's) as TensorBoard event files in WORKSPACE/tensorboard
    (as `shoal run script.py --tensorboard`). partition_dim: SINGA's neuralnet.partition_dim, 0 (the batch: each worker
    a whole replica) or 1 (the module cut on its features over one synchronous group's processes: run.model's cuts);
    `--set neuralnet.partition_dim=` overrides it. outer_optimizer: Local SGD / DiLoCo's outer step as a torch
    optimizer over the groups' mean change at each meeting, in shoal.fit's form (a factory on the params, e.g.
    `lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)`, DiLoCo's; None: cluster.outer_updater,
    SINGA's, by default plain averaging). device: where the workers compute, as a job file's `device` field and
    shoal.fit's device=: "cuda:0", or one device per worker of a process (["cuda:0", "cpu"]: worker 0 on the GPU, worker 1
    on the CPU, Caffe con Troll's split; "cpu:N" a CPU device with a replica of its own); None: the CPU.
    Under `shoal run script.py` a layout of several processes starts one per rank running this script from the top:
    this call does not return in the launcher, which exits with the job's outcome, nor in a Downpour or Sandblaster server process,
    which serves and then ends the script (exit status 0)."""
    context = rank_context()
    job = session_job(cluster, train_steps, seed, disp_freq, checkpoint_freq, name, checkpoint_interval_s, partition_dim,
                      device)
    outer = outer_optimizer is not None or bool(job.cluster.outer_updater.user_type)
    if outer:  # Local SGD / DiLoCo's outer step, a torch optimizer (bound to the module at run.model())
        from shoal.frontend import session_outer

        session_outer.with_outer_optimizer(job, outer_optimizer)
    if tensorboard:  # (`shoal run script.py --tensorboard` set it already, as for any job of a script)
        job.tensorboard = True
    if context is not None:  # a rank the launcher started: its plan is the launcher's
        same_job(job, context.plan)
        if serves_only(context.plan, context.rank):  # a Downpour server: it serves, and the script ends here
            session_exchange.serve_downpour(context.plan, context.rank, context.workspace, context.log,
                                            restarted=context.rejoin is not None)
            raise SystemExit(0)
        return Session(context.plan, context.rank, context.workspace, context.resume_from, context.log, owned=None,
                       rejoin=context.rejoin, terminal=context.terminal)
    launched = started_by_a_launcher()
    plan = plan_session(job, launched.nnodes if launched is not None else 1)
    if outer:
        session_outer.check_layout(plan)
    if launched is not None:  # torchrun, srun, env://: this process is one rank of the world they started
        supervise_if_restartable(plan, launched, Path(workspace) if workspace else None, resume, log)  # (--max-restarts)
        serve_if_server(plan, launched, Path(workspace) if workspace else None, resume, log)  # (a server process)
        return Session.launched(plan, launched, workspace, resume, log)
    if not plan.in_one_process:
        if script.running_path() is None:
            refuse_unstarted(plan)
        from shoal.frontend.session_outer import setup_of

        raise SystemExit(start_ranks(plan, Path(workspace) if workspace else None, resume, log, setup_of(plan.job)))
    return Session.in_this_process(plan, workspace, resume, log)


class Session:
    """One process's part of a user's loop: its plan, rank, device, workspace and what it wraps."""

    def __init__(self, plan: JobPlan, rank: int, workspace: Path, resume_from: Optional[Path], log: Callable[[str], None],
                 owned=None, rejoin=None, terminal: bool = False):
        """`terminal`: a rank of shoal's launcher whose chief talks to the terminal; this process's lines go to its log
        file, and to the terminal too should it take a dead chief's place."""
        check_layout(plan)
        self.plan, self.rank, self.workspace, self.say = plan, rank, Path(workspace), log
        self._terminal = terminal
        self.rejoin = rejoin  # restarted into the running loop (--max-restarts): it takes the chief's state at run.batches()
        self.job = plan.job
        self.chief = rank == 0 and rejoin is None  # (a dead chief's restarted process rejoins as a non-chief: report/succession.py)
        self.distributed = not plan.in_one_process
        # groups that train apart (Local SGD / DiLoCo, Distributed Hogwild): each writes its own checkpoint part
        self.apart = self.distributed and not plan.strategy.synchronous
        self._update_lock = None  # Distributed Hogwild's: held around the user's update (its masters add peers' deltas)
        self.pushes = pushes_to_servers(plan)  # Downpour: opt.step() pushes the gradients; the servers update
        # Sandblaster under --max-restarts: its worker processes go on without a dead one, which rejoins at run.batches()
        self._served_replicas = self.pushes and plan.strategy.goes_on_without_a_process(plan)
        self._receiving = False  # a restarted process taking the chief's state (its optimizers' step pushes and meets nothing)
        # a compressed AllReduce's replicas are equal but each process's error-feedback residual is its own: every
        # other process writes it as its part of a checkpoint, as a Local SGD group writes its state
        self.own_residual = (self.distributed and plan.strategy.synchronous and not self.pushes
                             and not plan.compression.dense)
        self._store: Optional[ParamStore] = None
        # server slices (AllReduce, cluster.nservers_per_group > 1, no restarts): each process updates its slices alone,
        # with an optimizer of the user's optimizer's class and groups over them (runtime/session_slices.py: ZeRO-1's)
        self.sliced = plan.nservers_per_group > 1 and session_slices.shards_optimizer_state(plan)
        self._slices: list[session_slices.SlicedUpdate] = []
        self._saved_server_state: dict = {}  # Downpour, resumed: the servers' updater state, sent with the chief's FIRST
        # run.scheduler(s, steps="update") under Downpour: the chief's schedule by the servers' update count (its pushes'
        # hyper-parameters at every position the run can reach), which the servers set over each push's own
        self._hyper_layout: Optional[session_exchange.HyperLayout] = None  # (the optimizer's pushes', at run.optimizer)
        self._update_schedule: Optional[session_exchange.UpdateSchedule] = None
        self._loop_started = False  # (run.batches() or run.steps() began: the schedulers' state restored)
        self._holding = False
        hosted = plan.process(rank).workers[0]
        self.group, self.worker = hosted.group, hosted.id
        # several workers in this process (threads, the CPU+GPU split): run.each_worker runs the loop once per worker
        self.local_workers = len(plan.process(rank).workers)
        # in-memory Downpour / Hogwild: the groups are this process's workers, pushing to one in-process server
        self.groups_in_memory = groups_in_memory(plan)
        # Local SGD / DiLoCo's groups as this process's threads, meeting in memory (session_threads.py)
        self.meets_in_memory = meets_in_memory(plan)
        self._threads: Optional[session_threads.WorkerThreads] = None  # (run.each_worker's, several workers)
        self._workers: list[session_worker.SessionWorker] = []
        self._measured: list[session_shares.MeasuredShares] = []  # cluster.auto_batch_shares: each group's balancer here
        # each worker thread reports into the one display window; in-memory asynchronous groups' step boundary (group 0's)
        # closes it while the others report, and may checkpoint, which closes it too: reentrant
        self._window_lock = threading.RLock()
        self.device = torch_device(usable_device_names(plan.devices_of(rank))[0])
        if self.distributed:
            torch.set_num_threads(plan.threads_per_worker)  # every process of the host shares its cores
            # as a job file's rank says it (runtime/assemble.py's start_lines): where each worker runs, and this process's
            # pid, in its log (a restarted process adds its own: users and benchmarks/chaos.py read the newest there)
            for hosted, device in zip(plan.process(rank).workers, usable_device_names(plan.devices_of(rank))):
                log(f"Worker (group = {hosted.group}, id = {hosted.id}) start on {device_label(device)} "
                    f"in process {rank} (pid = {os.getpid()})")
        self._owned = owned  # release(status, reason): the workspace's lock and the registry's entry, by close()
        self.resumed = ckpt_io.load(resume_from, parts=True) if resume_from is not None else None
        if self.resumed is not None and not self.resumed.trainer.get("session"):
            raise SessionError(f"--resume: {resume_from} was written by shoal's job path (a job file, or a shoal.fit layout "
                               "that runs there), whose state a loop on shoal.session() cannot continue exactly: resume it "
                               "with the layout that wrote it")
        self._mine = (session_state.own_part(self.resumed, resume_from, self.group, self.rank, self.own_residual, self.apart,
                                             self.say) if self.resumed is not None else None)
        self.start_step = int(self._mine.trainer.get("next_step", self.resumed.step)) if self._mine is not None else 0
        self.step = self.start_step
        self.module: Optional[torch.nn.Module] = None
        self.optimizers: list[torch.optim.Optimizer] = []
        self.schedulers: list = []
        self.exchange = None  # the strategy's: Local SGD / DiLoCo's PeriodicExchange, or a replicated group's
        self._cuts: dict[str, str] = {}  # tensor-parallel (neuralnet.partition_dim 1): the Linears cut, by name
        self.mean: Optional[session_exchange.GradientMean] = None
        self.window = MetricWindow()
        self.window_rows = 0
        self.exchange_seconds = 0.0
        self.paused_seconds = 0.0  # evaluations in the display window: not training time
        self._updated_at = -1  # the step whose update (the first optimizer's step) ran
        self._rows_counted = -1  # the step whose rows are in the display window
        self._end_reason: Optional[str] = None
        self._window_start = time.perf_counter()
        self._batch = 0
        self._share = 1
        self._closed = False
        self._finished = False
        self._displayed = -1  # the step whose display line is out (a checkpoint at a display step shows it first)
        self._group_window = False  # a synchronous group over processes: the Train line averages every process's rows
        self.metrics: Optional[MetricsLog] = None
        if self.chief:
            self.metrics = open_run_log(plan, self.workspace, float(self._mine.trainer.get("elapsed", 0.0)) if self._mine else 0.0,
                                        usable_device_names(plan.all_devices()), self.start_step if self.resumed else None)
        if self._mine is not None:
            self.window.load_state(self._mine.trainer.get("window", {}))
        # checkpoint_interval_s (without checkpoint_freq): the chief picks the steps and every process writes its part
        # there, as a job file's trainers do (runtime/checkpoint_schedule.py); in-memory groups run freely, their
        # checkpoint a meeting set at a step none has ended (session_worker.FreeRunningInterval, from the loop's start)
        # (Local SGD's groups in one process reach each step boundary together: this process writes every part itself)
        self._interval = (None if self.groups_in_memory else
                          checkpoint_schedule.for_process(plan, rank, {} if self.meets_in_memory else
                                                          checkpoint_schedule.checkpoint_parts(plan),
                                                          comm.publish, comm.published, deciding=self.chief))
        self._free_interval: Optional[session_worker.FreeRunningInterval] = None
        atexit.register(self.close)
        script.at_script_end(self._script_ended)  # (a rank's process exits without running atexit's functions)

    @property
    def processes(self) -> int:
        """How many processes run this loop (this one is `rank`; 0 is the chief, which writes the metrics)."""
        return self.plan.nprocs

    @property
    def index(self) -> int:
        """This worker's place in its process (run.each_worker's bodies: the session is the one worker's view)."""
        return 0

    @property
    def label(self) -> str:
        """The layout's framework as `shoal plan` names it (single worker, AllReduce, DiLoCo ...)."""
        return self.plan.label

    @classmethod
    def in_this_process(cls, plan: JobPlan, workspace, resume, log) -> "Session":
        """One process: this one holds the workspace (never clobbered) and the job's registry entry while the loop runs."""
        from shoal.launcher import elastic, job_registry
        from shoal.launcher.run_job import resolve_workspace
        from shoal.launcher.workspace import WorkspaceLock, check_workspace, claim, prepare

        ws = resolve_workspace(plan.job, script.workspace(Path(workspace) if workspace else None))
        check_workspace(ws)
        claim(ws)
        lock = WorkspaceLock(ws, plan.job.name)
        lock.__enter__()
        try:
            resume_from = prepare(ws, elastic.resolve_resume(ws, script.resume(resume), plan.job), log)
            record = job_registry.register(plan.job.name, str(script.running_path() or "<shoal.session>"), ws)
        except BaseException:
            lock.__exit__(None, None, None)
            raise
        log(f"Job {record.id}: {plan.label}; workspace {ws}")

        def release(status: str, reason: Optional[str]) -> None:
            job_registry.finish(record, status, reason or "")
            lock.__exit__(None, None, None)

        try:
            return cls(plan, 0, ws, resume_from, log, owned=release)
        except BaseException as err:  # (a checkpoint that does not fit, say): the workspace is released, the job failed
            release("failed", str(err).splitlines()[0] if str(err) else type(err).__name__)
            raise

    @classmethod
    def launched(cls, plan: JobPlan, launched, workspace, resume, log) -> "Session":
        """A rank of a world torchrun, srun or a PyTorchJob started (each process runs the script): it joins the world
        as a job file's rank does (launcher/elastic.py's launched_job: rank 0 holds the workspace and the registry
        entry, the others wait for its word), and the loop runs here until close()."""
        from contextlib import ExitStack

        from shoal.launcher.elastic import launched_job
        from shoal.launcher.options import RunOptions
        from shoal.launcher.run_job import resolve_workspace

        ws = resolve_workspace(plan.job, script.workspace(Path(workspace) if workspace else None))
        stack = ExitStack()
        options = RunOptions(workspace=ws, resume=script.resume(resume), log=log)
        resume_from, say = stack.enter_context(launched_job(plan, options, launched, str(script.running_path() or
                                                                                           sys.argv[0] or "<shoal.session>"), ws))

        def release(status: str, reason: Optional[str]) -> None:
            if status == "finished":
                stack.close()
            else:  # the rank's end as the launcher's: recorded failed, its stall watch and the world closed
                stack.__exit__(SessionError, SessionError(reason or status), None)

        try:
            return cls(plan, launched.rank, ws, resume_from, say, owned=release, terminal=True)  # (torchrun's console)
        except BaseException as err:
            stack.__exit__(type(err), err, err.__traceback__)
            raise

    # -- several workers in this process -----------------------------------------------------------------
    def each_worker(self, train: Callable[[Any], Any]) -> list:
        """Run `train(worker)`, the loop's body, once per worker of this process, each in a thread of its own (as the
        job path's Trainer runs its workers), and return their results in worker order. `worker` has this session's
        loop calls (model, optimizer, batches, steps, log, evaluate, checkpoint, accumulating) for one worker's replica,
        device and rows (frontend/session_worker.py); with one worker in the process, `train(run)` runs here, so one
        body runs every layout. A worker's error stops the others and is raised here."""
        if self._workers or self.module is not None:  # (one worker too: a script must not break when a worker is added)
            raise SessionError("run.each_worker: once per session, instead of run.model")
        if self.local_workers == 1:
            return [train(self)]
        self._threads = session_threads.WorkerThreads(self)  # (the process's part of its workers' loop)
        self._workers = self._threads.workers
        return self._threads.run_each(train)

    def _group_part(self, group: int):
        """The resumed checkpoint's state of worker group `group`: this process's part (`_mine`), or under Local SGD /
        DiLoCo's groups in one process the part the chief's file lists for the group (session_threads.py's
        `WorkerThreads.write_group_parts` wrote it)."""
        if not self.meets_in_memory or not group or self.resumed is None:
            return self._mine
        return self.resumed.parts[ckpt_io.part_name(self.resumed.step, group, self.rank)]

    def furthest_step(self) -> int:
        """The furthest step a worker of this process is at (in-memory asynchronous groups run freely)."""
        return max((worker.step for worker in self._workers), default=self.step)

    def checkpoints_after(self, step: int) -> bool:
        """Whether the step boundary after `step` writes a checkpoint (the job's checkpoint_freq; in-memory groups, their
        interval's step too: every worker asks, and meets there)."""
        if self.job.checkpoint_freq:
            return fires(self.job.checkpoint_freq, self.job.checkpoint_after, step + 1)
        return (self._free_interval is not None and step + 1 < self.job.train_steps
                and self._free_interval.due_after(step))

    def _checkpoint(self) -> Path:
        return self.checkpoint()

    # -- the user's objects ------------------------------------------------------------------------------
    def model(self, module: torch.nn.Module, cuts: Optional[dict[str, str]] = None) -> torch.nn.Module:
        """The module itself, on this worker's device, its values the checkpoint's (--resume) or rank 0's on every
        replica; under AllReduce its gradients become the group's mean at the end of each backward. Under
        neuralnet.partition_dim 1 its features are cut over the group's processes: `cuts` names the Linears to cut
        ({"blocks.0.mlp.c_fc": "colwise", "blocks.0.mlp.c_proj": "rowwise"}, torch's plan) and the attentions to cut
        by heads ({"blocks.0.attn": "heads"}), else those of every Linear → element-wise → Linear pair in its
        nn.Sequential containers and every attention (frontend/session_partition.py)."""
        if not isinstance(module, torch.nn.Module):
            raise SessionError(f"run.model: expected a torch.nn.Module, got {type(module).__name__}")
        if cuts is not None and not self.plan.tensor_parallel:
            raise SessionError("run.model: cuts= cuts a module on its features over the group's processes: it needs "
                               "neuralnet.partition_dim 1 (`--set neuralnet.partition_dim=1`)")
        self._cuts = session_partition.checked_cuts(module, cuts) if cuts is not None else {}
        if self.local_workers > 1:
            raise SessionError(f"run.model: {self.plan.label} runs {self.local_workers} workers in this process: write the "
                               "loop's body as a function of its worker and call run.each_worker(body) (docs/python.md)")
        return self._model(module)

    def _model(self, module: torch.nn.Module, own_mean: bool = True) -> torch.nn.Module:
        if self.module is not None:
            raise SessionError("run.model: one module per session")
        module.to(self.device)
        self.module = module
        trained = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if self._mine is not None:
            session_state.load_module(module, self._mine.params)
        elif self.distributed and self.rejoin is None and not self.pushes:  # (a restarted process takes the chief's
            # values at run.batches(); Downpour's groups the servers', which the chief's values started)
            # every replica from rank 0's values; under a synchronous layout the replicated exchange broadcasts the
            # trained params itself as it starts (its start_from), so only the rest goes here
            theirs = ({p.data_ptr() for _, p in trained} if self.plan.strategy.synchronous and not self.plan.tensor_parallel
                      else set())
            session_exchange.broadcast_values(self.plan, [t for t in module.state_dict().values()
                                                          if isinstance(t, torch.Tensor) and t.data_ptr() not in theirs])
        if self.plan.tensor_parallel:  # the module's features cut over the group (torch's DTensors): no exchange
            self._cuts = session_partition.cut(module, self.plan, self.device, self._cuts or None)
            return module
        store = ParamStore.viewing([(n, p.data) for n, p in trained])
        saved = dict(self._mine.exchange) if self._mine is not None else None
        if self.distributed and self.plan.strategy.synchronous and not self.pushes:
            # the strategy's replicated exchange: the mean over the members that came (the group goes on without a
            # dead process; under --max-restarts a restarted one heals from the chief)
            self.exchange = session_exchange.replicated_exchange(self.plan, self.rank, store, self.start_step, saved,
                                                                 self.metrics, self.say, rejoining=self.rejoin is not None)
            self._group_window = True  # the Train line's averages are the group's (every process's rows)
            if own_mean:  # (several workers in this process: each worker's goes to their LocalMean)
                self.mean = session_exchange.GradientMean(trained, self.exchange, 1, lambda: self.step)
        elif self.distributed and self.plan.strategy.meets:
            if self.plan.job.cluster.outer_updater.user_type:  # (outer_optimizer=: a torch optimizer over these params)
                from shoal.frontend import session_outer

                session_outer.bind(self.plan, module)
            self.exchange = session_exchange.attached_exchange(self.plan, self.rank, store, self.group, self.start_step,
                                                               resumed=self._mine is not None, saved=saved, metrics=self.metrics,
                                                               log=self.say, rejoining=self.rejoin is not None)
            self.exchange.loop_state = lambda: session_healing.handover(self)  # (a restarted group's too, at a meeting)
        elif self.pushes:  # the exchange is made at run.optimizer(): the servers build the user's optimizer
            self._store = store
        elif self.distributed and syncs_with_peers(self.plan):
            sliced = sliced_for(self.plan, {name: value.numel() for name, value in store.values.items()})  # (masters)
            self.exchange = session_exchange.hogwild_exchange(sliced, self.rank, store, self.group, self.start_step, saved,
                                                              self.metrics, self.say, rejoining=self.rejoin is not None)
            self._update_lock = self.exchange.lock
        return module

    def optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The user's optimizer itself; its step is the step boundary (Local SGD / DiLoCo meet after it, Distributed
        Hogwild syncs after it, its masters kept out of the update by the exchange's lock; under Downpour and
        Sandblaster the servers run it, built from its recipe, and its step pushes the gradients instead)."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise SessionError(f"run.optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        index = len(self.optimizers)
        if index == 0 and (self.pushes or self.groups_in_memory):  # (what a push carries, as its recipe lays it out:
            self._hyper_layout = session_exchange.hyper_layout(optimizer)  # before a scheduler adds keys of its own)
        if self.pushes:
            session_pushes.push_to_servers(self, optimizer, index)
        self.optimizers.append(optimizer)
        if self._mine is not None:
            optimizer.load_state_dict(self._saved_optimizer_state(index, optimizer, self.module))
        if self.sliced:
            session_server_slices.update_slices(self, optimizer, index)
        optimizer.register_step_pre_hook(self._before_update)
        # one step boundary per step: the first optimizer's (Local SGD / DiLoCo meet after it, Hogwild syncs when due)
        optimizer.register_step_post_hook(self._after_update if index == 0 else self._after_other_update)
        return optimizer

    def _saved_optimizer_state(self, index: int, optimizer: torch.optim.Optimizer, module: torch.nn.Module,
                               group: int = 0) -> dict:
        """Optimizer `index`'s state_dict from the resumed checkpoint, for `optimizer` over `module` (of worker group
        `group`: `_group_part`): under server slices without its state (the process's slices hold it: SlicedUpdate), and
        from a sliced checkpoint in a loop without them each param's whole state assembled from every slice
        (runtime/session_slices.whole_state)."""
        state = session_state.saved_optimizer_state(self._group_part(group), index)
        if self.sliced:
            return dict(state, state={})
        pieces = session_slices.saved_slices(self.resumed)
        if not pieces:
            return state
        return dict(state, state=session_slices.whole_state(pieces, index,
                                                            session_server_slices.named_params(optimizer, module)))

    @property
    def optimizer_state_elements(self) -> int:
        """The elements of optimizer state this process holds: its optimizers' (under server slices, its slices' alone)."""
        optimizers = self.optimizers + [o for worker in self._workers[1:] for o in worker.optimizers]
        own = sum(v.numel() for o in optimizers for state in o.state.values() for v in state.values()
                  if isinstance(v, torch.Tensor))
        return own + sum(sliced.state_elements() for sliced in self._slices)

    def scheduler(self, scheduler, steps: str = "group"):
        """Checkpoint a scheduler made after the loop started (those made before are found by themselves). `steps`: what
        its position counts where several asynchronous groups update one set of values on servers (Downpour, in-memory
        Downpour and Hogwild): "group" (the default), each group's own steps, as the loop steps it (each push carries
        what it set); "update", the servers' updates, every group's (G groups advance it G times per round of steps,
        as shoal.fit's default scheduler_steps="update"): give it as made, before the loop, over the optimizer given
        to run.optimizer; the chief's (process 0's, worker 0's) then sets every group's. Elsewhere every update is a
        step of one group, and both are the same."""
        if steps not in session_exchange.SCHEDULER_STEPS:
            raise SessionError(f"run.scheduler: steps is 'group' (each asynchronous group's own steps) or 'update' (the "
                               f"servers' updates, every group's), got {steps!r}")
        if steps == "update" and (self.pushes or self.groups_in_memory) and not self.plan.strategy.synchronous:
            session_pushes.schedule_by_updates(self, scheduler)
        if scheduler not in self.schedulers:
            self.schedulers.append(scheduler)
        return scheduler

    def _before_update(self, optimizer, args, kwargs) -> None:
        """Distributed Hogwild: no peer's delta lands in the params while the user's optimizer updates them."""
        if self._update_lock is not None and not self._holding:
            self._update_lock.acquire()
            self._holding = True

    def _release(self) -> None:
        if self._holding:
            self._holding = False
            self._update_lock.release()

    def _after_other_update(self, optimizer, args, kwargs) -> None:
        self._release()

    def _after_update(self, optimizer, args, kwargs) -> None:
        """The step boundary, after the user's update: Local SGD / DiLoCo's meeting, or Hogwild's sync, when it is due."""
        self._updated_at = self.step
        self._release()
        if not self._workers:  # (several workers: the boundary comes once they all updated, threads.step_done)
            self._boundary(self.step)

    def _boundary(self, step: int) -> None:
        """Local SGD / DiLoCo's meeting, or Hogwild's sync, when due after step `step` (every group counts the same
        steps: a step whose update the loop skipped still reaches it, from `_step_done`)."""
        if self.exchange is None or (self.mean is not None and self.plan.strategy.synchronous) or self.pushes \
                or self.groups_in_memory:
            return  # (a replicated group heals after the loop's body: session_healing.heal; Downpour pushed in the optimizer's pre-hook)
        started = time.perf_counter()
        self.exchange.step(step, [({}, self._share)])  # the inner update was the user's: the meeting when it is due
        self.exchange_seconds += time.perf_counter() - started

    @contextmanager
    def accumulating(self) -> Iterator[None]:
        """Backward passes inside add to `.grad` without the group's mean (gradient accumulation's micro-batches, as
        DDP's no_sync): the backward after it takes the mean of the sum."""
        with self.mean.accumulating() if self.mean is not None else nullcontext():
            yield

    # -- data --------------------------------------------------------------------------------------------
    def batches(self, dataset, batch_size, shuffle: bool = True, seed: Optional[int] = None) -> Iterator[tuple[int, Any]]:
        """(step, this worker's rows of the group's batch) for each step to train_steps, on the worker's device.

        The rows of a step are a pure function of the step (shoal.data.in_place: reshuffled per epoch from `seed`,
        default the session's): a resumed run reads what the uninterrupted one would, and a group's batch split over
        its workers reads the rows one worker would. Local SGD's groups read disjoint shards of an epoch. batch_size:
        the group's rows a step, split evenly over its workers, or a list of one share per worker of the group."""
        if self.plan.tensor_parallel and isinstance(batch_size, (list, tuple)):
            raise SessionError("run.batches: under neuralnet.partition_dim 1 every process reads the group's whole batch: "
                               "give batch_size as one number")
        shares = group_shares(batch_size, 1 if self.plan.tensor_parallel else self.plan.nworkers_per_group, "run.batches")
        if self.module is None:
            raise SessionError("run.batches: give the module to run.model(...) first")
        data = as_dataset(dataset, "run.batches")
        self._batch = batch_size = sum(shares)
        if self.plan.tensor_parallel:  # every process the group's whole batch: its features are cut, not its rows
            offset, self._share = 0, batch_size
        else:
            offset, self._share = sum(shares[: self.worker]), shares[self.worker]
        if self.mean is not None:
            self.mean.share = self._share
        if self.pushes:  # a group's push is the mean over its processes' rows (each weighs its share)
            session_pushes.pushing(self).global_batch = batch_size
        skip = self.plan.group_shards.offset(self.group, 0, len(data))
        reader = reader_for(data, self.job.seed if seed is None else seed, shuffle, batch_size)
        yield from self._steps(lambda step: (step, to_device(reader.batch(skip + step * batch_size + offset, self._share),
                                                             self.device)))

    def steps(self, rows: int = 1) -> Iterator[int]:
        """Each step to train_steps, for a loop that reads its own data (nanoGPT's get_batch, a DataLoader of its own):
        what run.batches() does but the rows. Those are the loop's, not sharded by shoal: each process must draw its own
        (a seed per run.rank, say), and a resume reads the same rows only where they come from torch's generator, which
        a checkpoint holds. rows: this process's rows per step (samples/s; its weight in the group's mean gradient)."""
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise SessionError(f"run.steps: rows must be a whole number from 1, got {rows!r}")
        if self.module is None:
            raise SessionError("run.steps: give the module to run.model(...) first")
        self._share = rows
        if self.mean is not None:
            self.mean.share = rows
        if self.pushes:
            session_pushes.pushing(self).global_batch = rows * self.plan.nworkers_per_group
        yield from self._steps(lambda step: step)

    def _steps(self, item: Callable[[int], Any]) -> Iterator[Any]:
        self._restore_loop_state()
        if self.pushes:  # (Downpour: a restarted group pulls the servers' live values there)
            session_pushes.start_pushing(self)
        elif self.rejoin is not None and self._update_lock is not None:
            session_healing.take_live_values(self)
        elif self.rejoin is not None:
            session_healing.take_chiefs_state(self)
        if self._update_lock is not None:  # Hogwild: the values every group starts from are set; its masters serve from now
            self.exchange.begin(self.start_step)
        if self.chief and self.distributed and self.plan.strategy.chief_succeeded_by_a_group(self.plan):
            say_chief_started()  # (the others' first values came from it: dead before this, the whole job restarts)
        self._window_start = time.perf_counter()
        step, end = self.start_step, self.job.train_steps
        # past train_steps, a Distributed Hogwild group trains its share of the steps restarted groups skipped
        retrains = self.plan.strategy.retrains_skipped_steps
        while step < end or (retrains and (end := self.exchange.steps_to_train(self.job.train_steps)) > step):
            self.step = step
            if self.distributed:
                session_exchange.note_step(step)
            try:
                yield item(step)
            except GeneratorExit:  # the loop broke out: after the last step's update (nanoGPT's own stop), the run is done
                if step + 1 == end and self._updated_at == step:
                    self._step_done(step)
                    self._finish()
                raise
            self._step_done(step)
            step += 1
        self._finish()

    def _step_done(self, step: int) -> None:
        """The end of step `step`, after the loop's body: the step boundary its skipped update did not reach, a
        restarted process's healing or a dead chief's successor, its rows in the display window, a checkpoint when
        due, the display when due."""
        if self._updated_at != step:  # the loop skipped this step's update (a GradScaler that found inf or NaN)
            self._boundary(step)
        session_healing.after_the_body(self, step)
        session_display.count_rows(self, step)
        session_checkpoint.when_due(self, step)
        if session_display.displays(self, step) and self._displayed != step:
            session_display.display(self, step)

    def _restore_loop_state(self) -> None:
        """At the loop's start: the schedulers over this session's optimizers (made after run.optimizer), and on a
        resume their state, the optimizers' learning rates they set, and the random generators."""
        self._loop_started = True
        if self._interval is not None:  # the interval counts from the loop's first step, as a job file's trainer's
            self._interval.due(self.group, self.start_step, self.chief)
        if self.groups_in_memory and self.plan.checkpoint_interval_s > 0:
            self._free_interval = session_worker.FreeRunningInterval(self.plan.checkpoint_interval_s, self.furthest_step)
        for found in session_state.schedulers_of(self.optimizers):
            self.scheduler(found)
        if self._mine is not None:
            session_state.restore_resumed(self._mine, self.optimizers, self.schedulers, sliced=self.plan.tensor_parallel,
                                          saved_state=lambda i: self._saved_optimizer_state(i, self.optimizers[i], self.module))

    # -- metrics -----------------------------------------------------------------------------------------
    def evaluate(self, dataset, loss_fn: Callable, *, batch_size: int = 100, steps: Optional[int] = None,
                 metrics: Optional[dict] = None, phase: str = "val", loss_takes: Optional[str] = None, autocast=None,
                 model: Optional[torch.nn.Module] = None) -> dict:
        """The module's loss (and `metrics`) on `dataset`, in eval mode without gradients, averaged by samples over the
        set (or its first `steps` batches); recorded in metrics.jsonl as shoal.fit's validation (phase="val": `validate`)
        or test (phase="test") at the updates done so far, and returned. loss_fn and metrics take fit's forms. The chief
        evaluates its model (the group's under AllReduce, worker group 0's under Local SGD / DiLoCo, as fit does); the
        other processes return {}. The module's own train/eval modes are restored. session_eval.py."""
        return session_eval.evaluate(self, dataset, loss_fn, batch_size=batch_size, steps=steps, metrics=metrics, phase=phase,
                                     loss_takes=loss_takes, autocast=autocast, model=model)

    @property
    def updates_done(self) -> int:
        """How many updates the module has had: the step a record made now is at (fit validates before step S's update
        and records it at S; after step S's update it is S + 1)."""
        return self.step + 1 if self._updated_at == self.step else self.step

    def log(self, step: int, **values) -> None:
        """Metrics of this step (numbers or 0-d tensors, means over this worker's rows): averaged over the display
        window, written to metrics.jsonl and shown every disp_freq steps by the chief (its own rows)."""
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                value = value.detach()
            self.window.report(name, value, self._share)

    # -- checkpoints -------------------------------------------------------------------------------------
    def checkpoint(self) -> Path:
        """Write the state after this step's update: the module's values, the optimizers' and schedulers' state, the
        data position, torch's random generators and the exchange's state (Local SGD's anchor and outer state); every
        process writes its part, then the chief the file that lists them. `--resume` continues with the next step."""
        if session_display.displays(self, self.step) and self._displayed != self.step:  # the window closes before it is saved
            session_display.count_rows(self, self.step)
            session_display.display(self, self.step)
        return session_checkpoint.write(self, self.step + 1)

    # -- the end -----------------------------------------------------------------------------------------
    def _finish(self) -> None:
        """The loop's end: the exchange finished. The run log stays open for what the script does after the loop (the
        final run.evaluate, run.checkpoint): the run ends when the script does, or at run.close()."""
        if self.exchange is not None:
            self.exchange.finish()
            if session_healing.succeeds_the_chief_at_the_end(self):  # the chief died before its last word: this one says it
                session_healing.take_over(self, self.step)
            sent = self.exchange.job_bytes_sent  # the job's bytes to its last message (summary.json's bytes_sent, as fit's)
            if self.metrics is not None and sent is not None:
                self.metrics.annotate(bytes_sent=sent)
            if self.metrics is not None and self.plan.strategy.retrains_skipped_steps and self.exchange.job_notes:
                self.metrics.annotate(**self.exchange.job_notes)  # the skipped steps, who re-trained them
            if self.metrics is not None and (self.pushes or self.groups_in_memory):
                self._note_staleness()
        self._finished = True

    def _note_staleness(self) -> None:
        """Downpour's chief, after its last request: the servers' count of every group's updates by lag (and how many
        each was to apply) into summary.json's staleness_histogram, and its line, as a job file's chief writes them
        (strategies/downpour.py's staleness_histogram; its missed_updates and the closing line read it)."""
        from shoal.runtime.exchanges.staleness import staleness_line

        if self.groups_in_memory:  # (in-memory groups: the board that counted them)
            histogram = self.exchange.staleness_histogram(self.plan)
        else:
            member = session_exchange.SessionMember(self._store, self.group, self.start_step, exchange=self.exchange)
            histogram = self.plan.strategy.staleness_histogram(session_exchange.SessionRun(self.plan, self.rank, [member]))
        if histogram:
            self.metrics.annotate(staleness_histogram=histogram)
            self.say(staleness_line(histogram, self.plan.max_update_lag))

    def _script_ended(self, failed: bool) -> None:
        if not self._finished:  # a loop that stopped early: closed as failed at exit, or by the launcher, as before
            return
        if failed:  # (the final evaluation or checkpoint, say)
            self._finished, self._end_reason = False, "the script failed after its loop's last step"
        self.close()

    def close(self) -> None:
        """End the run: the run log closed (finished, or failed when the loop stopped before train_steps; summary.json
        written), the workspace released. At the end of the script (or of the process) by itself; call it to end the
        run sooner (a notebook)."""
        if self._closed:
            return
        self._closed = True
        if self.mean is not None:
            self.mean.remove()
        status, reason = ("finished", None) if self._finished else ("failed", self._end_reason or
                                                                      f"the loop stopped at step {self.step}")
        if self.metrics is not None:
            self.metrics.close(status, reason)
        if self._owned is not None:
            self._owned(status, reason)

