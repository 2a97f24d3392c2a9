"""What a process does when a peer stalls (found by shoal.comm.heartbeat), and what the launcher makes of it.

- A peer the job cannot lose (any process of a job whose groups do not outlive a dead one: a
  synchronous layout; in Downpour, Hogwild and Local SGD a server, a process of group 0, or the
  store): the job fails. The process that noticed writes the
  verdict, one line naming the peer and what it hosted, to WORKSPACE/logs/rank<R>.stalled and exits
  with STALLED_EXIT (its main thread waits in a gloo receive that nothing can interrupt). The
  launcher reads the verdict (`verdict`) and first SIGKILLs stopped processes (`kill_stopped`: a
  stopped process ignores SIGTERM until it is continued). A process started by a launcher
  (torchrun, srun) prints the line itself.
- A process of a group other than 0 where the strategy says the groups outlive a dead one
  (`outlives_a_dead_group`: Downpour, Hogwild, Local SGD): the group is dropped. The servers and the other
  groups stop waiting for it (the exchanges ask `heartbeat.is_stalled`; Local SGD's meetings go on
  without it: shoal.comm.quorum), the chief warns once, the
  group's other processes leave with GROUP_DROPPED_EXIT (not reported again), and once the job's
  essential processes are done the launcher kills what is still stopped (`end_dropped`). If the
  stalled process runs again before that, it sees the gap in its own heartbeat and leaves; a push
  it sends first is refused by the servers. With restarts left (--max-restarts) the launcher ends a
  process stopped past the timeout and a beat at once, and restarts it, or one that left, as a dead one.
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

from shoal.comm import heartbeat
from shoal.errors import warn
from shoal.launcher.ranks import chief_replaceable, describe_process, expendable, heals, read_exit_line, replicas_go_on, write_exit_line
from shoal.planning.plan import JobPlan
from shoal.report import succession
from shoal.runtime.interfaces import GroupDropped
from shoal.report.terminal import write_line

STALLED_EXIT = 86  # this process found a peer the job cannot lose stalled: logs/rank<R>.stalled says which
GROUP_DROPPED_EXIT = 87  # this process's asynchronous group was dropped: it leaves, the chief has warned


def verdict_path(workspace: Path, rank: int) -> Path:
    return Path(workspace) / "logs" / f"rank{rank}.stalled"


class StallPolicy:
    """Process `rank`'s answers to a stalled peer and to its own stall (see the module's text)."""

    def __init__(self, plan: JobPlan, rank: int, workspace: Path, reports_itself: bool,
                 store: Optional[tuple[str, str]] = None):
        self.plan, self.rank, self.workspace, self.reports_itself = plan, rank, Path(workspace), reports_itself
        self.store = store  # (HOST:PORT, who holds it): names a lost store as the launcher sees it
        self.terminal = 2  # the file descriptor of the process's own stderr (fd 2 may be sent to its log meanwhile)
        self.group = self._group_of(rank)
        self._warned: set[int] = set()
        self._stalled: set[int] = set()  # the ranks seen stalled

    def _group_of(self, rank: int) -> Optional[int]:
        workers = self.plan.process(rank).workers
        return workers[0].group if workers else None

    def _expendable(self, rank: int) -> bool:
        return expendable(self.plan, rank)

    def on_stall(self, stall: heartbeat.Stall) -> None:
        if stall.lost:  # refused outright: its host died (every process says so, naming itself)
            at, holder = self.store or ("", "the launcher: shoal run's, or torchrun's agent" if stall.rank is None
                                       else describe_process(self.plan, stall.rank))
            self._fail(f"{describe_process(self.plan, self.rank)} failed: lost the job's store{' at ' + at if at else ''} "
                       f"({holder} died?); see {self.workspace}/logs/rank{self.rank}.log")
        silent = f"no heartbeat for {stall.silent_s:.0f} s" + (f", the last at step {stall.step}" if stall.step >= 0 else "")
        if stall.rank is None:
            self._fail(f"the job's store (held by the launcher: shoal run's, or torchrun's agent) stopped answering ({silent})")
        who = describe_process(self.plan, stall.rank)
        if heals(self.plan, stall.rank):  # the launcher ends it and restarts it; its stubs wait for the new process
            if stall.rank not in self._warned:
                self._warned.add(stall.rank)
                write_line(f"{who} stopped answering ({silent}); waiting for the launcher to restart it")
            return
        if not self._expendable(stall.rank):
            hosts_store = "; it hosts the job's store" if stall.store else ""
            stops = why_the_job_stops(self.plan)
            self._fail(f"{who} stopped answering ({silent}{hosts_store})" + (f"; {stops}" if stops else ""))
        if replicas_go_on(self.plan):  # a group of replicas: the next step goes on without it (shoal.comm.quorum)
            if self._speaks_for_the_job(stall.rank) and stall.rank not in self._warned:
                self._warned.add(stall.rank)
                self._warn(f"WARNING: {who} stopped answering ({silent}); the other processes go on without it "
                     f"(see {self.workspace}/logs/rank{stall.rank}.log)")
            return
        group = self._group_of(stall.rank)
        if group == self.group:  # a member of this process's own group: the group cannot go on
            self._leave(f"worker group {group} is dropped: {who} stopped answering ({silent})")
        if self._speaks_for_the_job(stall.rank) and group not in self._warned:  # one warning, on the terminal
            self._warned.add(group)
            self._warn(f"WARNING: worker group {group} dropped: {who} stopped answering ({silent}); "
                 f"the other worker groups go on (see {self.workspace}/logs/rank{stall.rank}.log)")

    def _speaks_for_the_job(self, stalled: int) -> bool:
        """Whether this process warns of a stalled peer: the chief (its stderr is the terminal), or the process that took
        a dead chief's place (report/succession.py); where the chief may be replaced (`chief_replaceable`) and is the
        one stalled, the lowest process this one has not seen stalled (the one the meetings' or steps' quorum makes its
        successor, shoal.comm.quorum)."""
        self._stalled.add(stalled)
        if self.rank == 0 or succession.took_over_here():  # (a chief killed rather than stalled: its successor)
            return True
        return chief_replaceable(self.plan) and self.rank == min(set(range(self.plan.nprocs)) - self._stalled)

    def _warn(self, line: str) -> None:
        """A warning of the process that speaks for the job: the chief's stderr is the terminal; a successor's is its log
        (launcher/ranks.rank_output), so the line goes to the terminal too (`terminal`: the process's own stderr)."""
        warn(line)
        if self.rank != 0 and self.terminal != 2:
            try:
                os.write(self.terminal, (line + "\n").encode())
            except OSError:
                pass

    def on_woken(self, gap: float) -> None:
        """This process was stopped longer than the timeout: its peers have given up on it."""
        line = f"process {self.rank} was stopped for {gap:.0f} s, longer than the stall timeout ({self.plan.stall_timeout_s:g} s)"
        if not self._expendable(self.rank):
            self._fail(f"{line}; {why_the_job_stops(self.plan) or 'the job cannot go on without it'}")
        if replicas_go_on(self.plan):
            self._leave(f"{line}; the other processes went on without it, so it leaves")
        self._leave(f"{line}; the job dropped worker group {self.group}, so it leaves")

    def _fail(self, line: str) -> None:
        write_exit_line(verdict_path(self.workspace, self.rank), line)
        if self.reports_itself:
            try:
                sys.__stderr__.flush()
                os.write(self.terminal, (line + "\n").encode())
            except OSError:
                pass
        elif self.rank != 0:  # the others' stdout is their log; the chief's is the terminal, where the launcher speaks
            write_line(line)
        _exit(STALLED_EXIT)

    def _leave(self, line: str) -> None:
        leave(line)


def why_the_job_stops(plan: JobPlan) -> Optional[str]:
    """Why a job of several worker groups stops without one of them, where its strategy says so, as a clause for the
    line that names the process; None where the job has one group or outlives it."""
    why = plan.strategy.why_a_dead_group_stops_the_job(plan)
    if why is None or plan.nworker_groups < 2:
        return None
    return f"{plan.label} cannot go on without it: {why}"


def leave(line: str) -> None:
    """This process's asynchronous group was dropped: say why in its log (its stdout) and leave quietly."""
    write_line(line)
    _exit(GROUP_DROPPED_EXIT)


def _exit(code: int) -> None:
    """End now: the main thread waits in gloo, which cannot be interrupted."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


@contextmanager
def watching(plan: JobPlan, rank: int, workspace: Path, reports_itself: bool = False,
             store: Optional[tuple[str, str]] = None):
    """Beat and watch the job's other processes while the body runs (a world of several processes only); a peer
    silent for the plan's stall_timeout_s (cluster.stall_timeout_s; SHOAL_STALL_TIMEOUT overrides) is stalled.

    An exchange that finds its group dropped raises GroupDropped: the process leaves here, before the
    heartbeat says "done" (its peers have given up on it) and before gloo's teardown."""
    if plan.nprocs == 1:
        yield
        return
    policy = StallPolicy(plan, rank, workspace, reports_itself, store)
    with native_stderr_to(sys.stderr) as terminal:
        policy.terminal = terminal
        heartbeat.start(rank, plan.nprocs, plan.stall_timeout_s, on_stall=policy.on_stall, on_woken=policy.on_woken)
        try:
            with leaving_when_dropped():
                yield
        finally:
            heartbeat.stop()


@contextmanager
def leaving_when_dropped():
    """An exchange raised GroupDropped: this process leaves (GROUP_DROPPED_EXIT), saying why in its log."""
    try:
        yield
    except GroupDropped as dropped:
        leave(str(dropped))


@contextmanager
def native_stderr_to(stream):
    """c10d logs a failed store call (a peer's store gone at the end of a job, a store not listening yet) from
    C++ to file descriptor 2: send it where `stream` goes (a rank's log, the launcher's log), not to the terminal."""
    try:
        target = stream.fileno()
    except (AttributeError, OSError, ValueError):
        target = 2
    if target == 2:
        yield 2
        return
    saved = os.dup(2)
    os.dup2(target, 2)
    try:
        yield saved  # where the process's own stderr went: its one line for the terminal
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def exit_if_abandoned() -> None:
    """A process whose threads gave up on a dropped peer ends without gloo's teardown (which would abort it)."""
    if heartbeat.abandoned():
        _exit(0)


# -- the launcher's side ------------------------------------------------------------------------
def verdict(workspace: Path, ranks: list[int], processes) -> Optional[str]:
    """The line of a process that exited because a peer stalled (None if none did)."""
    for rank, proc in zip(ranks, processes):
        if proc.exitcode == STALLED_EXIT:
            line = read_exit_line(verdict_path(workspace, rank))
            if line is not None:
                return line
    return None


def is_stopped(pid: int) -> bool:
    """Stopped by a signal (SIGSTOP, SIGTSTP) or a tracer: state T or t in /proc."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def kill_stopped(processes) -> None:
    """SIGKILL the stopped processes: SIGTERM would wait until they are continued."""
    for proc in processes:
        if proc.exitcode is None and is_stopped(proc.pid):
            proc.kill()


def wait_for_first_failure(context) -> None:
    """Return once a process torch's join still watches has failed (stopped ones then SIGKILLed) or all ended."""
    from multiprocessing.connection import wait

    while True:
        watched = [p for p in context.processes if p.sentinel in context.sentinels]
        if any(p.exitcode not in (None, 0) for p in watched):
            kill_stopped(context.processes)
            return
        alive = [p.sentinel for p in watched if p.exitcode is None]
        if not alive:
            return
        wait(alive, timeout=1.0)


def end_dropped(context, ranks: list[int], essential: Callable[[int], bool]) -> list[int]:
    """Once this node's essential processes all ended well, kill the ones still stopped (their group was
    dropped); returns their indices. Where every process is expendable (Local SGD / DiLoCo's groups in a user's loop,
    group 0's too): once every process not stopped has ended and one of them finished, nothing is left for the stopped
    ones to meet (every group ends at the job's last step). Otherwise a node with no essential process waits for its
    own."""
    procs = context.processes
    needed = [p for i, p in enumerate(procs) if essential(ranks[i])]
    if needed:
        if any(p.exitcode != 0 for p in needed):
            return []
    else:
        going = [p for p in procs if not (p.exitcode is None and is_stopped(p.pid))]
        if len(going) == len(procs) or any(p.exitcode is None for p in going) or all(p.exitcode != 0 for p in going):
            return []
    killed = []
    for i, proc in enumerate(procs):
        if proc.exitcode is None and is_stopped(proc.pid):
            proc.kill()
            proc.join()
            context.sentinels.pop(proc.sentinel, None)
            killed.append(i)
    return killed
