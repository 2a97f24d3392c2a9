"""Run one synchronous worker group over several local processes (spawned, gloo on loopback).

The parent checks the workspace, picks a free loopback port, and spawns one
process per entry of the placement. Rank 0 hosts the rendezvous store and
worker 0 of group 0 (the chief: it tests, displays and writes checkpoints);
every process logs to WORKSPACE/logs/rank<R>.log. If any process dies, torch's
process context terminates the others and the parent reports which one.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.multiprocessing as mp

from shoal import checkpoint as ckpt_io
from shoal.cluster import Placement, place
from shoal.comm import dist as comm
from shoal.config import job_pb2
from shoal.metrics import MetricsLog, read_metrics
from shoal.runtime.exchange import SlicedExchange
from shoal.runtime.trainer import History, Trainer
from shoal.updaters import make_updater

HOST = "127.0.0.1"  # one host: nothing listens beyond loopback


class ProcessFailed(RuntimeError):
    """A process of the job died; the message names its rank and what it hosted."""


def describe_process(placement: Placement, rank: int) -> str:
    proc = placement.processes[rank]
    members = [str(w) for w in proc.workers] + [str(s) for s in proc.servers]
    return f"process {rank} ({', '.join(members)})"


def _entry(rank: int, world: int, port: int, job_bytes: bytes, workspace: str, resume_from: Optional[str], base_dirs: list[str], threads: int) -> None:
    job = job_pb2.JobProto.FromString(job_bytes)
    log_dir = Path(workspace) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_file = open(log_dir / f"rank{rank}.log", "a", buffering=1)
    if rank != 0:  # the chief talks to the terminal; the others to their log files
        sys.stdout = sys.stderr = log_file
    torch.set_num_threads(threads)
    comm.init(rank, world, HOST, port)
    try:
        placement = place(job.cluster)
        hosted = placement.processes[rank]
        say = (lambda line: (print(line), log_file.write(line + "\n"))) if rank == 0 else print
        trainer = Trainer(
            job, Path(workspace), [Path(d) for d in base_dirs], torch.device("cpu"), log=say,
            progress=False, worker_indices=[w.id for w in hosted.workers], chief=rank == 0,
        )
        placement = place(job.cluster, {name: info.numel for name, info in trainer.store.info.items()})
        trainer.attach_exchange(SlicedExchange(trainer.store, make_updater(job.updater), placement, rank, trainer.global_batch))
        if resume_from:
            trainer.restore(Path(resume_from))
        elif job.checkpoint_path:
            trainer.load_params([ckpt_io.resolve_path(p, [Path(d) for d in base_dirs]) for p in job.checkpoint_path])
        for w in hosted.workers:
            print(f"Worker (group = {w.group}, id = {w.id}) start on CPU in process {rank} (pid = {os.getpid()})")
        for s in hosted.servers:
            print(f"Server (group = {s.group}, id = {s.id}) start in process {rank}: {sum(x.size for x in placement.slices_of(s)):,} param elements")
        _inject_faults(trainer, rank)
        metrics = MetricsLog(Path(workspace) / "metrics.jsonl", elapsed_before=trainer.elapsed_before) if rank == 0 else None
        try:
            trainer.run(metrics)
        finally:
            if metrics is not None:
                metrics.close()
    finally:
        comm.shutdown()


def _inject_faults(trainer: Trainer, rank: int) -> None:
    """Fault injection for tests: SHOAL_INJECT_EXIT="RANK:STEP" makes that rank die at that step."""
    spec = os.environ.get("SHOAL_INJECT_EXIT")
    if not spec:
        return
    target_rank, target_step = (int(x) for x in spec.split(":"))
    if rank != target_rank:
        return
    step_fn = trainer.train_step

    def dying_step(step: int) -> int:
        if step == target_step:
            os._exit(3)
        return step_fn(step)

    trainer.train_step = dying_step


def run_processes(
    job: job_pb2.JobProto,
    workspace: Path,
    resume_from: Optional[Path],
    base_dirs: list[Path],
    threads: int,
    on_start: Callable[[list[int]], None] = lambda pids: None,
) -> History:
    placement = place(job.cluster)
    world = len(placement.processes)
    port = comm.free_port(HOST)
    # our one-line report replaces torch's per-process "Terminating process" warnings
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    args = (world, port, job.SerializeToString(), str(workspace), str(resume_from) if resume_from else None, [str(d) for d in base_dirs], threads)
    try:
        context = mp.start_processes(_entry, args=args, nprocs=world, start_method="spawn", join=False)
        on_start([p.pid for p in context.processes])
        while not context.join():
            pass
    except mp.ProcessRaisedException as err:
        first = str(err).strip().splitlines()[-1]
        raise ProcessFailed(f"{describe_process(placement, err.error_index)} failed: {first}; see {workspace}/logs/rank{err.error_index}.log") from None
    except mp.ProcessExitedException as err:
        raise ProcessFailed(
            f"{describe_process(placement, err.error_index)} exited with code {err.exit_code}; "
            f"the other processes were stopped; see {workspace}/logs/rank{err.error_index}.log"
        ) from None
    history = History(workspace)
    history.records = read_metrics(workspace / "metrics.jsonl")
    return history
