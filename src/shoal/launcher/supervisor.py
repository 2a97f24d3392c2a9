"""A rank of a launched job (torchrun, srun, env://) that comes back into the running job when its process dies or stalls.

Under `torchrun ... -m shoal run JOB --max-restarts N` (shoal's flag, cluster.max_restarts: the same budget as under
`shoal run`, N restarts per process) the process torchrun starts for a rank that may rejoin (`rejoin.why_not`: not
the chief) is a small supervisor: it runs the rank's training in a child process (the same rank, environment and
path as an unsupervised rank, `elastic.train_launched`) and, when that child dies or stays stopped past the stall
timeout, has `rejoin.Restarter` (the one place that decides, as for `shoal run`'s launcher) start a new one into the
running job through the job's store. torchrun sees nothing fail: the survivors' processes go on unchanged.
A `shoal.session()` script's rank is supervised the same way (frontend/session_start.py, `supervise_if_restartable`):
its child runs the script from the top, and so does a restarted one (`RunOptions.rank_main`, as under `shoal run`).

The store outlives the child: torchrun's agent hosts it (srun, env://: process 0, which is never supervised). What
a supervisor cannot survive falls back to the launcher's whole-job restart from the newest checkpoint (torchrun's
own --max-restarts with --resume=auto): the chief's death, the supervisor itself killed, torchrun's agent or a
node lost. Its SIGTERM (torchrun stopping the job, Ctrl-C) ends the child first: no orphans.
"""
from __future__ import annotations

import functools
import os
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

from shoal.launcher import launchers, stalls
from shoal.launcher.options import RunOptions
from shoal.planning.plan import JobPlan
from shoal.runtime.trainer import History

WATCH_INTERVAL_S = 0.5  # how often the supervisor looks for a stopped child between its exits


def supervises(plan: JobPlan, launched: launchers.LaunchedProcess) -> bool:
    """Whether this launched process runs its rank in a child it restarts into the running job (restarts allowed, a
    strategy whose processes rejoin, a rank that may: never the chief)."""
    from shoal.launcher import rejoin

    # (never the chief: under torchrun/srun its process holds the workspace's lock and the registry's entry, which a
    # restarted child could not take back; its death restarts the whole job there)
    return (plan.nprocs > 1 and plan.max_restarts > 0 and rejoin.rejoins(plan) and launched.rank != 0
            and rejoin.why_not(plan, launched.rank) is None)


def supervise(plan: JobPlan, options: RunOptions, launched: launchers.LaunchedProcess, workspace: Path,
              first_process: functools.partial) -> History:
    """Run this rank in a child process and restart it into the job as often as the plan allows; returns when the
    rank's work is over (its last process finished, or it was given up on and the others go on without it).
    `first_process(environment)`: the child's first process, a partial of a module-level function (picklable; the
    forkserver preloads its module): elastic.rank_process, the rank as an unsupervised one runs it, or a session's
    script from the top; a restarted one runs `options.rank_main` (None: a job file's rank, launch.run_process)."""
    from shoal.config.plugins import forkserver_context, rank_environment
    from shoal.launcher import rejoin
    from shoal.launcher.launch import (Meeting, _end_stopped_to_restart, _wait_for_exit, children_stop_with_this_process,
                                       launched_interface)
    from shoal.runtime.assemble import RunSpec

    rank = launched.rank
    # (the job's secret in it: the launcher's user gave it to every process; OpenMP's wait policy as the forkserver's)
    environment = rank_environment(os.environ)
    # torch and shoal imported once: a restart costs no interpreter start
    context = forkserver_context([first_process.func.__module__])
    child = context.Process(target=first_process, name=f"shoal-rank{rank}", daemon=False, args=(environment,))
    children = SimpleNamespace(processes=[child], sentinels={})  # what rejoin.Restarter replaces a dead one in

    # torchrun stops the job (or Ctrl-C): the child goes with this process
    with children_stop_with_this_process(lambda: children.processes):
        try:
            child.start()
            interface = "lo" if launched.on_loopback else launched_interface(launched.master_addr)
            # the store's keys as the world's ranks have them: torchrun's agent scopes each of its attempts
            meeting = Meeting(launched.world_size, launched.nnodes, launched.local_world_size, launched.master_addr,
                              launched.master_port, interface, attempt=launched.restart if launched.agent_store else None)
            spec = RunSpec(workspace, options.base_dirs, None, log=options.log, progress=False, initial_values=options.initial_values)
            restarter = rejoin.Restarter(plan, meeting, spec, options.process_setup, environment, rank_main=options.rank_main,
                                         notes_store=False)
            stopped_since: dict[int, float] = {}
            while True:
                current = children.processes[0]
                current.join(WATCH_INTERVAL_S)
                if current.exitcode is None:
                    if _end_stopped_to_restart(children, [rank], plan, restarter, stopped_since, set()):
                        restarter.restart(children, 0, rank, -signal.SIGKILL, how=f"was stopped past the stall timeout "
                                          f"({plan.stall_timeout_s:g} s) and dropped; the launcher ended it (SIGKILL)")
                        if children.processes[0].exitcode is not None:  # not restarted (the line said why)
                            return _rank_over(workspace, rank, _given_up(plan, rank, workspace))
                    continue
                code = current.exitcode
                if code == 0:
                    return _rank_over(workspace, rank, History(workspace))
                if code == stalls.STALLED_EXIT:  # it found a process the job cannot lose stalled, and said so
                    raise SystemExit(code)
                left = code == stalls.GROUP_DROPPED_EXIT
                if not left or restarter.can_restart(rank):
                    restarter.restart(children, 0, rank, code, how="left after the job dropped it for a stall" if left else None)
                if children.processes[0].exitcode is None:  # a new process in its place
                    continue
                if rejoin.heals(plan, rank):  # a server with no restart left: the job cannot go on (its stubs were told)
                    raise SystemExit(code)
                return _rank_over(workspace, rank, _given_up(plan, rank, workspace))
        except BaseException:  # stopped (SIGTERM, Ctrl-C), or the job's store unreachable: no child outlives this process
            for proc in children.processes:
                if proc.is_alive():
                    proc.terminate()
            _wait_for_exit([proc for proc in children.processes if proc.pid is not None])
            raise


def _rank_over(workspace: Path, rank: int, history: History) -> History:
    """What this process says from now on (the CLI's closing line) goes to the rank's log, as an unsupervised rank's
    stdout does (launch.rank_output): the chief's process says it on the terminal."""
    from shoal.report.writes import open_for_append

    sys.stdout = open_for_append(Path(workspace) / "logs" / f"rank{rank}.log")
    return history


def _given_up(plan: JobPlan, rank: int, workspace: Path) -> History:
    """This rank was not restarted (no restart left, or nothing left to train): the others go on without it, as
    under `shoal run`, so its supervisor ends as a finished rank would (torchrun must not stop the survivors)."""
    from shoal.launcher import rejoin

    groups = [] if rejoin.replicas_go_on(plan) else [f"worker group {rejoin.group_of(plan, rank)}"]
    return History(workspace, failed_groups=groups)
