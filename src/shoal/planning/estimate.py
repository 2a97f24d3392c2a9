"""`shoal plan --estimate`: a layout's step time, samples/s, bytes and memory, predicted from its JobPlan. Pure.

The model (docs/planning.md has the page): a group's step is the slowest worker's forward and
backward (shoal.planning.costs, on the calibrated machine, the host's memory bandwidth shared by
the workers computing at once), then the exchange (the exact bytes the framework's exchange
moves, at the link's calibrated bandwidth, plus a fixed cost for each collective and message the
framework counts (planning/framework_costs/): the calibrated cost of one small collective, and the link's latency per hop between
hosts), then the update (the
updater's memory traffic over the elements each server owns). Nothing overlaps: backward and
the exchange compete for the same cores on a CPU host. Asynchronous groups run side by side; the
layout's throughput is the groups' together, capped by what they share (the server, the host's
cores, a link), and the bottleneck is the bound that decides.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from shoal.config import job_pb2
from shoal.errors import ShoalError
from shoal.neuralnet.updaters import make_updater
from shoal.planning.costs import (FLOAT, Calibration, Kernel, LayerCost, compute_seconds, in_net_factor, kernels_of, learning_nodes,
                                  module_kernels, net_concurrency, net_kernel, node_rows, numel, worker_costs)
from shoal.planning.partition import PartitionPlan
from shoal.planning.module_costs import describe_basis, module_costs_of
from shoal.planning.nodes import node_of_rank
from shoal.planning.plan import JobPlan, busiest_node_workers
from shoal.planning.framework_costs import Messages, costs_of


@dataclass
class WorkerEstimate:
    group: int
    id: int
    rank: int
    device: str
    threads: int
    rows: int
    fwd_flops: int
    bwd_flops: int
    fwd_s: float
    bwd_s: float
    layers: list[dict]  # per node: name, rows, fwd/bwd FLOPs


@dataclass
class ProcessEstimate:
    rank: int
    host: int
    sent: int  # bytes per step of its group (per sync_freq steps averaged, Distributed Hogwild)
    received: int
    links: dict[int, list[int]]  # peer rank -> [bytes sent to it, bytes received from it] per step
    params: int  # bytes of param values it holds
    gradients: int
    updater_state: int
    activations: int

    @property
    def memory(self) -> int:
        return self.params + self.gradients + self.updater_state + self.activations


@dataclass
class Estimate:
    label: str
    framework: str
    nprocs: int
    nworkers: int
    ngroups: int
    global_batch: int
    step_s: float  # one step of one group
    samples_per_s: float  # all groups together
    bottleneck: str
    phases: dict[str, float]  # seconds per group step: compute, reduce, exchange, update
    workers: list[WorkerEstimate]
    processes: list[ProcessEstimate]
    staleness: str = ""
    notes: list[str] = field(default_factory=list)
    # the fixed costs counted per group step, one entry per term (in the exchange phase): what, count, each_s, seconds
    fixed_costs: list[dict] = field(default_factory=list)
    # measured terms of the step outside the fixed costs, one entry per term: kind, what, seconds (in-net: its factor,
    # rows and the kernels' seconds alone; copies: in the update phase)
    step_terms: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        out = asdict(self)
        for p, proc in zip(out["processes"], self.processes):
            p["memory"] = proc.memory
        return out


@dataclass(frozen=True)
class Hosts:
    """Where a plan's processes run: `count` hosts of `cores` cores, joined by a link of `link_gbps` (each way)."""

    count: int = 1
    cores: int = 0  # 0: the calibrated host's
    gpus: int = 0
    link_gbps: float = 0.0  # 0: the calibrated loopback
    latency_s: float = 0.0
    # GB/s each way while both directions carry data at once, where that is less (a shaper's ACKs queue behind the other
    # direction's data); 0: link_gbps
    duplex_gbps: float = 0.0


class HostsFileError(ShoalError, ValueError):
    """A cluster description file that cannot be read; the message names the file and the field."""


HOSTS_FIELDS = {"hosts": int, "cores": int, "gpus": int, "bandwidth": float, "latency": float}


def hosts_from_file(path: Path) -> Hosts:
    """Hosts from a small YAML/JSON file: hosts, cores, gpus, bandwidth (Gbit/s each way), latency (µs)."""
    import yaml

    from shoal.config.limits import load_yaml

    try:
        _, data = load_yaml(path.read_text())  # bounded: no alias bombs, no unbounded nesting
    except OSError as err:
        raise HostsFileError(f"{path}: cannot read ({err.strerror})") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        raise HostsFileError(f"{path}{where}: not YAML or JSON ({getattr(err, 'problem', None) or err})") from None
    if not isinstance(data, dict):
        raise HostsFileError(f"{path}: expected a mapping of {', '.join(HOSTS_FIELDS)}")
    values = {}
    for key, value in data.items():
        if key not in HOSTS_FIELDS:
            raise HostsFileError(f"{path}: {key}: unknown field (known: {', '.join(HOSTS_FIELDS)})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (key == "hosts" and value < 1):
            raise HostsFileError(f"{path}: {key}: {value!r} is not a {'positive' if key == 'hosts' else 'non-negative'} number")
        values[key] = HOSTS_FIELDS[key](value)
    if "hosts" not in values:
        raise HostsFileError(f"{path}: hosts: missing (how many hosts to predict for)")
    return Hosts(values["hosts"], values.get("cores", 0), values.get("gpus", 0), values.get("bandwidth", 0.0) / 8,
                 values.get("latency", 0.0) / 1e6)


def updater_slots(job: job_pb2.JobProto, params: Optional[dict[str, tuple[int, ...]]] = None) -> int:
    """Element-wise state tensors per param (SINGA's slots; a torch optimizer's state shaped as its param: AdamW 2,
    SGD with momentum 1), the most any param of `params` has."""
    return _updater_state(job, params)[0]


def updater_name(job: job_pb2.JobProto) -> str:
    """The updater as a user named it: a torch optimizer's class (shoal.fit's optimizer=), else SINGA's type."""
    return _updater_state(job, None)[1]


_UPDATER_STATES: dict = {}  # a torch optimizer's state is found by stepping a scratch copy: once per updater and params


def _updater_state(job: job_pb2.JobProto, params: Optional[dict[str, tuple[int, ...]]]) -> tuple[int, str]:
    try:
        updater = make_updater(job.updater)
    except Exception:  # a user updater this process cannot build: assume one slot (momentum)
        return 1, job.updater.user_type or job_pb2.UpdaterType.Name(job.updater.type)
    shapes = tuple((name, tuple(shape)) for name, shape in (params or {}).items())
    key = (type(updater), job.updater.SerializeToString(deterministic=True), shapes)
    if key not in _UPDATER_STATES:
        try:
            slots = max((sum(1 for s in updater.state_shapes(name, shape).values() if tuple(s) == shape) for name, shape in shapes),
                        default=0) if shapes else len(updater.slots)
            optimizer = updater.made_optimizer()
        except Exception:
            slots, optimizer = 1, None
        name = type(optimizer).__name__ if optimizer is not None else (job.updater.user_type or job_pb2.UpdaterType.Name(job.updater.type))
        if len(_UPDATER_STATES) > 64:
            _UPDATER_STATES.clear()
        _UPDATER_STATES[key] = (slots, name)
    return _UPDATER_STATES[key]


def trainable(parts: PartitionPlan) -> set[str]:
    names = set()
    for n in parts.nodes:
        flags = n.layer.param_trainable()
        names.update(v.name for v, t in zip(n.params, flags) if t)
    return names


def host_of(plan: JobPlan, hosts: Hosts) -> list[int]:
    """Each rank's host, as `shoal run --nnodes` places them (planning/nodes.py)."""
    return node_of_rank(plan.nprocs, hosts.count)


def estimate(plan: JobPlan, calib: Calibration, hosts: Optional[Hosts] = None) -> Estimate:
    """The predicted step time, samples/s, bytes and memory of `plan` on `hosts` (default: the calibrated one)."""
    hosts = hosts or Hosts()
    return _Model(plan, calib, hosts).run()


def plan_kernels(plan: JobPlan, cores: Optional[int] = None) -> list:
    """The dense kernels the plan's workers run, and its updater's pass: what the calibration measures for this job
    on a host of `cores` (default: this one's, as plan_job's)."""
    shares = plan.batch_shares[0] if plan.batch_shares else [1]
    module = module_costs_of(plan.partition)
    threads = plan.threads_per_worker
    at_once = net_concurrency(busiest_node_workers(plan.placement, plan.nnodes), threads, cores or os.cpu_count() or 1)
    nets = {net_kernel(plan.partition, plan.job.neuralnet, rows, threads, concurrent=at_once) for rows in set(shares)}
    return (kernels_of(worker_costs(plan.partition, shares, plan.threads_per_worker)) + [update_kernel(plan, plan.threads_per_worker)]
            + (module_kernels(module, plan.threads_per_worker) if module else []) + [k for k in nets if k is not None])


UPDATE_TIMED_ELEMENTS = 32_000_000  # a larger model's updater is timed on its first params up to this many elements


def update_kernel(plan: JobPlan, threads: int) -> Kernel:
    """The job's updater applied once to its trained params (those up to UPDATE_TIMED_ELEMENTS), at `threads`:
    SINGA's updaters and torch optimizers make several passes over memory, which the calibration times."""
    names, timed, total = trainable(plan.partition), [], 0
    for name, shape in plan.params.items():
        if name in names and total + math.prod(shape) <= UPDATE_TIMED_ELEMENTS:
            timed.append((name, tuple(shape)))
            total += math.prod(shape)
    return Kernel("update", (total,), max(1, threads), "cpu", plan.job.updater.SerializeToString(deterministic=True), tuple(timed))


class _Model:
    def __init__(self, plan: JobPlan, calib: Calibration, hosts: Hosts):
        self.plan, self.calib, self.hosts = plan, calib, hosts
        self.cores = hosts.cores or calib.cores
        self.where = host_of(plan, hosts)
        self.link_bw = (hosts.link_gbps or calib.link_gbps) * 1e9
        self.duplex_bw = hosts.duplex_gbps * 1e9 if hosts.duplex_gbps and hosts.link_gbps else self.link_bw
        self.latency = hosts.latency_s or calib.link_latency_s
        self.slots = updater_slots(plan.job, plan.params)
        self.trainable = trainable(plan.partition)
        self.sizes = {name: math.prod(shape) for name, shape in plan.params.items()}
        self.elements = sum(s for n, s in self.sizes.items() if n in self.trainable)
        module = module_costs_of(plan.partition)  # an opaque module's measured costs name the estimate's basis
        self.notes: list[str] = [describe_basis(module, self.slots, updater_name(plan.job))] if module else []
        timed = [(k.dims[0], calib.kernels.get(k.key)) for k in module_kernels(module, plan.threads_per_worker)] if module else []
        if timed and all(t is not None for _, t in timed):
            self.notes.append("module time read from the calibration's forward + backward on real batches at "
                              f"{plan.threads_per_worker} thread(s): " + ", ".join(f"{1e3 * t:.1f} ms for {r} sample(s)" for r, t in timed)
                              + " (a fixed cost per call, a cost per sample), not from its FLOPs")

    # -- pieces ---------------------------------------------------------------------------
    def workers_on_host(self, host: int) -> int:
        return sum(len(p.workers) for p in self.plan.placement.processes if self.where[p.rank] == host)

    def update_s(self, elements: int, threads: int, concurrent: int = 1) -> float:
        """The updater's pass: reads value, gradient and slots, writes value and slots (float32) at this worker's share
        of the bandwidth; never less than the calibrated updater took per element (its real passes, alone)."""
        bw = min(self.calib.bandwidth(threads), self.calib.host_bandwidth / max(1, concurrent))
        streamed = FLOAT * elements * (3 + 2 * self.slots) / bw
        timed = update_kernel(self.plan, threads)
        measured = self.calib.kernels.get(timed.key)
        return max(streamed, measured * elements / timed.dims[0]) if measured and timed.dims[0] else streamed

    def exchange_s(self, links: dict[int, dict[int, list[int]]]) -> float:
        """The longest process's bytes of a step at the bandwidth: loopback between its host's processes, the
        host's link to other hosts (shared by the processes on it). Latency is per message: fixed_costs()."""
        return max(self.loopback_s(links), self.between_hosts_s(links))

    def loopback_s(self, links: dict[int, dict[int, list[int]]]) -> float:
        """The busiest process's bytes to and from its own host's processes at the loopback's bandwidth (copies by the
        cores, whichever the direction: the larger of what it sends and what it receives)."""
        loop = 0.0
        for rank, peers in links.items():
            local = [v for q, v in peers.items() if self.where[q] == self.where[rank]]
            if local:
                loop = max(loop, max(sum(v[0] for v in local), sum(v[1] for v in local)) / (self.calib.link_gbps * 1e9))
        return loop

    def between_hosts_s(self, links: dict[int, dict[int, list[int]]]) -> float:
        """The busiest host's link: what its processes send to and receive from other hosts, both directions at once
        (the link's bandwidth is each way): the bytes both directions carry together at the duplex bandwidth, the
        larger direction's rest at the link's."""
        nic: dict[int, list[int]] = {}
        for rank, peers in links.items():
            far = [v for q, v in peers.items() if self.where[q] != self.where[rank]]
            if far:
                host = nic.setdefault(self.where[rank], [0, 0])
                host[0] += sum(v[0] for v in far)
                host[1] += sum(v[1] for v in far)
        return max((min(v) / self.duplex_bw + (max(v) - min(v)) / self.link_bw for v in nic.values()), default=0.0)

    def links_of(self, moves) -> dict[int, dict[int, list[int]]]:
        """rank -> peer -> [sent, received] of the bytes `moves(move)` moves."""
        links: dict[int, dict[int, list[int]]] = {p.rank: {} for p in self.plan.placement.processes}

        def move(src: int, dst: int, nbytes: float) -> None:
            links[src].setdefault(dst, [0, 0])[0] += int(nbytes)
            links[dst].setdefault(src, [0, 0])[1] += int(nbytes)

        moves(move)
        return links

    def request_s(self, links: dict[int, dict[int, list[int]]], rank: int) -> float:
        """A request/response exchange of process `rank`: what it sends, then (after the peer's answer) what it
        receives, one after the other, each at its link's bandwidth (loopback on its host, the link between hosts)."""
        total = 0.0
        for peer, (sent, received) in links[rank].items():
            bw = self.calib.link_gbps * 1e9 if self.where[peer] == self.where[rank] else self.link_bw
            total += (sent + received) / bw
        return total

    def message_s(self, term: Messages) -> float:
        """One of `term`'s calls: a collective's calibrated fixed cost per hop (a ping-pong's one way for a message),
        plus the link's one-way latency per hop where its processes are on different hosts."""
        each = self.calib.collective_cost_s if term.kind == "collective" else self.calib.link_latency_s
        remote = len({self.where[r] for r in term.ranks}) > 1
        return term.hops * (each + (self.latency if remote else 0.0))

    def fixed_costs(self) -> list[dict]:
        """The framework's collectives and messages of one group step, each term with its count and cost."""
        return [{"what": t.what, "kind": t.kind, "count": t.count, "ranks": len(t.ranks), "each_s": self.message_s(t),
                 "seconds": t.count * self.message_s(t)} for t in costs_of(self.plan).messages(self) if t.count > 0]

    def workers(self) -> tuple[list[WorkerEstimate], dict[int, float]]:
        """Every worker's compute, and each group's (its slowest worker's) forward + backward seconds."""
        plan, shares = self.plan, self.plan.batch_shares[0] if self.plan.batch_shares else [1]
        threads = plan.threads_per_worker
        by_device: dict[str, dict[int, list[LayerCost]]] = {}
        out, group_s = [], {}
        self.in_net: dict[int, tuple[float, float, int, int]] = {}  # rows -> (net timed, its kernels, threads, nets at once)
        for proc, devices in zip(plan.placement.processes, plan.devices):
            host = self.where[proc.rank]
            busy = self.workers_on_host(host)
            oversubscribed = max(1.0, busy * threads / self.cores)
            for w, device in zip(proc.workers, devices):
                kind = _device(device)
                if kind not in by_device:
                    by_device[kind] = worker_costs(plan.partition, shares, threads, kind)
                mine = by_device[kind][w.id]
                fwd, bwd, _ = compute_seconds(mine, self.calib, threads, concurrent=busy, device=kind)
                rows = shares[w.id] if w.id < len(shares) else 0
                at_once = net_concurrency(busy, threads, self.cores)
                measured = in_net_factor(mine, self.calib, net_kernel(plan.partition, plan.job.neuralnet, rows, threads, kind, at_once))
                if measured:  # the net as it runs (kernels together, cold caches, dispatch) over its kernels alone; never
                    # under 1, as the bytes floor a kernel: a net timed under its kernels' sum says they were timed slow
                    self.in_net[rows] = (*measured, threads, at_once)
                    factor = max(1.0, measured[0] / measured[1])
                    fwd, bwd = fwd * factor, bwd * factor
                fwd, bwd = fwd * oversubscribed, bwd * oversubscribed
                out.append(WorkerEstimate(
                    w.group, w.id, proc.rank, device, threads, shares[w.id] if w.id < len(shares) else 0,
                    sum(c.fwd_flops for c in mine), sum(c.bwd_flops for c in mine), fwd, bwd,
                    [{"node": c.node, "layer": c.layer, "rows": c.rows, "fwd_flops": c.fwd_flops, "bwd_flops": c.bwd_flops} for c in mine],
                ))
                group_s[w.group] = max(group_s.get(w.group, 0.0), fwd + bwd)
        return out, group_s

    def memory(self, rank: int) -> tuple[int, int, int, int]:
        """(params, gradients, updater state, activations) bytes of one process."""
        plan, proc = self.plan, self.plan.process(rank)
        shares = plan.batch_shares[0] if plan.batch_shares else [1]
        devices = set(plan.devices[rank]) or {"cpu"}
        all_params = FLOAT * sum(self.sizes.values())
        params = all_params * len(devices) if proc.workers else 0
        served = sum(s.size for srv in proc.servers for s in plan.placement.slices_of(srv) if s.param in self.trainable)
        served = costs_of(plan).served_elements(self, rank, served)
        if not proc.workers:
            params = FLOAT * served
        costs = worker_costs(plan.partition, shares, plan.threads_per_worker)
        grads = FLOAT * sum(self._computed_elements(w.id) for w in proc.workers)
        acts = sum(c.activation_bytes for w in proc.workers for c in costs[w.id])
        params += costs_of(plan).extra_param_bytes(self)
        return params, grads, FLOAT * self.slots * served, acts

    def _computed_elements(self, worker: int) -> int:
        total = 0
        for view in {v for n in self.plan.partition.worker_nodes(worker) for v in n.params}:
            whole = self.sizes[view.name]
            total += whole if view.axis < 0 else whole // self.plan.params[view.name][view.axis] * view.size
        return total

    # -- bytes per step: the framework's messages -----------------------------------------------------
    def encoded(self, elements: int) -> int:
        return encoded_bytes(self.plan.cluster, elements)

    def trainable_slices(self) -> list:
        return [s for s in self.plan.placement.slices if s.param in self.trainable]

    def traffic(self) -> dict[int, dict[int, list[int]]]:
        """rank -> peer -> [sent, received] bytes per group step (a synchronous group's, or one async group's)."""
        return self.links_of(lambda move: costs_of(self.plan).traffic(self, move))

    def in_memory_bytes(self) -> int:
        """A group in one process: bridged blobs between its workers, plus the replicated gradients other workers
        hand to worker 0's server and the values they get back (runtime/partitioned.py counts the same)."""
        parts = self.plan.partition
        if parts.nworkers < 2:
            return 0
        shares = self.plan.batch_shares[0] if self.plan.batch_shares else [1]
        learns = learning_nodes(parts)
        total = 0
        if parts.partitioned:
            for n in parts.nodes:
                if n.layer.conf.type == job_pb2.kBridgeDst:
                    total += node_rows(n, shares) * numel(n.shape) * FLOAT * (2 if learns[n.peer] else 1)
        owned = parts.updated_where_computed()
        for k in range(1, parts.nworkers):
            views = {v for n in parts.worker_nodes(k) for v in n.params if v not in owned}
            for v in views:
                whole = self.sizes[v.name]
                total += 2 * FLOAT * (whole if v.axis < 0 else whole // self.plan.params[v.name][v.axis] * v.size)
        return total

    # -- the step -------------------------------------------------------------------------------
    def run(self) -> Estimate:
        plan, c = self.plan, self.plan.cluster
        workers, group_s = self.workers()
        compute = max(group_s.values(), default=0.0)
        slowest = max(workers, key=lambda w: w.fwd_s + w.bwd_s)
        threads = plan.threads_per_worker
        links = self.traffic()
        exchange = self.exchange_s(links)
        ngroups = c.nworker_groups
        batch = plan.global_batch
        terms = costs_of(plan).phases(self, compute, links)
        reduce, update, staleness = terms.reduce, terms.update, terms.staleness
        fixed = self.fixed_costs()
        exchange = (exchange if terms.exchange is None else terms.exchange) + sum(f["seconds"] for f in fixed)
        bounds: dict[str, float] = dict(terms.bounds or {})
        step = compute + reduce + exchange + update
        samples = ngroups * batch / step if step > 0 else 0.0
        why = {
            "compute": f"compute (the slowest worker: group {slowest.group}, worker {slowest.id})" if len(workers) > 1 else "compute",
            "reduce": "summing the workers' gradients in memory",
            "exchange": "the network (gradients and values between processes)",
            "update": "the updater's memory traffic",
        }
        phases = {"compute": compute, "reduce": reduce, "exchange": exchange, "update": update}
        bottleneck = why[max(phases, key=phases.get)]
        if ngroups > 1:
            # groups run side by side; what they share caps them
            core_s = ngroups * (compute * threads + update * threads + exchange + reduce)
            hosts_used = len(set(self.where))
            bounds["the host's cores"] = ngroups * batch * self.cores * hosts_used / max(core_s, 1e-12)
            for name, limit in bounds.items():
                if limit < samples:
                    samples, bottleneck = limit, name
        procs = []
        for p in plan.placement.processes:
            peers = links[p.rank]
            params, grads, state, acts = self.memory(p.rank)
            procs.append(ProcessEstimate(p.rank, self.where[p.rank], sum(v[0] for v in peers.values()), sum(v[1] for v in peers.values()),
                                         {q: v for q, v in sorted(peers.items())}, params, grads, state, acts))
        if plan.in_one_process and plan.nworkers > 1:
            procs[0].links = {0: [self.in_memory_bytes(), self.in_memory_bytes()]}
        return Estimate(plan.label, plan.framework.value, plan.nprocs, plan.nworkers, ngroups, batch, step, samples, bottleneck,
                        phases, workers, procs, staleness, self.notes, fixed, self.compute_terms() + list(terms.terms))

    def copy_s(self, nbytes: float, concurrent: int = 1) -> float:
        """Copies on the host (an exchange's buffers: gathers, scatters, fresh zeroed tensors), one thread, counted as bytes
        read + written at the calibrated copy bandwidth, shared by the `concurrent` processes streaming at once."""
        return nbytes / min(self.calib.bandwidth(1), self.calib.host_bandwidth / max(1, concurrent))

    def compute_terms(self) -> list[dict]:
        """The measured terms of the compute phase, one per term and batch size (its factor on the kernels' sum)."""
        return [{"what": f"the net as it runs: forward + backward timed on {rows} random rows at {threads} thread(s)"
                         + (f" with {at_once} copies computing at once" if at_once > 1 else "")
                         + ", over its kernels timed alone (cold caches, allocation, dispatch)",
                 "kind": "in-net", "rows": rows, "factor": max(1.0, timed / alone), "alone_s": alone, "seconds": max(0.0, timed - alone)}
                for rows, (timed, alone, threads, at_once) in sorted(self.in_net.items())]

    def view_numel(self, view) -> int:
        whole = self.sizes[view.name]
        return whole if view.axis < 0 else whole // self.plan.params[view.name][view.axis] * view.size


def _device(name: str) -> str:
    return "cuda:0" if name == "cuda" else name.split(":")[0] if name.startswith("cpu") else name


def encoded_bytes(cluster: job_pb2.ClusterProto, elements: int) -> int:
    """One message of `elements` float32 values as cluster.compression sends it (runtime/exchanges/compression.py):
    4 bytes an element, 2 cast to bf16/fp16, top-k its k = ceil(fraction · n) entries at 6 bytes (int32 + bf16)."""
    if cluster.compression == job_pb2.kTopK:
        return 6 * (min(elements, max(1, math.ceil(cluster.topk_fraction * elements))) if elements else 0)
    if cluster.compression in (job_pb2.kBF16, job_pb2.kFP16):
        return 2 * elements
    return FLOAT * elements
