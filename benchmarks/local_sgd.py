"""Claim (issue #16, point 3): Local SGD with H = 50 moves at least 40x fewer bytes per sample than Downpour,
measured on the wire, and its test accuracy is within 0.5 points of synchronous training at equal samples.

Every layout trains the small MLP (784-256-128-10, momentum 0.9, lr 0.05) on real MNIST for the same number of
samples: 2 groups of batch 64 (Local SGD, Downpour) or one synchronous group of 2 workers and batch 128, for
--steps steps, and is tested on the whole 10,000-image test set. The groups read disjoint halves of the
training set (no random_skip: groups start at evenly spaced offsets), as a synchronous group's workers do.

Bytes on the wire: each multi-process job runs in a network namespace of its own (`ip netns add`, root only),
so the namespace's loopback counter (tx_bytes) counts that job's traffic and nothing else: gloo's tensors,
the rendezvous store, heartbeats. Without the namespace (not root, no `ip`) the column says "n/a".
Counted: what the exchange itself reports (Local SGD: the pseudo-gradients handed to the meetings, per group;
Downpour: the chief's pushes only, times the groups). Analytic: `shoal plan --estimate`'s bytes per step.

    shoal prepare mnist --out examples/mnist/data     # once
    sudo python benchmarks/local_sgd.py [--steps 400] [--seeds 1 2 3] [--only NAME ...]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "examples" / "mnist" / "data"
sys.path.insert(0, str(REPO / "benchmarks"))
from mnist_mlp import small_mlp  # noqa: E402 - the MLP every asynchronous benchmark trains
GROUP_BATCH = 64

LOCAL_SGD = ["cluster.nworker_groups=2", "cluster.local_steps=50"]
DILOCO = ["cluster.outer_updater.type=kNesterov", "cluster.outer_updater.momentum=0.9",
          "cluster.outer_updater.learning_rate.type=kFixed"]


@dataclass(frozen=True)
class Layout:
    name: str
    sets: tuple[str, ...]
    batch: int = GROUP_BATCH  # a group's batch
    groups: int = 1
    wire: bool = True  # over processes: its bytes on the wire are measured


LAYOUTS = [
    Layout("synchronous, 2 workers (in-memory Sandblaster)", ("cluster.nworkers_per_group=2", "cluster.nworkers_per_procs=2"),
           batch=2 * GROUP_BATCH, wire=False),
    Layout("synchronous, 2 workers, lr 0.1 (the linear scaling rule for batch 128), in-memory",
           ("cluster.nworkers_per_group=2", "cluster.nworkers_per_procs=2", "updater.learning_rate.base_lr=0.1"),
           batch=2 * GROUP_BATCH, wire=False),
    Layout("synchronous, 2 workers (AllReduce, 2 processes)", ("cluster.nworkers_per_group=2",), batch=2 * GROUP_BATCH),
    Layout("Downpour, 2 groups + 1 server", ("cluster.nworker_groups=2", "cluster.server_worker_separate=true"), groups=2),
    Layout("Local SGD H=50, 2 groups (processes)", tuple(LOCAL_SGD), groups=2),
    Layout("Local SGD H=50, 2 groups (threads)", (*LOCAL_SGD, "cluster.nworkers_per_procs=2"), groups=2, wire=False),
    Layout("Local SGD H=50 after a 12-step synchronous warm-up (post-local SGD), threads",
           (*LOCAL_SGD, "cluster.local_warmup_steps=12", "cluster.nworkers_per_procs=2"), groups=2, wire=False),
    Layout("DiLoCo H=50 (outer Nesterov 0.9, lr 0.7), threads", (*LOCAL_SGD, *DILOCO, "cluster.outer_updater.learning_rate.base_lr=0.7",
                                                                "cluster.nworkers_per_procs=2"), groups=2, wire=False),
]


@dataclass
class Result:
    accuracy: float
    samples: int
    wire_bytes: Optional[int]
    counted_bytes: Optional[int]
    analytic_per_sample: Optional[float]
    wall_s: float


def netns_available() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    probe = f"shoal-bench-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    if made:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return made


def in_namespace(command: list[str], name: str, cwd: Optional[Path] = None) -> tuple[subprocess.CompletedProcess, int]:
    """Run `command` in a fresh namespace whose only traffic is its own; return it and the loopback's tx bytes."""
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
        proc = subprocess.run(["ip", "netns", "exec", name, *command], capture_output=True, text=True, timeout=3600, cwd=cwd)
        counter = subprocess.run(["ip", "netns", "exec", name, "cat", "/sys/class/net/lo/statistics/tx_bytes"],
                                 capture_output=True, text=True, check=True)
        return proc, int(counter.stdout)
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def analytic_bytes_per_sample(job: Path, sets: list[str], samples_per_step: int) -> Optional[float]:
    args = [sys.executable, "-m", "shoal", "plan", str(job), "--estimate", "--json"]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        return None
    estimate = json.loads(proc.stdout).get("estimate", {})
    sent = sum(p["sent"] for p in estimate.get("processes", []))  # every process's bytes per step of its group
    return sent / samples_per_step if sent else None


def run_layout(layout: Layout, steps: int, seed: int, netns: bool, folder: Path, skip: int = 0) -> Result:
    job = folder / f"mlp-{layout.batch}-{seed}.conf"
    job.write_text(small_mlp(DATA, steps=steps, seed=seed, batch=layout.batch, random_skip=skip, disp_freq=50, disp_after=49))
    ws = Path(tempfile.mkdtemp(dir=folder)) / "ws"
    args = [sys.executable, "-m", "shoal", "run", str(job), "--workspace", str(ws), "--no-progress"]
    for s in layout.sets:
        args += ["--set", s]
    start = time.perf_counter()
    if netns and layout.wire:
        proc, wire = in_namespace(args, f"shoal-bench-{os.getpid()}")
    else:
        proc, wire = subprocess.run(args, capture_output=True, text=True, timeout=3600), None
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{layout.name}: {(proc.stderr.strip().splitlines() or ['failed'])[-1]}")
    records = [json.loads(line) for line in (ws / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("phase") == "train"]
    accuracy = [r for r in records if r.get("phase") == "test"][-1]["accuracy"]
    samples = steps * layout.batch * layout.groups
    counted = None
    if any("sent_bytes" in r for r in train):  # Local SGD: the chief group's pseudo-gradients, as many per group
        counted = sum(r.get("sent_bytes", 0) for r in train) * layout.groups
    elif any("pushed_bytes" in r for r in train):  # Downpour: the chief's pushes, as many per group
        counted = sum(r.get("pushed_bytes", 0) for r in train) * layout.groups
    # the estimate models one step of every Local SGD group (they meet in lockstep), one group's step otherwise
    modelled = layout.batch * (layout.groups if any(s.startswith("cluster.local_steps") for s in layout.sets) else 1)
    analytic = analytic_bytes_per_sample(job, list(layout.sets), modelled) if layout.wire else None
    return Result(accuracy, samples, wire, counted, analytic, wall)


def per_sample(value: Optional[float], samples: int) -> str:
    return "n/a" if value is None else f"{value / samples:,.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="steps per group")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--only", nargs="+", help="layouts whose name contains one of these")
    parser.add_argument("--random-skip", type=int, default=0,
                        help="SINGA's random_skip (each group draws its own start in [0, N]: their data overlap)")
    parser.add_argument("--set", dest="extra", action="append", default=[], help="an extra --set for the Local SGD layouts")
    args = parser.parse_args()
    if not (DATA / "test_data.bin").exists():
        raise SystemExit(f"{DATA}: run `shoal prepare mnist --out {DATA}` first")
    netns = netns_available()
    layouts = [l for l in LAYOUTS if not args.only or any(o in l.name for o in args.only)]
    if args.extra:
        layouts = [Layout(l.name + " + " + " ".join(args.extra), l.sets + tuple(args.extra), l.batch, l.groups, l.wire)
                   if "Local SGD" in l.name or "DiLoCo" in l.name else l for l in layouts]
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; {time.strftime('%Y-%m-%d %H:%M')}; "
          f"load {os.getloadavg()[0]:.1f}; {args.steps} steps per group; seeds {args.seeds}; "
          f"bytes on the wire: {'one network namespace per job' if netns else 'n/a (needs root and ip netns)'}")
    print("| layout | samples | test accuracy | wire B/sample | counted B/sample | analytic B/sample | wall s |")
    print("|---|---|---|---|---|---|---|")
    folder = Path(tempfile.mkdtemp())
    for layout in layouts:
        results = [run_layout(layout, args.steps, seed, netns, folder, args.random_skip) for seed in args.seeds]
        first = results[0]
        accuracy = " ".join(f"{r.accuracy:.4f}" for r in results)
        if len(results) > 1:
            accuracy += f" (mean {sum(r.accuracy for r in results) / len(results):.4f})"
        analytic = "n/a" if first.analytic_per_sample is None else f"{first.analytic_per_sample:,.0f}"
        print(f"| {layout.name} | {first.samples:,} | {accuracy} | {per_sample(first.wire_bytes, first.samples)} | "
              f"{per_sample(first.counted_bytes, first.samples)} | {analytic} | "
              f"{sum(r.wall_s for r in results) / len(results):.1f} |", flush=True)
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
