"""Claim (Krizhevsky's "one weird trick", SINGA's hybrid partitioning): on a net whose params sit in
large fully connected layers, cutting those layers on the feature dimension (each worker owns a
slice of the weights) while the convolutions split the batch moves far fewer bytes per step than
splitting everything on the batch, and is the fastest of the four partitionings.

Net: an AlexNet-like convnet on random 3×32×32 images (conv 32 → pool → conv 64 → pool →
fc 2048 → fc 2048 → fc 10; 10.7 M params, 99.5 % of them in the fc layers), batch 128, 2 workers
in one group (threads), SGD with momentum. For each partitioning:

- samples/s (median of --repeats runs of --steps steps, runs alternate between partitionings);
- bytes moved between the workers per step, *measured* by the runtime (bridges both ways, plus the
  gradients of the replicated params worker 1 computes and their new values coming back: those are
  summed at worker 0's server; a feature slice or a placed layer's param is updated by the one worker
  computing it and never crosses) next to the *analytic* value computed from the plan's shapes.

Next to each measured row: what `shoal plan --estimate` predicted for it before anything ran
(samples/s and bytes), and a fifth row, the partitioning `shoal plan --suggest` picks for this net
(greedy over partition_dim per layer on the cost model), measured the same way.

    python benchmarks/partition.py [--steps 8] [--repeats 3] [--batch 128]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from shoal.config import job_from_text  # noqa: E402
from shoal.data.prepare import write_image_store  # noqa: E402
from shoal.planning.partition import BATCH, PartitionPlan  # noqa: E402
from shoal.runtime.exchanges.local import LocalExchange  # noqa: E402
from shoal.runtime.partitioned import PartitionedGroup  # noqa: E402
from shoal.planning.plan import plan_job  # noqa: E402
import shoal.strategies.registry  # noqa: E402,F401 - installs the strategies plan_job uses (issue 41)
from shoal.runtime.assemble import RunSpec, assemble  # noqa: E402
from shoal.runtime.exchanges.server import Server  # noqa: E402
from shoal.neuralnet.updaters import make_updater  # noqa: E402
from shoal.planning.alternatives import suggest, with_dims  # noqa: E402
from shoal.planning.estimate import estimate, plan_kernels  # noqa: E402
from shoal.runtime import calibrate  # noqa: E402

CONV = "conv1 relu1 pool1 conv2 relu2 pool2"
FC = "fc1 relu3 fc2 relu4 fc3"
PARTITIONINGS = {
    "batch (data parallel)": {},
    "feature (model parallel)": {name: "partition_dim: 1" for name in (CONV + " " + FC).split()},
    "hybrid: conv batch, fc feature": {name: "partition_dim: 1" for name in FC.split()},
    "location: conv on w0, fc on w1": {**{n: "location: 0" for n in CONV.split()}, **{n: "location: 1" for n in FC.split()}},
}


def job_text(data: Path, batch: int, extra: dict[str, str]) -> str:
    def layer(name, body):
        return f'layer {{ name: "{name}" {body} {extra.get(name, "")} }}'

    def params(i, std):
        return f'param {{ name: "w{i}" init {{ type: kGaussian std: {std} }} }} param {{ name: "b{i}" init {{ type: kConstant value: 0 }} }}'

    layers = [
        layer("data", f'type: kRecordInput store_conf {{ backend: "kvfile" path: "{data}" batchsize: {batch} shape: 3 shape: 32 shape: 32 std_value: 255 }}'),
        layer("conv1", f'type: kConvolution srclayers: "data" convolution_conf {{ num_filters: 32 kernel: 5 pad: 2 }} {params(1, 0.01)}'),
        layer("relu1", 'type: kReLU srclayers: "conv1"'),
        layer("pool1", 'type: kPooling srclayers: "relu1" pooling_conf { pool: MAX kernel: 3 stride: 2 }'),
        layer("conv2", f'type: kConvolution srclayers: "pool1" convolution_conf {{ num_filters: 64 kernel: 5 pad: 2 }} {params(2, 0.01)}'),
        layer("relu2", 'type: kReLU srclayers: "conv2"'),
        layer("pool2", 'type: kPooling srclayers: "relu2" pooling_conf { pool: MAX kernel: 3 stride: 2 }'),
        layer("fc1", f'type: kInnerProduct srclayers: "pool2" innerproduct_conf {{ num_output: 2048 }} {params(3, 0.01)}'),
        layer("relu3", 'type: kReLU srclayers: "fc1"'),
        layer("fc2", f'type: kInnerProduct srclayers: "relu3" innerproduct_conf {{ num_output: 2048 }} {params(4, 0.01)}'),
        layer("relu4", 'type: kReLU srclayers: "fc2"'),
        layer("fc3", f'type: kInnerProduct srclayers: "relu4" innerproduct_conf {{ num_output: 10 }} {params(5, 0.01)}'),
        layer("loss", 'type: kSoftmaxLoss srclayers: "fc3" srclayers: "data"'),
    ]
    return f"""
name: "fc-heavy-convnet" train_steps: 1000000 disp_freq: 0 test_steps: 0
train_one_batch {{ alg: kBP }}
updater {{ type: kSGD momentum: 0.9 learning_rate {{ type: kFixed base_lr: 0.01 }} }}
neuralnet {{ {" ".join(layers)} }}
cluster {{ nworkers_per_group: 2 nworkers_per_procs: 2 }}
"""


def analytic_bytes(plan: PartitionPlan, shares: list[int], shapes: dict[str, tuple[int, ...]]) -> int:
    """Bytes crossing between workers per step, from the plan's shapes alone (float32)."""
    by_name = {n.name: n for n in plan.nodes}
    learns: dict[str, bool] = {}  # whether a node's output depends on params (its gradient flows back)
    for n in plan.nodes:
        srcs = [by_name[n.peer]] if n.type == "kBridgeDst" else [by_name[s] for s in n.srcs]
        learns[n.name] = bool(n.params) or any(learns[s.name] for s in srcs)
    total, batch = 0, sum(shares)
    for n in plan.nodes:
        if n.type == "kBridgeDst":
            rows = shares[n.part] if n.partitioning == BATCH else batch
            total += rows * int(np.prod(n.shape)) * 4 * (2 if learns[n.peer] else 1)
    owned = plan.updated_where_computed()  # updated by the worker computing them: they never cross
    for k in range(1, plan.nworkers):
        views = {v for n in plan.worker_nodes(k) for v in n.params if v not in owned}
        # each replicated view worker k computes with: its gradient goes to worker 0's server, the new values come back
        total += sum(2 * 4 * view_numel(shapes[v.name], v) for v in views)
    return total


def view_numel(shape: tuple[int, ...], view) -> int:
    whole = int(np.prod(shape))
    return whole if view.axis < 0 else whole // shape[view.axis] * view.size


def measure(job, steps: int, partitioned_runtime: bool, warmup: int = 2) -> tuple[float, int, PartitionPlan, dict]:
    """samples/s over `steps` steps and the group's measured bytes per step (0 when not measured)."""
    trainer = assemble(plan_job(job), 0, RunSpec(Path(tempfile.mkdtemp()), log=lambda *a: None, progress=False)).chief
    plan = trainer.plan.partition
    if partitioned_runtime and not isinstance(trainer.workers[0], PartitionedGroup):
        # the plain batch split, run by the partitioned runtime only to count its bytes the same way
        trainer.workers = [PartitionedGroup(job, plan, trainer.store, [REPO], [torch.device("cpu")] * 2)]
        trainer.pool = None
        trainer.attach_exchange(LocalExchange(Server(trainer.store, make_updater(job.updater))))
    for step in range(warmup):
        trainer.train_step(step)
    start = time.perf_counter()
    for step in range(warmup, warmup + steps):
        trainer.train_step(step)
    rate = steps * trainer.global_batch / (time.perf_counter() - start)
    group = trainer.workers[0]
    return rate, getattr(group, "bytes_per_step", 0), plan, {name: tuple(v.shape) for name, v in trainer.store.values.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=128)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    data = Path(tempfile.mkdtemp()) / "train_data.bin"
    write_image_store(data, rng.integers(0, 256, (2048, 3, 32, 32), dtype=np.uint8), rng.integers(0, 10, 2048))
    jobs = {name: job_from_text(job_text(data, args.batch, extra)) for name, extra in PARTITIONINGS.items()}
    calibrated = lambda kernels: calibrate.calibration(kernels)  # noqa: E731
    advice = suggest(jobs["batch (data parallel)"], calibrated, workers=2)
    cut = sorted(n for n, d in advice.dims.items() if d == 1)
    layers = ", ".join(n for n in cut if not n.startswith(("relu", "pool")))
    jobs["suggested: " + (f"{layers} feature" if layers else "the batch split")] = with_dims(jobs["batch (data parallel)"], advice.dims)
    predicted = {}
    for name, job in jobs.items():
        plan = plan_job(job)
        e = estimate(plan, calibrated(plan_kernels(plan)))
        predicted[name] = (e.samples_per_s, sum(v[0] for p in e.processes for v in p.links.values()))
    load_before = os.getloadavg()[0]
    rates: dict[str, list[float]] = {name: [] for name in jobs}
    measured, analytic = {}, {}
    for _ in range(args.repeats):
        for name, job in jobs.items():
            rate, *_ = measure(job, args.steps, partitioned_runtime=False)
            rates[name].append(rate)
    for name, job in jobs.items():  # bytes: one short run each through the partitioned runtime
        _, measured[name], plan, shapes = measure(job, 1, partitioned_runtime=True, warmup=1)
        analytic[name] = analytic_bytes(plan, [args.batch - args.batch // 2, args.batch // 2], shapes)
    base = statistics.median(rates["batch (data parallel)"])
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; 2 workers (threads), batch {args.batch}; "
          f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    print(f"suggested by the cost model: partition_dim 1 on {', '.join(cut) or 'nothing'} ({advice.tried} candidates estimated)")
    print(f"{'partitioning':>40} | {'samples/s':>9} | {'predicted':>9} | {'error':>6} | {'÷ batch':>7} | {'MB/step measured':>16} | {'analytic':>8} | {'predicted':>9} | {'÷ batch':>7}")
    print("-" * 140)
    dim0 = measured["batch (data parallel)"]
    for name in jobs:
        rate = statistics.median(rates[name])
        guess, guess_bytes = predicted[name]
        print(f"{name:>40} | {rate:>9.1f} | {guess:>9.1f} | {100 * (guess - rate) / rate:>+5.0f}% | {rate / base:>7.2f} | "
              f"{measured[name] / 1e6:>16.2f} | {analytic[name] / 1e6:>8.2f} | {guess_bytes / 1e6:>9.2f} | {measured[name] / dim0:>7.2f}")


if __name__ == "__main__":
    main()
