"""What the launcher knows of one rank of a job: what it hosts, whether the job outlives it, where its output goes."""
from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

from shoal.planning.plan import JobPlan
from shoal.report.terminal import write_line
from shoal.report.writes import WorkspaceWriteError, open_for_append, own_folder, replace_file


def describe_process(plan: JobPlan, rank: int) -> str:
    proc = plan.process(rank)
    members = [str(w) for w in proc.workers] + [str(s) for s in proc.servers]
    return f"process {rank} ({', '.join(members)})"


def replicas_go_on(plan: JobPlan) -> bool:
    """A synchronous group of whole replicas that goes on without a process (AllReduce under cluster.max_restarts)."""
    return plan.strategy.goes_on_without_a_process(plan)


def chief_replaceable(plan: JobPlan) -> bool:
    """Whether the chief's death drops it like any other process (the lowest living process decides the steps or
    meetings and takes over the run log, tests and checkpoints: shoal.comm.quorum's `replaceable`, report/succession.py):
    a group of replicas (Sandblaster's worker processes too, whose new decider also becomes the servers' stub and
    keeps their mirror: runtime/exchanges/sandblaster.py), or Local SGD / DiLoCo's groups of one process each, in a
    user's loop or a job file; Downpour's and Distributed Hogwild's groups of one process each under
    cluster.max_restarts, in a job file or a user's loop, and a job file's Downpour groups over several processes (all of
    group 0's restarted together: rejoin.Restarter._restart_group) (no step to decide: the lowest living group's stub
    takes the chief's duties, shoal.comm.succession; a loop's chief dead before its first step still restarts the whole job:
    rejoin.Restarter). Elsewhere the chief's death restarts the whole job (launcher/job_restarts.py)."""
    if plan.in_one_process:
        return False
    meeting_groups = plan.strategy.meets and all(len(plan.ranks_of_group(g)) == 1 for g in range(plan.nworker_groups))
    return replicas_go_on(plan) or meeting_groups or plan.strategy.chief_succeeded_by_a_group(plan)


def outlives_a_dead_process(plan: JobPlan) -> bool:
    """Whether the job may lose a process and go on: its groups outlive a dead one, its replicas go on, or its servers
    heal (a user's loop's Sandblaster: only its server processes)."""
    return plan.strategy.outlives_a_dead_group or replicas_go_on(plan) or servers_heal_here(plan)


def servers_heal_here(plan: JobPlan) -> bool:
    """Whether some process of this plan is a server that heals (`heals`)."""
    return any(heals(plan, rank) for rank in range(plan.nprocs))


def heals(plan: JobPlan, rank: int) -> bool:
    """A server process that the launcher restarts into the running job, healed from the chief's mirror of its state
    (Downpour under cluster.max_restarts: the strategy says); its death stops nobody while restarts are left."""
    proc = plan.process(rank)
    return bool(proc.servers) and not proc.workers and plan.strategy.servers_heal(plan)


def expendable(plan: JobPlan, rank: int) -> bool:
    """Jobs whose groups outlive a dead one (Downpour, Hogwild: the strategy says) outlive a process that hosts only
    workers of groups other than group 0 (group 0's too where `chief_replaceable`); a group of replicas that goes on (AllReduce under cluster.max_restarts), any process of workers, the
    chief's too (`chief_replaceable`)."""
    proc = plan.process(rank)
    if replicas_go_on(plan):
        return (rank != 0 or chief_replaceable(plan)) and bool(proc.workers)
    return plan.strategy.outlives_a_dead_group and bool(proc.workers) and (
        chief_replaceable(plan) or all(m.group != 0 for m in proc.workers + proc.servers))


@contextmanager
def rank_output(workspace: Path, rank: int, restarted: bool = False):
    """WORKSPACE/logs/rank<R>.log: the chief talks to the terminal (and copies its lines there); every other
    rank writes only to its file, as a restarted process 0 does (the chief no more: `chief_replaceable`). Afterwards
    stderr is given back, so that a failure's one line reaches the terminal."""
    log_file = open_for_append(Path(workspace) / "logs" / f"rank{rank}.log")  # through no link (nor at logs/)
    saved_stderr = sys.stderr
    if rank != 0 or restarted:
        sys.stdout = sys.stderr = log_file
    try:
        yield log_file
    finally:
        sys.stderr = saved_stderr


def chief_log(rank: int, log_file) -> Callable[[str], None]:
    """How a rank says a line: the chief to the terminal and its log file, the others to their log file (their stdout)."""
    return ChiefLog(log_file) if rank == 0 else write_line


class ChiefLog:
    """The chief's lines: on the terminal and in logs/rank0.log; `to_file` writes one to the log file alone (shoal.fit's
    chief rank says its lines through the caller's `log=` instead of the terminal)."""

    def __init__(self, log_file):
        self.log_file = log_file

    def __call__(self, line: str) -> None:
        write_line(line)
        self.to_file(line)

    def to_file(self, line: str) -> None:
        self.log_file.write(line + "\n")


def to_its_file_only(log: Callable[[str], None]) -> Callable[[str], None]:
    """A rank's way of saying a line, the chief's terminal left out (its log file alone: shoal.fit relays the chief's
    log file to its own `log=`); any other rank's as it is."""
    return log.to_file if isinstance(log, ChiefLog) else log


def write_exit_line(path: Path, line: str) -> None:
    """The line a process leaves for the launcher before it exits with a code that says to read it (a stall verdict,
    bad input before the first step): written whole, through no link, nor at logs/; unwritable, the launcher names the
    process instead."""
    try:
        own_folder(path.parent)
        replace_file(path, (line + "\n").encode(), temp_name=path.name + ".tmp")
    except (OSError, WorkspaceWriteError):
        pass


def read_exit_line(path: Path) -> Optional[str]:
    """The line write_exit_line left at `path` (None: none could be read)."""
    try:
        return path.read_text().strip().splitlines()[0]
    except (OSError, IndexError):
        return None
