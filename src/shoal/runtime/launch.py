"""Run one synchronous worker group over several processes, on one host or several.

One host: the parent picks a free loopback port and spawns one process per
entry of the placement. Several hosts: `shoal run` is started on every node
with the same --nnodes and --master and its own --node-rank, and spawns that
node's share of the ranks (a static rendezvous, as torchrun's: the c10d store
of rank 0 at the master address). Rank 0 hosts the store and worker 0 of
group 0 (the chief: it tests, displays and writes checkpoints); every process
logs to WORKSPACE/logs/rank<R>.log. If a process dies, torch's process context
terminates the others on its node, the others time out of their collectives,
and each parent reports which rank failed.
"""
from __future__ import annotations

import logging
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch.multiprocessing as mp

from shoal.comm import dist as comm
from shoal.config.plugins import decode_job
from shoal.errors import ShoalError
from shoal.planning.plan import JobPlan, plan_job
from shoal.report.metrics import read_metrics
from shoal.report.run_log import Terminated, mark_run_ended
from shoal.runtime.assemble import RunSpec, run_process
from shoal.runtime.trainer import History

LOOPBACK = "127.0.0.1"  # one host: nothing listens beyond loopback


@dataclass(frozen=True)
class Nodes:
    """Where the job's processes run: nnodes hosts, this one being node_rank."""

    nnodes: int = 1
    node_rank: int = 0
    master_host: str = LOOPBACK
    master_port: int = 0  # 0: pick a free port (one host only)
    interface: str = "lo"

    def ranks(self, world: int) -> list[int]:
        """This node's ranks: nodes take equal consecutive blocks (node 0 hosts rank 0, the chief)."""
        per_node = -(-world // self.nnodes)
        return list(range(self.node_rank * per_node, min(world, (self.node_rank + 1) * per_node)))


class ProcessFailed(ShoalError, RuntimeError):
    """A process of the job died; the message names its rank and what it hosted."""


class StalledPeer(RuntimeError):
    """A collective timed out: the message names the rank(s) that stopped answering."""


def route_interface(host: str) -> str:
    """The network interface this machine uses to reach `host` (from `ip route get`)."""
    import subprocess

    try:
        out = subprocess.run(["ip", "route", "get", host], capture_output=True, text=True, timeout=5).stdout.split()
        return out[out.index("dev") + 1]
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        raise ProcessFailed(f"--master {host}: cannot tell which interface reaches it; pass --interface") from None


def describe_process(plan: JobPlan, rank: int) -> str:
    proc = plan.process(rank)
    members = [str(w) for w in proc.workers] + [str(s) for s in proc.servers]
    return f"process {rank} ({', '.join(members)})"


def _entry(local_index: int, ranks: list[int], world: int, nodes: Nodes, job_bytes: bytes, workspace: str,
           resume_from: Optional[str], base_dirs: list[str], process_setup: Optional[Callable[[], None]] = None,
           initial_values: Optional[Callable] = None) -> None:
    """A spawned process: join the world, plan the job (deterministic: every process plans the same) and run its rank."""
    rank = ranks[local_index]
    log_dir = Path(workspace) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_file = open(log_dir / f"rank{rank}.log", "a", buffering=1)
    if rank != 0:  # the chief talks to the terminal; the others to their log files
        sys.stdout = sys.stderr = log_file
    comm.init(rank, world, nodes.master_host, nodes.master_port, nodes.interface)
    try:
        if process_setup is not None:
            process_setup()
        plan = plan_job(decode_job(job_bytes), nnodes=nodes.nnodes)  # decode_job: the job's plugins first
        say = (lambda line: (print(line), log_file.write(line + "\n"))) if rank == 0 else print
        spec = RunSpec(Path(workspace), [Path(d) for d in base_dirs], Path(resume_from) if resume_from else None,
                       log=say, progress=False, initial_values=initial_values)
        try:
            run_process(plan, rank, spec)
        except RuntimeError as err:  # a collective failed: find who stopped answering
            progress = comm.progress(world)
            calls, step = progress[rank]
            behind = [r for r, (c, _) in progress.items() if r != rank and c < calls]
            if behind:
                who = "; ".join(f"{describe_process(plan, r)} stopped answering at step {progress[r][1]}" for r in behind)
                raise StalledPeer(f"{who} (process {rank} waited {comm.timeout_seconds():.0f} s at step {step})") from None
            raise RuntimeError(f"{str(err).splitlines()[0]}") from None
    finally:
        comm.shutdown()


def expendable(plan: JobPlan, rank: int) -> bool:
    """Asynchronous jobs outlive a process that hosts only workers of groups other than group 0."""
    proc = plan.process(rank)
    return not plan.framework.synchronous and bool(proc.workers) and all(m.group != 0 for m in proc.workers + proc.servers)


def _join_tolerating_groups(context, ranks: list[int], plan: JobPlan, workspace: Path) -> None:
    """Wait for the processes of an asynchronous job; a dead worker group is reported, not fatal.

    Returns when every process has exited or one that the job cannot lose has
    failed (torch's context.join then reports it and stops the others).
    """
    from multiprocessing.connection import wait

    reported: set[int] = set()
    while True:
        exited = [i for i, p in enumerate(context.processes) if p.exitcode is not None]
        for i in exited:
            code = context.processes[i].exitcode
            if code != 0 and not expendable(plan, ranks[i]):
                return
            if code != 0 and i not in reported:
                reported.add(i)
                context.sentinels.pop(context.processes[i].sentinel, None)  # torch's join must not fail the job for it
                print(f"WARNING: {describe_process(plan, ranks[i])} exited with code {code}; "
                      f"the other worker groups go on (see {workspace}/logs/rank{ranks[i]}.log)", flush=True)
        if len(exited) == len(context.processes):
            return
        wait([p.sentinel for p in context.processes if p.exitcode is None], timeout=1.0)


def _wait_for_exit(processes, grace: float = 5.0) -> None:
    """Wait for terminated processes to exit (SIGKILL after `grace` seconds) and reap them."""
    deadline = time.monotonic() + grace
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def run_processes(
    plan: JobPlan,
    spec: RunSpec,
    on_start: Callable[[list[int]], None] = lambda pids: None,
    nodes: Nodes = Nodes(),
    process_setup: Optional[Callable[[], None]] = None,
) -> History:
    """Spawn this node's processes of the plan, each running shoal.runtime.assemble.run_process for its rank."""
    world, workspace = plan.nprocs, spec.workspace
    if nodes.master_port == 0:
        nodes = Nodes(master_port=comm.free_port(LOOPBACK))
    ranks = nodes.ranks(world)
    if not ranks:
        raise ProcessFailed(f"node {nodes.node_rank} has no process to run: {plan.label} has {world} process(es) for {nodes.nnodes} nodes")
    # our one-line report replaces torch's per-process "Terminating process" warnings
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    args = (ranks, world, nodes, plan.job.SerializeToString(), str(workspace), str(spec.resume_from) if spec.resume_from else None,
            [str(d) for d in spec.base_dirs], process_setup, spec.initial_values)
    try:
        context = mp.start_processes(_entry, args=args, nprocs=len(ranks), start_method="spawn", join=False)
        on_start([p.pid for p in context.processes])

        def stop(signum, frame):
            # Ctrl-C or `shoal jobs kill`: children blocked in a collective would not see the
            # signal until their timeout, so stop them now and leave no orphans
            for proc in context.processes:
                if proc.is_alive():
                    proc.terminate()
            raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt

        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            if not plan.framework.synchronous:
                _join_tolerating_groups(context, ranks, plan, workspace)
            while not context.join():
                pass
        except KeyboardInterrupt as interruption:
            _wait_for_exit(context.processes)
            if 0 in ranks:  # a chief killed mid-step left its summary saying "running"
                mark_run_ended(workspace, interruption)
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    except mp.ProcessRaisedException as err:
        rank = ranks[err.error_index]
        last = str(err).strip().splitlines()[-1]
        if rank == 0 and last.startswith("BrokenPipeError"):  # the chief writes to our stdout: its reader went away
            raise BrokenPipeError(last) from None
        if last.startswith(f"{__name__}.StalledPeer: "):
            raise ProcessFailed(last.split(": ", 1)[1] + f"; see {workspace}/logs") from None
        raise ProcessFailed(f"{describe_process(plan, rank)} failed: {last}; see {workspace}/logs/rank{rank}.log") from None
    except mp.ProcessExitedException as err:
        rank = ranks[err.error_index]
        raise ProcessFailed(
            f"{describe_process(plan, rank)} exited with code {err.exit_code}; "
            f"the other processes were stopped; see {workspace}/logs/rank{rank}.log"
        ) from None
    history = History(workspace)
    if 0 in ranks:  # the chief's node holds the metrics
        history.records = read_metrics(workspace / "metrics.jsonl")
    return history
