"""OpenMP's waits in the ranks shoal starts, on an idle and on a busy machine (issue 40, point 1).

libgomp's threads (torch's intra-op pool, MKL's, oneDNN's) spin after each parallel region before they sleep, unless
OMP_WAIT_POLICY=PASSIVE: on a machine whose cores are shared that spinning burns CPU the other processes (the job's
other rank, other jobs) need. shoal's ranks get OMP_WAIT_POLICY=PASSIVE unless the user's environment sets it
(docs/cluster.md, "Threads"); this script measures what that is worth, the same job under each policy:

- spin: OpenMP's own default, what the ranks had before (about 3 ms of spinning, then sleep): OMP_WAIT_POLICY unset
  and GOMP_SPINCOUNT=300000 (OpenMP's default count, which libgomp takes over the policy shoal sets);
- passive: OMP_WAIT_POLICY unset, so shoal's default: PASSIVE (sleep at once);
- active (--policies ... active): OMP_WAIT_POLICY=ACTIVE (spin for minutes: the idle, dedicated machine's choice).

The job: `shoal.fit` of examples/gpt's GPT at benchmarks/gpt_lowcomm.py's small sizes (--full: the full ones), DiLoCo
(2 groups x 1 process, H = 50, AdamW inside, outer SGD 0.7 Nesterov) or AllReduce over 2 processes (--layout
allreduce), --threads torch threads per worker (default 1, as benchmarks/peer_torchft.py; 2 lets the intra-op pools
spin and oversubscribes 2 cores), each job in a fresh process, the policies alternating within each round, with
--load N CPU-burning processes beside every job (0: idle). Columns:

- samples/s: summary.json's samples_per_sec (the chief's group's samples over its training seconds);
- compute s/step: the chief's seconds computing gradients per step (metrics.jsonl's compute_sec over its steps): what a
  busy machine doubled (issue 40);
- loop s: the first step to the end of the final validation (the final test record's time);
- job s: the job's process, start to exit;
- CPU s: user + system CPU seconds of the job's whole process tree (the job's process, the forkserver, the ranks),
  as the kernel counted them when each was reaped (this script reaps the orphans: PR_SET_CHILD_SUBREAPER; Linux).

    shoal prepare shakespeare --out examples/gpt/data      # once
    python benchmarks/busy_machine.py [--steps 200] [--rounds 2] [--load 0 3] [--layout diloco] [--threads 1] [--full]

Timings belong to an otherwise idle machine (the --load processes are the only load meant to be there).
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import functools
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import gpt  # noqa: E402 - the model's loss, AdamW, schedule and clipping every GPT benchmark uses
from gpt_lowcomm import build, nesterov_outer, sizes  # noqa: E402 - the GPT at its sizes, DiLoCo's outer optimizer

H = 50
LAYOUTS = {"diloco": dict(nworker_groups=2, local_steps=H), "allreduce": dict(nworkers_per_group=2, nservers_per_group=2)}
# policy -> the variables of the job's environment (None: removed)
POLICIES = {
    "spin": {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "300000"},
    "passive": {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None},
    "active": {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": None},
}
PR_SET_CHILD_SUBREAPER = 36


def job(args) -> None:
    """The job's process: shoal.fit starts the ranks (forked from its forkserver) and ends them."""
    import torch
    import shoal

    torch.set_num_threads(args.threads)
    model, train, val = build(not args.full, args.seed)
    ws = Path(tempfile.mkdtemp(prefix="busy-machine-")) / "ws"
    extra = {"outer_optimizer": nesterov_outer} if args.layout == "diloco" else {}
    batch = sizes(not args.full)["batch"] * (2 if args.layout == "allreduce" else 1)  # the 2 groups' rows, as one group's
    history = shoal.fit(model, gpt.next_char_loss, train, test_data=val, test_batch=100, steps=args.steps, batch_size=batch,
                        seed=args.seed, cluster=shoal.Cluster(threads_per_worker=args.threads, **LAYOUTS[args.layout]),
                        optimizer=gpt.adamw, scheduler=functools.partial(gpt.scheduler, steps=args.steps),
                        clip_grad_norm=gpt.CLIP, disp_freq=max(1, args.steps // 10), workspace=ws, log=lambda _line: None,
                        **extra)
    summary = json.loads((ws / "summary.json").read_text())
    train_records = history.phase("train")
    groups = LAYOUTS[args.layout].get("nworker_groups", 1)
    steps = sum(r["samples"] for r in train_records) / (batch * groups)  # a record's samples: every group's, every step's
    compute = sum(r.get("compute_sec", 0.0) for r in train_records)
    tests = history.phase("test")
    args.out.write_text(json.dumps({"samples_per_s": summary.get("samples_per_sec"), "loop_s": tests[-1]["time"],
                                    "compute_per_step_s": compute / steps if steps else None,
                                    "val_loss": history.final_test["loss"]}))
    shutil.rmtree(ws.parent, ignore_errors=True)


def reap_orphans(keep: set[int], timeout_s: float = 30.0) -> None:
    """Wait for every child but `keep` (the load): the job's forkserver and resource tracker come to this process
    (a subreaper) when the job's process ends, and their CPU time counts in RUSAGE_CHILDREN once they are reaped."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        children = set()
        for task in Path("/proc/self/task").iterdir():
            children |= {int(pid) for pid in (task / "children").read_text().split()}
        children -= keep
        if not children:
            return
        for pid in children:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        time.sleep(0.05)
    print(f"warning: processes {sorted(children)} outlived their job; their CPU time is not counted", file=sys.stderr)


def run_job(policy: str, args, load: set[int]) -> dict:
    """One job in a fresh process under `policy`: its result, wall time and its process tree's CPU seconds."""
    out = Path(tempfile.mkdtemp(prefix="busy-machine-")) / "result.json"
    env = dict(os.environ, SHOAL_HOME=str(out.parent / "home"))  # shoal's job registry: this job's own
    for name, value in POLICIES[policy].items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    cmd = [sys.executable, str(Path(__file__).resolve()), "--job", "--out", str(out), "--steps", str(args.steps),
           "--seed", str(args.seed), "--layout", args.layout, "--threads", str(args.threads)] + (["--full"] if args.full else [])
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
    job_s = time.perf_counter() - start
    reap_orphans(load)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        raise SystemExit(f"the {policy} job failed (exit {proc.returncode}): {lines[-1] if lines else 'no output'}")
    result = json.loads(out.read_text())
    shutil.rmtree(out.parent, ignore_errors=True)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return result | {"job_s": job_s, "cpu_s": cpu_s}


def describe(variables: dict) -> str:
    return ", ".join(f"{name}={value or 'unset'}" for name, value in variables.items())


def start_load(n: int) -> list[subprocess.Popen]:
    """N processes that burn a CPU each until stopped (the fixed load of issue 40)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="steps per group (DiLoCo: a multiple of H = 50)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, the policies alternating within each")
    parser.add_argument("--load", type=int, nargs="+", default=[0, 3], help="CPU-burning processes beside every job, per pass")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="diloco")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker (cluster.threads_per_worker)")
    parser.add_argument("--policies", nargs="+", choices=list(POLICIES), default=["spin", "passive"])
    parser.add_argument("--full", action="store_true", help="the GPT's full sizes (4 layers, 128 wide, block 64)")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        return job(args)
    if args.layout == "diloco" and args.steps % H:
        raise SystemExit(f"--steps must be a multiple of H = {H} for DiLoCo")
    if any(not (REPO / "examples/gpt/data" / n).is_file() for n in ("train.txt", "val.txt", "vocab.txt")):
        raise SystemExit("examples/gpt/data: run `shoal prepare shakespeare --out examples/gpt/data` first")
    if not sys.platform.startswith("linux"):
        raise SystemExit("busy_machine.py counts a job's CPU time as a Linux subreaper: Linux only")
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    s = sizes(not args.full)
    print(f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"machine: {gpt.machine()}; load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"GPT {s['layers']} layers, {s['width']} wide, block {s['block']}; {args.layout}, 2 processes x {args.threads} "
          f"thread(s), {args.steps} steps, seed {args.seed}; policies: "
          + "; ".join(f"{p} ({describe(POLICIES[p])})" for p in args.policies) + "\n")
    print("| load | round | policy | samples/s | compute s/step | loop s | job s | CPU s | val loss |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    results: dict[tuple[int, str], list[dict]] = {}
    for n in args.load:
        load = start_load(n)
        try:
            for round_ in range(args.rounds):
                for policy in args.policies if round_ % 2 == 0 else args.policies[::-1]:
                    r = run_job(policy, args, {p.pid for p in load})
                    results.setdefault((n, policy), []).append(r)
                    print(f"| {n} | {round_ + 1} | {policy} | {r['samples_per_s']:.1f} | {r['compute_per_step_s']:.4f} | "
                          f"{r['loop_s']:.1f} | {r['job_s']:.1f} | {r['cpu_s']:.1f} | {r['val_loss']:.4f} |", flush=True)
        finally:
            for p in load:
                p.kill()
                p.wait()
    print("\nmedians:")
    print("| load | policy | samples/s | compute s/step | job s | CPU s |")
    print("|---|---|---|---|---|---|")
    for (n, policy), rs in results.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("samples_per_s", "compute_per_step_s", "job_s", "cpu_s")}
        print(f"| {n} | {policy} | {med['samples_per_s']:.1f} | {med['compute_per_step_s']:.4f} | {med['job_s']:.1f} | "
              f"{med['cpu_s']:.1f} |")


if __name__ == "__main__":
    main()
