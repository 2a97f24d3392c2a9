"""Claim (SINGA paper, Caffe con Troll): on one node, p single-threaded workers splitting the batch
beat one worker with p intra-op threads.

In-memory Sandblaster (`nworkers_per_group: p  nworkers_per_procs: p`, one thread each) against a
single worker with p threads, same model, global batch, data and updater, samples/s measured in
alternating runs and compared by median. Models: SINGA's MNIST MLP and the cifar10 "18pct" convnet
(on random 3×32×32 images when CIFAR-10 is not prepared: throughput does not depend on pixel values).

    python benchmarks/inmem_sync.py [--workers 2] [--steps 30] [--repeats 3]
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

from shoal.config import load_job  # noqa: E402
from shoal.data.prepare import write_image_store  # noqa: E402
from shoal.planning.plan import plan_job  # noqa: E402
from shoal.runtime.assemble import RunSpec, assemble  # noqa: E402


def stores(tmp: Path) -> dict[str, Path]:
    """Record stores for both models (real MNIST when available, random images otherwise)."""
    from shoal.data.errors import StoreError
    from shoal.data.prepare import prepare_mnist

    rng = np.random.default_rng(0)
    mnist = tmp / "mnist"
    try:
        prepare_mnist(mnist, None)
    except StoreError:
        write_image_store(mnist / "train_data.bin", rng.integers(0, 256, (6000, 28, 28), dtype=np.uint8), rng.integers(0, 10, 6000))
    cifar = tmp / "cifar"
    write_image_store(cifar / "train_data.bin", rng.integers(0, 256, (5000, 3, 32, 32), dtype=np.uint8), rng.integers(0, 10, 5000))
    return {"mlp": mnist / "train_data.bin", "cifar10": cifar / "train_data.bin"}


def job_for(model: str, data: Path, cluster: str, threads: int):
    """The example job, training on `data`, with `cluster` (e.g. "nworkers_per_group=2 ...") and a thread budget."""
    conf = REPO / "examples" / ("mnist/job.conf" if model == "mlp" else "cifar10/job.conf")
    overrides = ["test_steps=0", "disp_freq=0", "train_steps=1000000", f"neuralnet.layer[0].store_conf.path={data}",
                 f"cluster.threads_per_worker={threads}"] + [f"cluster.{kv}" for kv in cluster.split()]
    job = load_job(conf, overrides)
    job.neuralnet.layer[0].store_conf.ClearField("mean_file")  # random images: no mean file
    return job


def throughput(job, steps: int, warmup: int = 3) -> float:
    trainer = assemble(plan_job(job), 0, RunSpec(Path(tempfile.mkdtemp()), log=lambda *a: None, progress=False)).chief
    for step in range(warmup):
        trainer.train_step(step)
    start = time.perf_counter()
    for step in range(warmup, warmup + steps):
        trainer.train_step(step)
    return steps * trainer.workers[0].global_batch / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    p = args.workers
    data = stores(Path(tempfile.mkdtemp()))
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; p = {p}")
    print(f"{'model':>8} | {'batch':>5} | {'1 worker x p threads':>20} | {'p workers x 1 thread':>20} | {'ratio':>5}")
    print("-" * 72)
    for model in ("mlp", "cifar10"):
        single = job_for(model, data[model], "", p)
        group = job_for(model, data[model], f"nworkers_per_group={p} nworkers_per_procs={p}", 1)
        batch = single.neuralnet.layer[0].store_conf.batchsize[0]
        a_runs, b_runs = [], []
        for _ in range(args.repeats):
            a_runs.append(throughput(single, args.steps))
            b_runs.append(throughput(group, args.steps))
        a, b = statistics.median(a_runs), statistics.median(b_runs)
        print(f"{model:>8} | {batch:>5} | {a:>14.0f} smp/s | {b:>14.0f} smp/s | {b / a:>5.2f}")


if __name__ == "__main__":
    main()
