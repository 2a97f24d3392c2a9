"""Claim: one shoal worker trains as fast as a hand-written PyTorch loop, with every updater (goal: ratio >= 0.97).

Both train SINGA's MNIST MLP (784-2500-2000-1500-1000-500-10, scaled tanh,
softmax loss) on the same data and batch size, with the same thread count,
once per updater: shoal with SINGA's SGD, momentum, Nesterov and Adam, the
PyTorch loop with the torch.optim optimizer a user would pick for each
(foreach=True, torch's multi-tensor implementation). Every model is built
once; then timed blocks of steps alternate (shoal, torch, torch, shoal, ...
over every updater, the order rotating each round), so that the shared
machine's noise hits both alike, and the medians are compared. Also reports
achieved GFLOP/s against this machine's fp32 matmul peak.

    python benchmarks/single_worker.py [--batch 64 256] [--steps 40] [--repeats 5] [--updaters SGD momentum]
    python benchmarks/single_worker.py --cpu-time           # 1 thread each, samples per CPU second (shared machines)
    python benchmarks/single_worker.py --update-only 40     # the update step alone, shoal vs torch.optim
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

SIZES = [784, 2500, 2000, 1500, 1000, 500, 10]
LR = 0.001

# name: (SINGA's updater section, the torch.optim optimizer a PyTorch user writes for it)
UPDATERS: dict[str, tuple[str, Callable]] = {
    "SGD": ("type: kSGD", lambda p: torch.optim.SGD(p, lr=LR, foreach=True)),
    "momentum": ("type: kSGD momentum: 0.9", lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9, foreach=True)),
    "Nesterov": ("type: kNesterov momentum: 0.9", lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9, nesterov=True, foreach=True)),
    "Adam": ("type: kAdam", lambda p: torch.optim.Adam(p, lr=LR, foreach=True)),
}


def mlp_job(data: Path, batch: int, updater: str) -> str:
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
updater {{ {updater} learning_rate {{ type: kFixed base_lr: {LR} }} }}
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


def shoal_trainer(job_text: str):
    """shoal's trainer for a one-worker job, assembled as `shoal run` assembles it (the only shoal wiring here)."""
    from shoal.config import job_from_text
    from shoal.planning.plan import plan_job
    from shoal.runtime.assemble import RunSpec, assemble
    from shoal.strategies.registry import REGISTRY

    spec = RunSpec(workspace=Path(tempfile.mkdtemp()), log=lambda *a: None, progress=False)
    return assemble(plan_job(job_from_text(job_text, "bench.conf"), strategies=REGISTRY), 0, spec).chief


def torch_step(data: np.ndarray, labels: np.ndarray, batch: int, make_optimizer: Callable) -> Callable[[int], None]:
    """The loop a PyTorch user writes: nn.Sequential, CrossEntropyLoss, a torch.optim optimizer."""

    class STanh(torch.nn.Module):
        def forward(self, x):
            return 1.7159047 * torch.tanh(0.6666667 * x)

    layers = []
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(SIZES) - 2:
            layers.append(STanh())
    model = torch.nn.Sequential(*layers)
    opt = make_optimizer(model.parameters())
    loss_fn = torch.nn.CrossEntropyLoss()
    n = len(data)

    def step(i: int) -> None:
        start = (i * batch) % (n - batch)
        x = (torch.from_numpy(np.ascontiguousarray(data[start : start + batch], dtype=np.float32)) - 127.5) / 127.5
        y = torch.from_numpy(np.ascontiguousarray(labels[start : start + batch], dtype=np.int64))
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    return step


class Timed:
    """A training step function, its step counter (the data cursor goes on across blocks) and its samples/s per block."""

    clock = time.perf_counter  # time.thread_time with --cpu-time

    def __init__(self, step: Callable[[int], object], batch: int, warmup: int):
        self.step, self.batch, self.next, self.rates = step, batch, 0, []
        self.block(warmup, record=False)

    def block(self, steps: int, record: bool = True) -> None:
        start = self.clock()
        for i in range(self.next, self.next + steps):
            self.step(i)
        self.next += steps
        if record:
            self.rates.append(steps * self.batch / (self.clock() - start))


def updater_steps(names: list[str], reps: int) -> None:
    """The update alone, on the MLP's 12 params with random gradients: shoal's Server.update against
    optimizer.step(), interleaved, on one thread, timed in that thread's CPU seconds (medians): on a
    shared machine the wall time of two OpenMP threads mostly measures who else is running."""
    from google.protobuf import text_format

    from shoal.config import job_pb2
    from shoal.neuralnet.params import ParamStore
    from shoal.neuralnet.updaters import make_updater
    from shoal.runtime.exchanges.server import Server

    shapes = [s for a, b in zip(SIZES[:-1], SIZES[1:]) for s in ((b, a), (b,))]
    gen = torch.Generator().manual_seed(0)
    torch.set_num_threads(1)
    print(f"{'updater':>8} | {'shoal update, CPU ms':>20} | {'torch step, CPU ms':>18} | ratio (torch/shoal time)")
    print("-" * 70)
    for name in names:
        conf, make_optimizer = UPDATERS[name]
        store = ParamStore()
        for i, shape in enumerate(shapes):
            store.declare(job_pb2.ParamProto(name=f"p{i}"), shape, gen)
        server = Server(store, make_updater(text_format.Parse(f"{conf} learning_rate {{ type: kFixed base_lr: {LR} }}", job_pb2.UpdaterProto())))
        grads = {n: torch.randn(store.values[n].shape, generator=gen) for n in store.values}
        params = [torch.nn.Parameter(store.values[n].clone()) for n in store.values]
        for param, grad in zip(params, grads.values()):
            param.grad = grad.clone()
        optimizer = make_optimizer(params)
        steps = {"shoal": lambda: server.update(0, grads), "torch": optimizer.step}
        seconds = {k: [] for k in steps}
        for r in range(reps + 2):
            for k in steps if r % 2 == 0 else reversed(steps):
                start = time.thread_time()
                steps[k]()
                if r >= 2:  # the first two allocate the slots
                    seconds[k].append(time.thread_time() - start)
        s, t = statistics.median(seconds["shoal"]) * 1e3, statistics.median(seconds["torch"]) * 1e3
        print(f"{name:>8} | {s:>20.1f} | {t:>18.1f} | {t / s:.2f}")


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
    parser.add_argument("--steps", type=int, default=40, help="steps per timed block")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5, help="timed blocks per system and updater")
    parser.add_argument("--updaters", nargs="+", choices=list(UPDATERS), default=list(UPDATERS))
    parser.add_argument("--cpu-time", action="store_true",
                        help="one thread each, samples per CPU second of that thread (what a shared machine's load barely moves)")
    parser.add_argument("--update-only", type=int, metavar="REPS", default=0,
                        help="time only the update step (REPS interleaved repetitions), not training")
    args = parser.parse_args()
    if args.update_only:
        print(f"torch {torch.__version__}, load average before: {os.getloadavg()[0]:.2f}")
        updater_steps(args.updaters, args.update_only)
        print(f"load average after: {os.getloadavg()[0]:.2f}")
        return
    # both read the store's read-only rows without copying them (shoal's feed does the same)
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

    from shoal.config import job_pb2
    from shoal.data.dataset import open_store

    tmp = Path(tempfile.mkdtemp())
    data_path = find_data(tmp)
    ds = open_store(job_pb2.StoreProto(path=str(data_path), shape=[784]))
    flops_per_sample = 3 * 2 * sum(a * b for a, b in zip(SIZES[:-1], SIZES[1:]))  # forward + 2x backward
    peak = matmul_peak()
    header_printed = False
    rows = []
    for batch in args.batch:
        pairs = {}
        for name in args.updaters:
            conf, make_optimizer = UPDATERS[name]
            shoal = shoal_trainer(mlp_job(data_path, batch, conf))  # sets the worker's thread count, which torch then shares
            pairs[name] = (Timed(shoal.train_step, batch, args.warmup), Timed(torch_step(ds.data, ds.labels, batch, make_optimizer), batch, args.warmup))
        if args.cpu_time:  # after assembling: assemble sets the worker's thread count
            torch.set_num_threads(1)
            Timed.clock = staticmethod(time.thread_time)
        if not header_printed:
            print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads{' (CPU time)' if args.cpu_time else ''}; "
                  f"data: {'MNIST' if (tmp / 'test_data.bin').exists() else 'random images'}; "
                  f"fp32 matmul peak (1024², measured): {peak:.0f} GFLOP/s; load average before: {os.getloadavg()[0]:.2f}")
            print(f"{'updater':>8} | {'batch':>5} | {'shoal samples/s':>15} | {'torch samples/s':>15} | {'ratio':>5} | "
                  f"{'block ratios':>11} | {'shoal GFLOP/s':>13} | {'% of peak':>9}")
            print("-" * 104)
            header_printed = True
        names = list(pairs)
        for r in range(args.repeats):
            for name in names[r % len(names):] + names[: r % len(names)]:  # rotate which updater runs first
                for timed in pairs[name] if r % 2 == 0 else reversed(pairs[name]):  # and which system
                    timed.block(args.steps)
        for name, (shoal, reference) in pairs.items():
            s, t = statistics.median(shoal.rates), statistics.median(reference.rates)
            block_ratios = [a / b for a, b in zip(shoal.rates, reference.rates)]
            gflops = s * flops_per_sample / 1e9
            rows.append((name, batch, s / t))
            print(f"{name:>8} | {batch:>5} | {s:>15.0f} | {t:>15.0f} | {s / t:>5.2f} | {min(block_ratios):.2f}–{max(block_ratios):.2f} | "
                  f"{gflops:>13.1f} | {'–' if args.cpu_time else f'{100 * gflops / peak:.0f}%':>9}")  # peak is wall time
        del pairs
    below = [f"{name} at batch {batch} ({ratio:.2f})" for name, batch, ratio in rows if ratio < 0.97]
    print(f"load average after: {os.getloadavg()[0]:.2f}; below the 0.97 goal: {', '.join(below) or 'none'}")


if __name__ == "__main__":
    main()
