"""Claims about devices (issue "Devices"), measured side by side in one run:

1. framework overhead: shoal's single worker ÷ a hand-written PyTorch loop on the same device, same
   model, batch, updater and data (goal ≥ 0.95), for SINGA's MNIST MLP and the cifar10 "18pct" convnet;
2. measured batch shares (Caffe con Troll's CPU+GPU split, found at run time): a group of the device
   plus a second, slower one, with shares even / measured (`auto_batch_shares`), against the device
   alone (goal: measured ≥ 1.10× alone where the second device helps, and never below alone).

On a machine with CUDA the device is cuda:0 and the second device is the CPU. Without CUDA the
device is the CPU and the second device a "cpu:1" whose slowness is injected
(SHOAL_SLOW_WORKER, per sample and per step), which exercises the same balancing.

    python benchmarks/devices.py [--steps 30] [--repeats 3] [--device cuda:0|cpu]
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
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from inmem_sync import job_for, stores  # noqa: E402

from shoal.planning.plan import plan_job  # noqa: E402
import shoal.strategies.registry  # noqa: E402,F401 - installs the strategies plan_job uses (issue 41)
from shoal.runtime.assemble import RunSpec, assemble  # noqa: E402


class STanh(nn.Module):
    def forward(self, x):
        return 1.7159047 * torch.tanh(0.6666667 * x)


def hand_model(model: str) -> nn.Module:
    if model == "mlp":
        sizes = [784, 2500, 2000, 1500, 1000, 500, 10]
        layers: list[nn.Module] = []
        for a, b in zip(sizes, sizes[1:]):
            layers += [nn.Linear(a, b), STanh()]
        return nn.Sequential(*layers[:-1])
    lrn = lambda: nn.LocalResponseNorm(3, alpha=5e-5, beta=0.75)  # noqa: E731
    return nn.Sequential(
        nn.Conv2d(3, 32, 5, padding=2), nn.MaxPool2d(3, 2), nn.ReLU(), lrn(),
        nn.Conv2d(32, 32, 5, padding=2), nn.ReLU(), nn.AvgPool2d(3, 2), lrn(),
        nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.AvgPool2d(3, 2), nn.Flatten(), nn.Linear(64 * 3 * 3, 10),
    )


def hand_loop(model: str, job, device: torch.device, steps: int, warmup: int = 3) -> float:
    """What a PyTorch user writes: batches sliced from host memory, moved, forward, backward, step."""
    conf = job.neuralnet.layer[0].store_conf
    batch = conf.batchsize[0]
    shape = (-1,) + tuple(conf.shape) if model == "cifar10" else (-1, 784)
    rng = np.random.default_rng(0)
    images = torch.from_numpy(rng.integers(0, 256, (batch * 20, int(np.prod(conf.shape))), dtype=np.uint8))
    labels = torch.from_numpy(rng.integers(0, 10, batch * 20))
    net = hand_model(model).to(device)
    u = job.updater
    opt = torch.optim.SGD(net.parameters(), lr=0.001, momentum=u.momentum, weight_decay=u.weight_decay)

    def step(i: int) -> None:
        at = (i * batch) % (len(images) - batch)
        x = ((images[at : at + batch].float() - 127.5) / 127.5).reshape(shape).to(device)
        loss = F.cross_entropy(net(x), labels[at : at + batch].to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for i in range(warmup):
        step(i)
    sync(device)
    start = time.perf_counter()
    for i in range(warmup, warmup + steps):
        step(i)
    sync(device)
    return steps * batch / (time.perf_counter() - start)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def shoal_rate(job, device: torch.device, steps: int, warmup: int = 3) -> tuple[float, list[int]]:
    """samples/s of shoal's training step (after `warmup` steps, in which measured shares settle)."""
    trainer = assemble(plan_job(job), 0, RunSpec(Path(tempfile.mkdtemp()), log=lambda *a: None, progress=False)).chief
    for step in range(warmup):
        trainer.train_step(step)
    sync(device)
    start = time.perf_counter()
    for step in range(warmup, warmup + steps):
        trainer.train_step(step)
    sync(device)
    return steps * trainer.global_batch / (time.perf_counter() - start), trainer.shares


def with_devices(job, devices: list[str], auto: bool, freq: int):
    job = type(job).FromString(job.SerializeToString())
    del job.device[:]
    job.device.extend(devices)
    job.cluster.nworkers_per_group = job.cluster.nworkers_per_procs = len(devices)
    job.cluster.auto_batch_shares, job.cluster.auto_batch_freq = auto, freq
    return job


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--balance-warmup", type=int, default=40, help="steps before measuring a group with measured shares")
    args = parser.parse_args()
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if gpu else f"{platform.processor() or platform.machine()} CPU"
    threads = os.cpu_count() or 1
    data = stores(Path(tempfile.mkdtemp()))
    print(f"device: {name}; {threads} cores; torch {torch.__version__}; {time.strftime('%Y-%m-%d')}")

    print("\n1. shoal single worker ÷ hand-written PyTorch loop, same device")
    print(f"{'model':>8} | {'batch':>5} | {'hand loop':>13} | {'shoal':>13} | ratio")
    for model in ("mlp", "cifar10"):
        job = job_for(model, data[model], "", threads)
        del job.device[:]
        job.device.append(args.device)
        hand, ours = [], []
        for _ in range(args.repeats):  # alternating, so drift in machine load hits both alike
            hand.append(hand_loop(model, job, device, args.steps))
            ours.append(shoal_rate(job, device, args.steps)[0])
        a, b = statistics.median(hand), statistics.median(ours)
        print(f"{model:>8} | {job.neuralnet.layer[0].store_conf.batchsize[0]:>5} | {a:>7.0f} smp/s | {b:>7.0f} smp/s | {b / a:.2f}")

    print("\n2. measured batch shares: the device plus a second one, cifar10 convnet")
    if gpu:
        scenarios = {"GPU + CPU": ([args.device, "cpu"], "")}
    else:  # the second CPU device's slowness is injected: 3x slower per sample, or hopeless (a fixed
        # cost per step of twice the first device's whole step: its rows can only make the step longer)
        per_sample = 1 / shoal_rate(job_for("cifar10", data["cifar10"], "", 1), device, 5)[0]
        step = 100 * per_sample
        scenarios = {
            "cpu + cpu:1 (3x slower)": (["cpu:0", "cpu:1"], f"1:{2 * per_sample:.6f}"),
            f"cpu + cpu:1 (+{2 * step * 1000:.0f} ms/step)": (["cpu:0", "cpu:1"], f"1:{2 * per_sample:.6f}+{2 * step:.4f}"),
        }
    print(f"{'group':>26} | {'alone':>11} | {'even shares':>17} | {'measured shares':>21} | measured ÷ alone")
    for label, (devices, slow) in scenarios.items():
        os.environ["SHOAL_SLOW_WORKER"] = slow
        base = job_for("cifar10", data["cifar10"], "", 1 if not gpu else threads)
        alone, even, auto, shares = [], [], [], []
        for _ in range(args.repeats):
            alone.append(shoal_rate(with_devices(base, devices[:1], False, 10), device, args.steps)[0])
            even.append(shoal_rate(with_devices(base, devices, False, 10), device, args.steps)[0])
            rate, split = shoal_rate(with_devices(base, devices, True, 10), device, args.steps, warmup=args.balance_warmup)
            auto.append(rate)
            shares.append(split)
        a, e, m = statistics.median(alone), statistics.median(even), statistics.median(auto)
        print(f"{label:>26} | {a:>5.0f} smp/s | {e:>5.0f} smp/s ({e / a:.2f}) | {m:>5.0f} smp/s {str(shares[-1]):>9} | {m / a:.2f}")
    os.environ.pop("SHOAL_SLOW_WORKER", None)


if __name__ == "__main__":
    main()
