"""Claim: when one of two workers is 2x slower, asynchronous groups with a staleness bound (cluster.max_update_lag)
reach Sandblaster's 95 % MNIST test accuracy in at most 0.6x Sandblaster's wall-clock time.

Sandblaster (one group of 2 workers) waits for the slow worker every step; two asynchronous groups (one worker
each) do not wait for each other, except where the bound holds the fast one back. Both in one process (worker
threads; the asynchronous groups share the params: SINGA's in-memory Downpour) and over processes (a server
process; Downpour). The job is SINGA's LeNet (examples/mnist/conv.conf, unmodified but for the overrides below); every
worker computes on batches of the same size in every row (Sandblaster splits its group's batch, a Downpour group
is one worker), so the rows differ only in how updates are combined. Worker 1 of the job is slowed with
SHOAL_SLOW_WORKER=xFACTOR (each step takes FACTOR x its measured compute, whatever the machine's load).

Time to accuracy: the chief writes a checkpoint every --every steps and no test runs during training (a test
pauses Sandblaster's whole group but only an asynchronous chief); each checkpoint is tested afterwards on the whole
10,000-image test set, and its time is the wall-clock seconds since training started (metrics.jsonl's `time`). Each row runs --repeats times, interleaved; the table gives medians and the staleness
histogram (summary.json) of the Downpour rows.

    python benchmarks/async_uneven.py [--per-worker 32] [--steps 400] [--repeats 3] [--bound 2]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
MNIST = REPO / "examples" / "mnist"
JOB = MNIST / "conv.conf"
TARGET = 0.95


@dataclass(frozen=True)
class Row:
    name: str
    cluster: str  # cluster.FIELD=VALUE overrides
    batch_per_worker_factor: int  # the group's batch, in per-worker batches
    slow: str  # SHOAL_SLOW_WORKER: worker 1 of group 0 (one synchronous group) or worker 0 of group 1 (two groups)
    baseline: str = ""  # the synchronous row it is compared with (empty: it is one)


IN_MEMORY_SB = "in-memory Sandblaster, 2 worker threads"
PROCESSES_SB = "Sandblaster, 2 workers + server, 3 processes"


def rows(bound: int, factor: float) -> list[Row]:
    """Two families, each against its own Sandblaster: threads of one process (SINGA's docs call the asynchronous one
    in-memory Downpour; shoal: in-memory Hogwild) and processes (Downpour's server in a process of its own)."""
    threads, processes = "nworkers_per_procs=2", "server_worker_separate=true"
    sync, groups = f"1:x{factor}", f"1.0:x{factor}"
    return [
        Row(IN_MEMORY_SB, f"nworkers_per_group=2 {threads}", 2, sync),
        Row(f"in-memory Hogwild (SINGA: in-memory Downpour), 2 groups, max_update_lag {bound}",
            f"nworker_groups=2 {threads} max_update_lag={bound}", 1, groups, IN_MEMORY_SB),
        Row(PROCESSES_SB, f"nworkers_per_group=2 {processes}", 2, sync),
        Row(f"Downpour, 2 groups + server, 3 processes, max_update_lag {bound}", f"nworker_groups=2 {processes} max_update_lag={bound}",
            1, groups, PROCESSES_SB),
        Row(f"Downpour as above, overlap_push, max_update_lag {2 * bound + 1}",
            f"nworker_groups=2 {processes} overlap_push=true max_update_lag={2 * bound + 1}", 1, groups, PROCESSES_SB),
    ]


@dataclass
class Result:
    seconds_to_target: Optional[float]
    step_to_target: Optional[int]
    samples_per_sec: float
    histogram: dict = field(default_factory=dict)
    layout: tuple = ()  # summary.json's (processes, workers, framework): the run had its layout


def train(row: Row, per_worker: int, steps: int, every: int, workspace: Path, data: Path) -> Path:
    """`shoal run` the row; returns the workspace of the run that finished."""
    # a display after steps every-1, 2*every-1, ... closes the training window that each checkpoint follows
    sets = [f"train_steps={steps}", "test_freq=0", f"disp_freq={every}", f"disp_after={every - 1}", f"checkpoint_freq={every}",
            f"neuralnet.layer[0].store_conf.batchsize={per_worker * row.batch_per_worker_factor}"] + data_paths(data)
    sets += [f"cluster.{kv}" for kv in row.cluster.split()]
    args = [sys.executable, "-m", "shoal", "run", str(JOB), "--no-progress"]
    for s in sets:
        args += ["--set", s]
    env = {**os.environ, "SHOAL_SLOW_WORKER": row.slow}
    for attempt in range(2):  # a run that crashes is reported with its log's end, and run once more
        ws = workspace.with_name(f"{workspace.name}{attempt}")
        with open(ws.with_suffix(".log"), "w") as log:
            proc = subprocess.run(args + ["--workspace", str(ws)], cwd=MNIST, stdout=log, stderr=subprocess.STDOUT, env=env)
        if proc.returncode == 0:
            return ws
        tail = ws.with_suffix(".log").read_text().splitlines()[-15:]
        print(f"{row.name}: shoal run exited {proc.returncode}:\n  " + "\n  ".join(tail), file=sys.stderr, flush=True)
    raise SystemExit(f"{row.name}: shoal run failed twice")


def wall_seconds(workspace: Path) -> dict[int, float]:
    """Seconds since training started when each step's checkpoint was taken (it follows the display at step s-1).
    Wall-clock, checkpoint pauses included: while Sandblaster's pause stops the job, an asynchronous chief's pause
    lets the other group run on (up to the bound), so leaving pauses out would hand the asynchronous rows free work."""
    records = [json.loads(line) for line in (workspace / "metrics.jsonl").read_text().splitlines() if line.strip()]
    seconds = {0: 0.0}
    for r in records:
        if r["phase"] == "train":
            seconds[r["step"] + 1] = r["time"]
    return seconds


def data_paths(data: Path) -> list[str]:
    """The job's train and test stores in `data` (`shoal prepare mnist --out DATA`)."""
    return [f"neuralnet.layer[0].store_conf.path={data / 'train_data.bin'}", f"neuralnet.layer[1].store_conf.path={data / 'test_data.bin'}"]


def accuracy_of(checkpoint: Path, workspace: Path, data: Path) -> float:
    import shoal

    job = shoal.load_job(JOB, ["test_steps=100"] + data_paths(data))  # the whole test set: 100 batches of 100
    return shoal.evaluate(job, checkpoint=checkpoint, workspace=workspace / "eval", log=lambda *a: None)["accuracy"]


def measure(row: Row, per_worker: int, steps: int, every: int, folder: Path, data: Path = MNIST / "data") -> Result:
    workspace = Path(tempfile.mkdtemp(dir=folder)) / "ws"
    workspace = train(row, per_worker, steps, every, workspace, data)
    seconds = wall_seconds(workspace)
    summary = json.loads((workspace / "summary.json").read_text())
    reached = None
    for step in range(every, steps + 1, every):  # the first checkpoint at the target accuracy
        checkpoint = workspace / "checkpoint" / f"step{step}-worker0.safetensors"
        if step in seconds and checkpoint.exists() and accuracy_of(checkpoint, workspace, data) >= TARGET:
            reached = step
            break
    return Result(seconds.get(reached) if reached else None, reached, summary.get("samples_per_sec") or 0.0,
                  summary.get("staleness_histogram") or {}, (summary["processes"], summary["workers"], summary["framework"]))


def machine() -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{platform.node()}, {os.cpu_count()} cores, {platform.processor() or platform.machine()}, load {load:.2f}"


def merged_lags(results: list[Result]) -> Counter:
    lags: Counter = Counter()
    for r in results:
        lags.update({int(k): v for k, v in r.histogram.get("updates_per_lag", {}).items()})
    return lags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-worker", type=int, default=32, help="samples each worker computes per step")
    parser.add_argument("--steps", type=int, default=400, help="chief steps per run")
    parser.add_argument("--every", type=int, default=5, help="checkpoint (and so accuracy resolution) every N chief steps")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bound", type=int, default=2, help="cluster.max_update_lag of the bounded rows (overlap_push: 2 * bound + 1)")
    parser.add_argument("--factor", type=float, default=2.0, help="how many times slower worker 1 is")
    args = parser.parse_args()
    if not (MNIST / "data" / "train_data.bin").exists():
        raise SystemExit("prepare MNIST first: shoal prepare mnist --out examples/mnist/data (docs/datasets.md)")
    table = rows(args.bound, args.factor)
    print(f"# {time.strftime('%Y-%m-%d')}, {machine()}, torch {__import__('torch').__version__}")
    print(f"# LeNet (examples/mnist/conv.conf), {args.per_worker} samples per worker per step, worker 1 {args.factor:g}x slower, "
          f"target {TARGET:.0%} on the 10,000 test images, checkpoints every {args.every} chief steps, {args.repeats} repeats\n")
    results: dict[str, list[Result]] = {r.name: [] for r in table}
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(args.repeats):
            for row in table if repeat % 2 == 0 else reversed(table):  # interleaved: drift in the machine's load hits every row
                results[row.name].append(measure(row, args.per_worker, args.steps, args.every, Path(folder)))
                r = results[row.name][-1]
                print(f"  [{repeat + 1}/{args.repeats}] {row.name}: {r.seconds_to_target} s (step {r.step_to_target}), "
                      f"{r.samples_per_sec:.0f} samples/s", file=sys.stderr, flush=True)
    print("| layout | time to 95 % (median s; runs) | x its Sandblaster | chief step at 95 % | samples/s | staleness: updates per lag (max) |")
    print("|---|---|---|---|---|---|")
    for row in table:
        runs = results[row.name]
        seconds = median_seconds(runs)
        steps = [r.step_to_target for r in runs if r.step_to_target]
        lags = merged_lags(runs)
        spread = ", ".join(f"{lag}: {n}" for lag, n in sorted(lags.items())) + f" ({max(lags)})" if lags else "-"
        baseline = median_seconds(results[row.baseline]) if row.baseline else None
        ratio = f"{seconds / baseline:.2f}" if seconds and baseline else "-"
        print(f"| {row.name} | {fmt(seconds)} ({', '.join(fmt(r.seconds_to_target) for r in runs)}) | {ratio} | "
              f"{statistics.median(steps) if steps else 'not reached'} | {statistics.median(r.samples_per_sec for r in runs):.0f} | {spread} |")


def median_seconds(runs: list[Result]) -> Optional[float]:
    """Median time to the target; a run that never reached it counts as slower than every run that did."""
    values = sorted((r.seconds_to_target if r.seconds_to_target is not None else float("inf")) for r in runs)
    middle = statistics.median_low(values) if values else float("inf")
    return None if middle == float("inf") else middle


def fmt(seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{seconds:.1f}"


if __name__ == "__main__":
    main()
