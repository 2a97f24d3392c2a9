"""The same job otherwise: under each framework layout, with another partitioning, on more hosts. Pure.

Every alternative is a real JobPlan (`plan_job` on a copy of the job with its cluster or
partition_dim fields changed), estimated by shoal.planning.estimate; a layout the runtime would
refuse is listed with the runtime's one-line reason. `calibrated(kernels)` gives the calibration
holding those kernels (the caller measures them: planning itself never does).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

from shoal.config import job_pb2
from shoal.errors import ShoalError
from shoal.planning.costs import Calibration, Kernel
from shoal.planning.estimate import Estimate, Hosts, estimate, plan_kernels
from shoal.planning.partition import PartitionError
from shoal.planning.plan import JobPlan, plan_job

Calibrated = Callable[[list[Kernel]], Calibration]
LAYOUT_FIELDS = ("nworker_groups", "nserver_groups", "nworkers_per_group", "nservers_per_group", "nworkers_per_procs",
                 "nservers_per_procs", "server_worker_separate", "share_memory", "max_staleness", "warmup_steps",
                 "max_update_lag", "overlap_push", "auto_batch_shares", "threads_per_worker")


@dataclass(frozen=True)
class Layout:
    name: str
    cluster: dict  # ClusterProto fields
    about: str


def layouts(p: int) -> list[Layout]:
    """SINGA's frameworks for p workers (benchmarks/frameworks.py runs the same seven for p = 2)."""
    return [
        Layout("single worker", {}, "one worker, every core"),
        Layout("in-memory Sandblaster", {"nworkers_per_group": p, "nworkers_per_procs": p}, f"one group of {p} workers as threads of one process"),
        Layout("AllReduce", {"nworkers_per_group": p, "nservers_per_group": p}, f"{p} processes, each a worker and the server of 1/{p} of the params"),
        Layout("Sandblaster", {"nworkers_per_group": p, "nservers_per_group": p, "server_worker_separate": True}, f"{p} worker processes + {p} server processes"),
        Layout("Downpour", {"nworker_groups": p, "server_worker_separate": True}, f"{p} async groups of 1 worker + 1 server process"),
        Layout("Distributed Hogwild", {"nworker_groups": p, "nserver_groups": p}, f"{p} async groups, each with its own server; servers sync"),
        Layout("in-memory Hogwild", {"nworker_groups": p, "nworkers_per_procs": p}, f"{p} async groups as threads sharing one param copy"),
    ]


def with_cluster(job: job_pb2.JobProto, fields: dict) -> job_pb2.JobProto:
    """A copy of the job whose layout is `fields` (the other layout fields at their defaults)."""
    out = job_pb2.JobProto()
    out.CopyFrom(job)
    for name in LAYOUT_FIELDS:
        out.cluster.ClearField(name)
    for name, value in fields.items():
        setattr(out.cluster, name, value)
    return out


@dataclass
class Compared:
    layout: Layout
    estimate: Optional[Estimate]
    refused: str = ""


def compare(job: job_pb2.JobProto, calibrated: Calibrated, workers: int, cores: Optional[int] = None) -> list[Compared]:
    """Each framework layout for `workers` workers, ranked by predicted samples/s (refused ones last)."""
    plans: list[tuple[Layout, Optional[JobPlan], str]] = []
    for layout in layouts(workers):
        try:
            plans.append((layout, plan_job(with_cluster(job, layout.cluster), cores=cores), ""))
        except ShoalError as err:
            plans.append((layout, None, str(err).splitlines()[0]))
    calib = calibrated([k for _, plan, _ in plans if plan for k in plan_kernels(plan)])
    rows = [Compared(layout, estimate(plan, calib) if plan else None, why) for layout, plan, why in plans]
    return sorted(rows, key=lambda r: -(r.estimate.samples_per_s if r.estimate else -1))


# -- partition_dim per layer -------------------------------------------------------------------
@dataclass
class Suggestion:
    dims: dict[str, int]  # user layer -> partition_dim to set (1: features; 0: batch)
    best: Estimate
    batch_split: Estimate
    bytes_best: int  # bytes between the group's workers per step
    bytes_batch: int
    tried: int


def blocks(plan: JobPlan) -> list[list[str]]:
    """Layers that are cut together: a one-to-all layer and the feature-local layers after it."""
    out: list[list[str]] = []
    seen = set()
    for node in plan.partition.nodes:
        if node.inserted or node.origin in seen:
            continue
        seen.add(node.origin)
        layer = node.layer
        if layer.one_to_all and layer.narrowed(1) is not None:
            out.append([node.origin])
        elif out and layer.feature_local and not layer.draws_random and layer.category not in ("input", "loss", "output"):
            out[-1].append(node.origin)
        elif out and out[-1] != []:
            out.append([])  # a layer that cannot split its features ends the block
    return [b for b in out if b]


def with_dims(job: job_pb2.JobProto, dims: dict[str, int]) -> job_pb2.JobProto:
    out = job_pb2.JobProto()
    out.CopyFrom(job)
    for layer in out.neuralnet.layer:
        if layer.name in dims:
            layer.partition_dim = dims[layer.name]
    return out


def group_bytes(e: Estimate) -> int:
    return sum(p.sent for p in e.processes) if e.nprocs > 1 else sum(v[0] for p in e.processes for v in p.links.values())


def suggest(job: job_pb2.JobProto, calibrated: Calibrated, workers: int, cores: Optional[int] = None) -> Suggestion:
    """partition_dim per layer for a group of `workers` that minimises the predicted step time.

    Greedy from the batch split: flip the block (a one-to-all layer and the feature-local layers
    following it) whose flip shortens the step most, until no flip does.
    """
    cluster = {f: getattr(job.cluster, f) for f in LAYOUT_FIELDS if job.cluster.HasField(f)}
    if job.cluster.nworkers_per_group < 2:
        cluster = {"nworkers_per_group": workers, "nworkers_per_procs": workers}
    base_job = with_cluster(job, cluster)
    base_plan = plan_job(base_job, cores=cores)
    groups = blocks(base_plan)
    cache: dict[tuple, Optional[Estimate]] = {}

    def score(choice: tuple[int, ...]) -> Optional[Estimate]:
        if choice not in cache:
            dims = {name: d for block, d in zip(groups, choice) for name in block}
            try:
                plan = plan_job(with_dims(base_job, dims), cores=cores)
            except (PartitionError, ShoalError):
                cache[choice] = None
                return None
            cache[choice] = estimate(plan, calibrated(plan_kernels(plan)))
        return cache[choice]

    current = tuple(0 for _ in groups)
    batch = score(current)
    best = batch
    while True:
        flips = [tuple(1 - d if i == k else d for i, d in enumerate(current)) for k in range(len(groups))]
        scored = [(c, score(c)) for c in flips]
        better = [(c, e) for c, e in scored if e is not None and e.step_s < best.step_s * (1 - 1e-6)]
        if not better:
            break
        current, best = min(better, key=lambda ce: ce[1].step_s)
    dims = {name: d for block, d in zip(groups, current) for name in block}
    return Suggestion(dims, best, batch, group_bytes(best), group_bytes(batch), len(cache))


# -- past this machine -------------------------------------------------------------------------
SCALING = {
    "AllReduce": lambda w, n: {"nworkers_per_group": w, "nservers_per_group": w},
    "Sandblaster": lambda w, n: {"nworkers_per_group": w, "nservers_per_group": n, "server_worker_separate": True},
    "Downpour": lambda w, n: {"nworker_groups": w, "server_worker_separate": True},
    "Distributed Hogwild": lambda w, n: {"nworker_groups": w, "nserver_groups": w},
}


@dataclass
class ScalingPoint:
    framework: str
    hosts: int
    samples_per_s: float
    bottleneck: str
    refused: str = ""


def scaling(job: job_pb2.JobProto, calib: Calibration, hosts: Hosts, gpu: Optional[dict[str, float]] = None) -> list[ScalingPoint]:
    """Each framework's predicted samples/s on 1..hosts.count hosts: one worker per host (all its cores), or per GPU."""
    per_host = max(1, hosts.gpus)
    if hosts.gpus:
        calib = replace(calib, devices={**calib.devices, "cuda:0": gpu or calib.devices.get("cuda:0") or {"gflops": 10000.0, "mem_gbps": 1000.0}})
    points = []
    for n in range(1, hosts.count + 1):
        for name, cluster in SCALING.items():
            fields = cluster(n * per_host, n)
            variant = with_cluster(job, fields | {"nworkers_per_procs": 1})
            if hosts.gpus:
                del variant.device[:]
                variant.device.append("cuda:0")
            try:
                plan = plan_job(variant, cores=hosts.cores or calib.cores, nnodes=n)
            except ShoalError as err:
                points.append(ScalingPoint(name, n, 0.0, "", str(err).splitlines()[0]))
                continue
            e = estimate(plan, calib, replace(hosts, count=n))
            points.append(ScalingPoint(name, n, e.samples_per_s, e.bottleneck))
    return points


def stops_scaling(points: list[ScalingPoint], gain: float = 1.05) -> dict[str, tuple[int, str, bool]]:
    """Per framework: (hosts, bottleneck, stopped): the host count after which one more host adds less than
    5 % and that point's bottleneck (stopped), or the last host count and its bottleneck (still scaling)."""
    out = {}
    for name in dict.fromkeys(p.framework for p in points):
        mine = [p for p in points if p.framework == name and not p.refused]
        if not mine:
            continue
        out[name] = (mine[-1].hosts, mine[-1].bottleneck, False)
        for a, b in zip(mine, mine[1:]):
            if b.samples_per_s < a.samples_per_s * gain:
                out[name] = (a.hosts, b.bottleneck, True)  # what holds the next host back
                break
    return out
