"""Claim: asynchronous groups converge per step at least as well as one worker when the servers' momentum is
compensated for the asynchrony (cluster.async_momentum: kCompensated, the default), and not always with SINGA's
plain momentum (kAsConfigured).

Each layout trains the same steps per group (so 2 groups see twice the samples) and is tested on the whole
10,000-image MNIST test set: a small MLP (784-256-128-10, momentum 0.9, batch 64, 400 steps) at several learning
rates, and SINGA's MNIST MLP example (examples/mnist/job.conf, its own schedule and no momentum) for --singa-steps.

    shoal prepare mnist --out examples/mnist/data     # once
    python benchmarks/async_momentum.py [--lrs 0.01 0.05 0.1] [--singa-steps 200]
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
LAYOUTS = {
    "one worker": [],
    "Downpour, 2 groups + 1 server": ["cluster.nworker_groups=2", "cluster.server_worker_separate=true"],
    "Distributed Hogwild, 2 groups, sync_freq 10": ["cluster.nworker_groups=2", "cluster.nserver_groups=2", "cluster.sync_freq=10"],
    "in-memory Hogwild, 2 groups": ["cluster.nworker_groups=2", "cluster.nworkers_per_procs=2"],
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


def table(title: str, job: Path, extra: list[str], cwd: Path) -> None:
    print(f"\n{title}")
    print(f"| layout | {' | '.join(MODES)} |")
    print("|---|" + "---|" * len(MODES))
    single = final_accuracy(job, extra, cwd)
    print(f"| one worker | {single:.4f} | {single:.4f} |", flush=True)
    for name, sets in list(LAYOUTS.items())[1:]:
        cells = [final_accuracy(job, extra + sets + [f"cluster.async_momentum={mode}"], cwd) for mode in MODES.values()]
        print(f"| {name} | " + " | ".join(f"{a:.4f}{' ✓' if a >= single else ' ✗'}" for a in cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lrs", type=float, nargs="+", default=[0.01, 0.05, 0.1])
    parser.add_argument("--singa-steps", type=int, default=200)
    args = parser.parse_args()
    if not (DATA / "test_data.bin").exists():
        raise SystemExit(f"{DATA}: run `shoal prepare mnist --out {DATA}` first")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; {time.strftime('%Y-%m-%d')}; load {os.getloadavg()[0]:.1f}")
    print("✓: at least the single worker's test accuracy at the same steps per group")
    folder = Path(tempfile.mkdtemp())
    for lr in args.lrs:
        job = folder / f"small-{lr}.conf"
        job.write_text(small_mlp(DATA, lr=lr))
        table(f"MLP 784-256-128-10, momentum 0.9, lr {lr}, 400 steps per group", job, [], folder)
    table(f"SINGA's MNIST MLP (examples/mnist/job.conf), {args.singa_steps} steps per group", REPO / "examples/mnist/job.conf",
          [f"train_steps={args.singa_steps}", f"test_freq={args.singa_steps}", "test_steps=100"], REPO / "examples" / "mnist")


if __name__ == "__main__":
    main()
