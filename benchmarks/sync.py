"""Claims about synchronous training on one machine:

1. Two shoal worker processes train at least as fast as torch DistributedDataParallel (gloo) with
   two processes: same model (SINGA's MNIST MLP), global batch, data and optimizer (goal >= 1.00).
2. Throughput of the layouts: 1 worker, 2 workers as threads, 2 processes, AllReduce, Sandblaster
   (2 workers + 2 server processes), with the thread budget on (cores / workers) and off (every
   process uses every core).
3. Bytes moved per step per worker over loopback, measured from the kernel's counter of bytes
   sent on the `lo` interface, next to the analytic value. As root, every run gets a network
   namespace of its own (`unshare -n`), so its `lo` carries nothing but that run's traffic; otherwise
   the host's `lo` counter is read (other programs' loopback traffic then counts too).

Because samples/s swing with whatever else runs on the machine, the comparison also reports CPU
seconds per step of the whole process tree (getrusage of waited-for children; the difference
between a long and a short run, so start-up cancels out): under contention a system that needs
fewer CPU seconds per step gets more steps done.

Samples/s are steady-state means for both systems: shoal's from its display windows after the
first ten steps (samples / time, from metrics.jsonl), DDP's timed from step 10 to the end. The
DDP comparison is repeated (--repeats, interleaved) because other programs may share the cores.

    python benchmarks/sync.py [--steps 50] [--batch 64] [--repeats 3] [--skip-layouts]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIZES = [784, 2500, 2000, 1500, 1000, 500, 10]
PARAMS = sum(a * b + b for a, b in zip(SIZES[:-1], SIZES[1:]))


ISOLATED = os.geteuid() == 0 and shutil.which("unshare") is not None and shutil.which("ip") is not None


def lo_sent(dev_text: str) -> int:
    """Bytes sent on `lo` from a /proc/net/dev listing (each loopback byte is counted once as sent)."""
    for line in dev_text.splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "lo":
            return int(rest.split()[8])
    return 0


def adopt_orphans() -> None:
    """Make this process the reaper of its descendants' orphans (Linux PR_SET_CHILD_SUBREAPER): shoal's ranks are
    children of multiprocessing's forkserver, which nobody waits for once `shoal run` exits, so without this their
    CPU time never reaches getrusage(RUSAGE_CHILDREN) here."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # 36: PR_SET_CHILD_SUBREAPER


def reap_orphans(timeout: float = 30.0) -> None:
    """Wait for the adopted orphans of a finished run (the forkserver exits once its parent has)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return  # none left
        if pid == 0:
            time.sleep(0.05)


def children_cpu_seconds() -> float:
    reap_orphans()
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def cpu_per_step(run, short: int, long: int) -> float:
    """CPU seconds per step of `run(steps)` (all its processes), start-up cancelled out."""
    spent = []
    for steps in (short, long):
        before = children_cpu_seconds()
        run(steps)
        spent.append(children_cpu_seconds() - before)
    return (spent[1] - spent[0]) / (long - short)


def run_measured(args: list[str], cwd: Path = REPO) -> int:
    """Run `args`; return the bytes it sent over loopback (its own namespace's `lo` when isolated)."""
    if not ISOLATED:
        before = lo_sent(Path("/proc/net/dev").read_text())
        subprocess.run(args, check=True, capture_output=True, cwd=cwd)
        return lo_sent(Path("/proc/net/dev").read_text()) - before
    script = 'ip link set lo up && "$@" >/dev/null && echo "==proc/net/dev==" && cat /proc/net/dev'
    out = subprocess.run(["unshare", "-n", "sh", "-c", script, "sh", *args], check=True, capture_output=True, text=True, cwd=cwd).stdout
    return lo_sent(out.split("==proc/net/dev==")[-1])


def run_shoal(data: Path, cluster: str, steps: int, batch: int, threads: int) -> tuple[float, float]:
    """(samples/s over the display windows after step 10, loopback bytes per step)."""
    ws = Path(tempfile.mkdtemp()) / "ws"
    sets = [f"train_steps={steps}", "test_steps=0", "disp_freq=10", f"neuralnet.layer[0].store_conf.path={data}",
            f"neuralnet.layer[0].store_conf.batchsize={batch}", "updater.momentum=0.9"]
    sets += [f"cluster.{kv}" for kv in cluster.split()]
    if threads:
        sets.append(f"cluster.threads_per_worker={threads}")
    args = [sys.executable, "-m", "shoal", "run", str(REPO / "examples/mnist/job.conf"), "--workspace", str(ws), "--no-progress"]
    for s in sets:
        args += ["--set", s]
    moved = run_measured(args)
    records = [json.loads(line) for line in (ws / "metrics.jsonl").read_text().splitlines()]
    windows = [r for r in records if r["phase"] == "train" and r["step"] > 10]
    seconds = sum(10 * batch / r["samples_per_sec"] for r in windows)
    return (10 * batch * len(windows) / seconds if windows else float("nan")), moved / steps


DDP_SCRIPT = r"""
import sys, time, torch, torch.distributed as dist, torch.multiprocessing as mp
from shoal.config import job_pb2
from shoal.data.dataset import open_store

SIZES = [784, 2500, 2000, 1500, 1000, 500, 10]

class STanh(torch.nn.Module):
    def forward(self, x):
        return 1.7159047 * torch.tanh(0.6666667 * x)

def worker(rank, world, port, data, steps, batch, threads, out):
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    layers = []
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(SIZES) - 2:
            layers.append(STanh())
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers))
    opt = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9)
    ds = open_store(job_pb2.StoreProto(path=data, shape=[784]))
    share = batch // world
    start_time = None
    for step in range(steps):
        if step == 10:
            dist.barrier()
            start_time = time.perf_counter()
        start = step * batch + rank * share
        x = (torch.from_numpy(ds.data[start:start + share]) - 127.5) / 127.5
        y = torch.from_numpy(ds.labels[start:start + share])
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    dist.barrier()
    if rank == 0:
        open(out, "w").write(str(batch * (steps - 10) / (time.perf_counter() - start_time)))
    dist.destroy_process_group()

def main():
    port, data, steps, batch, threads, out = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
    mp.start_processes(worker, args=(2, port, data, steps, batch, threads, out), nprocs=2, start_method="spawn")

if __name__ == "__main__":
    main()
"""


def run_ddp(data: Path, steps: int, batch: int, threads: int) -> float:
    """The same training written the way a DDP user writes it, two processes on loopback."""
    sys.path.insert(0, str(REPO / "src"))
    from shoal.comm.dist import free_port

    script = Path(tempfile.mkdtemp()) / "ddp.py"
    script.write_text(DDP_SCRIPT)
    out = script.with_suffix(".out")
    port = 29400 if ISOLATED else free_port()  # a namespace of its own has every port free
    run_measured([sys.executable, str(script), str(port), str(data), str(steps), str(batch), str(threads), str(out)])
    return float(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the DDP comparison")
    parser.add_argument("--skip-layouts", action="store_true", help="only the DDP comparison")
    args = parser.parse_args()
    adopt_orphans()
    data = REPO / "examples/mnist/data/train_data.bin"
    if not data.exists():
        sys.exit("prepare MNIST first: shoal prepare mnist --out examples/mnist/data")
    cores = os.cpu_count() or 1
    print(f"machine: {platform.machine()}, {cores} cores; SINGA MNIST MLP ({PARAMS:,} params), global batch {args.batch}, momentum SGD")
    print(f"bytes: {'each run in its own network namespace' if ISOLATED else 'host-wide lo counter (not root: other traffic counts too)'}")

    # claim 1: two processes each, one thread budget (cores / 2) each, interleaved rounds
    ratios: dict[str, list[float]] = {"1 server (rank 0)": [], "AllReduce, 2 servers": []}
    print(f"\n{'round':<6} | {'DDP':>6} | {'shoal, 1 server':>16} | {'shoal AllReduce, 2 servers':>27}")
    for round_ in range(args.repeats):
        ddp = run_ddp(data, args.steps, args.batch, max(1, cores // 2))
        one, _ = run_shoal(data, "nworkers_per_group=2", args.steps, args.batch, 0)
        two, _ = run_shoal(data, "nworkers_per_group=2 nservers_per_group=2", args.steps, args.batch, 0)
        ratios["1 server (rank 0)"].append(one / ddp)
        ratios["AllReduce, 2 servers"].append(two / ddp)
        print(f"{round_:<6} | {ddp:>6.0f} | {one:>8.0f} ({one / ddp:.2f}x) | {two:>19.0f} ({two / ddp:.2f}x)", flush=True)
    for name, values in ratios.items():
        print(f"shoal {name} / DDP: median {statistics.median(values):.2f} (min {min(values):.2f}, max {max(values):.2f})")
    short, long = 20, 20 + args.steps
    cpu = {
        "DDP": cpu_per_step(lambda n: run_ddp(data, n, args.batch, max(1, cores // 2)), short, long),
        "shoal, 1 server": cpu_per_step(lambda n: run_shoal(data, "nworkers_per_group=2", n, args.batch, 0), short, long),
        "shoal AllReduce, 2 servers": cpu_per_step(lambda n: run_shoal(data, "nworkers_per_group=2 nservers_per_group=2", n, args.batch, 0), short, long),
    }
    print("CPU seconds per step, all processes: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in cpu.items()))
    print()
    if args.skip_layouts:
        return

    # analytic bytes per step per worker: the gradient bytes it must ship to servers in other
    # processes plus the value bytes it must get back (P = 4 bytes x params)
    p = 4 * PARAMS
    layouts = [
        ("1 worker", "", 1, 0),
        ("2 workers, threads (in-memory)", "nworkers_per_group=2 nworkers_per_procs=2", 2, 0),
        ("2 processes, 1 server", "nworkers_per_group=2", 2, p),  # worker 1 ships everything, worker 0 nothing
        ("AllReduce: 2 processes, 2 servers", "nworkers_per_group=2 nservers_per_group=2", 2, p),
        ("Sandblaster: 2 workers + 2 servers", "nworkers_per_group=2 nservers_per_group=2 server_worker_separate=true", 2, 2 * p),
    ]
    print(f"{'layout':<36} | {'budget on':>10} | {'budget off':>10} | {'lo bytes/step/worker':>20} | {'analytic':>10}", flush=True)
    print("-" * 98)
    for name, cluster, workers, analytic in layouts:
        on, moved = run_shoal(data, cluster, args.steps, args.batch, 0)
        off, _ = run_shoal(data, cluster, args.steps, args.batch, cores)
        print(f"{name:<36} | {on:>10.0f} | {off:>10.0f} | {moved / workers / 1e6:>17.1f} MB | {analytic / 1e6:>7.1f} MB", flush=True)


if __name__ == "__main__":
    main()
