"""Jobs whose processes a launcher started (torchrun, srun, a PyTorchJob), and restarts with `--resume=auto`.

A launched process runs only its own rank (`train_launched`): every rank joins
the world, rank 0 claims and locks the workspace, decides what to resume from,
registers the job and says so through the store; the others wait for its word
before they write anything. The launcher restarts failed processes
(torchrun's --max-restarts, Slurm's --requeue, a Job's backoffLimit); with
`--resume=auto` each start continues from this job's newest readable
checkpoint, or starts fresh when there is none. It never continues another
job's checkpoints: the workspace's job copy (.shoal/job.conf, written at every
start; job.conf in an older shoal's workspace) must be the same job: same name,
net, algorithm and updater.
"""
from __future__ import annotations

import functools
import os
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional, Union

from google.protobuf import text_format

from shoal.config import job_pb2
from shoal.errors import ShoalError, first_line, warn
from shoal.neuralnet import checkpoint as ckpt_io
from shoal.planning.plan import JobPlan
from shoal.launcher import faults, job_registry, launchers
from shoal.runtime.assemble import RunSpec
from shoal.runtime.trainer import History
from shoal.launcher.workspace import JOB_COPY, WorkspaceError, WorkspaceLock, claim, job_copy, prepare
from shoal.report.job_copy import write_job_copy

from shoal.launcher.options import RunOptions


class LaunchMismatch(ShoalError, ValueError):
    """A launcher started a world whose size is not the number of processes the job's layout has."""


def launched_process(nodes_given: bool) -> Optional[launchers.LaunchedProcess]:
    """This process's place in a launched world (None: shoal starts the processes); refuses --nnodes under a launcher."""
    launched = launchers.detect(os.environ)
    if launched is not None and nodes_given:
        raise launchers.LauncherEnvError(f"started by {launched.launcher} ({launched.describe()}): "
                                         "the launcher places the processes; drop --nnodes/--hostfile")
    return launched


def resolve_resume(workspace: Path, resume: Union[bool, str], job: job_pb2.JobProto) -> bool:
    """--resume=auto as --resume when the workspace holds this job's checkpoints, else as a fresh start."""
    if resume != "auto":
        return bool(resume)
    if not ckpt_io.list_checkpoints(workspace):
        return False
    check_same_job(workspace, job)
    return True


def job_identity(job: job_pb2.JobProto) -> job_pb2.JobProto:
    """What makes two runs the same job: its name, net, algorithm and updater (not its layout, steps or frequencies)."""
    same = job_pb2.JobProto(name=job.name)
    same.neuralnet.CopyFrom(job.neuralnet)
    same.train_one_batch.CopyFrom(job.train_one_batch)
    same.updater.CopyFrom(job.updater)
    return same


IDENTITY_FIELDS = ("name", "neuralnet", "train_one_batch", "updater")


def check_same_job(workspace: Path, job: job_pb2.JobProto) -> None:
    """The workspace's checkpoints were written by this job (its job copy says so), else one line refusing them."""
    copy = job_copy(workspace)
    refuse = f"{workspace}: --resume=auto found checkpoints of {{}}; it continues only this job's own (give --workspace for a new run)"
    try:
        if copy is None:
            raise FileNotFoundError(JOB_COPY)
        stored = text_format.Parse(copy.read_text(), job_pb2.JobProto())
    except FileNotFoundError:
        raise WorkspaceError(refuse.format(f"an unknown job (no {JOB_COPY} beside them)")) from None
    except (text_format.ParseError, UnicodeDecodeError):
        raise WorkspaceError(refuse.format(f"another job ({copy} does not read as this job's)")) from None
    theirs, ours = job_identity(stored), job_identity(job)
    if theirs != ours:
        if stored.name != job.name:
            raise WorkspaceError(refuse.format(f"job {stored.name!r}"))
        differs = next(f for f in IDENTITY_FIELDS if getattr(theirs, f) != getattr(ours, f))
        raise WorkspaceError(refuse.format(f"a job {job.name!r} whose {differs} differs"))


def train_launched(plan: JobPlan, options: RunOptions, launched: launchers.LaunchedProcess, job_file: str,
                   workspace: Path, may_supervise: bool = True) -> History:
    """This rank of a job whose processes a launcher started; rank 0 prepares and registers the job. With restarts
    allowed (--max-restarts N) a rank that may rejoin runs in a child process restarted into the running job when it
    dies or stalls (shoal.launcher.supervisor); `may_supervise` False: that child, running the rank here."""
    from shoal.launcher import supervisor
    from shoal.launcher.launch import run_rank

    if may_supervise and supervisor.supervises(plan, launched):
        return supervisor.supervise(plan, options, launched, workspace, functools.partial(
            rank_process, plan.job.SerializeToString(), plan.nnodes, launched, job_file, str(workspace), options.resume,
            [str(d) for d in options.base_dirs], options.process_setup, options.initial_values))
    if may_supervise:
        warn_if_not_restarted(plan, launched)
    with launched_job(plan, options, launched, job_file, workspace) as (resume_from, log):
        return run_rank(plan, launched.rank, RunSpec(workspace, options.base_dirs, resume_from, log, progress=False,
                                                     initial_values=options.initial_values, faults=faults.from_environment()))


def warn_if_not_restarted(plan: JobPlan, launched: launchers.LaunchedProcess) -> None:
    """Rank 0's one line at the start when restarts are allowed (--max-restarts N, cluster.max_restarts) but the
    layout's processes are not restarted into the running job: a job file's rank and a shoal.session() script's alike."""
    from shoal.launcher import rejoin

    if launched.rank == 0 and plan.max_restarts > 0 and not rejoin.rejoins(plan):
        warn(f"WARNING: --max-restarts: {plan.label}'s processes are not restarted into the running job (only AllReduce's and "
             f"Sandblaster's replicas, Downpour, Local SGD and Distributed Hogwild groups are); a dead one stops the job, which "
             f"{launched.launcher}'s own restarts may start again")
    elif launched.rank == 0 and plan.max_restarts > 0 and not rejoin.workers_rejoin(plan):
        warn(f"WARNING: --max-restarts: {plan.label}'s worker processes are not restarted into the running job (its server "
             f"processes are, healed from process 0's mirror); a dead one stops the job, which {launched.launcher}'s own "
             "restarts may start again")


@contextmanager
def launched_job(plan: JobPlan, options: RunOptions, launched: launchers.LaunchedProcess, job_file: str,
                 workspace: Path) -> Iterator[tuple[Optional[Path], Callable[[str], None]]]:
    """This rank of a launched job around the body that runs it (the rank's run, or a shoal.session()'s user loop),
    which gets (the checkpoint to resume from, how the rank says a line): rank 0 claims and locks the workspace,
    registers the job and, once the body ended, records how (and, restarts allowed, the rejoins in summary.json)."""
    from shoal.launcher import rejoin
    from shoal.launcher.launch import launched_rank

    if launched.world_size != plan.nprocs:
        raise LaunchMismatch(
            f"{launched.launcher} started {launched.world_size} process{'es' if launched.world_size > 1 else ''} "
            f"({launched.world_variable}={launched.world_size}) "
            f"but the job's layout, {plan.label}, has {plan.nprocs} processes (see `shoal plan`)")
    record: Optional[job_registry.JobRecord] = None
    lock: Optional[WorkspaceLock] = None
    began = time.time()  # logs/rejoins.jsonl may hold an earlier run's rejoins (a resumed workspace)

    def start(processes: list[dict]) -> Optional[Path]:
        nonlocal record, lock
        claim(workspace)
        lock = WorkspaceLock(workspace, plan.job.name).__enter__()  # held by rank 0 until the run ends
        resume_from = prepare(workspace, resolve_resume(workspace, options.resume, plan.job), options.log)
        record = job_registry.register(plan.job.name, job_file, workspace)
        record.processes = [job_registry.identified(p) for p in processes]  # start time, command line: for `jobs kill`
        record.save()
        write_job_copy(text_format.MessageToString(plan.job), workspace)
        restart = f", restart {launched.restart} of {launched.max_restarts}" if launched.restart else ""
        options.log(f"Job {record.id}: {plan.label}, {plan.nprocs} processes started by {launched.launcher}{restart}; "
                    f"logs in {workspace / 'logs'}" + (f"; resuming from {resume_from.name}" if resume_from else ""))
        return resume_from

    try:
        with launched_rank(plan, launched, workspace, start) as started:
            yield started
    except KeyboardInterrupt:
        _finish(record, "killed", "interrupted")
        raise
    except BaseException as err:
        _finish(record, "failed", str(err).splitlines()[0] if str(err) else type(err).__name__)
        raise
    finally:
        if lock is not None:
            lock.__exit__(None, None, None)
    if launched.rank == 0 and plan.max_restarts > 0 and rejoin.rejoins(plan):  # the chief closed the summary: its rejoins
        rejoin.add_rejoins_to_summary(workspace, since=began)
    _finish(record, "finished")


def _finish(record: Optional[job_registry.JobRecord], status: str, message: str = "") -> None:
    if record is not None:  # rank 0 registered the job; the other ranks have nothing to record
        job_registry.finish(record, status, message)


def supervised_child(environment: dict[str, str]) -> None:
    """What a supervised rank's first process does before its work (forked from its supervisor's forkserver): the
    supervisor's environment, not the forkserver's when it started; SIGTERM stops the run as in `shoal run`'s own
    process, which then closes its records."""
    from shoal.report.run_log import Terminated

    os.environ.clear()
    os.environ.update(environment)

    def terminated(signum, frame):
        raise Terminated

    signal.signal(signal.SIGTERM, terminated)


def rank_process(job_bytes: bytes, nnodes: int, launched: launchers.LaunchedProcess, job_file: str, workspace: str,
                 resume, base_dirs: list[str], process_setup, initial_values, environment: dict[str, str]) -> None:
    """A supervised rank's first process (forked from its supervisor's forkserver, shoal.launcher.supervisor): the rank
    as an unsupervised one runs it."""
    from shoal.config.plugins import decode_job
    from shoal.planning.plan import plan_job
    from shoal.strategies.registry import REGISTRY

    supervised_child(environment)
    if process_setup is not None:
        process_setup()
    try:
        plan = plan_job(decode_job(job_bytes), nnodes=nnodes, strategies=REGISTRY)
        options = RunOptions(resume=resume, base_dirs=[Path(d) for d in base_dirs], progress=False,
                             process_setup=process_setup, initial_values=initial_values)
        train_launched(plan, options, launched, job_file, Path(workspace), may_supervise=False)
    except ShoalError as err:  # one line, as `shoal run` says it (its supervisor says nothing more)
        print(first_line(str(err)) or type(err).__name__, file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:  # stopped with its supervisor, which speaks for both, or on its own (`jobs kill`): its
        raise SystemExit(130) from None  # supervisor then stops too (supervisor.STOPPED_EXIT), never restarting it
