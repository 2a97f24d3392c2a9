"""A rank of a launched job (torchrun, srun, env://) that comes back into the running job when its process dies or stalls.

Under `torchrun ... -m shoal run JOB --max-restarts N` (shoal's flag, cluster.max_restarts: the same budget as under
`shoal run`, N restarts per process) the process torchrun starts for a rank that may rejoin (`rejoin.why_not`: not
the chief) is a small supervisor: it runs the rank's training in a child process (the same rank, environment and
path as an unsupervised rank, `elastic.train_launched`) and, when that child dies or stays stopped past the stall
timeout, has `rejoin.Restarter` (the one place that decides, as for `shoal run`'s launcher) start a new one into the
running job through the job's store. torchrun sees nothing fail: the survivors' processes go on unchanged.
A `shoal.session()` script's rank is supervised the same way (frontend/session_start.py, `supervise_if_restartable`):
its child runs the script from the top, and so does a restarted one (`RunOptions.rank_main`, as under `shoal run`).

The store outlives the child: torchrun's agent hosts it, or, under srun and env://, rank 0's supervisor (where rank 0
is supervised: `store_by_supervisor`, which every rank computes alike, so that rank 0's child and everyone else are its
clients). The chief's rank is supervised too where another process takes a dead chief's place
(`ranks.chief_replaceable`: AllReduce's and Sandblaster's replicas, Local SGD / DiLoCo's groups of one process
each): its first child claims the workspace and registers the job as an unsupervised chief does; once that child died,
the supervisor holds what it held (`ChiefsRecords`: the workspace's lock, the registry's record and lock) and, after the
successor closed the run log, writes summary.json's rejoins and ends the record, as the chief would have; its restarted
child rejoins as a non-chief. What a supervisor cannot survive falls back to the launcher's whole-job restart from the newest
checkpoint (torchrun's own --max-restarts with --resume=auto): the chief's death elsewhere, the supervisor itself
killed, torchrun's agent or a node lost. Its SIGTERM (torchrun stopping the job, Ctrl-C) ends the child first: no
orphans.
"""
from __future__ import annotations

import functools
import os
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from shoal.comm import dist as comm
from shoal.errors import warn
from shoal.launcher import job_registry, launchers, stalls
from shoal.launcher.rejoin import store_by_supervisor, supervises  # noqa: F401 (supervises: this module's word, kept in rejoin)
from shoal.launcher.options import RunOptions
from shoal.launcher.workspace import WorkspaceError, WorkspaceLock
from shoal.planning.plan import JobPlan
from shoal.report.summary import read_summary
from shoal.runtime.trainer import History

WATCH_INTERVAL_S = 0.5  # how often the supervisor looks for a stopped child between its exits
STOPPED_EXIT = 130  # a child SIGTERMed (`shoal jobs kill` signals the chief's, the registry lock's holder): elastic.rank_process


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
    # srun, env://: the world's store lives here (kept until this function returns), not in rank 0's process, which it outlives
    store = (comm.host_store(launched.master_addr, launched.master_port, launched.world_size, plan.comm_timeout_s,
                             wait_for_workers=False) if rank == 0 and store_by_supervisor(plan, launched) else None)
    # (the job's secret in it: the launcher's user gave it to every process; OpenMP's wait policy as the forkserver's)
    environment = rank_environment(os.environ)
    # torch and shoal imported once: a restart costs no interpreter start
    context = forkserver_context([first_process.func.__module__])
    child = context.Process(target=first_process, name=f"shoal-rank{rank}", daemon=False, args=(environment,))
    children = SimpleNamespace(processes=[child], sentinels={})  # what rejoin.Restarter replaces a dead one in
    records = ChiefsRecords(plan, workspace) if rank == 0 else None

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
                        if records is not None:
                            records.hold()
                        restarter.restart(children, 0, rank, -signal.SIGKILL, how=f"was stopped past the stall timeout "
                                          f"({plan.stall_timeout_s:g} s) and dropped; the launcher ended it (SIGKILL)")
                        if children.processes[0].exitcode is not None:  # not restarted (the line said why)
                            return _rank_over(workspace, rank, _given_up(plan, rank, workspace), records)
                    continue
                code = current.exitcode
                if code == 0:
                    return _rank_over(workspace, rank, History(workspace), records)
                if code in (stalls.STALLED_EXIT, STOPPED_EXIT):  # it found a process the job cannot lose stalled (and
                    raise SystemExit(code)  # said so), or was stopped on purpose (`shoal jobs kill`): not a death
                left = code == stalls.GROUP_DROPPED_EXIT
                if records is not None:  # the chief's first process died: what it held is this process's now
                    records.hold()
                if not left or restarter.can_restart(rank):
                    restarter.restart(children, 0, rank, code, how="left after the job dropped it for a stall" if left else None)
                if children.processes[0].exitcode is None:  # a new process in its place
                    continue
                if rejoin.heals(plan, rank):  # a server with no restart left: the job cannot go on (its stubs were told)
                    raise SystemExit(code)
                return _rank_over(workspace, rank, _given_up(plan, rank, workspace), records)
        except BaseException as err:  # stopped (SIGTERM, Ctrl-C), or the job's store unreachable: no child outlives this process
            for proc in children.processes:
                if proc.is_alive():
                    proc.terminate()
            _wait_for_exit([proc for proc in children.processes if proc.pid is not None])
            if records is not None:
                records.abandon(err)
            raise


def _rank_over(workspace: Path, rank: int, history: History, records: Optional["ChiefsRecords"] = None) -> History:
    """What this process says from now on (the CLI's closing line) goes to the rank's log, as an unsupervised rank's
    stdout does (launch.rank_output): the chief's process says it on the terminal, once the records its first child
    held are closed."""
    from shoal.report.writes import open_for_append

    if records is not None:
        records.close()
    if rank != 0:
        sys.stdout = open_for_append(Path(workspace) / "logs" / f"rank{rank}.log")
    return history


class ChiefsRecords:
    """What the chief's first process held, held by its supervisor once that process died and another took the chief's
    place (`ranks.chief_replaceable`): the workspace's lock, the registry's record and its lock; at the end the
    record's status and summary.json's rejoins, which that process would have written."""

    def __init__(self, plan: JobPlan, workspace: Path):
        self.plan, self.workspace = plan, Path(workspace)
        self.began = time.time()  # logs/rejoins.jsonl may hold an earlier run's rejoins (a resumed workspace)
        self.lock: Optional[WorkspaceLock] = None
        self.record: Optional[job_registry.JobRecord] = None
        self.held = False

    def hold(self) -> None:
        """At the first child's death (its locks went with it)."""
        if self.held:
            return
        self.held = True
        try:
            self.lock = WorkspaceLock(self.workspace, self.plan.job.name).__enter__()
        except WorkspaceError as err:  # taken in the moment between: say so, the job goes on
            warn(f"WARNING: {err}")
        self.record = job_registry.running_record(self.workspace)
        if self.record is not None:
            job_registry.take_over(self.record, 0)

    def close(self) -> None:
        """After this rank's last child ended: once the successor closed the run log (summary.json no longer says
        `running`; at most the job's communication timeout), its rejoins and the record's end."""
        if not self.held:
            return
        deadline = time.monotonic() + self.plan.comm_timeout_s
        while (read_summary(self.workspace) or {}).get("status") == "running" and time.monotonic() < deadline:
            time.sleep(0.1)
        summary = read_summary(self.workspace) or {}
        from shoal.launcher import rejoin

        rejoin.add_rejoins_to_summary(self.workspace, since=self.began)
        status = summary.get("status") if summary.get("status") in ("finished", "failed", "killed") else "failed"
        self._end(status, summary.get("reason") or "")

    def abandon(self, err: BaseException) -> None:
        if self.held:
            self._end("killed" if isinstance(err, KeyboardInterrupt) else "failed", str(err).splitlines()[0] if str(err) else "")

    def _end(self, status: str, message: str) -> None:
        if self.record is not None:
            job_registry.finish(self.record, status, message)
        if self.lock is not None:
            self.lock.__exit__(None, None, None)


def _given_up(plan: JobPlan, rank: int, workspace: Path) -> History:
    """This rank was not restarted (no restart left, or nothing left to train): the others go on without it, as
    under `shoal run`, so its supervisor ends as a finished rank would (torchrun must not stop the survivors)."""
    from shoal.launcher import rejoin

    groups = [] if rejoin.replicas_go_on(plan) else [f"worker group {rejoin.group_of(plan, rank)}"]
    return History(workspace, failed_groups=groups)
