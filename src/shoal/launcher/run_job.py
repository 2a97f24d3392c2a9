"""A job from start to end on this host: plan it once, prepare its workspace, run it here or spawn its processes.

`train_job` is what `shoal run`, `shoal.train` and `shoal.fit` reach (through
shoal.frontend.api). A layout of one process runs in this process as rank 0
of a world of one; a layout of several spawns them (shoal.launcher.launch);
either way each process is assembled by shoal.runtime.assemble.run_process.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from shoal.config import job_pb2
from shoal.errors import warn
from shoal.planning.plan import JobPlan, plan_job
from shoal.report.tensorboard import require_tensorboard
from shoal.report.writes import WorkspaceWriteError, as_write_error, is_writable
from shoal.neuralnet import checkpoint as ckpt_io
from shoal.launcher import elastic, faults, job_registry
from shoal.launcher.options import RunOptions
from shoal.runtime import visualization
from shoal.runtime.assemble import RunSpec, run_process
from shoal.runtime.replicas import torch_device, usable_device_names
from shoal.runtime.trainer import History, Trainer
from shoal.strategies.registry import REGISTRY
from shoal.launcher.workspace import WorkspaceError, WorkspaceLock, check_workspace, claim, is_users, prepare


def resolve_workspace(job: job_pb2.JobProto, override: Optional[Path]) -> Path:
    """--workspace, else cluster.workspace, else a folder named after the job."""
    if override is not None:
        return Path(override)
    if job.cluster.workspace:
        return Path(job.cluster.workspace)
    return Path(f"{job.name or 'job'}-workspace")


def train_job(job: job_pb2.JobProto, options: RunOptions, job_file: str = "<python>") -> History:
    """Plan, then train as the cluster section says; the job is registered for `shoal jobs` while it runs.

    A write into the workspace the machine refuses (disk full, quota, read-only) is WorkspaceWriteError: one line.
    """
    try:
        return _train_job(job, options, job_file)
    except OSError as err:
        failure = as_write_error(err, resolve_workspace(job, options.workspace))
        if failure is None:
            raise
        raise failure from None


def plan_of(job: job_pb2.JobProto, nodes=None, given: Optional[JobPlan] = None) -> JobPlan:
    """The job's plan on the nodes of this launch (torchrun's or srun's, else `nodes`, else this host): `given`
    when it is that plan already (planned by the caller, for the same job bytes and nodes), else planned here."""
    launched = elastic.launched_process(nodes_given=nodes is not None)  # torchrun, srun, ...: run one rank
    nnodes = launched.nnodes if launched else nodes.nnodes if nodes else 1
    if given is not None and given.nnodes == nnodes and given.job_bytes == job.SerializeToString():
        return given
    return plan_job(job, nnodes=nnodes, strategies=REGISTRY)


def _train_job(job: job_pb2.JobProto, options: RunOptions, job_file: str) -> History:
    launched = elastic.launched_process(nodes_given=options.nodes is not None)  # torchrun, srun, ...: run one rank
    plan = plan_of(job, options.nodes, options.plan)
    if job.tensorboard:
        require_tensorboard()
    workspace = resolve_workspace(job, options.workspace)
    check_workspace(workspace)  # every rank, before any writes there: a workspace another user could redirect or feed
    if launched is not None and (launched.world_size > 1 or plan.nprocs > 1):
        return elastic.train_launched(plan, options, launched, job_file, workspace)
    claim(workspace)
    with WorkspaceLock(workspace, job.name):
        resume_from = prepare(workspace, elastic.resolve_resume(workspace, options.resume, job), options.log)
        record = job_registry.register(job.name, job_file, workspace)
        try:
            history = _train(plan, options, workspace, resume_from, record)
        except KeyboardInterrupt:
            job_registry.finish(record, "killed", "interrupted")
            raise
        except BaseException as err:
            job_registry.finish(record, "failed", str(err).splitlines()[0] if str(err) else type(err).__name__)
            raise
        job_registry.finish(record, "finished")
        return history


def _train(plan: JobPlan, options: RunOptions, workspace: Path, resume_from: Optional[Path], record: job_registry.JobRecord) -> History:
    spec = RunSpec(workspace, options.base_dirs, resume_from, options.log, options.progress, options.initial_values,
                   faults=faults.from_environment())
    if plan.in_one_process and options.nodes is None:
        options.log(f"Job {record.id}: {plan.label}; workspace {workspace}")
        return run_process(plan, 0, spec)
    from shoal.launcher.launch import Nodes, run_processes

    def started(pids: list[int]) -> None:
        launcher = dict(record.processes[0], rank="launcher")
        record.processes = [launcher] + [job_registry.process_entry(rank, pid) for rank, pid in enumerate(pids)]
        record.save()

    options.log(f"Job {record.id}: {plan.label}, {plan.nprocs} processes; logs in {workspace / 'logs'}")
    nodes = options.nodes or Nodes()
    if plan.max_restarts <= 0 or not nodes.one_host:  # (over several hosts each node's launcher sees only its own ranks)
        return run_processes(plan, spec, on_start=started, nodes=nodes, process_setup=options.process_setup,
                             rank_main=options.rank_main)
    return _with_restarts(plan, spec, options, started, nodes)


def _with_restarts(plan: JobPlan, spec: RunSpec, options: RunOptions, started, nodes) -> History:
    """The job's processes, started again from the newest checkpoint each time one that the job cannot go on without
    dies, up to plan.max_restarts times (shoal.launcher.job_restarts)."""
    from dataclasses import replace

    from shoal.launcher.job_restarts import JobRestarts
    from shoal.launcher.launch import ProcessLost, run_processes

    restarts = JobRestarts(plan, spec.workspace, options.log)
    while True:
        try:
            history = run_processes(plan, spec, on_start=started, nodes=nodes, process_setup=options.process_setup,
                                    rank_main=options.rank_main)
        except ProcessLost as lost:
            spec = replace(spec, resume_from=restarts.resume_point(lost))  # raises once no restart is left
            continue
        except BaseException:
            restarts.finish(None)  # the summary still says how many restarts came before
            raise
        restarts.finish(history)
        return history


def test_job(job: job_pb2.JobProto, options: RunOptions, checkpoint: Optional[Path] = None) -> dict[str, float]:
    """SINGA's -test mode: load a checkpoint and run test_steps batches of the test net (on worker 0's device)."""
    if job.test_steps <= 0:
        raise WorkspaceError("test-only mode needs test_steps > 0 in the job")
    plan = plan_job(job, strategies=REGISTRY)
    workspace = resolve_workspace(job, options.workspace)
    check_workspace(workspace)  # before a checkpoint is read there or test_net.json written: no link, nobody else's
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
    torch.set_num_threads(plan.threads_per_worker)
    device = torch_device(usable_device_names(plan.devices_of(0))[0])
    trainer = Trainer(plan, workspace, options.base_dirs, device, log=options.log, progress=False, train=False)
    step = trainer.load_params(paths)
    if not is_writable(workspace):  # an archived run, evaluated where it lies: testing needs no write
        options.log(f"Workspace {workspace} is read-only: {visualization.FOLDER}/test_net.json not written")
    elif is_users(workspace, visualization.FOLDER):  # the test runs without the drawing
        warn(f"{Path(workspace) / visualization.FOLDER} is not shoal's: test_net.json is not written")
    else:
        try:
            visualization.write_test_net(job, workspace)
        except WorkspaceWriteError as err:  # a full disk: the drawing is not what was asked for
            options.log(f"{err}; testing without it")
    cursor = trainer.tested_from(step)
    values = trainer.test_only(None, step, cursor or 0)
    if not trainer.nets[job_pb2.kTest].samples:  # a sampling net generates text: its "samples" are not data
        which = (f"the same samples as the run's own test at step {step}" if cursor is not None
                 else "from the start of the test data")
        options.log(f"Tested {paths[-1]} on {trainer.eval_samples(job_pb2.kTest, job.test_steps)} test samples "
                    f"(test_steps {job.test_steps} × batch {trainer.eval_samples(job_pb2.kTest, 1)}): {which}")
    return values
