"""Run a job in this process: one worker group (its workers as threads) and its server."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import torch
from google.protobuf import text_format

from shoal.errors import ShoalError
from shoal.runtime import checkpoint as ckpt_io
from shoal.runtime import job_registry as jobs
from shoal.planning.placement import place
from shoal.config import job_pb2
from shoal.planning.partition import plan_partition
from shoal.report.run_log import end_status, open_run_log
from shoal.report.tensorboard import require_tensorboard
from shoal.runtime.exchanges.sliced import LocalExchange
from shoal.runtime.feed import train_input_shares
from shoal.runtime.exchanges.groups import GroupBoard, GroupExchange, run_groups
from shoal.runtime.replicas import device_label, process_devices, torch_device
from shoal.runtime.exchanges.server import Server
from shoal.runtime import visualization
from shoal.runtime.trainer import History, Trainer
from shoal.neuralnet.updaters import make_updater

if TYPE_CHECKING:
    from shoal.neuralnet.params import ParamStore
    from shoal.runtime.launch import Nodes


class WorkspaceError(ShoalError, ValueError):
    """The workspace cannot be used as asked (would overwrite, nothing to resume, ...)."""


class UnsupportedClusterError(ShoalError, ValueError):
    """A cluster layout this build of the runtime cannot run yet (said in one line)."""


def check_runnable(job: job_pb2.JobProto) -> None:
    """Say in one line which layouts this runtime cannot run yet."""
    placement = place(job.cluster)
    c = job.cluster
    if c.auto_batch_shares:
        _check_balanceable(job, placement)
    if c.nworkers_per_group > 1 and plan_partition(job).partitioned:
        if job.train_one_batch.alg != job_pb2.kBP:
            raise UnsupportedClusterError("train_one_batch.alg: layers partitioned on features or placed by location train with kBP only")
        hosted = [[w.group for w in p.workers] for p in placement.processes]
        spans = any(groups.count(g) != c.nworkers_per_group for groups in hosted for g in groups)
        if spans and c.nworker_groups > 1:
            raise UnsupportedClusterError(
                f"cluster: an asynchronous partitioned group's {c.nworkers_per_group} workers must share one process "
                f"(nworkers_per_procs: a multiple of {c.nworkers_per_group}); one synchronous group may span processes"
            )
    if c.nworker_groups == 1:
        return
    if len(placement.processes) > 1:
        if c.nserver_groups > 1:
            # Distributed Hogwild: every process holds one whole worker group and its whole server group
            for p in placement.processes:
                if len({m.group for m in p.workers + p.servers}) != 1 or len(p.workers) != c.nworkers_per_group or len(p.servers) != c.nservers_per_group:
                    raise UnsupportedClusterError(
                        "cluster: with several server groups over processes, each process must hold one whole worker group and "
                        f"its server group (Distributed Hogwild: nworkers_per_procs: {c.nworkers_per_group}, "
                        f"nservers_per_procs: {c.nservers_per_group}, nserver_groups = nworker_groups, server_worker_separate: false)"
                    )
            if c.max_staleness >= 0 or c.warmup_steps > 0:
                raise UnsupportedClusterError("cluster: max_staleness and warmup_steps apply to Downpour and in-memory Hogwild, not to Distributed Hogwild")
            return
        if not c.server_worker_separate:
            raise UnsupportedClusterError(
                f"cluster: {placement.framework} over {len(placement.processes)} processes is not supported yet: "
                "asynchronous groups over processes run as Downpour (nserver_groups: 1, server_worker_separate: true) "
                f"or in one process (nworkers_per_procs: {c.nworker_groups * c.nworkers_per_group}); see `shoal plan`"
            )
        if any(len({w.group for w in p.workers}) > 1 for p in placement.processes):
            raise UnsupportedClusterError("cluster: a process hosting workers of several groups is not supported over processes yet")
        return
    if c.nserver_groups > 1:
        raise UnsupportedClusterError(
            "cluster: asynchronous groups in one process need nserver_groups: 1 (in-memory Hogwild or Downpour); "
            "Distributed Hogwild runs one group per process"
        )


def _check_balanceable(job: job_pb2.JobProto, placement) -> None:
    """auto_batch_shares re-splits a group's batch between threads of one process, over one batch size."""
    if any(len(p.workers) % job.cluster.nworkers_per_group for p in placement.processes):
        raise UnsupportedClusterError(
            "cluster.auto_batch_shares: the workers of a group must share one process "
            f"(nworkers_per_procs: a multiple of {job.cluster.nworkers_per_group}) to re-split its batch"
        )
    if job.cluster.nworkers_per_group > 1 and plan_partition(job).partitioned:
        raise UnsupportedClusterError("cluster.auto_batch_shares: a group with layers cut on features or placed by location splits by layer, not by batch")
    sizes = {sum(shares) for shares in train_input_shares(job)}
    if len(sizes) > 1:
        raise UnsupportedClusterError(f"cluster.auto_batch_shares: the training input layers read batches of different sizes ({sorted(sizes)})")


@dataclass
class RunOptions:
    workspace: Optional[Path] = None  # overrides cluster.workspace
    resume: bool = False
    # folders relative paths in the job are resolved against (cwd first, as SINGA)
    base_dirs: list[Path] = field(default_factory=lambda: [Path.cwd()])
    log: Callable[[str], None] = print
    progress: Optional[bool] = None  # None: a bar when stderr is a terminal
    nodes: Optional["Nodes"] = None  # several hosts (shoal.runtime.launch.Nodes); None: this host only
    # shoal.fit: registers its layer types in each spawned process (picklable), and sets initial param values
    process_setup: Optional[Callable[[], None]] = None
    initial_values: Optional[Callable[["ParamStore"], None]] = None


def resolve_workspace(job: job_pb2.JobProto, override: Optional[Path]) -> Path:
    """--workspace, else cluster.workspace, else a folder named after the job."""
    if override is not None:
        return Path(override)
    if job.cluster.workspace:
        return Path(job.cluster.workspace)
    return Path(f"{job.name or 'job'}-workspace")


def thread_budget(job: job_pb2.JobProto, workers_on_host: int = 1) -> int:
    """Intra-op threads per worker: the job's num_openblas_threads if set, else cores / workers."""
    if job.HasField("num_openblas_threads"):
        return max(1, job.num_openblas_threads)
    if job.cluster.threads_per_worker > 0:
        return job.cluster.threads_per_worker
    return max(1, (os.cpu_count() or 1) // max(1, workers_on_host))


def _prepare_workspace(workspace: Path, resume: bool) -> Optional[Path]:
    """Refuse to clobber an earlier run; return the checkpoint to resume from, if any."""
    existing = ckpt_io.latest(workspace)
    if resume:
        if existing is None:
            raise WorkspaceError(f"{workspace}: no checkpoint to resume from")
        return existing
    if existing is not None:
        raise WorkspaceError(
            f"{workspace} already holds checkpoints (newest: {existing.name}); "
            "use --resume to continue that run or --workspace to start a new one"
        )
    metrics = workspace / "metrics.jsonl"
    if metrics.exists():  # an earlier run that died before its first checkpoint: keep its metrics
        n = 1
        while metrics.with_name(f"metrics.jsonl.{n}").exists():
            n += 1
        metrics.rename(metrics.with_name(f"metrics.jsonl.{n}"))
    return None


def build_group_trainers(job: job_pb2.JobProto, workspace: Path, options: RunOptions) -> tuple[list[Trainer], GroupBoard]:
    """Asynchronous groups in this process sharing one store and one server (in-memory Hogwild)."""
    c = job.cluster
    torch.set_num_threads(thread_budget(job, workers_on_host=c.nworker_groups * c.nworkers_per_group))
    names = process_devices(job, c.nworker_groups * c.nworkers_per_group)
    of_group = [names[g * c.nworkers_per_group : (g + 1) * c.nworkers_per_group] for g in range(c.nworker_groups)]
    home = torch_device(names[0])  # the server's values live with worker 0 of group 0
    chief = Trainer(job, workspace, options.base_dirs, home, log=options.log, progress=options.progress, worker_devices=of_group[0])
    # share_memory: every group computes on the server's values; else each on its own copy (in-memory Downpour)
    others = [
        Trainer(job, workspace, options.base_dirs, home if c.share_memory else torch_device(of_group[g][0]), progress=False, chief=False,
                store=chief.store if c.share_memory else None, group=g, worker_devices=of_group[g])
        for g in range(1, c.nworker_groups)
    ]
    server = Server(chief.store if c.share_memory else chief.store.copy(), make_updater(job.updater))
    board = GroupBoard(c.nworker_groups, c.max_staleness, c.warmup_steps)
    for trainer in [chief] + others:
        trainer.attach_exchange(GroupExchange(server, board, trainer.group, None if c.share_memory else trainer.store))
    return [chief] + others, board


def build_trainer(job: job_pb2.JobProto, workspace: Path, options: RunOptions, train: bool = True) -> Trainer:
    torch.set_num_threads(thread_budget(job, workers_on_host=job.cluster.nworkers_per_group))
    names = process_devices(job, job.cluster.nworkers_per_group)
    trainer = Trainer(job, workspace, options.base_dirs, torch_device(names[0]), log=options.log, progress=options.progress, train=train,
                      worker_devices=names if train else None)
    if train:
        trainer.attach_exchange(LocalExchange(Server(trainer.store, make_updater(job.updater))))
    return trainer


def train_job(job: job_pb2.JobProto, options: RunOptions, job_file: str = "<python>") -> History:
    """Train as the cluster section says; the job is registered for `shoal jobs` while it runs."""
    check_runnable(job)
    if job.tensorboard:
        require_tensorboard()
    workspace = resolve_workspace(job, options.workspace)
    resume_from = _prepare_workspace(workspace, options.resume)
    record = jobs.register(job.name, job_file, workspace)
    try:
        history = _train(job, options, workspace, resume_from, record)
    except KeyboardInterrupt:
        jobs.finish(record, "killed", "interrupted")
        raise
    except BaseException as err:
        jobs.finish(record, "failed", str(err).splitlines()[0] if str(err) else type(err).__name__)
        raise
    jobs.finish(record, "finished")
    return history


def _train(job: job_pb2.JobProto, options: RunOptions, workspace: Path, resume_from: Optional[Path], record: jobs.JobRecord) -> History:
    placement = place(job.cluster)
    if len(placement.processes) > 1 or options.nodes is not None:
        from shoal.runtime.launch import Nodes, run_processes

        workspace.mkdir(parents=True, exist_ok=True)
        (workspace / "job.conf").write_text(text_format.MessageToString(job))
        workers = job.cluster.nworker_groups * job.cluster.nworkers_per_group

        def started(pids: list[int]) -> None:
            host = record.processes[0]["host"]
            record.processes = [{"rank": "launcher", "host": host, "pid": os.getpid()}] + [
                {"rank": rank, "host": host, "pid": pid} for rank, pid in enumerate(pids)
            ]
            record.save()

        options.log(f"Job {record.id}: {len(placement.processes)} processes ({placement.framework}); logs in {workspace / 'logs'}")
        nodes = options.nodes or Nodes()
        local_workers = max(1, -(-workers // nodes.nnodes))
        return run_processes(job, workspace, resume_from, options.base_dirs, thread_budget(job, workers_on_host=local_workers), on_start=started,
                             nodes=nodes, process_setup=options.process_setup, initial_values=options.initial_values)
    if job.cluster.nworker_groups > 1:
        trainers, board = build_group_trainers(job, workspace, options)
    else:
        trainers, board = [build_trainer(job, workspace, options)], None
    chief = trainers[0]
    for trainer in trainers:
        if options.initial_values is not None:
            options.initial_values(trainer.store)
        if resume_from is not None:
            trainer.restore(resume_from)
        elif job.checkpoint_path and trainer is chief:
            trainer.load_params([ckpt_io.resolve_path(p, options.base_dirs) for p in job.checkpoint_path])
    if board is not None:
        for trainer in trainers:
            trainer.exchange.start_from(chief.store)
        board.start_at([t.start_step for t in trainers])
        for trainer in trainers:
            trainer.start_step = board.first_step(trainer.group)
    workspace.mkdir(parents=True, exist_ok=True)
    (workspace / "job.conf").write_text(text_format.MessageToString(job))
    visualization.write_train_net(job, workspace, fresh=resume_from is None)
    # a partitioned group is one worker-like object holding its workers (parts)
    workers = [(t.group, w) for t in trainers for group in t.workers for w in getattr(group, "parts", [group])]
    devices = [getattr(w, "device_name", str(w.device)) for _, w in workers]
    for (group, w), device in zip(workers, devices):
        options.log(f"Worker (group = {group}, id = {w.index}) start on {device_label(device)}")
    options.log(f"Job {record.id}; workspace {workspace}")
    threads = thread_budget(job, workers_on_host=job.cluster.nworker_groups * job.cluster.nworkers_per_group)
    metrics = open_run_log(job, workspace, chief.elapsed_before, devices, threads)
    error = None
    try:
        return run_groups(trainers, board, metrics, options.log) if board else chief.run(metrics)
    except BaseException as err:
        error = err
        raise
    finally:
        metrics.close(end_status(error))


def test_job(job: job_pb2.JobProto, options: RunOptions, checkpoint: Optional[Path] = None) -> dict[str, float]:
    """SINGA's -test mode: load a checkpoint and run test_steps batches of the test net."""
    if job.test_steps <= 0:
        raise WorkspaceError("test-only mode needs test_steps > 0 in the job")
    workspace = resolve_workspace(job, options.workspace)
    if checkpoint is None:
        if job.checkpoint_path:
            paths = [ckpt_io.resolve_path(p, options.base_dirs) for p in job.checkpoint_path]
        else:
            newest = ckpt_io.latest(workspace)
            if newest is None:
                raise WorkspaceError(f"{workspace}: no checkpoint to test (give checkpoint_path or train first)")
            paths = [newest]
    else:
        paths = [Path(checkpoint)]
    trainer = build_trainer(job, workspace, options, train=False)
    step = trainer.load_params(paths)
    visualization.write_test_net(job, workspace)
    return trainer.test_only(None, step)
