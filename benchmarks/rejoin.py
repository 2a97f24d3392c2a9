"""Claim: a dead Downpour worker group is back in the running job, on the servers' live params, within 2 s of its
process starting; restarted by the launcher (--max-restarts), well under a second from the moment its death was seen.

One Downpour run on MNIST (small MLP 784-256-128-10, 2 groups + 1 server, 3 processes, --max-restarts K): group 1's
process is SIGKILLed K times, each once the previous restart rejoined and trained a while; then one more run where
the group is brought back by hand (`shoal run JOB --rejoin 1`, a fresh Python process). Prints, per kill, the step
and version it rejoined at and the times (the launcher's detection of the death → the first pull answered; the new
process's start → the first pull answered), the final test accuracy, and whether the server lost any update
(its version against the updates it applied).

    shoal prepare mnist --out examples/mnist/data     # once
    python benchmarks/rejoin.py [--kills 3] [--steps 1500]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "examples" / "mnist" / "data"
sys.path.insert(0, str(REPO / "benchmarks"))
from mnist_mlp import small_mlp  # noqa: E402 - the MLP every asynchronous benchmark trains
LAYOUT = ["--set", "cluster.nworker_groups=2", "--set", "cluster.server_worker_separate=true"]

def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise SystemExit(f"timed out waiting for {what}")


def pids_of_rank1(ws: Path) -> list[int]:
    log = ws / "logs" / "rank1.log"
    return [int(p) for p in re.findall(r"in process 1 \(pid = (\d+)\)", log.read_text())] if log.exists() else []


def records(ws: Path) -> list[dict]:
    path = ws / "logs" / "rejoins.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def start(job: Path, ws: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "shoal", "run", str(job), "--workspace", str(ws), "--no-progress", *LAYOUT, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def outcome(proc: subprocess.Popen, ws: Path) -> tuple[float, str]:
    out, err = proc.communicate(timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"the run failed: {err.strip()}")
    tests = [json.loads(line) for line in (ws / "metrics.jsonl").read_text().splitlines() if '"phase": "test"' in line]
    final = re.search(r"version (\d+); updates applied: group 0: (\d+), group 1: (\d+)", (ws / "logs" / "rank2.log").read_text())
    version, group0, group1 = map(int, final.groups())
    return tests[-1]["accuracy"], f"version {version} = {group0} + {group1} updates applied" + (" ✓" if version == group0 + group1 else " ✗")


def automatic(job: Path, kills: int, gap_s: float) -> None:
    ws = Path(tempfile.mkdtemp()) / "ws"
    proc = start(job, ws, "--max-restarts", str(kills))
    for kill in range(kills):
        pid = wait_for(lambda: (pids_of_rank1(ws) or [None])[-1] if len(pids_of_rank1(ws)) == kill + 1 else None, 120, "rank 1")
        time.sleep(gap_s)  # let it train a while (a restarted one: after its rejoin)
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: len(records(ws)) == kill + 1, 60, f"rejoin {kill + 1}")
    accuracy, applied = outcome(proc, ws)
    print("\n| kill | rejoined at step | version pulled | detection → rejoin (s) | process start → rejoin (s) | of which handshake + pull (s) |")
    print("|---|---|---|---|---|---|")
    for i, r in enumerate(records(ws), 1):
        print(f"| {i} (automatic) | {r['step']} | {r['version']} | {r['detection_to_rejoin_s']:.3f} | {r['process_start_to_rejoin_s']:.3f} | {r['handshake_and_pull_s']:.3f} |")
    print(f"\nfinal test accuracy {accuracy:.4f}; server: {applied}")


def by_hand(job: Path, gap_s: float) -> None:
    ws = Path(tempfile.mkdtemp()) / "ws"
    proc = start(job, ws)
    pid = wait_for(lambda: (pids_of_rank1(ws) or [None])[0], 120, "rank 1")
    time.sleep(gap_s)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: "lost worker group 1" in (ws / "logs" / "rank2.log").read_text(), 60, "the server to see the death")
    seen = time.time()
    hand = subprocess.run([sys.executable, "-m", "shoal", "run", str(job), "--workspace", str(ws), "--rejoin", "1", *LAYOUT],
                          capture_output=True, text=True, timeout=1800)
    if hand.returncode != 0:
        raise SystemExit(f"--rejoin failed: {hand.stderr.strip()}")
    accuracy, applied = outcome(proc, ws)
    r = records(ws)[0]
    print(f"| by hand (`--rejoin 1`, a fresh Python process) | {r['step']} | {r['version']} | "
          f"{r['time'] - seen:.3f} (from the server's warning) | {r['process_start_to_rejoin_s']:.3f} | {r['handshake_and_pull_s']:.3f} |")
    print(f"\nby hand: final test accuracy {accuracy:.4f}; server: {applied}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1500, help="steps per group")
    parser.add_argument("--gap", type=float, default=2.0, help="seconds between a (re)start and the next kill")
    args = parser.parse_args()
    if not (DATA / "test_data.bin").exists():
        raise SystemExit(f"{DATA}: run `shoal prepare mnist --out {DATA}` first")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; {time.strftime('%Y-%m-%d')}; load {os.getloadavg()[0]:.1f}")
    job = Path(tempfile.mkdtemp()) / "rejoin.conf"
    job.write_text(small_mlp(DATA, steps=args.steps, name="rejoin-mlp"))
    automatic(job, args.kills, args.gap)
    by_hand(job, args.gap)
    print(f"load afterwards {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
