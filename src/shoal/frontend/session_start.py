"""Where a `shoal.session()` comes from: its job and plan, the layouts it runs, and which process runs the user's loop.

- A layout of one process: the loop runs here (this process holds the workspace's lock and the job's registry entry
  while it runs).
- Several processes under `shoal run script.py`: this process (the launcher) starts one process per rank through
  shoal's launcher (launcher/launch.py: its rendezvous, signed store and secret, as for a job file), each running the
  script from the top, as torchrun does (`run_rank_script`); it waits for them and exits with the job's outcome. The
  user's loop never runs in the launcher.
- Inside such a rank: the session is that rank's (`rank_context`), its job checked against the launcher's.
- A process torchrun, srun or a PyTorchJob started (launcher/launchers.py reads their environment): it is one rank
  and runs the loop itself (frontend/session.py, `Session.launched`); with restarts allowed, a rank that may rejoin
  instead supervises a child that runs the script from the top (`supervise_if_restartable`, launcher/supervisor.py)
  and ends the script there once the rank's work is over.
- Several processes from a plain `python script.py`: refused in one line.
- A Downpour or Sandblaster server process (`serves_only`): its `shoal.session()` serves
  (runtime/session_exchange.serve_downpour) and ends the script there with SystemExit(0): the user's loop never runs on
  a server.
"""
from __future__ import annotations

import functools
import sys
import types
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from shoal.config import job_pb2
from shoal.config.validate import validate_cluster
from shoal.errors import ShoalError
from shoal.frontend import script
from shoal.frontend.keras import Cluster
from shoal.launcher.options import RunOptions
from shoal.planning.plan import JobPlan, plan_job
from shoal.planning.shares import batch_shares


class SessionError(ShoalError, ValueError):
    """A session that cannot run as asked: one line naming the argument or the layout."""


@dataclass(frozen=True)
class RankContext:
    """This process is rank `rank` of a job shoal's launcher started for a session (set before the script runs)."""

    plan: JobPlan
    rank: int
    workspace: Path
    resume_from: Optional[Path]
    log: Callable[[str], None]
    rejoin: Optional[object] = None  # restarted into the running loop (runtime/assemble.py's Rejoin: its incarnation)
    terminal: bool = True  # the chief's lines reach the terminal (shoal.fit with its own log= relays them instead)


_RANK: Optional[RankContext] = None


def rank_context() -> Optional[RankContext]:
    return _RANK


def session_job(cluster: Optional[job_pb2.ClusterProto], train_steps: int, seed: int, disp_freq: int,
                checkpoint_freq: int, name: str, checkpoint_interval_s: float = 0.0, partition_dim: int = 0,
                device=None) -> job_pb2.JobProto:
    """The job of a session: its cluster and counts, no net (the user's module is not shoal's to build), and an
    updater that applies nothing (the user's optimizer updates; an exchange's own inner updater never moves a value).
    `checkpoint_interval_s`: 0 (a user's loop checkpoints where it calls run.checkpoint()), or fit's. `partition_dim`:
    neuralnet.partition_dim (1: the module cut on its features), which the command line's --set overrides. `device`:
    the job's device list (worker k of each process on device[k], the others on the CPU; a name, or a list of them)."""
    for what, value, least in (("train_steps", train_steps, 1), ("seed", seed, 0), ("disp_freq", disp_freq, 1),
                               ("checkpoint_freq", checkpoint_freq, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise SessionError(f"shoal.session: {what} must be a whole number from {least}, got {value!r}")
    if isinstance(checkpoint_interval_s, bool) or not isinstance(checkpoint_interval_s, (int, float)):
        raise SessionError(f"shoal.session: checkpoint_interval_s must be a number of seconds from 0 (0: off), got "
                           f"{checkpoint_interval_s!r}")
    if cluster is not None and not isinstance(cluster, job_pb2.ClusterProto):
        raise SessionError(f"shoal.session: cluster= is a shoal.Cluster(...), got {type(cluster).__name__}")
    job = job_pb2.JobProto(name=name, train_steps=train_steps, seed=seed, disp_freq=disp_freq, checkpoint_freq=checkpoint_freq,
                           checkpoint_interval_s=float(checkpoint_interval_s))
    job.cluster.CopyFrom(cluster if cluster is not None else Cluster())
    job.updater.type = job_pb2.kSGD
    job.updater.learning_rate.type = job_pb2.kFixed
    job.updater.learning_rate.base_lr = 0.0
    if isinstance(partition_dim, bool) or partition_dim not in (0, 1):
        raise SessionError(f"shoal.session: partition_dim must be 0 (the batch) or 1 (the module's features), got {partition_dim!r}")
    if partition_dim:
        job.neuralnet.partition_dim = partition_dim
    job.device.extend(_device_names(device))
    job = script.applied(job)  # under `shoal run script.py`: the command line's --set
    if job.neuralnet.partition_dim not in (0, 1):  # the batch, or the features (torch's tensor parallelism)
        raise SessionError(f"shoal.session: neuralnet.partition_dim {job.neuralnet.partition_dim}: your own loop's module "
                           "is cut on the batch (0) or on its features (1, tensor-parallel over the group's processes)")
    for field, message in validate_cluster(job.cluster):
        raise SessionError(f"shoal.session: cluster.{field}: {message}")
    if job.train_steps < 1:
        raise SessionError(f"shoal.session: train_steps must be >= 1, got {job.train_steps}")
    if not 0 <= job.checkpoint_interval_s < float("inf"):  # (the keyword's, or --set checkpoint_interval_s=)
        raise SessionError(f"shoal.session: checkpoint_interval_s must be a number of seconds from 0 (0: off), got "
                           f"{job.checkpoint_interval_s:g}")
    return job


def _device_names(device) -> list[str]:
    """shoal.session's device=: None, a device's name ("cuda:0", "cpu:1") or a torch.device, or a list of them."""
    from shoal.config.validate import DEVICE_NAME

    names = [] if device is None else [device] if isinstance(device, (str, torch.device)) else device
    if not isinstance(names, (list, tuple)):
        raise SessionError(f"shoal.session: device= is a device's name or a list of them, got {type(device).__name__}")
    out = []
    for name in names:
        text = str(name) if isinstance(name, torch.device) else name
        text = "cuda:0" if text == "cuda" else text
        if not isinstance(text, str) or not DEVICE_NAME.match(text):
            raise SessionError(f"shoal.session: device {name!r} is not a device: give \"cpu\", \"cpu:N\" or \"cuda:N\"")
        out.append(text)
    return out


def check_layout(plan: JobPlan) -> None:
    """The layouts a user's loop runs today: one worker in one process; a synchronous group over processes, one worker
    each (AllReduce: the replicated update); Local SGD / DiLoCo groups over processes, one worker each; Distributed
    Hogwild groups over processes, one worker each, on CPU; Downpour's groups, or Sandblaster's one group, over
    processes, one worker each, on CPU, with server processes of their own (one server group); several workers in a
    process of one synchronous group (in-memory, or AllReduce over processes) or of Local SGD / DiLoCo's or
    Distributed Hogwild's (on CPU) group of the process, in-memory Downpour and Hogwild groups (a warm-up too), Local
    SGD / DiLoCo's groups in one process (on CPU: one thread per worker of each group, meeting in memory), or
    Downpour's groups and Sandblaster's group with server processes,
    each process one group's workers, the loop's body run once per worker by run.each_worker, each worker on its device
    (the job's device list) reading its share of the group's batch (cluster.auto_batch_shares: re-split by the group's
    measured speeds, frontend/session_shares.py). Every other layout is refused in one line naming it and what runs it."""
    one_worker_each = all(len(p.workers) == 1 for p in plan.placement.processes) and not any(p.servers and not p.workers
                                                                                           for p in plan.placement.processes)
    if plan.tensor_parallel:
        _check_tensor_parallel(plan, one_worker_each)
        return
    if plan.in_one_process and plan.nworkers == 1:
        return
    if several_workers_in_a_process(plan):
        if pushes_to_servers(plan):
            _pushes_on_cpu(plan)
        if syncs_with_peers(plan):
            _hogwild_on_cpu(plan)
        if meets_in_memory(plan):
            _meetings_on_cpu(plan)
        if groups_in_memory(plan):
            _groups_on_one_device(plan)
        return  # (run.each_worker: frontend/session_worker.py)
    if not plan.in_one_process and one_worker_each and not plan.server_worker_separate and plan.nworker_groups == 1 \
            and plan.strategy.synchronous:
        return  # (cluster.compression too: the replicated exchange all-gathers the encodings)
    if not plan.in_one_process and one_worker_each and plan.strategy.meets and plan.nworkers_per_group == 1:
        return
    if pushes_to_servers(plan) and all(len(p.workers) == 1 for p in plan.placement.processes if p.workers) \
            and plan.nserver_groups == 1:
        _pushes_on_cpu(plan)
        return
    if syncs_with_peers(plan) and one_worker_each:
        _hogwild_on_cpu(plan)
        return
    where = "in one process" if plan.in_one_process else f"over {plan.nprocs} processes"
    raise SessionError(f"shoal.session: {plan.label} {where} ({plan.nworkers} workers) is not supported in your own loop yet "
                       "(one worker per process: single worker, AllReduce, Local SGD / DiLoCo, Distributed Hogwild, "
                       "Downpour, Sandblaster; several per process: one synchronous group, Local SGD / DiLoCo (in one "
                       "process too) and Distributed Hogwild over processes, in-memory Downpour and Hogwild, Downpour and Sandblaster "
                       "with server processes): use a job file (`shoal run job.conf`) or shoal.fit for it")


def _check_tensor_parallel(plan: JobPlan, one_worker_each: bool) -> None:
    """neuralnet.partition_dim 1 in a user's loop: one synchronous group over processes, one worker each (the module's
    features cut over them: frontend/session_partition.py), on the CPU, uncompressed (no gradient travels)."""
    if plan.in_one_process or not one_worker_each or plan.nworker_groups != 1 or not plan.strategy.synchronous \
            or plan.server_worker_separate:
        raise SessionError(f"shoal.session: neuralnet.partition_dim 1 cuts your module's features over one synchronous "
                           f"group's processes, one worker each (cluster.nworkers_per_group N, nworkers_per_procs 1), "
                           f"not {plan.label} with {plan.nworkers} worker(s) in {plan.nprocs} process(es)")
    if not on_the_cpu(plan):
        raise SessionError("shoal.session: neuralnet.partition_dim 1 in your own loop runs on the CPU (gloo) here: leave "
                           "device unset (or \"cpu\")")
    if not plan.compression.dense:
        raise SessionError("shoal.session: cluster.compression compresses gradients, which a tensor-parallel group "
                           "(neuralnet.partition_dim 1) does not exchange: leave it unset")


def _hogwild_on_cpu(plan: JobPlan) -> None:
    if plan.strategy.params_on_host and not on_the_cpu(plan):
        raise SessionError("shoal.session: Distributed Hogwild in your own loop runs on CPU (its syncs go point-to-point "
                           "over gloo from the module's params): leave device unset (or \"cpu\"), or use a job file or shoal.fit")


def on_the_cpu(plan: JobPlan) -> bool:
    """Every worker of the layout on the CPU (no device list, or CPU devices only: "cpu:0", "cpu:1"). A user's loop runs
    Distributed Hogwild, Downpour's and Sandblaster's pushes to server processes, in-memory groups and a module cut on
    its features on the CPU alone (and shoal.fit keeps its job path for them on a GPU: fit.fit_layout)."""
    return all(device.startswith("cpu") for device in plan.all_devices())


def _meetings_on_cpu(plan: JobPlan) -> None:
    if not on_the_cpu(plan):
        raise SessionError("shoal.session: Local SGD / DiLoCo's groups in one process run on the CPU in your own loop for "
                           "now: leave device unset (or \"cpu\"), or use a job file (`shoal run job.conf`) or shoal.fit for it")


def _groups_on_one_device(plan: JobPlan) -> None:
    """In-memory Downpour's and Hogwild's groups compute around one in-process server's copy of the params (Hogwild's
    groups on that one copy itself): their workers on one device."""
    devices = sorted({"cpu" if d.startswith("cpu") else d for d in plan.all_devices()})  # (cpu:N: the one CPU's memory)
    if len(devices) > 1:
        raise SessionError(f"shoal.session: {plan.label} in your own loop computes around one copy of the params, on one "
                           f"device: give every worker the same device, not {', '.join(devices)} (or use a job file "
                           "(`shoal run job.conf`) or shoal.fit for it)")


def _pushes_on_cpu(plan: JobPlan) -> None:
    if not on_the_cpu(plan):
        raise SessionError(f"shoal.session: {plan.label} in your own loop runs on CPU (its pushes and pulls go point-to-point "
                           "over gloo from the module's params): leave device unset (or \"cpu\"), or use a job file "
                           "(`shoal run job.conf`) or shoal.fit for it")


def measures_shares(plan: JobPlan) -> bool:
    """cluster.auto_batch_shares over a group of several workers (the plan keeps them in one process): the group's batch
    re-split by their measured step times (planning/balance.py's balancer: the job path's Trainer's, and in a user's loop
    frontend/session_shares.py's); one worker a group has nothing to split."""
    return plan.balance_freq > 0 and plan.nworkers_per_group > 1


def group_shares(batch_size, workers: int, caller: str) -> list[int]:
    """The rows of a group's batch each of its `workers` reads: `batch_size` split evenly (planning/shares.batch_shares:
    the remainder to the first workers), or a list of one share per worker of the group, Caffe con Troll's split by
    hand (as a job file's store_conf.batchsize list: [200, 56]); every worker at least one row."""
    if isinstance(batch_size, (list, tuple)):
        if len(batch_size) != workers or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in batch_size):
            raise SessionError(f"{caller}: a batch_size list is one share per worker of the group: {workers} whole numbers "
                               f"from 1, got {list(batch_size)!r}")
        return list(batch_size)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise SessionError(f"{caller}: batch_size must be a whole number from 1 (or a list of one share per worker of the "
                           f"group), got {batch_size!r}")
    shares = batch_shares(job_pb2.StoreProto(batchsize=[batch_size]), workers)
    if min(shares) < 1:
        raise SessionError(f"{caller}: batch_size {batch_size} leaves worker {shares.index(0)} no rows ({workers} workers "
                           "per group)")
    return shares


def several_workers_in_a_process(plan: JobPlan) -> bool:
    """Several workers in a process, the same number in each (threads, `device=[...]`'s split), no server-only
    process but Downpour's and Sandblaster's: one synchronous group (in-memory, or AllReduce over processes), or Local
    SGD / DiLoCo or Distributed Hogwild with one group per process, whose workers' gradients meet in one mean; in-memory
    Downpour and Hogwild (groups_in_memory); Local SGD / DiLoCo's groups in one process (meets_in_memory); or
    Downpour's groups and Sandblaster's group with server processes (one server group), each process one group's
    workers, whose mean the process pushes once a step. run.each_worker's
    layouts, under restarts too (a restarted process's worker 0 takes the handover, which its other workers copy, or
    whose copy they share: session_healing.workers_take_chiefs_state, session_pushes.start_pushing,
    session_healing.take_live_values)."""
    pushes = pushes_to_servers(plan)
    counts = {len(p.workers) for p in plan.placement.processes if p.workers or not pushes}
    if max(counts) < 2 or len(counts) > 1:
        return False
    if pushes:  # (restarted: Downpour's pulls the servers' live values into the copy its threads share, Sandblaster's
        return (plan.nserver_groups == 1  # worker 0 takes the chief's state, which its other workers copy)
                and all(len({w.group for w in p.workers}) <= 1 for p in plan.placement.processes))
    if groups_in_memory(plan) or meets_in_memory(plan):
        return True
    if plan.nworker_groups == 1 and plan.strategy.synchronous:  # (restarted, its workers take the chief's worker 0's)
        return True
    # Local SGD / DiLoCo: each process one group's workers, whose mean stays in the process between meetings (restarted,
    # its workers take worker 0's, which took a live group's at a meeting); Distributed Hogwild: each process one group's
    # workers, whose mean updates the group's one copy between syncs (restarted, the live values land in that copy)
    return ((plan.strategy.meets or plan.strategy.syncs_with_peers) and not plan.in_one_process
            and all(len({w.group for w in p.workers}) == 1 for p in plan.placement.processes))


def groups_in_memory(plan: JobPlan) -> bool:
    """In-memory Downpour and Hogwild: asynchronous groups as threads of this process around one in-process server that
    runs the user's optimizer (run.each_worker: a group's workers' gradients meet in their mean, which its workers'
    opt.step() push once); under Downpour each group computes on its own copy, which takes the server's answer, under
    Hogwild every group on the server's one copy (`share_memory`), which the server updates in place."""
    return (plan.in_one_process and plan.nworker_groups > 1
            and not plan.strategy.synchronous and not plan.strategy.meets and not plan.strategy.syncs_with_peers)


def meets_in_memory(plan: JobPlan) -> bool:
    """Local SGD / DiLoCo's groups as threads of this process (one thread per worker of each group): each group trains
    its own replicas with its own optimizers, and every local_steps steps the groups meet in memory (the strategy's
    PeriodicExchange per group, its InMemoryMeeting: the mean change, then the outer step), as a job file's groups do."""
    return plan.in_one_process and plan.strategy.meets


def pushes_to_servers(plan: JobPlan) -> bool:
    """Downpour over processes (each group pushes its gradients to server processes that hold no trainer: the
    strategy's `servers_hold_trainers`), or Sandblaster's one synchronous group with its servers in processes of their
    own: in a user's loop the servers run the user's optimizer, built from its recipe, never the user's loop."""
    return not plan.in_one_process and (not plan.strategy.servers_hold_trainers
                                        or (plan.strategy.synchronous and plan.server_worker_separate))


def serves_only(plan: JobPlan, rank: int) -> bool:
    """Process `rank` hosts servers and no worker (Downpour's, Sandblaster's): it serves, the loop never runs there."""
    process = plan.process(rank)
    return bool(process.servers) and not process.workers


def syncs_with_peers(plan: JobPlan) -> bool:
    """Distributed Hogwild: each process's group updates its own replica and syncs with the other groups' masters."""
    return plan.strategy.syncs_with_peers


_last_plan: Optional[JobPlan] = None


def planned(job: job_pb2.JobProto, nnodes: int = 1) -> JobPlan:
    """The plan of a session's `job` on `nnodes` hosts, planned once: shoal.fit decides its path from the plan its
    session then runs on (the same job's bytes), not from a second planning of it."""
    from shoal.strategies.registry import REGISTRY

    global _last_plan
    if _last_plan is None or _last_plan.nnodes != nnodes or _last_plan.job_bytes != job.SerializeToString():
        _last_plan = plan_job(job, nnodes=nnodes, strategies=REGISTRY)
    return _last_plan


def plan_session(job: job_pb2.JobProto, nnodes: int = 1) -> JobPlan:
    """The plan (on `nnodes` hosts: a launcher's), its layout checked; `shoal plan script.py` shows the session's job
    (a layout the loop cannot run refused as `shoal run` refuses it) and stops the script here."""
    plan = planned(job, nnodes)
    check_layout(plan)
    try:
        script.plan_instead(job)
    except ShoalError as err:
        if "neuralnet" not in str(err):
            raise
        raise SessionError("shoal plan: a shoal.session()'s job has no net to estimate (its module is yours, built after "
                           "the session): `shoal plan script.py` without --estimate/--compare/--recommend shows its layout") from None
    return plan


def started_by_a_launcher():
    """This process's place in a world torchrun, srun or env:// started (launcher/launchers.py), or None."""
    from shoal.launcher.elastic import launched_process

    return launched_process(nodes_given=False)


def start_ranks(plan: JobPlan, workspace: Optional[Path], resume, log: Callable[[str], None],
                process_setup: Optional[Callable[[], None]] = None) -> int:
    """Under `shoal run script.py`: one process per rank, each running the script from the top; returns the exit
    status once every one has ended (a failure is the launcher's one line, a ProcessFailed). `process_setup`: what a
    rank does before it plans the job (a torch outer optimizer's stand-in: session_outer.setup_of)."""
    from shoal.launcher import process_server
    from shoal.launcher.run_job import resolve_workspace, train_job
    from shoal.report.progress import closing_line

    # (the script's own cluster placed the processes: the server its ranks fork from imports what they would each
    # import, torch._dynamo's second of CPU too; a no-op where `shoal run --set cluster.…` forked it already)
    process_server.start_for(plan.job.cluster, process_server.SESSION_RANK_IMPORTS)
    settings = script.settings()
    path = Path(script.running_path())
    main = functools.partial(run_rank_script, str(path), list(script.running_argv()), settings)
    ws = resolve_workspace(plan.job, script.workspace(workspace))
    # runpy made the script this process's __main__: multiprocessing would import it again in the forkserver and in
    # every rank it starts (running the user's loop there). Each rank runs the script itself, from the top
    saved, sys.modules["__main__"] = sys.modules["__main__"], types.ModuleType("__main__")
    try:
        history = train_job(plan.job, RunOptions(workspace=ws, resume=script.resume(resume), log=log, plan=plan,
                                                 rank_main=main, progress=False, process_setup=process_setup),
                            job_file=str(path))
    finally:
        sys.modules["__main__"] = saved
    log(closing_line(history.workspace))
    return 0


_SUPERVISED = False  # this process is a supervised rank's child (under torchrun/srun): it runs the loop itself


def serve_if_server(plan: JobPlan, launched, workspace: Optional[Path], resume, log: Callable[[str], None]) -> None:
    """Under torchrun/srun, a server process (`serves_only`) joins the world as a rank does and serves
    (runtime/session_exchange.serve_downpour), then ends the script (exit status 0), as under `shoal run script.py`
    (where the rank's context says so). Returns in every other process."""
    from shoal.launcher.elastic import launched_job
    from shoal.launcher.run_job import resolve_workspace
    from shoal.runtime.session_exchange import serve_downpour

    if not serves_only(plan, launched.rank):
        return
    ws = resolve_workspace(plan.job, script.workspace(workspace))
    options = RunOptions(workspace=ws, resume=script.resume(resume), log=log)
    with launched_job(plan, options, launched, str(script.running_path() or sys.argv[0]), ws) as (_, say):
        serve_downpour(plan, launched.rank, ws, say)
    raise SystemExit(0)


def supervise_if_restartable(plan: JobPlan, launched, workspace: Optional[Path], resume, log: Callable[[str], None]) -> None:
    """Under torchrun/srun with restarts allowed (`cluster.max_restarts`, `shoal run script.py --max-restarts N`), a
    rank that may rejoin (launcher/supervisor.py's `supervises`: never the chief) runs the loop in a child process that
    runs the script from the top, and its supervisor restarts a dead or stalled one into the running loop (the
    script from the top again: its session knocks at run.batches()), as `shoal run script.py` does; the script ends
    here (exit status 0) once the rank's work is over. Returns in every other process: it runs the loop itself. Rank 0
    of a layout whose processes are not restarted says so, as a job file's (launcher/elastic.py decides)."""
    from shoal.launcher import supervisor
    from shoal.launcher.elastic import warn_if_not_restarted
    from shoal.launcher.run_job import resolve_workspace

    if _SUPERVISED or not supervisor.supervises(plan, launched):
        if not _SUPERVISED:
            warn_if_not_restarted(plan, launched)
        return
    path = Path(script.running_path() or sys.argv[0])
    argv = list(script.running_argv()) if script.running_path() else sys.argv[1:]
    settings = script.settings() or script.ScriptSettings()
    ws = resolve_workspace(plan.job, script.workspace(workspace))
    options = RunOptions(workspace=ws, resume=script.resume(resume), log=log,
                         rank_main=functools.partial(run_rank_script, str(path), argv, settings))
    # the script is this process's __main__: the forkserver's children would import it again (start_ranks says why)
    saved, sys.modules["__main__"] = sys.modules["__main__"], types.ModuleType("__main__")
    try:
        supervisor.supervise(plan, options, launched, ws, functools.partial(supervised_rank_script, str(path), argv, settings))
    finally:
        sys.modules["__main__"] = saved
    raise SystemExit(0)


def supervised_rank_script(path: str, argv: list[str], settings: script.ScriptSettings, environment: dict[str, str]) -> None:
    """A supervised rank's first process (forked from its supervisor's forkserver): the script from the top, its
    session the launched rank's, as an unsupervised rank runs it; a failure is one line and a non-zero status, which
    its supervisor answers (a restart, or the rank given up on)."""
    global _SUPERVISED
    from shoal.errors import first_line
    from shoal.launcher.elastic import supervised_child

    supervised_child(environment)
    _SUPERVISED = True
    try:
        status = script.run_script(Path(path), argv, settings, expected=(ShoalError,))
    except ShoalError as err:
        print(first_line(str(err)) or type(err).__name__, file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:  # stopped with its supervisor, which speaks for both
        raise SystemExit(130) from None
    if status:
        raise SystemExit(status)


def refuse_unstarted(plan: JobPlan) -> None:
    """Several processes, and nothing started them (a plain `python script.py`): one line and exit status 2, as the
    CLI's refusals (no traceback: the script is fine, the command that started it is not)."""
    print(f"shoal.session: {plan.label} runs {plan.nprocs} processes: start the script with `shoal run "
          f"{Path(sys.argv[0]).name if sys.argv and sys.argv[0] else 'script.py'} --set cluster.…`, which starts one "
          "process per rank (or with torchrun: `torchrun --nproc-per-node N script.py`, SHOAL_JOB_SECRET set)", file=sys.stderr)
    raise SystemExit(2)


@contextmanager
def as_rank(plan: JobPlan, rank: int, spec, terminal: bool = True) -> Iterator[None]:
    """Inside, this process is rank `rank` of the launcher's job (`spec`: its RunSpec): `shoal.session()` returns the
    rank's session (a loop shoal runs as a function: shoal.fit's, frontend/fit_loop.py). `terminal`: RankContext's."""
    global _RANK
    _RANK = RankContext(plan, rank, Path(spec.workspace), spec.resume_from, spec.log, spec.rejoin, terminal)
    try:
        yield
    finally:
        _RANK = None


def run_rank_script(path: str, argv: list[str], settings: script.ScriptSettings, plan: JobPlan, rank: int, spec) -> None:
    """A rank of a session's job (launcher/launch.py calls it after the rank joined the world): the script, from the
    top, with this rank's context for its `shoal.session()`."""
    global _RANK
    _RANK = RankContext(plan, rank, Path(spec.workspace), spec.resume_from, spec.log, spec.rejoin)
    try:
        status = script.run_script(Path(path), argv, settings, expected=(ShoalError,))
    finally:
        _RANK = None
    if status:
        raise script.ScriptError(f"{path}: process {rank} exited with status {status}")


def same_job(given: job_pb2.JobProto, plan: JobPlan) -> None:
    """A rank's script asked for the job its launcher planned (the script runs once per process: a value that differs
    between them, a random draw or the time, would make them disagree)."""
    if given.SerializeToString(deterministic=True) != plan.job.SerializeToString(deterministic=True):
        raise SessionError("shoal.session: this process's session differs from the launcher's (its keywords changed "
                           "between processes): give every process the same cluster, train_steps and seed")

