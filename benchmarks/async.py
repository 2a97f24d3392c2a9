"""Claims about asynchronous training on one machine (SINGA's MNIST MLP, real MNIST):

1. Time to 97 % test accuracy and samples/s for: 1 worker, 2 synchronous workers (in-memory
   Sandblaster), Downpour with 2 groups, in-memory Hogwild with 2 groups, Distributed Hogwild with
   2 groups, each through `shoal run` with the same job (examples/mnist/tuned.conf: Nesterov
   momentum, batch 64 per group) and the same wall-clock budget.
2. In-memory Hogwild samples/s against a baseline written the way PyTorch's mnist_hogwild example
   does it (model.share_memory(), N processes each with its own optimizer), same model, same N,
   batch and threads (goal >= 1.0).

Uneven workers (one of two 2x slower: bounded asynchronous groups against Sandblaster) are
benchmarks/async_uneven.py's claim.

    python benchmarks/async.py [--budget 300] [--hogwild-steps 200]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "examples" / "mnist" / "data"
LAYOUTS = {
    "1 worker": "",
    "sync 2 workers (in-memory Sandblaster)": "nworkers_per_group=2 nworkers_per_procs=2",
    "Downpour 2 groups": "nworker_groups=2 server_worker_separate=true",
    "in-memory Hogwild 2 groups": "nworker_groups=2 nworkers_per_procs=2",
    "Distributed Hogwild 2 groups": "nworker_groups=2 nserver_groups=2",
}


def run_shoal(cluster: str, sets: list[str], budget: float) -> list[dict]:
    """Run the tuned MLP for at most `budget` seconds; return its metrics records."""
    ws = Path(tempfile.mkdtemp()) / "ws"
    args = [sys.executable, "-m", "shoal", "run", str(REPO / "examples/mnist/tuned.conf"), "--workspace", str(ws), "--no-progress"]
    for s in sets + [f"cluster.{kv}" for kv in cluster.split()]:
        args += ["--set", s]
    proc = subprocess.Popen(args, cwd=REPO / "examples" / "mnist", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        proc.wait(timeout=budget)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # as `shoal jobs kill`: shoal stops every process of the job
        proc.wait(timeout=60)
    path = ws / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def time_to(records: list[dict], accuracy: float) -> str:
    hits = [r for r in records if r["phase"] == "test" and r["accuracy"] >= accuracy]
    return f"{hits[0]['time']:.0f} s (step {hits[0]['step']})" if hits else "not reached"


HOGWILD_BASELINE = r"""
import sys, time, torch, torch.nn as nn, torch.multiprocessing as mp
from shoal.config import job_pb2
from shoal.data.dataset import open_store

SIZES = [784, 2500, 2000, 1500, 1000, 500, 10]

def train(rank, model, steps, batch, threads, out):
    torch.set_num_threads(threads)
    torch.manual_seed(rank)
    store = open_store(job_pb2.StoreProto(backend="kvfile", path=sys.argv[1], shape=[784]))
    opt = torch.optim.SGD(model.parameters(), lr=0.005, momentum=0.9, nesterov=True)
    loss_fn = nn.CrossEntropyLoss()
    start = None
    for step in range(steps):
        if step == 5:
            start = time.perf_counter()
        x, y = store.rows(rank * 30000 + step * batch, batch)
        x = (torch.from_numpy(x) - 127.5) / 127.5
        opt.zero_grad()
        loss_fn(model(x), torch.from_numpy(y).long()).backward()
        opt.step()
    out.put((steps - 5) * batch / (time.perf_counter() - start))

if __name__ == "__main__":
    nprocs, steps, batch, threads = (int(a) for a in sys.argv[2:6])
    layers = []
    for a, b in zip(SIZES[:-1], SIZES[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    model = nn.Sequential(*layers[:-1])
    model.share_memory()
    out = mp.get_context("fork").Queue()
    procs = [mp.get_context("fork").Process(target=train, args=(r, model, steps, batch, threads, out)) for r in range(nprocs)]
    [p.start() for p in procs]
    [p.join() for p in procs]
    print(sum(out.get() for _ in procs))
"""


def hogwild_baseline(groups: int, steps: int, threads: int) -> float:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(HOGWILD_BASELINE)
    out = subprocess.run([sys.executable, f.name, str(DATA / "train_data.bin"), str(groups), str(steps), "64", str(threads)],
                         check=True, capture_output=True, text=True, cwd=REPO)
    return float(out.stdout.strip().splitlines()[-1])


def shoal_hogwild(groups: int, steps: int, threads: int) -> float:
    sets = [f"train_steps={steps}", "test_steps=0", "disp_freq=20", "checkpoint_freq=0", f"cluster.threads_per_worker={threads}"]
    records = run_shoal(f"nworker_groups={groups} nworkers_per_procs={groups}", sets, budget=3600)
    return statistics.median([r["samples_per_sec"] for r in records if r["phase"] == "train"][1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=float, default=300, help="wall-clock seconds per layout (claim 1)")
    parser.add_argument("--test-freq", type=int, default=250)
    parser.add_argument("--hogwild-steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if not (DATA / "train_data.bin").exists():
        sys.exit(f"{DATA}: run `shoal prepare mnist --out {DATA}` first")
    print(f"# {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}, {time.strftime('%Y-%m-%d')}")

    print(f"\n## Time to 97 % test accuracy, budget {args.budget:.0f} s per layout (tuned.conf, test every {args.test_freq} steps)\n")
    print("| layout | samples/s (median) | time to 95 % | time to 97 % | best test accuracy | mean staleness |")
    print("|---|---|---|---|---|---|")
    sets = ["train_steps=100000", f"test_freq={args.test_freq}", "test_steps=100", "disp_freq=50", "checkpoint_freq=0"]
    for name, cluster in LAYOUTS.items():
        records = run_shoal(cluster, sets, args.budget)
        train = [r for r in records if r["phase"] == "train"]
        tests = [r for r in records if r["phase"] == "test"]
        rate = statistics.median(r["samples_per_sec"] for r in train[1:]) if len(train) > 1 else 0.0
        stale = [r["staleness"] for r in train if "staleness" in r]
        best = max((r["accuracy"] for r in tests), default=0.0)
        print(f"| {name} | {rate:.0f} | {time_to(records, 0.95)} | {time_to(records, 0.97)} | {best:.4f} | "
              f"{statistics.mean(stale):.2f} |" if stale else
              f"| {name} | {rate:.0f} | {time_to(records, 0.95)} | {time_to(records, 0.97)} | {best:.4f} | — |", flush=True)

    groups, threads = 2, max(1, (os.cpu_count() or 2) // 2)
    print(f"\n## In-memory Hogwild vs a mnist_hogwild-style baseline: {groups} groups/processes, batch 64, {threads} thread(s) each\n")
    print("| repeat | shoal in-memory Hogwild samples/s | mnist_hogwild baseline samples/s | ratio |")
    print("|---|---|---|---|")
    ratios = []
    for i in range(args.repeats):
        ours = shoal_hogwild(groups, args.hogwild_steps, threads)
        theirs = hogwild_baseline(groups, args.hogwild_steps, threads)
        ratios.append(ours / theirs)
        print(f"| {i + 1} | {ours:.0f} | {theirs:.0f} | {ours / theirs:.2f} |", flush=True)
    print(f"\nmedian ratio: {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
