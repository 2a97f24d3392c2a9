"""What one training step of a worker costs, layer by layer, from the partitioned net's shapes. Pure.

For every node a worker computes (shoal.planning.partition), the kernels it runs: a matrix
product per inner product (forward y = x·Wᵀ; backward dW = dyᵀ·x, and dx = dy·W when the input
carries a gradient), a convolution per conv layer, and for every other layer the bytes it streams
through memory (elementwise, pooling, losses, connection layers). FLOPs count a multiply-add as 2
and a bias add as 1 per output; bytes are float32.

`Calibration` is what the machine measured (shoal.runtime.calibrate writes it; here it is plain
data): a kernel's time is the measured one when the calibration holds that kernel at that thread
count, else its FLOPs at the measured GEMM rate. Memory traffic is timed at the measured
bandwidth shared by the workers running at once.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

from shoal.config import job_pb2
from shoal.planning.module_costs import ModuleCosts
from shoal.planning.partition import BATCH, PartitionPlan, PartNode

FLOAT = 4  # bytes of a float32
GEMM_TYPES = {job_pb2.kInnerProduct}
CONV_TYPES = {job_pb2.kConvolution, job_pb2.kCConvolution, job_pb2.kCudnnConv}


@dataclass(frozen=True)
class Kernel:
    """One dense kernel: a matrix product (m×k)·(k×n), or a 2-D convolution (its fwd or its bwd); or the job's
    updater applied once to every trained param ("update": its time per element is what the model charges)."""

    op: str  # "mm" | "conv" | "conv_bwd" (weight gradient, plus input gradient when dims[-1] is 1) | "update" | "module" | "layer"
    # | "net" (the whole train net's forward and backward on dims[0] random rows: what its kernels take together)
    dims: tuple[int, ...]  # mm: (m, k, n); conv: (n, c, h, w, f, kh, kw, sh, sw, ph, pw, input_grad); update: (elements,)
    threads: int
    device: str = "cpu"
    # update: the UpdaterProto's bytes and the trained params (name, shape) it is timed on (the key names their digest);
    # layer (an elementwise, pooling or normalising layer, forward and backward): its LayerProto's bytes, its input shapes;
    # module: the module's digest (the key names it), and the probe running one forward and backward on `rows` samples;
    # net: the job's NetProto bytes (the key names their digest)
    spec: bytes = field(default=b"", compare=False, repr=False)
    params: tuple = field(default=(), compare=False, repr=False)
    probe: Optional[Callable[[int], None]] = field(default=None, compare=False, repr=False)

    @property
    def key(self) -> str:
        if self.op == "module":
            return f"module {self.spec.decode()[:12]} r{self.dims[0]} {self.device} t{self.threads}"
        if self.op == "net":  # rows, copies running at once; "mean": its passes averaged (a cache's older fastest-pass
            # timings are not read as these)
            return f"net {hashlib.sha1(self.spec).hexdigest()[:12]} r{self.dims[0]} c{self.dims[1]} {self.device} t{self.threads} mean"
        if self.op == "layer":  # the layer's conf and input shapes, on (rows, input gradient or not)
            digest = hashlib.sha1(self.spec + repr(self.params).encode()).hexdigest()[:12]
            return f"layer {digest} r{self.dims[0]} g{self.dims[1]} {self.device} t{self.threads}"
        if self.op == "update":
            digest = hashlib.sha1(self.spec + repr(self.params).encode()).hexdigest()[:12]
            return f"update {digest} {self.dims[0]} {self.device} t{self.threads}"
        return f"{self.op} {'x'.join(map(str, self.dims))} {self.device} t{self.threads}"

    @property
    def flops(self) -> int:
        if self.op in ("update", "module", "layer", "net"):
            return 0
        if self.op == "mm":
            m, k, n = self.dims
            return 2 * m * k * n
        n, c, h, w, f, kh, kw, sh, sw, ph, pw, input_grad = self.dims
        ho, wo = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
        one = 2 * n * f * ho * wo * c * kh * kw
        return one if self.op == "conv" else one * (1 + input_grad)

    @property
    def bytes(self) -> int:
        """The operands it reads and the result it writes, once each (the floor on its memory traffic)."""
        if self.op == "update":
            return 3 * FLOAT * self.dims[0]  # value and gradient read, value written
        if self.op in ("module", "layer", "net"):
            return 0
        if self.op == "mm":
            m, k, n = self.dims
            return FLOAT * (m * k + k * n + m * n)
        n, c, h, w, f, kh, kw, sh, sw, ph, pw, input_grad = self.dims
        ho, wo = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
        one = FLOAT * (n * c * h * w + f * c * kh * kw + n * f * ho * wo)
        return one if self.op == "conv" else one * (1 + input_grad)


@dataclass(frozen=True)
class Calibration:
    """A machine's measured speeds (runtime/calibrate.py measures and caches them as JSON)."""

    host: str = "unknown"
    cores: int = 1
    gemm_gflops: dict[int, float] = field(default_factory=lambda: {1: 20.0})  # threads -> GFLOP/s, large GEMM
    mem_gbps: dict[int, float] = field(default_factory=lambda: {1: 5.0})  # threads -> GB/s moved (read + write)
    link_gbps: float = 1.0  # GB/s between two processes (loopback) or hosts, each way
    link_latency_s: float = 50e-6  # one small message, one way (a ping-pong's half: mostly gloo's software cost)
    # one small collective between two processes (shoal.comm.collectives: reduce, broadcast, all-reduce of a few bytes,
    # issued and waited): the fixed cost every collective of a step pays whatever its size; 0: not measured (an older cache)
    collective_s: float = 0.0
    kernels: dict[str, float] = field(default_factory=dict)  # Kernel.key -> seconds measured
    devices: dict[str, dict[str, float]] = field(default_factory=dict)  # cuda:N -> {"gflops", "mem_gbps", "h2d_gbps"}
    # the conditions it was taken under (runtime/calibrate.py judges them; docs/planning.md)
    taken_at: str = ""  # ISO 8601 with the UTC offset; "" (an older cache): unknown, so stale
    took_s: float = 0.0
    load: float = 0.0  # the highest 1-minute load average seen before or after measuring
    cpu_share: float = 1.0  # CPU time the timing thread got over the wall time of the timed runs
    spread: float = 0.0  # the slowest repeat of a timing over its fastest, minus 1 (the median over timings)
    contended: bool = False  # the machine's rates were taken while other work competed for the cores
    torch: str = ""  # torch.__version__ that measured
    cpu_model: str = ""
    contended_kernels: tuple[str, ...] = ()  # Kernel.keys whose time was measured under contention

    def to_json(self) -> dict:
        return {
            "host": self.host, "cores": self.cores,
            "gemm_gflops": {str(t): v for t, v in self.gemm_gflops.items()},
            "mem_gbps": {str(t): v for t, v in self.mem_gbps.items()},
            "link_gbps": self.link_gbps, "link_latency_s": self.link_latency_s, "collective_s": self.collective_s,
            "kernels": dict(self.kernels), "devices": dict(self.devices),
            "taken_at": self.taken_at, "took_s": self.took_s, "load": self.load, "cpu_share": self.cpu_share,
            "spread": self.spread, "contended": self.contended, "torch": self.torch, "cpu_model": self.cpu_model,
            "contended_kernels": sorted(self.contended_kernels),
        }

    @classmethod
    def from_json(cls, data: dict) -> "Calibration":
        """Read what a cache file holds, checking every type (the file is input: ValueError names the field)."""
        def number(value, name: str, positive: bool = False) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 or (positive and value == 0):
                raise ValueError(f"{name}: {value!r:.40} is not a {'positive ' if positive else ''}number")
            return float(value)

        def table(value, name: str, key=str, positive: bool = True) -> dict:
            if not isinstance(value, dict):
                raise ValueError(f"{name}: not a table")
            out = {}
            for k, v in value.items():
                try:
                    typed = key(k)
                except (TypeError, ValueError, OverflowError):
                    raise ValueError(f"{name}: the key {k!r:.40} is not a {'whole number' if key is int else 'string'}") from None
                out[typed] = number(v, f"{name}[{k!r:.40}]", positive)
            return out

        def text(value, name: str) -> str:
            if not isinstance(value, str) or len(value) > 200:
                raise ValueError(f"{name}: not a string (of at most 200 characters)")
            return value

        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        missing = [k for k in ("host", "cores", "gemm_gflops", "mem_gbps", "link_gbps", "link_latency_s") if k not in data]
        if missing:
            raise ValueError(f"{missing[0]}: missing")
        cores = data["cores"]
        if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
            raise ValueError(f"cores: {cores!r:.40} is not a number of cores")
        devices = data.get("devices", {})
        if not isinstance(devices, dict):
            raise ValueError("devices: not a table")
        contended_kernels = data.get("contended_kernels", [])
        if not isinstance(contended_kernels, list) or not all(isinstance(k, str) for k in contended_kernels):
            raise ValueError("contended_kernels: not a list of kernel names")
        if not isinstance(data.get("contended", False), bool):
            raise ValueError("contended: not true or false")
        calib = cls(
            host=text(data["host"], "host"), cores=cores,
            gemm_gflops=table(data["gemm_gflops"], "gemm_gflops", int), mem_gbps=table(data["mem_gbps"], "mem_gbps", int),
            link_gbps=number(data["link_gbps"], "link_gbps", True), link_latency_s=number(data["link_latency_s"], "link_latency_s"),
            collective_s=number(data.get("collective_s", 0.0), "collective_s"),
            kernels=table(data.get("kernels", {}), "kernels"),
            devices={text(d, "devices"): table(s, f"devices[{d!r:.40}]") for d, s in devices.items()},
            taken_at=text(data.get("taken_at", ""), "taken_at"), took_s=number(data.get("took_s", 0.0), "took_s"),
            load=number(data.get("load", 0.0), "load"), cpu_share=number(data.get("cpu_share", 1.0), "cpu_share"),
            spread=number(data.get("spread", 0.0), "spread"), contended=data.get("contended", False),
            torch=text(data.get("torch", ""), "torch"), cpu_model=text(data.get("cpu_model", ""), "cpu_model"),
            contended_kernels=tuple(sorted(contended_kernels)),
        )
        if not calib.gemm_gflops or not calib.mem_gbps:
            raise ValueError("gemm_gflops, mem_gbps: empty")
        return calib

    @property
    def collective_cost_s(self) -> float:
        """One small collective between two processes of this host: measured, else (an older cache) a ping-pong."""
        return self.collective_s or 2 * self.link_latency_s

    def _by_threads(self, table: dict[int, float], threads: int) -> float:
        """The rate at `threads`: measured, else scaled linearly from the nearest measured count (more threads
        than this host has cores: an extrapolation to a bigger host, as `shoal plan --hosts --cores` asks)."""
        threads = max(1, threads)
        if threads in table:
            return table[threads]
        near = min(table, key=lambda t: abs(t - threads))
        return table[near] * threads / near

    def gflops(self, threads: int, device: str = "cpu") -> float:
        if device.startswith("cuda") and device in self.devices:
            return self.devices[device]["gflops"]
        return self._by_threads(self.gemm_gflops, threads)

    def bandwidth(self, threads: int, device: str = "cpu") -> float:
        """Bytes per second one worker's memory traffic moves at, alone on the host."""
        if device.startswith("cuda") and device in self.devices:
            return self.devices[device]["mem_gbps"] * 1e9
        return self._by_threads(self.mem_gbps, threads) * 1e9

    @property
    def host_bandwidth(self) -> float:
        """Bytes per second all the host's cores together move."""
        return self._by_threads(self.mem_gbps, self.cores) * 1e9

    def seconds(self, kernel: Kernel) -> float:
        """The kernel's time: measured if calibrated at this size and thread count, else FLOPs at the GEMM rate."""
        if kernel.key in self.kernels:
            return self.kernels[kernel.key]
        return max(kernel.flops / (self.gflops(kernel.threads, kernel.device) * 1e9), kernel.bytes / self.bandwidth(kernel.threads, kernel.device))


@dataclass
class LayerCost:
    """One node of a worker's part of the net, for `rows` samples."""

    node: str
    layer: str  # the user's layer it computes
    worker: int
    rows: int
    fwd_flops: int
    bwd_flops: int
    kernels_fwd: list[Kernel]
    kernels_bwd: list[Kernel]
    stream_fwd: int  # memory traffic outside the dense kernels (elementwise, pooling, copies), forward
    stream_bwd: int  # and backward
    activation_bytes: int  # its output and the output's gradient, kept for backward
    counted: bool = False  # an opaque module's FLOPs (counted by torch, no kernels): timed at the GEMM rate, streams as a floor
    module: Optional[ModuleCosts] = None  # that module (its forward and backward calibrated on real batches: module_kernels)
    timed: Optional[Kernel] = None  # a layer outside the dense kernels, run forward and backward by the calibration


def numel(shape) -> int:
    return math.prod(shape) if shape else 1


def learning_nodes(parts: PartitionPlan) -> dict[str, bool]:
    """Whether each node's output depends on params (so a gradient flows back into it)."""
    by_name = {n.name: n for n in parts.nodes}
    learns: dict[str, bool] = {}
    for n in parts.nodes:
        srcs = [by_name[n.peer]] if n.layer.conf.type == job_pb2.kBridgeDst else [by_name[s] for s in n.srcs]
        learns[n.name] = bool(n.params) or any(learns[s.name] for s in srcs)
    return learns


def node_rows(node: PartNode, shares: list[int]) -> int:
    """Samples a node computes on: its worker's share when cut on the batch, else the group's batch."""
    if node.partitioning == BATCH and len(shares) > 1:
        return shares[node.part]
    return sum(shares)


def layer_cost(node: PartNode, rows: int, threads: int, input_grad: bool, device: str = "cpu") -> LayerCost:
    """FLOPs, kernels and memory traffic of one node on `rows` samples."""
    layer, kind = node.layer, node.layer.conf.type
    measured = layer.measured_costs()
    if measured is not None:
        return module_cost(node, rows, measured)
    out = rows * numel(node.shape)
    ins = sum(rows * numel(s) for s in layer.src_shapes)
    fwd, bwd = [], []
    fwd_flops = bwd_flops = stream_fwd = stream_bwd = 0
    bias = out if len(node.params) > 1 else 0
    if kind in GEMM_TYPES:
        vdim, nout = numel(layer.src_shapes[0]), node.shape[0]
        fwd = [Kernel("mm", (rows, vdim, nout), threads, device)]
        bwd = [Kernel("mm", (nout, rows, vdim), threads, device)] + ([Kernel("mm", (rows, nout, vdim), threads, device)] if input_grad else [])
    elif kind in CONV_TYPES:
        h, w = layer.src_shapes[0][-2:]
        dims = (rows, layer.channels, h, w, node.shape[0], *layer.kernel, *layer.stride, *layer.pad)
        fwd = [Kernel("conv", dims + (0,), threads, device)]
        bwd = [Kernel("conv_bwd", dims + (int(input_grad),), threads, device)]
    if fwd:
        fwd_flops = sum(k.flops for k in fwd) + bias
        bwd_flops = sum(k.flops for k in bwd) + bias
        stream_fwd = stream_bwd = FLOAT * 2 * bias  # the bias add; its gradient's sum over rows
    elif layer.category == "input":
        stream_fwd = FLOAT * out  # the batch's decoded rows
    else:
        # elementwise, pooling, normalisation, losses, connection layers: memory-bound; one op per
        # element read (pooling and LRN: per element of the window)
        window = 1
        if kind in (job_pb2.kPooling, job_pb2.kCPooling, job_pb2.kCudnnPool):
            window = layer.conf.pooling_conf.kernel ** 2
        elif kind in (job_pb2.kLRN, job_pb2.kCudnnLRN):
            window = layer.conf.lrn_conf.local_size
        fwd_flops = 0 if kind in COPIES else window * max(ins, out)
        bwd_flops = fwd_flops if input_grad else 0
        stream_fwd = FLOAT * (ins + out)  # reads its input, writes its output
        stream_bwd = FLOAT * (ins + 2 * out) if input_grad else 0  # reads the output's gradient and a saved blob, writes the input's
    activation = FLOAT * out * (2 if (input_grad or node.params) else 1)
    return LayerCost(node.name, node.origin, node.worker, rows, fwd_flops, bwd_flops, fwd, bwd, stream_fwd, stream_bwd, activation,
                     timed=None if fwd else layer_kernel(node, rows, threads, input_grad, device))


def layer_kernel(node: PartNode, rows: int, threads: int, input_grad: bool, device: str = "cpu") -> Optional[Kernel]:
    """The calibration's timing of a paramless neuron layer (activations, pooling, LRN, dropout, softmax...): one
    elementwise op per element read and written is what its bytes assume; tanh, LRN and friends make several passes
    and more arithmetic, so the layer itself is run (runtime/calibrate.py: time_layer). None: nothing to time."""
    layer = node.layer
    if layer.category != "neuron" or node.params or layer.conf.type in COPIES or device != "cpu" or not layer.src_shapes:
        return None
    return Kernel("layer", (rows, int(input_grad)), threads, device, layer.conf.SerializeToString(deterministic=True),
                  tuple(tuple(s) for s in layer.src_shapes))


def module_cost(node: PartNode, rows: int, costs: ModuleCosts) -> LayerCost:
    """An opaque module's node (shoal.fit): its measured costs on `rows` samples (planning/module_costs.py)."""
    fwd_flops, bwd_flops = costs.flops(rows)
    stream_fwd, stream_bwd = costs.stream_bytes(rows)
    return LayerCost(node.name, node.origin, node.worker, rows, fwd_flops, bwd_flops, [], [], stream_fwd, stream_bwd,
                     costs.memory_bytes(rows), counted=True, module=costs)


MODULE_ROWS = (1, 16)  # a module is timed on batches of these sizes: a fixed cost per call and a cost per row


def module_kernels(costs: ModuleCosts, threads: int) -> list[Kernel]:
    """The calibration's timings of a module's forward + backward at `threads` (one per batch size of MODULE_ROWS)."""
    if costs.probe is None or not costs.digest:
        return []
    return [Kernel("module", (rows,), threads, "cpu", costs.digest.encode(), probe=costs.probe) for rows in MODULE_ROWS]


def module_seconds(c: LayerCost, calib: "Calibration", threads: int) -> Optional[tuple[float, float]]:
    """(forward s, backward s) of a module's node on its rows: on the line through the calibrated batch sizes (a fixed
    cost per call, a cost per row), split as its counted FLOPs are; None when the calibration has not timed it."""
    points = [(k.dims[0], calib.kernels.get(k.key)) for k in module_kernels(c.module, threads)] if c.module else []
    if len(points) < 2 or any(t is None for _, t in points):
        return None
    (r0, t0), (r1, t1) = points[0], points[-1]
    total = max(0.0, t0 + (t1 - t0) * (c.rows - r0) / (r1 - r0))
    flops = c.fwd_flops + c.bwd_flops
    fwd_part = c.fwd_flops / flops if flops else 1 / 3
    return total * fwd_part, total * (1 - fwd_part)


def net_kernel(parts: PartitionPlan, net_conf: job_pb2.NetProto, rows: int, threads: int, device: str = "cpu",
               concurrent: int = 1) -> Optional[Kernel]:
    """The calibration's timing of the whole train net, forward and backward, on `rows` random rows at `threads`,
    while `concurrent` copies of it run at once on the host's other cores (runtime/calibrate.py: time_net). Its
    kernels timed one at a time on an otherwise idle host miss what they cost together: the weights and activations
    arrive cache-cold (a net larger than the cache evicts each layer's operands before their next use; workers
    computing at once share the cache), every output is a fresh allocation, and each layer pays Python and
    autograd's dispatch. None where the net cannot be timed alone: cut otherwise than on the batch, an opaque module
    (timed by its own probe), a device."""
    if parts.partitioned or device != "cpu" or rows < 1 or any(n.layer.measured_costs() is not None for n in parts.nodes):
        return None
    return Kernel("net", (rows, max(1, concurrent)), threads, device, net_conf.SerializeToString(deterministic=True))


def net_concurrency(busy: int, threads: int, cores: int) -> int:
    """How many workers' nets compute at once on a host (as the calibration can time them: no more than its cores hold)."""
    return max(1, min(busy, cores // max(1, threads)))


def in_net_factor(costs: list[LayerCost], calib: "Calibration", net: Optional[Kernel]) -> Optional[tuple[float, float]]:
    """(the net's measured forward + backward seconds, its kernels' seconds at the same concurrency) for one worker
    that computes the whole net on its rows; None when the calibration has not timed the net."""
    timed = calib.kernels.get(net.key) if net is not None else None
    if not timed:
        return None
    fwd, bwd, _ = compute_seconds(costs, calib, net.threads, concurrent=net.dims[1], device=net.device)
    return (timed, fwd + bwd) if fwd + bwd > 0 else None


COPIES = {job_pb2.kSlice, job_pb2.kConcate, job_pb2.kSplit, job_pb2.kBridgeSrc, job_pb2.kBridgeDst}


def worker_costs(parts: PartitionPlan, shares: list[int], threads: int, device: str = "cpu") -> dict[int, list[LayerCost]]:
    """Per worker of a group, the cost of every node it computes (its dense kernels on `device`)."""
    learns = learning_nodes(parts)
    by_name = {n.name: n for n in parts.nodes}
    costs: dict[int, list[LayerCost]] = {w: [] for w in range(parts.nworkers)}
    for n in parts.nodes:
        srcs = [by_name[n.peer]] if n.layer.conf.type == job_pb2.kBridgeDst else [by_name[s] for s in n.srcs]
        input_grad = any(learns[s.name] for s in srcs)
        costs[n.worker].append(layer_cost(n, node_rows(n, shares), threads, input_grad, device))
    return costs


def kernels_of(costs: dict[int, list[LayerCost]]) -> list[Kernel]:
    """The distinct dense kernels the workers run (what a calibration measures for this job)."""
    seen: dict[str, Kernel] = {}
    for layer_costs in costs.values():
        for c in layer_costs:
            for k in c.kernels_fwd + c.kernels_bwd + ([c.timed] if c.timed else []):
                seen.setdefault(k.key, k)
    return list(seen.values())


def compute_seconds(costs: list[LayerCost], calib: Calibration, threads: int, concurrent: int = 1, device: str = "cpu") -> tuple[float, float, float]:
    """(forward s, backward s, of which memory-bound s) of one worker while `concurrent` workers share the host's memory.

    Each dense kernel takes its calibrated time, or longer when its operands cannot stream in
    that time at this worker's share of the host's bandwidth; the rest is memory traffic at
    that share.
    """
    share = calib.bandwidth(threads, device)
    if not device.startswith("cuda"):
        share = min(share, calib.host_bandwidth / max(1, concurrent))
    fwd = bwd = memory = 0.0
    for c in costs:
        if c.counted:  # no kernels to time: timed on real batches at these threads, else the counted FLOPs at the GEMM
            # rate; or its bytes at the bandwidth (shared with the workers running at once) if longer
            rate = calib.gflops(threads, device) * 1e9
            timed = None if device.startswith("cuda") else module_seconds(c, calib, threads)
            fwd_s, bwd_s = timed or (c.fwd_flops / rate, c.bwd_flops / rate)
            times = [(fwd_s, c.stream_fwd / share), (bwd_s, c.stream_bwd / share)]
            fwd, bwd = fwd + max(times[0]), bwd + max(times[1])
            memory += sum(streamed for flops_s, streamed in times if streamed > flops_s)
            continue
        for kernels, phase in ((c.kernels_fwd, "fwd"), (c.kernels_bwd, "bwd")):
            for k in kernels:
                t = max(calib.seconds(k), k.bytes / share)
                if phase == "fwd":
                    fwd += t
                else:
                    bwd += t
        timed = calib.kernels.get(c.timed.key) if c.timed else None
        if timed:  # the layer as it ran, split as its bytes are; never less than its bytes at this worker's share
            streamed = c.stream_fwd + c.stream_bwd
            part = c.stream_fwd / streamed if streamed else 1.0
            fwd += max(timed * part, c.stream_fwd / share)
            bwd += max(timed * (1 - part), c.stream_bwd / share)
        else:
            fwd += c.stream_fwd / share
            bwd += c.stream_bwd / share
        memory += (c.stream_fwd + c.stream_bwd) / share
    return fwd, bwd, memory
