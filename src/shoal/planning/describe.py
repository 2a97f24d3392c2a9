"""`shoal plan`: the JobPlan as JSON (`--json`) and as text, nothing recomputed."""
from __future__ import annotations

from dataclasses import asdict

from shoal.config import job_pb2
from shoal.planning.plan import TIMEOUT_OVERRIDES, JobPlan


def describe(plan: JobPlan) -> dict:
    """Processes, their workers (device, batch share, threads, layers) and servers (param slices)."""
    placement, parts = plan.placement, plan.partition
    shares = plan.batch_shares[0] if plan.batch_shares else []  # the first training input layer's
    all_layers = [n.origin for n in parts.nodes if not n.inserted]
    processes = []
    for proc, devices in zip(placement.processes, plan.devices):
        workers = []
        for w, device in zip(proc.workers, devices):
            layers = [n.name for n in parts.worker_nodes(w.id)] if parts.partitioned else list(dict.fromkeys(all_layers))
            workers.append(asdict(w) | {
                "server_group": placement.server_group_of(w.group), "device": device, "threads": plan.threads_per_worker,
                "batch_share": shares[w.id] if shares else None, "layers": layers,
            })
        servers = [asdict(s) | {"slices": [asdict(x) for x in placement.slices_of(s)]} for s in proc.servers]
        processes.append({"rank": proc.rank, "workers": workers, "servers": servers})
    return {
        "framework": plan.framework.value,
        "label": plan.label,
        "synchronous": plan.strategy.synchronous,
        "nprocs": plan.nprocs,
        "nworkers": plan.nworkers,
        "nservers": plan.nservers,
        "nslices": placement.nslices,
        "global_batch": plan.global_batch,
        "processes": processes,
        "batch_shares": "measured at run time" if plan.cluster.auto_batch_shares else "as configured",
        "partition_notes": list(plan.notes),
        "compression": _compression(plan),
        "process_groups": [{"name": g.name, "ranks": list(g.ranks), "cuda_over": "nccl" if g.nccl else "gloo via the host"}
                           for g in plan.process_groups if not g.world],  # (the whole job: the world, as ever)
        # what the launcher passes down (cluster.*_timeout_s, or their SHOAL_* overrides): seconds
        "timeouts": {name: getattr(plan, name) for name in TIMEOUT_OVERRIDES},
        "params": {name: list(shape) for name, shape in plan.params.items()},
        "param_elements": sum(_numel(shape) for shape in plan.params.values()),
    }


def _compression(plan: JobPlan) -> dict:
    """cluster.compression as it runs: encoded only over processes, and then not bit-exact with one worker."""
    c = plan.cluster
    setting = f"top-{c.topk_fraction:g}" if c.compression == job_pb2.kTopK else job_pb2.Compression.Name(c.compression)[1:]
    applied = c.compression != job_pb2.kNone and not plan.in_one_process
    return {"setting": setting, "applied": applied, "bit_exact_with_one_worker": plan.strategy.synchronous and not applied}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def render(plan: JobPlan) -> str:
    """The plan as `shoal plan` prints it."""
    d = describe(plan)
    # a user's loop's module is built by the script after shoal.session(): its params are not the plan's to count
    unknown = plan.own_loop and not plan.params
    elements = "your module's params" if unknown else f"{d['param_elements']:,} param elements"
    lines = [f"job {plan.job.name!r}: {d['label']}, {d['nprocs']} process(es), {elements} in {d['nslices']} slice(s)"]
    computes = "your module" if unknown else "the module"  # (a loop's module is one piece, not SINGA's layers)
    auto = " (at start; measured at run time)" if d["batch_shares"] == "measured at run time" else ""
    for proc in d["processes"]:
        lines.append(f"process {proc['rank']}")
        for w in proc["workers"]:
            share = "" if w["batch_share"] is None else f"batch share {w['batch_share']}{auto}, "
            lines.append(
                f"  worker (group {w['group']}, id {w['id']}) on {w['device']}, {share}{w['threads']} thread(s), "
                f"server group {w['server_group']}: {', '.join(w['layers']) or computes}"
            )
        for s in proc["servers"]:
            if unknown:
                lines.append(f"  server (group {s['group']}, id {s['id']}): its slice of your module's params")
                continue
            owned = ", ".join(f"{x['param']}[{x['start']}:{x['stop']}]" for x in s["slices"]) or "nothing"
            total = sum(x["stop"] - x["start"] for x in s["slices"])
            lines.append(f"  server (group {s['group']}, id {s['id']}): {total:,} elements: {owned}")
    for g in d["process_groups"]:  # what the exchanges' collectives run over
        lines.append(f"process group {g['name']}: ranks {', '.join(map(str, g['ranks']))} (CUDA tensors: {g['cuda_over']})")
    lines.append("timeouts: " + ", ".join(f"cluster.{name} {seconds:g} s" for name, seconds in d["timeouts"].items()))
    lines += [f"note: {note}" for note in d["partition_notes"]]
    return "\n".join(lines)
