"""Run a job's processes from `shoal run`, on one host or several, and each process's rank.

`shoal run` is a small launcher: it takes part in torch.distributed.elastic's
node-level rendezvous (shoal.comm.rendezvous: static with --node-rank, c10d
without, a loopback store on one host), then spawns its node's share of the
ranks. Every spawned rank joins the job's process group as a client of the
store the rendezvous gave, as torchrun's workers join its agent's. Rank 0
hosts worker 0 of group 0 (the chief: it tests, displays and writes
checkpoints); every process logs to WORKSPACE/logs/rank<R>.log. If a process
dies, torch's process context terminates the others on its node, the others
time out of their collectives, and each launcher reports which rank failed.

Started by a launcher instead (torchrun, srun, a PyTorchJob: shoal.launcher.launchers),
each process runs only its own rank (`run_launched`): the same per-rank path
(`rank_output`, `join_world`, `run_rank`), with rank 0 starting the job once
every rank has joined.
"""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch.multiprocessing as mp

from shoal.comm import auth
from shoal.comm import dist as comm
from shoal.comm import heartbeat
from shoal.comm import rendezvous
from shoal.config.plugins import decode_job, forkserver_context, rank_environment
from shoal.errors import ShoalError, first_line, warn
from shoal.planning.nodes import ranks_of_node
from shoal.planning.plan import JobPlan, plan_job
from shoal.report.metrics import read_metrics
from shoal.report.run_log import Terminated, mark_run_ended
from shoal.report.summary import note_group_ends, restate_reason
from shoal.report.writes import open_for_append
from shoal.runtime.assemble import RunSpec, run_process
from shoal.launcher import faults, process_server, rejoin, stalls
from shoal.launcher.ranks import (chief_log, describe_process, expendable, heals, outlives_a_dead_process, rank_output,
                                  read_exit_line, replicas_go_on, write_exit_line)
from shoal.launcher.launchers import LaunchedProcess
from shoal.runtime.endings import ServerLost
from shoal.runtime.trainer import History
from shoal.strategies.registry import REGISTRY

LOOPBACK = "127.0.0.1"  # one host: nothing listens beyond loopback


@dataclass(frozen=True)
class Nodes:
    """Where the job's processes run: nnodes hosts meeting at master_host:master_port.

    node_rank None: torch's c10d rendezvous hands node ranks out as the nodes arrive.
    """

    nnodes: int = 1
    node_rank: Optional[int] = 0
    master_host: str = LOOPBACK
    master_port: int = 0  # one host: unused (a free loopback port is taken)
    interface: str = "lo"
    run_id: str = "shoal"  # the rendezvous's name: every node of one job gives the same

    @property
    def one_host(self) -> bool:
        return self.nnodes == 1 and self.master_host == LOOPBACK

    def ranks(self, world: int, node_rank: int) -> list[int]:
        """A node's ranks: nodes take equal consecutive blocks (node 0 hosts rank 0, the chief)."""
        return ranks_of_node(world, self.nnodes, node_rank)


class ProcessFailed(ShoalError, RuntimeError):
    """A process of the job died; the message names its rank and what it hosted."""


class ProcessLost(ProcessFailed):
    """A process the job cannot go on without died or stopped answering, with no error of its own (a signal, an exit,
    a stall, a lost connection): the fault a whole-job restart answers (--max-restarts, shoal.launcher.job_restarts).
    `rank`, `code`: the dead process and its exit code (-N: signal N) where the launcher saw it exit; `step`: the step
    the chief last said it started (its heartbeat), where the store could tell."""

    def __init__(self, message: str, rank: Optional[int] = None, code: Optional[int] = None):
        super().__init__(message)
        self.rank, self.code, self.step = rank, code, None
        self.why = ""  # what else it meant for the job (every worker process dead at once), for the launcher's line


class StalledPeer(RuntimeError):
    """A collective timed out: the message names the rank(s) that stopped answering."""


class PeerFailed(RuntimeError):
    """Another process failed with an error of its own (a full disk, say): the message is its line, naming it."""


class ConnectionFailed(comm.CommunicationFailed):
    """A collective or message of this process failed, in shoal's words (a peer's connection closed, say); where the
    launcher saw a peer die, its line names that one instead."""


FAILURE_KEY = "failure"  # where a rank that failed with a ShoalError leaves its line for its peers


def route(host: str) -> tuple[str, str]:
    """How this machine reaches `host`: (interface, source address), from `ip route get`; on `host` itself,
    the interface holding its address. Raises OSError when it cannot tell."""
    import subprocess

    try:
        address = socket.gethostbyname(host)
        if address.startswith("127."):
            return "lo", address
        out = subprocess.run(["ip", "route", "get", address], capture_output=True, text=True, timeout=5).stdout.split()
        device, source = out[out.index("dev") + 1], out[out.index("src") + 1]
        if device == "lo":  # `host` is this machine: the interface holding its address
            held = subprocess.run(["ip", "-o", "addr", "show", "to", address], capture_output=True, text=True, timeout=5)
            device = held.stdout.split()[1]
        return device, source
    except (ValueError, IndexError, subprocess.TimeoutExpired, socket.gaierror) as err:
        raise OSError(f"cannot tell how this machine reaches {host}") from err


def route_interface(host: str) -> str:
    """The network interface this machine uses to reach `host` (for --master without --interface)."""
    try:
        return route(host)[0]
    except OSError:
        raise ProcessFailed(f"--master {host}: cannot tell which interface reaches it; pass --interface") from None


def launched_interface(master: str) -> Optional[str]:
    """The interface gloo uses in a launched world: GLOO_SOCKET_IFNAME if set (None: leave it), else the one that
    reaches the master; None (gloo's own choice: the address of this host's name) when `ip` cannot tell."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return None
    try:
        return route(master)[0]
    except OSError:
        return None


def join_world(plan: JobPlan, rank: int, world: int, ranks_per_node: int, host: str, port: int,
               interface: Optional[str], secret: bytes, agent_store_attempt: Optional[int] = None,
               hosts_store: Optional[bool] = None) -> None:
    """Join the job's process group (NCCL for CUDA tensors where every process has GPUs of its own, else gloo),
    proving to the others that this process holds the job's `secret` (shoal.comm.auth). `hosts_store` False: rank 0
    is a client of the store its supervisor hosts (None: rank 0 hosts it)."""
    backend = comm.process_group_backend(plan.devices, [r // max(1, ranks_per_node) for r in range(world)], comm.nccl_usable())
    timeout_s = plan.comm_timeout_s  # cluster.comm_timeout_s (SHOAL_COMM_TIMEOUT overrides): every collective's
    if agent_store_attempt is None:
        comm.init(rank, world, host, port, interface, timeout_s, backend=backend, secret=secret, hosts_store=hosts_store)
    else:
        comm.init_with_agent_store(rank, world, host, port, agent_store_attempt, interface, timeout_s, backend=backend, secret=secret)


RankMain = Callable[[JobPlan, int, RunSpec], Optional[History]]


def run_rank(plan: JobPlan, rank: int, spec: RunSpec, rank_main: Optional[RankMain] = None) -> History:
    """run_process (or `rank_main`: shoal.session's user script) for a rank of a world; a failed collective becomes
    StalledPeer naming who stopped answering."""
    try:
        return (rank_main or run_process)(plan, rank, spec)
    except ShoalError as err:  # the cause of the job's end: the peers, who see only a closed connection, name it
        _publish_failure(f"{describe_process(plan, rank)} failed: {first_line(str(err)) or type(err).__name__}")
        raise
    except RuntimeError as err:  # a collective failed: find who stopped answering, in words of ours (never gloo's)
        failure = _collective_failure(plan, rank, err)
        if rank == 0:  # the chief closed summary.json with what its collective saw: the reason is this line
            named = isinstance(failure, (StalledPeer, PeerFailed))  # they name the process at fault
            restate_reason(spec.workspace, str(failure) if named else f"{describe_process(plan, rank)} failed: {failure}")
        raise failure from None


def _collective_failure(plan: JobPlan, rank: int, err: RuntimeError) -> RuntimeError:
    """Why process `rank`'s collective failed: a peer's own line, the peer that stopped answering, or what happened
    to the connection."""
    why = comm.describe_error(err)
    if comm.store_lost():  # no progress to read: the caller names the store's host
        return ConnectionFailed(why)
    cause = comm.published(FAILURE_KEY, wait_s=1.0)
    if cause is not None:
        return PeerFailed(cause)
    if why == comm.PEER_CLOSED:  # a peer died, it did not stall: the launcher that saw it exit names it
        return ConnectionFailed(why)
    progress = comm.progress(plan.nprocs)
    calls = progress[rank]
    behind = [r for r, c in progress.items() if r != rank and c < calls]
    if behind:
        who = "; ".join(f"{describe_process(plan, r)} stopped answering at step {heartbeat.last_step(r)}" for r in behind)
        return StalledPeer(f"{who} (process {rank} waited {plan.comm_timeout_s:.0f} s at step {heartbeat.last_step(rank)})")
    return ConnectionFailed(why)


FAILURE_LINE_CHARS = 2000


def _publish_failure(line: str) -> None:
    try:
        comm.publish(FAILURE_KEY, line[:FAILURE_LINE_CHARS])  # a value of the store is bounded (shoal.comm.signed_store)
    except (RuntimeError, AttributeError):  # the store is gone too (or there is none): the launcher still hears it
        pass


@dataclass(frozen=True)
class Meeting:
    """What a spawned rank needs to join the job: the world, where its store is, the interface gloo uses."""

    world: int
    nnodes: int
    ranks_per_node: int
    store_host: str
    store_port: int
    interface: Optional[str]
    # the prefix of the world's keys in the store (dist.attempt_scope): shoal run's and torchrun's agent's hold each
    # start's keys under its attempt; None: a store of the world's own (process 0's or its supervisor's, under srun or
    # env://), its keys unprefixed
    attempt: Optional[int] = 0


def _entry(local_index: int, ranks: list[int], meeting: Meeting, environment: dict[str, str], job_bytes: bytes,
           workspace: str, resume_from: Optional[str], base_dirs: list[str], process_setup: Optional[Callable[[], None]] = None,
           initial_values: Optional[Callable] = None, rank_main: Optional[RankMain] = None) -> None:
    """A spawned process: plan the job (deterministic: every process plans the same), join the world and run its rank
    (`rank_main`: what runs it instead of run_process, shoal.session's script run from the top)."""
    os.environ.clear()  # the launcher's environment now, not the forkserver's when it started
    os.environ.update(environment)
    rank = ranks[local_index]
    with rank_output(Path(workspace), rank) as log_file:
        if process_setup is not None:
            process_setup()
        plan = plan_job(decode_job(job_bytes), nnodes=meeting.nnodes, strategies=REGISTRY)  # decode_job: the job's plugins first
        # a client of the store the rendezvous gave (attempt 0), as torchrun's workers are of their agent's
        try:
            join_world(plan, rank, meeting.world, meeting.ranks_per_node, meeting.store_host, meeting.store_port,
                       meeting.interface, auth.required_secret("a rank of a job"), agent_store_attempt=0)
        except ShoalError:
            raise
        except (RuntimeError, ValueError, OSError) as err:  # torch's store and gloo errors, in words of ours
            # no process can go on without a world, whatever the layout tolerates later: the job stops with this line
            _leave_before_the_start(plan, rank, Path(workspace), log_file,
                                    f"cannot join the job's processes: {comm.describe_error(err)}")
        try:
            spec = RunSpec(Path(workspace), [Path(d) for d in base_dirs], Path(resume_from) if resume_from else None,
                           log=chief_log(rank, log_file), progress=False, initial_values=initial_values,
                           faults=faults.from_environment())
            with stalls.watching(plan, rank, Path(workspace)):  # a stalled peer: named within plan.stall_timeout_s
                with _stopping_the_job_on_bad_input(plan, rank, Path(workspace), log_file):
                    run_rank(plan, rank, spec, rank_main)
            stalls.exit_if_abandoned()
        except Exception:
            # into the rank's log too: the stderr multiprocessing prints it on is the forkserver's, which may be no
            # longer anyone's (a restarted process's is the log alone: rejoin._entry)
            traceback.print_exc(file=log_file)
            log_file.flush()
            raise
        finally:
            comm.shutdown()


REFUSED_AT_START_EXIT = 88  # bad input before this process's first step: logs/rank<R>.refused holds its line


def refused_path(workspace: Path, rank: int) -> Path:
    return Path(workspace) / "logs" / f"rank{rank}.refused"


def _leave_before_the_start(plan: JobPlan, rank: int, workspace: Path, log_file, why: str) -> None:
    """This process cannot start (bad input, or no world to join): it leaves with REFUSED_AT_START_EXIT and its line
    in logs/rank<R>.refused, which the launcher says as the job's end (no process goes on, no restart helps)."""
    line = f"{describe_process(plan, rank)} failed before its first step: {why}"
    write_exit_line(refused_path(workspace, rank), line)
    log_file.write(line + "\n")  # (the launcher says it on the terminal)
    log_file.flush()
    os._exit(REFUSED_AT_START_EXIT)  # before gloo's teardown, which would wait for peers still starting


@contextmanager
def _stopping_the_job_on_bad_input(plan: JobPlan, rank: int, workspace: Path, log_file) -> Iterator[None]:
    """Bad input met before this worker process's first step (its data not readable, say) is every process's to meet,
    not a fault its group could be dropped for while the others go on: the process leaves with REFUSED_AT_START_EXIT and
    its line, and the launcher stops the job with that line (a spawned rank's first incarnation; a restarted one is
    rejoin.py's)."""
    try:
        yield
    except ShoalError as err:
        if not isinstance(err, ValueError) or heartbeat.last_step(rank) >= 0 or not plan.process(rank).workers:
            raise
        _leave_before_the_start(plan, rank, workspace, log_file, first_line(str(err)) or type(err).__name__)


def run_launched(plan: JobPlan, launched: LaunchedProcess, workspace: Path,
                 start: Callable[[list[dict]], Optional[Path]], spec_for: Callable[[Optional[Path], Callable[[str], None]], RunSpec],
                 ) -> History:
    """This process's rank of a world a launcher (torchrun, srun, ...) started (`launched_rank`, around its run)."""
    with launched_rank(plan, launched, workspace, start) as (resume_from, log):
        return run_rank(plan, launched.rank, spec_for(resume_from, log))


@contextmanager
def launched_rank(plan: JobPlan, launched: LaunchedProcess, workspace: Path,
                  start: Callable[[list[dict]], Optional[Path]]) -> Iterator[tuple[Optional[Path], Callable[[str], None]]]:
    """This process's rank of a world a launcher (torchrun, srun, ...) started, around the body that runs it (the
    rank's run, or a shoal.session()'s user loop), which gets (the checkpoint to resume from, how the rank says a line).

    Every rank joins the world first; rank 0 then starts the job (`start`: prepares the workspace, registers
    the job, given every rank's host and pid; returns the checkpoint to resume from) and publishes its word
    in the store, which the other ranks wait for: nobody touches the workspace's checkpoints or metrics
    before rank 0 has decided what they are. A failure becomes one line naming the rank.
    """
    rank, world = launched.rank, launched.world_size
    wait_s = max(plan.comm_timeout_s, 60.0)
    by_supervisor = rejoin.store_by_supervisor(plan, launched)  # (srun, env://: rank 0's supervisor hosts it)
    secret = auth.required_secret(f"a job started by {launched.launcher}")
    try:
        join_world(plan, rank, world, launched.local_world_size, launched.master_addr, launched.master_port,
                   "lo" if launched.on_loopback else launched_interface(launched.master_addr), secret,
                   launched.restart if launched.agent_store else None,
                   hosts_store=False if by_supervisor else None)
    except auth.SecretError as err:
        raise auth.SecretError(f"process {rank}: {err}") from None
    except (RuntimeError, ValueError, OSError) as err:  # torch's store and gloo errors: their first line is the story
        raise ProcessFailed(f"process {rank}: cannot join the job's processes at {launched.master_addr}:{launched.master_port}: "
                            f"{comm.describe_error(err)}") from None
    store_at = f"{launched.master_addr}:{launched.master_port}"
    store_host = (f"{launched.launcher}'s agent" if launched.agent_store else
                  "process 0's supervisor, which hosts it," if by_supervisor else "process 0, which hosts it,")
    try:
        comm.publish(f"process/{rank}", json.dumps({"rank": rank, "host": socket.gethostname(), "pid": os.getpid()}))
        if rank == 0:
            try:
                processes = [json.loads(comm.read_published(f"process/{r}", wait_s)) for r in range(world)]
                resume_from = start(processes)
            except BaseException as err:
                comm.publish("start", json.dumps({"error": first_line(str(err)) or type(err).__name__}))
                raise
            comm.publish("start", json.dumps({"resume_from": str(resume_from) if resume_from else ""}))
        else:
            word = json.loads(comm.read_published("start", wait_s))
            if "error" in word:
                raise ProcessFailed(f"process {rank}: process 0 did not start the job: {word['error']}")
            resume_from = Path(word["resume_from"]) if word["resume_from"] else None
        with rank_output(workspace, rank) as log_file:  # after rank 0's word: it decides what the workspace holds
            with stalls.watching(plan, rank, workspace, reports_itself=True, store=(store_at, store_host)):
                yield resume_from, chief_log(rank, log_file)
    except ShoalError:
        raise
    except (StalledPeer, PeerFailed) as err:
        raise ProcessFailed(f"{err}; see {workspace}/logs{_restarting(launched)}") from None
    except RuntimeError as err:  # the store's host gone (torchrun's agent killed) is named as such
        why = comm.describe_error(err, store_at, store_host)
        raise ProcessFailed(f"{describe_process(plan, rank)} failed: {why}; see {workspace}/logs/rank{rank}.log"
                            f"{_restarting(launched)}") from None
    finally:
        comm.shutdown()


def _restarting(launched: LaunchedProcess) -> str:
    """What follows a failure under torchrun with restarts left: it starts the job's processes again."""
    if launched.launcher != "torchrun" or launched.restart >= launched.max_restarts:
        return ""
    return f"; torchrun restarts the job's processes (restart {launched.restart + 1} of {launched.max_restarts})"


def _join_tolerating_groups(context, ranks: list[int], plan: JobPlan, workspace: Path, restarter=None,
                            ends: Optional[dict[int, str]] = None) -> list[str]:
    """Wait for the processes of an asynchronous job; a dead worker group is reported, not fatal, and restarted
    into the running job when it can be (`restarter`: shoal.launcher.rejoin.Restarter, --max-restarts).

    Returns when every process has exited or one that the job cannot lose has
    failed (torch's context.join then reports it and stops the others): the worker groups of this node that
    ended without finishing (died and not restarted, or dropped for a stall), as History.failed_groups names them.
    `ends` gets, per worker group whose process ended early, what happened to it (summary.json's missed_updates).
    """
    from multiprocessing.connection import wait

    reported: set[int] = set()
    ends = {} if ends is None else ends

    def ended(index: int, what: str) -> None:
        if not replicas_go_on(plan) and not heals(plan, ranks[index]):  # (a server is no group: its heal is recorded)  # (a group of replicas lost a process, not a group: the chief's missed_steps says it)
            ends[rejoin.group_of(plan, ranks[index])] = what

    def failed_groups() -> list[str]:
        if replicas_go_on(plan):
            return []
        return [f"worker group {g}" for g in sorted({rejoin.group_of(plan, ranks[i]) for i in reported})]

    stopped_since: dict[int, float] = {}  # index -> when this launcher first saw its process stopped (SIGSTOP)
    while True:
        for i in stalls.end_dropped(context, ranks, lambda rank: not expendable(plan, rank)):
            reported.add(i)
            ended(i, f"dropped: process {ranks[i]} stopped answering")
        for i in _end_stopped_to_restart(context, ranks, plan, restarter, stopped_since, reported):
            dropped = "" if heals(plan, ranks[i]) else " and dropped"  # (a server is waited for, not dropped)
            if restarter.restart(context, i, ranks[i], -signal.SIGKILL, how=f"was stopped past the stall timeout "
                                 f"({plan.stall_timeout_s:g} s){dropped}; the launcher ended it (SIGKILL)"):
                ended(i, f"process {ranks[i]} was restarted after the job dropped it for a stall")
        exited = [i for i, p in enumerate(context.processes) if p.exitcode is not None]
        # a Downpour server with restarts left comes back, healed from the chief's mirror (its stubs wait for it)
        for i in exited:
            if (context.processes[i].exitcode not in (0, None) and heals(plan, ranks[i]) and restarter is not None
                    and restarter.can_restart(ranks[i])
                    and context.processes[i].exitcode not in (stalls.STALLED_EXIT, REFUSED_AT_START_EXIT)):
                context.sentinels.pop(context.processes[i].sentinel, None)  # torch's join must not fail the job for it
                restarter.restart(context, i, ranks[i], context.processes[i].exitcode)
        exited = [i for i, p in enumerate(context.processes) if p.exitcode is not None]
        # one the job cannot lose ends it, first (a peer that saw it die and exited too is not restarted in vain);
        # STALLED_EXIT: a process that found a peer the job cannot lose stalled (the chief, say): its verdict ends the job;
        # REFUSED_AT_START_EXIT: bad input every process meets (its data not readable): the job stops, no group goes on
        if any(context.processes[i].exitcode not in (0, None)
               and (not expendable(plan, ranks[i]) or context.processes[i].exitcode in (stalls.STALLED_EXIT, REFUSED_AT_START_EXIT)
                    or (restarter is not None and i not in reported and (restarter.chief_after_the_last_step(ranks[i])
                                                                          or restarter.nobody_left_to_heal_from(context, ranks[i]))))
               for i in exited):
            return failed_groups()
        for i in exited:
            code = context.processes[i].exitcode
            if code not in (0, None) and i not in reported:  # (None: restarted meanwhile with the rest of its group)
                context.sentinels.pop(context.processes[i].sentinel, None)  # torch's join must not fail the job for it
                # a process that left because the job dropped it (it stalled, then ran again) comes back as a dead one,
                # with restarts left; without, as before: the chief has warned
                left = code == stalls.GROUP_DROPPED_EXIT
                said = restarter is not None and (not left or restarter.can_restart(ranks[i])) and restarter.restart(
                    context, i, ranks[i], code, how="left after the job dropped it for a stall" if left else None)
                if context.processes[i].exitcode is None:  # restarted: a new process in its place
                    ended(i, f"process {ranks[i]} was restarted after "
                             + ("the job dropped it for a stall" if left else f"it exited with code {code}"))
                    continue
                reported.add(i)
                ended(i, f"dropped: process {ranks[i]} stopped answering" if code == stalls.GROUP_DROPPED_EXIT
                      else f"process {ranks[i]} exited with code {code}")
                if code != stalls.GROUP_DROPPED_EXIT and not said and not _none_finished(context):  # (dropped for a
                    # stall: the chief has warned; every process failed: the job's failure says it, below)
                    others = "the other processes go on without it" if replicas_go_on(plan) else "the other worker groups go on"
                    if all(p.exitcode is not None for p in context.processes):
                        others = "no other process is left"
                    warn(f"WARNING: {describe_process(plan, ranks[i])} exited with code {code}; "
                         f"{others} (see {workspace}/logs/rank{ranks[i]}.log)")
        if all(p.exitcode is not None for p in context.processes):
            if restarter is not None:
                restarter.finish()
            if _none_finished(context):  # nobody went on: the job failed, and torch's join names the first failure
                context.sentinels.update({p.sentinel: i for i, p in enumerate(context.processes)})
            return failed_groups()
        # an exit wakes this at once; a stopped process (SIGSTOP) is seen only here: within a quarter second, not a
        # whole one (its restart waited up to 2 s more: 1 s to be seen stopped, 1 s past the stall timeout)
        wait([p.sentinel for p in context.processes if p.exitcode is None], timeout=0.25)


def _none_finished(context) -> bool:
    """Whether every process of this node has exited and none finished (exit 0): a job that outlives a dead process
    outlives it only while another goes on."""
    return all(p.exitcode not in (0, None) for p in context.processes)


def _end_stopped_to_restart(context, ranks: list[int], plan: JobPlan, restarter, stopped_since: dict[int, float],
                            reported: set[int]) -> list[int]:
    """With restarts left: the indices of this node's processes stopped (SIGSTOP) longer than the stall timeout and a
    beat, which their peers have dropped by then, now SIGKILLed (the launcher's own children: a stopped one holds any
    other signal) so that they are restarted as dead ones are. Without restarts they stay until the job ends (end_dropped)."""
    if restarter is None:
        return []
    now, ended = time.monotonic(), []
    for i, proc in enumerate(context.processes):
        if i in reported or proc.exitcode is not None or not stalls.is_stopped(proc.pid) or not restarter.can_restart(ranks[i]):
            stopped_since.pop(i, None)
            continue
        since = stopped_since.setdefault(i, now)
        if now - since > plan.stall_timeout_s + heartbeat.beat_interval(plan.stall_timeout_s):
            proc.kill()
            proc.join()
            context.sentinels.pop(proc.sentinel, None)  # torch's join must not fail the job for it
            stopped_since.pop(i)
            ended.append(i)
    return ended


def _wait_for_exit(processes, grace: float = 5.0) -> None:
    """Wait for terminated processes to exit (SIGKILL after `grace` seconds) and reap them."""
    stalls.kill_stopped(processes)  # a stopped process would hold SIGTERM until continued
    deadline = time.monotonic() + grace
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def _failed(message: str, workspace: Path, ranks: list[int], root_cause: bool = False, lost: bool = False,
            rank: Optional[int] = None, code: Optional[int] = None) -> ProcessFailed:
    """The job failed: the chief may have been stopped before it could say so in summary.json; say it for it.
    root_cause: the launcher saw another process die first, so its word replaces the chief's (whose collective
    only saw a closed connection). lost: a process died or stopped answering (ProcessLost: a restart may help)."""
    error = ProcessLost(message, rank, code) if lost else ProcessFailed(message)
    if 0 in ranks:
        mark_run_ended(workspace, error, reason=message, root_cause=root_cause)
    return error


def _exited(plan: JobPlan, rank: int, code: int, workspace: Path, ranks: list[int]) -> ProcessFailed:
    stops = stalls.why_the_job_stops(plan)  # a job of several groups that cannot outlive one says why
    return _failed(f"{describe_process(plan, rank)} exited with code {code}; {stops + '; ' if stops else ''}"
                   f"the other processes were stopped; see {workspace}/logs/rank{rank}.log", workspace, ranks, root_cause=rank != 0,
                   lost=True, rank=rank, code=code)


def _refused_line(workspace: Path, ranks: list[int], processes) -> Optional[str]:
    """The line of a process that left with REFUSED_AT_START_EXIT (the first rank's), with where its log is; None if none."""
    for rank, proc in zip(ranks, processes):
        if proc.exitcode == REFUSED_AT_START_EXIT:
            line = read_exit_line(refused_path(workspace, rank)) or f"process {rank} failed before its first step"
            return f"{line}; see {workspace}/logs/rank{rank}.log"
    return None


def _died_first(first_exits: dict[int, int], context) -> Optional[int]:
    """The index of a process that died without an error of its own (a signal, an exit: no traceback for torch to
    keep) among those that had exited when the first failure was seen; None if none did."""
    for index, code in sorted(first_exits.items()):
        if code not in (stalls.STALLED_EXIT, stalls.GROUP_DROPPED_EXIT) and not os.access(context.error_files[index], os.R_OK):
            return index
    return None


def _error_line(traceback_text: str) -> str:
    """The last line of a rank's traceback; a ShoalError's without its class (its message is written for users)."""
    last = traceback_text.strip().splitlines()[-1]
    found = re.match(r"shoal(?:\.\w+)+(?:Error|Failed|Lost): (.+)$", last)
    return found.group(1) if found else last


def run_processes(
    plan: JobPlan,
    spec: RunSpec,
    on_start: Callable[[list[int]], None] = lambda pids: None,
    nodes: Nodes = Nodes(),
    process_setup: Optional[Callable[[], None]] = None,
    rank_main: Optional[RankMain] = None,
) -> History:
    """Meet the job's other nodes, then spawn this node's processes, each running assemble.run_process for its rank
    (`rank_main`, picklable: what each runs instead, shoal.session's script).

    Each process gets the job's secret in its environment: on one host a fresh one unless the user gave one;
    over several hosts the one the user gave every node (a one-line error when it is missing)."""
    process_server.end_without_walking_the_heap()  # this process's exit, after the job's last step
    if nodes.one_host:
        secret = auth.given_secret() or auth.new_secret()
    else:
        secret = auth.required_secret(f"a job over {nodes.nnodes} nodes")
    environment = rank_environment({**os.environ, auth.SECRET_VARIABLE: auth.to_text(secret)})  # OMP_WAIT_POLICY too
    if nodes.one_host:
        meeting_point = meet(nodes, plan)
    else:  # torch's store clients log every retry while the other nodes are not up yet: to this node's launcher log
        with open_for_append(Path(spec.workspace) / "logs" / "launcher.log") as launcher_log, stalls.native_stderr_to(launcher_log):
            meeting_point = meet(nodes, plan)
    try:
        return _spawn(plan, spec, on_start, nodes, meeting_point, process_setup, environment, rank_main)
    except ProcessLost as lost:  # where the chief was, for a whole-job restart's line (the store goes with the job)
        lost.step = _chief_step(meeting_point, secret) if nodes.one_host else None
        raise
    finally:
        meeting_point.close()


def _chief_step(met: rendezvous.NodeRendezvous, secret: bytes) -> Optional[int]:
    """The step the chief last said it started (its heartbeat in the job's store); None when the store cannot tell."""
    from shoal.comm import channels

    try:
        return heartbeat.said_step(channels.job_store_client(met.store_host, met.store_port, secret, timeout_s=2.0), 0)
    except (RuntimeError, OSError, ValueError):  # torch's store errors: the line goes without the step
        return None


def meet(nodes: Nodes, plan: JobPlan) -> rendezvous.NodeRendezvous:
    """This node's place among the job's nodes, from torch's rendezvous (one host: a loopback store)."""
    if nodes.one_host:
        return rendezvous.loopback(max(plan.comm_timeout_s, 60.0))
    how = f"static rendezvous as node {nodes.node_rank}" if nodes.node_rank is not None else "c10d rendezvous"
    try:
        _, source = route(nodes.master_host)
        master_address = socket.gethostbyname(nodes.master_host)
        met = rendezvous.across_nodes(nodes.nnodes, nodes.node_rank, nodes.master_host, nodes.master_port, nodes.run_id,
                                      local_addr=source, is_master_host=source == master_address,
                                      join_timeout_s=plan.join_timeout_s)  # cluster.join_timeout_s; SHOAL_JOIN_TIMEOUT overrides
    except (OSError, RuntimeError, ValueError) as err:  # torch's rendezvous and store errors: their first line is the story
        raise ProcessFailed(f"--master {nodes.master_host}:{nodes.master_port}: cannot meet the job's other "
                            f"{nodes.nnodes - 1} node(s) ({how}): {comm.describe_error(err)}") from None
    if not nodes.ranks(plan.nprocs, met.node_rank):
        met.close()
        raise ProcessFailed(f"node {met.node_rank} has no process to run: {plan.label} has {plan.nprocs} process(es) for {nodes.nnodes} nodes")
    return met


def start_method() -> str:
    """How ranks start: forked from multiprocessing's forkserver, which imported torch and shoal once (a rank then
    costs milliseconds, not an interpreter and torch's import each: seconds of CPU), else spawned. Each rank gets
    the launcher's environment of the moment (`_entry`); cwd and sys.path travel as with spawn. The server starts
    here (once per launcher) without the working folder on its import path (forkserver_context)."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    forkserver_context([__name__])
    return "forkserver"


@contextmanager
def children_stop_with_this_process(processes: Callable[[], list]):
    """While inside: Ctrl-C or SIGTERM (`shoal jobs kill`, torchrun stopping the job) terminates the alive processes of
    `processes()` at once (children blocked in a collective would not see the signal until their timeout: no orphans)
    and raises here (Terminated, KeyboardInterrupt). A process started with SIGINT ignored (nohup, `&` in a script)
    keeps ignoring Ctrl-C: it is not for this run; SIGTERM always is."""
    def stop(signum, frame):
        for proc in processes():
            if proc.is_alive():
                proc.terminate()
        raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)
                if sig == signal.SIGTERM or signal.getsignal(sig) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _spawn(plan: JobPlan, spec: RunSpec, on_start: Callable[[list[int]], None], nodes: Nodes,
           met: rendezvous.NodeRendezvous, process_setup: Optional[Callable[[], None]], environment: dict[str, str],
           rank_main: Optional[RankMain] = None) -> History:
    world, workspace = plan.nprocs, spec.workspace
    ranks = nodes.ranks(world, met.node_rank)
    meeting = Meeting(world, nodes.nnodes, -(-world // nodes.nnodes), met.store_host, met.store_port, nodes.interface)
    # our one-line report replaces torch's per-process "Terminating process" warnings
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    args = (ranks, meeting, environment, plan.job.SerializeToString(), str(workspace),
            str(spec.resume_from) if spec.resume_from else None, [str(d) for d in spec.base_dirs], process_setup, spec.initial_values,
            rank_main)
    metrics = workspace / "metrics.jsonl"
    # a resumed run appends to the earlier runs' records: its History holds its own, as in one process
    metrics_start = metrics.stat().st_size if 0 in ranks and metrics.exists() else 0
    try:
        context = mp.start_processes(_entry, args=args, nprocs=len(ranks), start_method=start_method(), join=False)
        on_start([p.pid for p in context.processes])

        failed_groups: list[str] = []
        restarter = None  # (where dead processes are restarted into the running job)
        group_ends: dict[int, str] = {}
        first_exits: dict[int, int] = {}
        with children_stop_with_this_process(lambda: context.processes):
            try:
                if outlives_a_dead_process(plan):  # (its strategy says so: Downpour, Hogwild, Local SGD, replicas) a dead group is dropped
                    failed_groups = _join_tolerating_groups(context, ranks, plan, workspace,
                                                            restarter := rejoin.Restarter(plan, meeting, spec, process_setup, environment,
                                                                             rank_main=rank_main, ranks_here=ranks), group_ends)
                elif plan.max_restarts > 0 and plan.nworker_groups > 1:  # groups that cannot outlive a dead one
                    warn(f"WARNING: --max-restarts: only Downpour, Local SGD and Distributed Hogwild worker groups are restarted; "
                         f"{plan.label}'s are not")
                stalls.wait_for_first_failure(context)  # and SIGKILL stopped processes, which SIGTERM cannot end
                # who had exited when the first failure was seen, before torch's join stops the others
                first_exits = {i: p.exitcode for i, p in enumerate(context.processes) if p.exitcode not in (None, 0)}
                while not context.join():
                    pass
            except KeyboardInterrupt as interruption:
                _wait_for_exit(context.processes)
                if 0 in ranks:  # a chief killed mid-step left its summary saying "running"
                    mark_run_ended(workspace, interruption)
                raise
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
        verdict = stalls.verdict(workspace, ranks, context.processes)  # a peer found stalled: the line naming it
        if verdict is not None:
            raise _failed(f"{verdict}; see {workspace}/logs", workspace, ranks, lost=True) from None
        refused = _refused_line(workspace, ranks, context.processes)
        if refused is not None:  # bad input before the first step: the job stops with its line (no restart helps)
            raise _failed(refused, workspace, ranks) from None
        if isinstance(err, mp.ProcessExitedException):
            lost = _exited(plan, ranks[err.error_index], err.exit_code, workspace, ranks)
            lost.why = restarter.why_nobody_is_left(ranks[err.error_index]) if restarter is not None else ""
            raise lost from None
        rank = ranks[err.error_index]
        last = str(err).strip().splitlines()[-1]
        if rank == 0 and last.startswith("BrokenPipeError"):  # the chief writes to our stdout: its reader went away
            raise BrokenPipeError(last) from None
        if last.startswith(f"{auth.__name__}.SecretError: "):  # a node was given another secret: no traceback for it
            raise _failed(last.split(": ", 1)[1], workspace, ranks) from None
        if last.startswith((f"{__name__}.StalledPeer: ", f"{__name__}.PeerFailed: ")):
            raise _failed(last.split(": ", 1)[1] + f"; see {workspace}/logs", workspace, ranks,
                          lost=last.startswith(f"{__name__}.StalledPeer: ")) from None  # (a PeerFailed is an error of its own)
        # a collective, or a Downpour worker's channel to its server, lost a peer: the dead one is the story, if one died
        lost_peer = last.startswith((f"{__name__}.ConnectionFailed: ", f"{ServerLost.__module__}.ServerLost: "))
        died = _died_first(first_exits, context) if lost_peer else None
        if died is not None:  # its peer only saw the connection close: the dead one is the story
            raise _exited(plan, ranks[died], first_exits[died], workspace, ranks) from None
        last = _error_line(last)
        raise _failed(f"{describe_process(plan, rank)} failed: {last}; see {workspace}/logs/rank{rank}.log", workspace, ranks,
                      lost=lost_peer) from None
    history = History(workspace, failed_groups=failed_groups)
    if 0 in ranks and metrics.exists():  # the chief's node holds the metrics (none: no process began the run)
        history.records = read_metrics(metrics, metrics_start)
        note_group_ends(workspace, group_ends)  # the groups that ended early, for the closing line
    return history
