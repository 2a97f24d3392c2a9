"""`shoal plan`: everything a job will start, computed without starting anything."""
from __future__ import annotations

import os

import torch

from shoal.planning.placement import describe, place
from shoal.config import job_pb2
from shoal.planning.devices import worker_device_names
from shoal.neuralnet.net import NeuralNet
from shoal.neuralnet.params import ParamStore
from shoal.planning.partition import partition
from shoal.runtime.feed import train_input_shares


def build_plan(job: job_pb2.JobProto, cores: int | None = None) -> dict:
    """Processes, their workers (device, batch share, threads, layers) and servers (param slices); pure."""
    store = ParamStore(allocate=False)
    net = NeuralNet(job.neuralnet, job_pb2.kTrain, store, torch.Generator())
    sizes = {name: info.numel for name, info in store.info.items()}
    placement = place(job.cluster, sizes)
    plan = describe(placement)
    cores = cores or os.cpu_count() or 1
    explicit = job.num_openblas_threads if job.HasField("num_openblas_threads") else job.cluster.threads_per_worker
    parts = partition(net, job.neuralnet, job.cluster.nworkers_per_group)
    shares = next(iter(train_input_shares(job)), [])  # the first training input layer's
    # one host: every worker of the job shares its cores (oversubscription is what kills CPU throughput)
    workers_on_host = sum(len(proc["workers"]) for proc in plan["processes"])
    threads = explicit or max(1, cores // max(1, workers_on_host))
    for proc in plan["processes"]:
        for worker, device in zip(proc["workers"], worker_device_names(job, len(proc["workers"]))):
            worker["device"] = device
            worker["threads"] = threads
            worker["batch_share"] = shares[worker["id"]] if shares else None
            # every layer on its share of the batch, or the worker's nodes of the partitioned net
            worker["layers"] = [n.name for n in parts.worker_nodes(worker["id"])] if parts.partitioned else [n.name for n in net.nodes]
    plan["batch_shares"] = "measured at run time" if job.cluster.auto_batch_shares else "as configured"
    plan["partition_notes"] = list(parts.notes)
    plan["params"] = {name: list(info.shape) for name, info in store.info.items()}
    plan["param_elements"] = sum(sizes.values())
    return plan


def render(plan: dict, job_name: str) -> str:
    lines = [
        f"job {job_name!r}: {plan['framework']}, {plan['nprocs']} process(es), "
        f"{plan['param_elements']:,} param elements in {plan['nslices']} slice(s)"
    ]
    auto = " (at start; measured at run time)" if plan["batch_shares"] == "measured at run time" else ""
    for proc in plan["processes"]:
        lines.append(f"process {proc['rank']}")
        for w in proc["workers"]:
            share = "" if w["batch_share"] is None else f"batch share {w['batch_share']}{auto}, "
            lines.append(
                f"  worker (group {w['group']}, id {w['id']}) on {w['device']}, {share}{w['threads']} thread(s), "
                f"server group {w['server_group']}: {', '.join(w['layers'])}"
            )
        for s in proc["servers"]:
            owned = ", ".join(f"{x['param']}[{x['start']}:{x['stop']}]" for x in s["slices"]) or "nothing"
            total = sum(x["stop"] - x["start"] for x in s["slices"])
            lines.append(f"  server (group {s['group']}, id {s['id']}): {total:,} elements: {owned}")
    lines += [f"note: {note}" for note in plan["partition_notes"]]
    return "\n".join(lines)
