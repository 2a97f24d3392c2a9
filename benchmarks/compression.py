"""Claim: compressed exchange (cluster.compression) sends at least 50x fewer bytes per step at 1 % top-k, in every
framework over processes, and keeps test accuracy within 1 point of the dense exchange at the same steps.

Each layout trains the MLP 784-256-128-10 (momentum 0.9, batch 64 per group, lr 0.05) on real MNIST for the same
steps per group, dense and with each codec, and is tested on the whole 10,000-image test set. Bytes per step are
the chief's exchange's (metrics.jsonl): AllReduce's `sent_bytes` (the chief's process sends the gradients of
others' slices and, owning slices, their values or encoded sums back), Downpour's `pushed_bytes` (its pushes),
Distributed Hogwild's `sync_bytes` (its own syncs both ways: its deltas and the masters' answers), Local SGD's
`sent_bytes` (the pseudo-gradients it hands to the meetings).

    shoal prepare mnist --out examples/mnist/data     # once
    python benchmarks/compression.py [--steps 400] [--lr 0.05]
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
    "AllReduce, 2 processes": ["cluster.nworkers_per_group=2"],
    "Downpour, 2 groups + 1 server": ["cluster.nworker_groups=2", "cluster.server_worker_separate=true"],
    "Distributed Hogwild, 2 groups, sync_freq 10": ["cluster.nworker_groups=2", "cluster.nserver_groups=2", "cluster.sync_freq=10"],
    "Local SGD, 2 groups, local_steps 10": ["cluster.nworker_groups=2", "cluster.local_steps=10"],
}
CODECS = {
    "dense (float32)": [],
    "bf16": ["cluster.compression=kBF16"],
    "fp16": ["cluster.compression=kFP16"],
    "top-k 1 %": ["cluster.compression=kTopK", "cluster.topk_fraction=0.01"],
}


def run(job: Path, sets: list[str]) -> tuple[float, float]:
    """(bytes the chief's process sent per step, final test accuracy) of one run."""
    ws = Path(tempfile.mkdtemp()) / "ws"
    args = [sys.executable, "-m", "shoal", "run", str(job), "--workspace", str(ws), "--no-progress"]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(sets)}: {proc.stderr.strip().splitlines()[-1]}")
    records = [json.loads(line) for line in (ws / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["phase"] == "train"]
    key = next(k for k in ("sent_bytes", "pushed_bytes", "sync_bytes") if k in train[-1])
    sent = sum(r[key] for r in train[1:]) / (train[-1]["step"] - train[0]["step"])
    return sent, [r for r in records if r["phase"] == "test"][-1]["accuracy"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--only", default="", help="run the layouts whose name contains this")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each cell (asynchronous runs vary with timing)")
    args = parser.parse_args()
    if not (DATA / "test_data.bin").exists():
        raise SystemExit(f"{DATA}: run `shoal prepare mnist --out {DATA}` first")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; {time.strftime('%Y-%m-%d')}; load {os.getloadavg()[0]:.1f}")
    job = Path(tempfile.mkdtemp()) / "mlp.conf"
    job.write_text(small_mlp(DATA, steps=args.steps, lr=args.lr, disp_freq=50))
    print(f"MLP 784-256-128-10, momentum 0.9, lr {args.lr}, {args.steps} steps per group; bytes: the chief's process, per step")
    print(f"accuracy: mean of {args.repeats} runs (each run's in brackets); vs dense: the means' difference")
    print("| layout | exchange | bytes per step | fewer than dense | test accuracy | vs dense |")
    print("|---|---|---|---|---|---|")
    for name, layout in LAYOUTS.items():
        if args.only not in name:
            continue
        dense_bytes = dense_acc = None
        for codec, sets in CODECS.items():
            runs = [run(job, layout + sets) for _ in range(args.repeats)]
            sent, accs = runs[0][0], [acc for _, acc in runs]
            acc = sum(accs) / len(accs)
            if dense_bytes is None:
                dense_bytes, dense_acc = sent, acc
            each = " (" + ", ".join(f"{a:.4f}" for a in accs) + ")" if len(accs) > 1 else ""
            print(f"| {name} | {codec} | {sent:,.0f} | {dense_bytes / sent:.1f}x | {acc:.4f}{each} | {100 * (acc - dense_acc):+.2f} pt |",
                  flush=True)
    print(f"load at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
