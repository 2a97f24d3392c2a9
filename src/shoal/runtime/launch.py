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
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.multiprocessing as mp

from shoal.errors import ShoalError
from shoal.runtime import checkpoint as ckpt_io
from shoal.planning.placement import Placement, ServerId, WorkerId, place
from shoal.comm import dist as comm
from shoal.config import job_pb2
from shoal.planning.devices import worker_device_names
from shoal.report.metrics import read_metrics
from shoal.report.run_log import Terminated, mark_run_ended, open_run_log
from shoal.runtime.exchanges.downpour import DownpourExchange, DownpourServer
from shoal.runtime.exchanges.sliced import SlicedExchange
from shoal.runtime.exchanges.hogwild import HogwildExchange
from shoal.runtime.replicas import device_label, process_devices
from shoal.runtime.exchanges.server import Server
from shoal.runtime import visualization
from shoal.runtime.trainer import History, Trainer
from shoal.neuralnet.updaters import make_updater

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


def describe_process(placement: Placement, rank: int) -> str:
    proc = placement.processes[rank]
    members = [str(w) for w in proc.workers] + [str(s) for s in proc.servers]
    return f"process {rank} ({', '.join(members)})"


def _entry(
    local_index: int, ranks: list[int], world: int, nodes: Nodes, job_bytes: bytes, workspace: str,
    resume_from: Optional[str], base_dirs: list[str], threads: int,
    process_setup: Optional[Callable[[], None]] = None, initial_values: Optional[Callable] = None,
) -> None:
    rank = ranks[local_index]
    job = job_pb2.JobProto.FromString(job_bytes)
    log_dir = Path(workspace) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_file = open(log_dir / f"rank{rank}.log", "a", buffering=1)
    if rank != 0:  # the chief talks to the terminal; the others to their log files
        sys.stdout = sys.stderr = log_file
    torch.set_num_threads(threads)
    comm.init(rank, world, nodes.master_host, nodes.master_port, nodes.interface)
    try:
        if process_setup is not None:
            process_setup()
        placement = place(job.cluster)
        hosted = placement.processes[rank]
        say = (lambda line: (print(line), log_file.write(line + "\n"))) if rank == 0 else print
        # params live in host memory (gloo moves them); workers on GPUs compute on replicas
        devices = process_devices(job, len(hosted.workers))
        trainer = Trainer(
            job, Path(workspace), [Path(d) for d in base_dirs], torch.device("cpu"), log=say,
            progress=False, worker_indices=[w.id for w in hosted.workers], chief=rank == 0,
            group=hosted.workers[0].group if hosted.workers else 0, worker_devices=devices,
        )
        if initial_values is not None:
            initial_values(trainer.store)
        placement = place(job.cluster, {name: info.numel for name, info in trainer.store.info.items()})
        if placement.is_synchronous:
            trainer.attach_exchange(SlicedExchange(trainer.store, make_updater(job.updater), placement, rank, trainer.global_batch, trainer.workers))
        elif job.cluster.nserver_groups > 1:
            exchange = HogwildExchange(trainer.store, Server(trainer.store, make_updater(job.updater)), placement, rank,
                                       hosted.workers[0].group, job.cluster.sync_freq, log=print)
            trainer.attach_exchange(exchange)
            trainer.before_final_test = exchange.finish
        else:
            server = _attach_downpour(trainer, placement, rank, say, resume_from)
            if server is not None and not hosted.workers:  # a server process: serve until every group stops
                for s in hosted.servers:
                    print(f"Server (group = {s.group}, id = {s.id}) start in process {rank}: {server.size:,} param elements")
                server.serve()
                return
        if resume_from:
            trainer.restore(Path(resume_from))
        if isinstance(trainer.exchange, DownpourExchange) and trainer.group != 0:
            # groups join where group 0's warm-up ends, and finish at train_steps like it
            trainer.start_step = trainer.exchange.first_step = max(trainer.start_step, job.cluster.warmup_steps)
        elif job.checkpoint_path:
            trainer.load_params([ckpt_io.resolve_path(p, [Path(d) for d in base_dirs]) for p in job.checkpoint_path])
        for w, device in zip(hosted.workers, devices):
            print(f"Worker (group = {w.group}, id = {w.id}) start on {device_label(device)} in process {rank} (pid = {os.getpid()})")
        for s in hosted.servers:
            print(f"Server (group = {s.group}, id = {s.id}) start in process {rank}: {sum(x.size for x in placement.slices_of(s)):,} param elements")
        _inject_faults(trainer, rank)
        step_fn = trainer.train_step

        def step_with_heartbeat(step: int) -> int:
            comm.heartbeat(step)
            return step_fn(step)

        trainer.train_step = step_with_heartbeat
        metrics = None
        if rank == 0:
            visualization.write_train_net(job, Path(workspace), fresh=resume_from is None)
            every = [d for p in placement.processes for d in worker_device_names(job, len(p.workers))]
            metrics = open_run_log(job, Path(workspace), trainer.elapsed_before, every, threads)
        status = "failed"
        try:
            trainer.run(metrics)
            status = "finished"
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        except RuntimeError as err:  # a collective failed: find who stopped answering
            progress = comm.progress(world)
            calls, step = progress[rank]
            behind = [r for r, (c, _) in progress.items() if r != rank and c < calls]
            if behind:
                who = "; ".join(f"{describe_process(placement, r)} stopped answering at step {progress[r][1]}" for r in behind)
                raise StalledPeer(f"{who} (process {rank} waited {comm.timeout_seconds():.0f} s at step {step})") from None
            raise RuntimeError(f"{str(err).splitlines()[0]}") from None
        finally:
            if metrics is not None:
                metrics.close(status)
    finally:
        comm.shutdown()


def resumed_version(step: int, job: job_pb2.JobProto) -> int:
    """The server version a Downpour run resumes at: every group had done about `step` updates."""
    return step * job.cluster.nworker_groups


def _attach_downpour(trainer: Trainer, placement: Placement, rank: int, log, resume_from: Optional[str]):
    """Give this process its Downpour role; return its server if it hosts one.

    Every process creates every group's process group (torch.distributed requires
    it), in group order, whether or not it belongs to it.
    """
    job = trainer.job
    group_ranks = {g: sorted({placement.process_of(WorkerId(g, w)) for w in range(job.cluster.nworkers_per_group)})
                   for g in range(job.cluster.nworker_groups)}
    group_comms = {g: comm.new_group(ranks) if len(ranks) > 1 else None for g, ranks in group_ranks.items()}
    server_ranks = {ServerId(0, i): placement.process_of(ServerId(0, i)) for i in range(job.cluster.nservers_per_group)}
    hosted = placement.processes[rank]
    if hosted.servers:
        server = DownpourServer(trainer.store, make_updater(job.updater), placement, hosted.servers[0],
                                {g: ranks[0] for g, ranks in group_ranks.items()}, log=print,
                                max_staleness=job.cluster.max_staleness, warmup_steps=job.cluster.warmup_steps)
        if resume_from:
            ckpt = ckpt_io.load(Path(resume_from))
            trainer.store.load(ckpt.params, strict=True)
            server.load_state(ckpt.updater_state)
            server.version = resumed_version(ckpt.step, job)
            server.resume_at(ckpt.step)
        spec = os.environ.get("SHOAL_INJECT_EXIT", "")
        if spec and int(spec.split(":")[0]) == rank:  # a server "dies" when its version reaches STEP
            server.exit_at_version = int(spec.split(":")[1])
        return server
    group = hosted.workers[0].group
    exchange = DownpourExchange(trainer.store, make_updater(job.updater), placement, rank, group,
                                group_ranks[group], group_comms[group], server_ranks, trainer.global_batch)
    if resume_from:
        step = ckpt_io.load(Path(resume_from)).step
        exchange.read_version = dict.fromkeys(exchange.read_version, resumed_version(step, job))
        exchange.last_version = resumed_version(step, job)
        exchange.first_step = step
    trainer.attach_exchange(exchange)
    trainer.before_final_test = exchange.finish
    return None


def _inject_faults(trainer: Trainer, rank: int) -> None:
    """Fault injection for tests: SHOAL_INJECT_EXIT / SHOAL_INJECT_STALL = "RANK:STEP" make that
    rank die (exit code 3) or hang at that step."""
    for variable, action in (("SHOAL_INJECT_EXIT", lambda: os._exit(3)), ("SHOAL_INJECT_STALL", lambda: time.sleep(10**6))):
        spec = os.environ.get(variable)
        if not spec:
            continue
        target_rank, target_step = (int(x) for x in spec.split(":"))
        if rank != target_rank:
            continue
        step_fn = trainer.train_step

        def faulty_step(step: int, step_fn=step_fn, target_step=target_step, action=action) -> int:
            if step == target_step:
                action()
            return step_fn(step)

        trainer.train_step = faulty_step


def expendable(placement: Placement, rank: int) -> bool:
    """Asynchronous jobs outlive a process that hosts only workers of groups other than group 0."""
    proc = placement.processes[rank]
    return not placement.is_synchronous and bool(proc.workers) and all(m.group != 0 for m in proc.workers + proc.servers)


def _join_tolerating_groups(context, ranks: list[int], placement: Placement, workspace: Path) -> None:
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
            if code != 0 and not expendable(placement, ranks[i]):
                return
            if code != 0 and i not in reported:
                reported.add(i)
                context.sentinels.pop(context.processes[i].sentinel, None)  # torch's join must not fail the job for it
                print(f"WARNING: {describe_process(placement, ranks[i])} exited with code {code}; "
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
    job: job_pb2.JobProto,
    workspace: Path,
    resume_from: Optional[Path],
    base_dirs: list[Path],
    threads: int,
    on_start: Callable[[list[int]], None] = lambda pids: None,
    nodes: Nodes = Nodes(),
    process_setup: Optional[Callable[[], None]] = None,
    initial_values: Optional[Callable] = None,
) -> History:
    placement = place(job.cluster)
    world = len(placement.processes)
    if nodes.master_port == 0:
        nodes = Nodes(master_port=comm.free_port(LOOPBACK))
    ranks = nodes.ranks(world)
    if not ranks:
        raise ProcessFailed(f"node {nodes.node_rank} has no process to run: {placement.framework} has {world} process(es) for {nodes.nnodes} nodes")
    # our one-line report replaces torch's per-process "Terminating process" warnings
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    args = (ranks, world, nodes, job.SerializeToString(), str(workspace), str(resume_from) if resume_from else None, [str(d) for d in base_dirs], threads, process_setup, initial_values)
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
            if not placement.is_synchronous:
                _join_tolerating_groups(context, ranks, placement, workspace)
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
        raise ProcessFailed(f"{describe_process(placement, rank)} failed: {last}; see {workspace}/logs/rank{rank}.log") from None
    except mp.ProcessExitedException as err:
        rank = ranks[err.error_index]
        raise ProcessFailed(
            f"{describe_process(placement, rank)} exited with code {err.exit_code}; "
            f"the other processes were stopped; see {workspace}/logs/rank{rank}.log"
        ) from None
    history = History(workspace)
    if 0 in ranks:  # the chief's node holds the metrics
        history.records = read_metrics(workspace / "metrics.jsonl")
    return history
