"""The one assembly path: a process's part of a job, from the JobPlan and a rank.

A run in this process is rank 0 of a world of one; a spawned process, a
process on another host and `shoal.fit`'s in-process run all come through
`run_process`. Per process, in this order:

1. `assemble`: the trainers of the worker groups this process hosts (or its
   server), each with the exchange its framework's strategy builds
   (`plan.strategy`, shoal/strategies/), initial values, a restored or
   loaded checkpoint, and the hooks it calls (debug norms, heartbeats,
   injected faults);
2. start lines (SINGA's "Worker (group = G, id = W) start on ..."), and on the
   chief the partitioned net (visualization/train_net.json) and the run log
   (metrics.jsonl, summary.json, TensorBoard);
3. the loop (`ProcessRun.run`), and the run log closed with how it ended.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from google.protobuf import text_format

from shoal.comm import collectives
from shoal.comm import dist as comm
from shoal.comm import heartbeat
from shoal.neuralnet.params import ParamStore
from shoal.planning.plan import JobPlan
from shoal.report.metrics import MetricsLog
from shoal.report.run_log import end_status, failure_reason, open_run_log
from shoal.report.writes import as_write_error
from shoal.neuralnet import checkpoint as ckpt_io
from shoal.runtime import checkpoint_schedule, debug_norms, visualization
from shoal.runtime.exchanges.groups import GroupBoard, run_groups
from shoal.runtime.exchanges.staleness import staleness_line
from shoal.runtime.interfaces import FaultInjection, TrainerHook
from shoal.runtime.replicas import device_label, torch_device, usable_device_names
from shoal.runtime.trainer import History, Trainer, checkpoint_parts
from shoal.runtime.worker import Worker
from shoal.report.job_copy import write_job_copy
from shoal.report.terminal import write_line


@dataclass(frozen=True)
class RunSpec:
    """What a process needs besides the plan: where to write, what to read, how to talk."""

    workspace: Path
    base_dirs: list[Path] = field(default_factory=lambda: [Path.cwd()])
    resume_from: Optional[Path] = None
    log: Callable[[str], None] = write_line
    progress: Optional[bool] = None  # None: a bar when stderr is a terminal
    initial_values: Optional[Callable[[ParamStore], None]] = None  # shoal.fit: the module's own values
    rejoin: Optional["Rejoin"] = None  # a process restarted into a running Downpour job (shoal.launcher.rejoin)
    faults: FaultInjection = field(default_factory=FaultInjection)  # injected by the launcher for tests (none here)


@dataclass(frozen=True)
class Rejoin:
    """This process takes a dead one's place in a running job: its group's `incarnation`-th restart."""

    incarnation: int
    detected_at: Optional[float] = None  # when the launcher saw the dead process exit (None: started by hand)


@dataclass
class ProcessRun:
    """One process's assembled part of a job: its trainers (chief first), or the server it hosts."""

    plan: JobPlan
    rank: int
    trainers: list[Trainer]
    board: Optional[GroupBoard] = None  # asynchronous groups of this process (in-memory Hogwild/Downpour)
    server: Optional[object] = None  # a process of servers only that serve until every group stops (Downpour's)
    rejoining: bool = False  # not a member of the job's world process group (shoal.launcher.rejoin)
    faults: FaultInjection = field(default_factory=FaultInjection)  # what a test injects (shoal.launcher.faults)
    process_groups: dict = field(default_factory=dict)  # the plan's, by name: what the exchanges' collectives run over

    @property
    def chief(self) -> Optional[Trainer]:
        return self.trainers[0] if self.trainers else None

    def run(self, metrics: Optional[MetricsLog], log: Callable[[str], None]) -> History:
        if self.server is not None:  # serve until every group stops
            self.server.serve()
            return History(self.chief.workspace)
        if self.board is not None:
            return run_groups(self.trainers, self.board, metrics, log)
        return self.chief.run(metrics)

    def staleness_histogram(self) -> Optional[dict]:
        """Asynchronous groups: how many updates landed at each lag (the chief's, after the run)."""
        return self.plan.strategy.staleness_histogram(self)


class Heartbeat(TrainerHook):
    """Each step tells the other processes how far this one got (who stopped answering, when one hangs): the
    watch's next beat carries it, so a step costs no message of its own (a store write per step was most of a
    DiLoCo job's bytes besides its meetings)."""

    def before_step(self, step: int) -> None:
        heartbeat.note_step(step)


def assemble(plan: JobPlan, rank: int, spec: RunSpec) -> ProcessRun:
    """Build process `rank`'s trainers and exchanges, set their initial values and restore them."""
    hosted = plan.process(rank)
    torch.set_num_threads(plan.threads_per_worker)
    devices = usable_device_names(plan.devices_of(rank))
    distributed = not plan.in_one_process
    # the params live with the process's first worker (the root of its device tree); the exchanges' collectives
    # move them there (shoal.comm.collectives). Request/response protocols (Downpour's stubs and servers, Distributed
    # Hogwild's syncs) keep them in host memory, which gloo's point-to-point moves
    on_host = distributed and plan.strategy.params_on_host
    home = torch_device(devices[0]) if devices and not on_host else torch.device("cpu")
    rejoining = spec.rejoin is not None
    chief_rank = rank == 0 and not rejoining  # (a dead chief's restarted process rejoins as a non-chief: report/succession.py)
    groups = sorted({w.group for w in hosted.workers})
    # the plan's process groups, made on every rank in its order (a rejoined process is in none: its group's restarted
    # processes form theirs afresh), before the trainers: a partitioned group's bridges to other processes run over them
    if rejoining:
        made = plan.strategy.groups_formed_afresh(plan, rank, spec.rejoin.incarnation)
    else:
        made = collectives.create(plan.process_groups) if distributed else {}
    # one schedule of interval checkpoints per process: its trainers write at the steps the chief chooses
    schedule = checkpoint_schedule.for_process(plan, rank, checkpoint_parts(plan), comm.publish, comm.published,
                                               deciding=chief_rank)
    trainers: list[Trainer] = []
    for group in groups or [0]:  # a server process builds a trainer too: it holds the params it serves
        mine = [(w.id, d) for w, d in zip(hosted.workers, devices) if w.group == group]
        # in-memory Hogwild's groups share one store; Downpour copies and Local SGD groups each have their own
        shared = trainers[0].store if trainers and plan.strategy.shares_one_store() else None
        trainers.append(Trainer(
            plan, spec.workspace, spec.base_dirs, home if shared is not None or not trainers else torch_device(mine[0][1]),
            log=spec.log, progress=spec.progress if chief_rank and not trainers else False,
            worker_indices=[i for i, _ in mine], chief=chief_rank and not trainers, store=shared, group=group,
            worker_devices=[d for _, d in mine], rank=rank, process_groups=made, checkpoint_schedule=schedule,
        ))
    run = ProcessRun(plan, rank, trainers, rejoining=rejoining, faults=spec.faults, process_groups=made)
    plan.strategy.attach_exchanges(run)
    _set_values(run, spec)
    if distributed:
        for trainer in trainers:
            trainer.add_hook(Heartbeat())
    _inject_faults(run, spec.faults)
    norms = debug_norms.install(trainers[0])  # `debug: true`: SINGA's fp/bp norm files at display steps
    if norms is not None:
        trainers[0].add_hook(norms)
    return run


def _inject_faults(run: ProcessRun, faults: FaultInjection) -> None:
    """The faults a test asked for, as hooks of this process's trainers and workers."""
    for trainer in run.trainers:
        for hook in faults.process_hooks(run.rank) + (faults.group_hooks(trainer.group) if run.board is not None else []):
            trainer.add_hook(hook)
        for member in trainer.workers:
            if isinstance(member, Worker):
                member.slow_down(faults.compute_delay(member.index, trainer.group))


def _set_values(run: ProcessRun, spec: RunSpec) -> None:
    """Initial values, then a resumed checkpoint (everything) or the job's checkpoint_path (params by name)."""
    plan, job = run.plan, run.plan.job
    chief = run.chief
    for trainer in run.trainers:
        if spec.initial_values is not None:
            spec.initial_values(trainer.store)
    resumed = ckpt_io.load(spec.resume_from, parts=True) if spec.resume_from is not None else None  # the chief's file and every part
    if resumed is not None and resumed.trainer.get("session"):
        # a loop's checkpoint holds its torch optimizers' state by index and the loop's own position, which this path
        # would not read: refused rather than resumed with the optimizer's state lost
        raise ckpt_io.CheckpointError(
            f"--resume: {spec.resume_from} was written by a loop on shoal.session() (shoal.fit's one worker in one process "
            f"runs there), which {plan.label} here cannot continue exactly: resume it with the layout that wrote it")
    if run.server is not None:
        if resumed is not None:
            plan.strategy.restore_server(run, resumed)
        return
    for trainer in run.trainers:
        if resumed is not None:
            trainer.restore(spec.resume_from, resumed)
        elif job.checkpoint_path and (trainer is chief or not plan.in_one_process) and plan.strategy.loads_checkpoint_path(trainer):
            trainer.load_params([ckpt_io.resolve_path(p, spec.base_dirs) for p in job.checkpoint_path])
    plan.strategy.after_values(run, spec)


def server_start_line(plan: JobPlan, rank: int, server) -> str:
    """SINGA's startup line of a server of process `rank`: what it serves (a user's loop's server process says it too)."""
    elements = sum(x.size for x in plan.placement.slices_of(server))
    return f"Server (group = {server.group}, id = {server.id}) start in process {rank}: {elements:,} param elements"


def start_lines(run: ProcessRun) -> list[str]:
    """SINGA's startup lines: every worker and server of this process, where it runs."""
    plan, rank = run.plan, run.rank
    where = f" in process {rank} (pid = {os.getpid()})" if not plan.in_one_process else ""
    lines = []
    if run.server is None:
        for trainer in run.trainers:
            for member in trainer.workers:
                for index, device in member.placed_workers():
                    lines.append(f"Worker (group = {trainer.group}, id = {index}) start on {device_label(device)}{where}")
    lines += [server_start_line(plan, rank, s) for s in plan.process(rank).servers]
    if rank == 0 and plan.updater.momentum != plan.job.updater.momentum:  # never silently (SINGA updaters only)
        lines.append(f"updater.momentum {plan.job.updater.momentum:g} -> {plan.updater.momentum:g} at the servers: "
                     f"{plan.nworker_groups} asynchronous groups add momentum of their own "
                     "(cluster.async_momentum: kAsConfigured keeps the job's)")
    return lines


def run_process(plan: JobPlan, rank: int, spec: RunSpec) -> History:
    """Assemble process `rank` and run it to the end; the chief writes the net and the run log.

    A write into the workspace that the machine refuses (disk full, read-only) ends it as WorkspaceWriteError.
    """
    try:
        return _run_process(plan, rank, spec)
    except OSError as err:
        failure = as_write_error(err, spec.workspace)
        if failure is None:
            raise
        raise failure from None


def _run_process(plan: JobPlan, rank: int, spec: RunSpec) -> History:
    run = assemble(plan, rank, spec)
    for line in start_lines(run):
        spec.log(line)
    metrics = None
    if rank == 0 and spec.rejoin is None:  # written once the job assembled (a refused --resume leaves the earlier copy alone)
        write_job_copy(text_format.MessageToString(plan.job), spec.workspace)
        visualization.write_train_net(plan, spec.workspace, fresh=spec.resume_from is None)
        devices = usable_device_names(plan.all_devices())
        resumed_at = run.chief.start_step if spec.resume_from is not None else None
        metrics = open_run_log(plan, spec.workspace, run.chief.elapsed_before, devices, resumed_at)
    error = None
    try:
        history = run.run(metrics, spec.log)
        speaker = metrics is not None or (run.chief is not None and run.chief.chief)  # (or a dead chief's successor)
        histogram = run.staleness_histogram() if speaker else None
        if histogram:
            (metrics or run.chief.metrics).annotate(staleness_histogram=histogram)
            (spec.log if metrics is not None else run.chief.log)(staleness_line(histogram, plan.max_update_lag))
        return history
    except BaseException as err:
        error = as_write_error(err, spec.workspace) or err
        raise
    finally:
        if metrics is None and run.chief is not None and run.chief.chief:
            metrics = run.chief.metrics  # the run log this process took over from a dead chief (report/succession.py)
        if metrics is not None:
            metrics.close(end_status(error), failure_reason(error))
