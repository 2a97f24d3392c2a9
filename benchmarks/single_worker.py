"""Claim: one shoal worker trains as fast as a hand-written PyTorch loop (goal: ratio >= 0.97).

Both train SINGA's MNIST MLP (784-2500-2000-1500-1000-500-10, scaled tanh,
softmax loss) with momentum SGD on the same data and batch size, with the
same thread count. Runs alternate (shoal, torch, shoal, torch, ...) and the
medians are compared, because this machine is shared and noisy. Also
reports achieved GFLOP/s against this machine's fp32 matmul peak.

    python benchmarks/single_worker.py [--batch 64 256] [--steps 60] [--repeats 3]
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
from shoal.runtime.local import RunOptions, build_trainer  # noqa: E402

SIZES = [784, 2500, 2000, 1500, 1000, 500, 10]


def mlp_job(data: Path, batch: int) -> str:
    layers, src = [], "data"
    for i, n in enumerate(SIZES[1:], 1):
        layers.append(
            f'layer {{ name: "fc{i}" type: kInnerProduct srclayers: "{src}" innerproduct_conf {{ num_output: {n} }}'
            f' param {{ name: "w{i}" init {{ type: kUniform low: -0.05 high: 0.05 }} }}'
            f' param {{ name: "b{i}" init {{ type: kUniform low: -0.05 high: 0.05 }} }} }}'
        )
        src = f"fc{i}"
        if i < len(SIZES) - 1:
            layers.append(f'layer {{ name: "tanh{i}" type: kSTanh srclayers: "fc{i}" }}')
            src = f"tanh{i}"
    return f"""
name: "bench" train_steps: 1000000
train_one_batch {{ alg: kBP }}
updater {{ type: kSGD momentum: 0.9 learning_rate {{ type: kFixed base_lr: 0.001 }} }}
neuralnet {{
  layer {{ name: "data" type: kRecordInput store_conf {{ backend: "kvfile" path: "{data}" batchsize: {batch} shape: 784 mean_value: 127.5 std_value: 127.5 }} }}
  {' '.join(layers)}
  layer {{ name: "loss" type: kSoftmaxLoss srclayers: "{src}" srclayers: "data" }}
}}
"""


def find_data(tmp: Path) -> Path:
    """Real MNIST if `shoal prepare mnist` can find it, else 60000 random images in the same format."""
    from shoal.data.errors import StoreError
    from shoal.data.prepare import prepare_mnist, write_image_store

    try:
        prepare_mnist(tmp, None)
        return tmp / "train_data.bin"
    except StoreError:
        rng = np.random.default_rng(0)
        write_image_store(tmp / "train_data.bin", rng.integers(0, 256, (60000, 28, 28), dtype=np.uint8), rng.integers(0, 10, 60000))
        return tmp / "train_data.bin"


def time_shoal(job_text: str, steps: int, warmup: int) -> float:
    job = job_from_text(job_text, "bench.conf")
    trainer = build_trainer(job, Path(tempfile.mkdtemp()), RunOptions(log=lambda *a: None, progress=False))
    batch = trainer.workers[0].global_batch
    for step in range(warmup):
        trainer.train_step(step)
    start = time.perf_counter()
    for step in range(warmup, warmup + steps):
        trainer.train_step(step)
    return steps * batch / (time.perf_counter() - start)


def time_torch(data: np.ndarray, labels: np.ndarray, batch: int, steps: int, warmup: int) -> float:
    """The loop a PyTorch user writes: nn.Sequential, CrossEntropyLoss, optim.SGD(momentum)."""

    class STanh(torch.nn.Module):
        def forward(self, x):
            return 1.7159047 * torch.tanh(0.6666667 * x)

    layers = []
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(SIZES) - 2:
            layers.append(STanh())
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    n = len(data)

    def step(i):
        idx = slice((i * batch) % (n - batch), (i * batch) % (n - batch) + batch)
        x = (torch.from_numpy(data[idx]) - 127.5) / 127.5
        y = torch.from_numpy(labels[idx])
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    for i in range(warmup):
        step(i)
    start = time.perf_counter()
    for i in range(warmup, warmup + steps):
        step(i)
    return steps * batch / (time.perf_counter() - start)


def matmul_peak() -> float:
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    for _ in range(3):
        a @ b
    reps = 20
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * 1024**3 * reps / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from shoal.data.dataset import open_store
    from shoal.config import job_pb2

    tmp = Path(tempfile.mkdtemp())
    data_path = find_data(tmp)
    ds = open_store(job_pb2.StoreProto(path=str(data_path), shape=[784]))
    flops_per_sample = 3 * 2 * sum(a * b for a, b in zip(SIZES[:-1], SIZES[1:]))  # forward + 2x backward
    peak = matmul_peak()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"data: {data_path.parent.name}; fp32 matmul peak (1024², measured): {peak:.0f} GFLOP/s")
    print(f"{'batch':>5} | {'shoal samples/s':>15} | {'torch samples/s':>15} | {'ratio':>5} | {'shoal GFLOP/s':>13} | {'% of peak':>9}")
    print("-" * 80)
    for batch in args.batch:
        job_text = mlp_job(data_path, batch)
        shoal_runs, torch_runs = [], []
        for _ in range(args.repeats):
            shoal_runs.append(time_shoal(job_text, args.steps, args.warmup))
            torch_runs.append(time_torch(ds.data, ds.labels, batch, args.steps, args.warmup))
        s, t = statistics.median(shoal_runs), statistics.median(torch_runs)
        gflops = s * flops_per_sample / 1e9
        print(f"{batch:>5} | {s:>15.0f} | {t:>15.0f} | {s / t:>5.2f} | {gflops:>13.1f} | {100 * gflops / peak:>8.0f}%")


if __name__ == "__main__":
    main()
