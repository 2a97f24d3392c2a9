"""Does `shoal plan --hosts` hold between hosts? Predicted against measured over shaped links (issue 30, point 3).

Two "hosts" are two network namespaces on this machine joined by a veth pair whose both ends are
rate-limited with `tc` (an HTB class per direction: `--rates`, Mbit/s each way). Each host gets one
of this machine's two cores (`taskset`), and the prediction is asked for exactly that: 2 hosts of 1
core, the link's bandwidth and latency as measured over the veth: what TCP carries one way, and each way while both
ends send at once (below the shaped rate by the headers, and both ways by the ACKs queued behind the other
direction's data), and half a one-byte round trip. Each framework of
`shoal plan --hosts` (planning/alternatives.py SCALING: AllReduce, Sandblaster, Downpour, Distributed
Hogwild) and Local SGD (H = --local-steps) runs the MNIST MLP of benchmarks/mnist_mlp.py as
`shoal run JOB --nnodes 2 --node-rank R --master A:PORT` in both namespaces, one worker per host,
`cluster.threads_per_worker=1` on both sides. Measured: steady-state samples/s (`shoal compare`'s,
from the chief's metrics.jsonl) and the bytes that crossed the link (the two veth ends' tx counters,
nothing else uses them) per sample; predicted: `shoal.planning.estimate` for the same job on those
hosts, and its per-step bytes between processes on different hosts. A row is within 25 % or not.

Latency is not shaped: this kernel has no `sch_netem` (only rate-limiting qdiscs), so the link's
latency is the veth's own (tens of µs), measured and given to the prediction as it is.

    python benchmarks/shaped_links.py [--rates 1000,100] [--steps 120] [--only AllReduce,Downpour] [--plot docs]
Needs root, iproute2 (ip, tc) and taskset; `shoal prepare mnist --out examples/mnist/data` once.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


def _benchmark_module(name: str):
    """A sibling benchmark script as a module, by its path (putting benchmarks/ on sys.path would shadow examples/gpt)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"shoal_benchmarks_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


small_mlp = _benchmark_module("mnist_mlp").small_mlp

from shoal.frontend import api  # noqa: E402
from shoal.planning.alternatives import SCALING, with_cluster  # noqa: E402
from shoal.planning.estimate import Hosts, estimate, plan_kernels  # noqa: E402
from shoal.planning.nodes import node_of_rank  # noqa: E402
from shoal.planning.plan import plan_job  # noqa: E402
from shoal.runtime import calibrate  # noqa: E402

DATA = REPO / "examples" / "mnist" / "data"
BATCH = 64
SUBNET = "10.233.{}.{}"


@dataclass(frozen=True)
class Link:
    rate_mbit: float
    latency_s: float  # measured one way (half a ping round trip)
    devices: tuple[tuple[str, str], ...]  # (namespace, veth) of both ends
    goodput_mbit: float = 0.0  # measured: TCP payload one way, the other idle (0: not measured, the rate)
    duplex_mbit: float = 0.0  # measured: TCP payload each way while both ends send at once (0: not measured)

    def tx_bytes(self) -> int:
        return sum(int(sh("ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/statistics/tx_bytes").stdout) for ns, dev in self.devices)


@dataclass
class Row:
    framework: str
    rate_mbit: float
    predicted_sps: float
    measured_sps: float
    predicted_bytes: float  # per sample, between the hosts
    measured_bytes: float
    bottleneck: str

    def within(self, predicted: float, measured: float) -> bool:
        return measured > 0 and abs(predicted - measured) <= 0.25 * measured


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)}: {proc.stderr.strip()}")
    return proc


@contextlib.contextmanager
def two_hosts(rate_mbit: float) -> Iterator[tuple[Link, list[tuple[str, str]]]]:
    """Namespaces A and B joined by a veth pair shaped to `rate_mbit` each way: (link, [(namespace, address)])."""
    tag = os.getpid() % 200 + 20
    hosts = [(f"shoal-sl-a{tag}", SUBNET.format(tag, 1), f"sla{tag}"), (f"shoal-sl-b{tag}", SUBNET.format(tag, 2), f"slb{tag}")]
    try:
        for ns, _, _ in hosts:
            sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", hosts[0][2], "type", "veth", "peer", "name", hosts[1][2])
        for ns, address, dev in hosts:
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            # HTB shapes what leaves each end: the link's rate each way; the default queue absorbs a bucket's burst
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10")
            sh("ip", "netns", "exec", ns, "tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb",
               "rate", f"{rate_mbit}mbit", "ceil", f"{rate_mbit}mbit")
        latency = one_way_latency(hosts[0][0], hosts[1][0], hosts[1][1])
        one_way, duplex = (goodput_mbit(hosts[0][0], hosts[1][0], hosts[1][1], rate_mbit, both) for both in (False, True))
        yield (Link(rate_mbit, latency, tuple((ns, dev) for ns, _, dev in hosts), one_way, duplex),
               [(ns, address) for ns, address, _ in hosts])
    finally:
        for ns, _, _ in hosts:
            sh("ip", "netns", "del", ns, check=False)


ECHO = """
import socket, sys
server = socket.create_server((sys.argv[1], 29599)); print("ready", flush=True)
conn, _ = server.accept()
while (data := conn.recv(64)):
    conn.sendall(data)
"""
PING = """
import socket, sys, time
conn = socket.create_connection((sys.argv[1], 29599)); conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
times = []
for _ in range(200):
    start = time.perf_counter(); conn.sendall(b"x"); conn.recv(64); times.append(time.perf_counter() - start)
print(sorted(times)[len(times) // 2])
"""


def one_way_latency(client_ns: str, server_ns: str, server_address: str) -> float:
    """Half the median round trip of a one-byte TCP message between the namespaces (no ping on this machine)."""
    echo = subprocess.Popen(["ip", "netns", "exec", server_ns, sys.executable, "-c", ECHO, server_address],
                            stdout=subprocess.PIPE, text=True)
    try:
        echo.stdout.readline()
        rtt = float(sh("ip", "netns", "exec", client_ns, sys.executable, "-c", PING, server_address).stdout)
    finally:
        echo.kill()
        echo.wait()
    return rtt / 2


GOODPUT = """
import socket, sys, threading, time
address, size, rounds, listening, both = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5] == "1"
if listening:
    server = socket.create_server((address, 29597)); print("ready", flush=True); conn, _ = server.accept()
else:
    conn = socket.create_connection((address, 29597))
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
data, buffer = b"x" * size, bytearray(size)
def receive():
    view, got = memoryview(buffer), 0
    while got < size:
        got += conn.recv_into(view[got:])
times = []
for _ in range(rounds):
    start = time.perf_counter()
    if both:  # each end sends a burst while receiving the other's
        reader = threading.Thread(target=receive); reader.start(); conn.sendall(data); reader.join()
    elif listening:  # one way: the listener receives the burst, then says so in one byte
        receive(); conn.sendall(b"k")
    else:
        conn.sendall(data); conn.recv(1)
    times.append(time.perf_counter() - start)
    time.sleep(0.01)
print(size / sorted(times)[len(times) // 2])
"""


def goodput_mbit(client_ns: str, server_ns: str, server_address: str, rate_mbit: float, both: bool) -> float:
    """What the shaped link carries over one TCP connection (as a gloo pair uses one), one way or each way while both
    ends send at once: bursts of a quarter second's worth at the rate, the median of 5, in Mbit/s of payload. Below
    the rate by the frames' headers, and both ways by the ACKs that queue behind the other direction's data in its
    shaper; the prediction gets both (`Hosts.link_gbps`, `Hosts.duplex_gbps`)."""
    size = max(1 << 20, int(rate_mbit * 1e6 / 8 / 4))
    script = [sys.executable, "-c", GOODPUT, server_address, str(size), "5"]
    peer = subprocess.Popen(["ip", "netns", "exec", server_ns, *script, "1", str(int(both))], stdout=subprocess.PIPE, text=True)
    try:
        peer.stdout.readline()
        mine = float(sh("ip", "netns", "exec", client_ns, *script, "0", str(int(both))).stdout)
        theirs = float(peer.communicate(timeout=120)[0])
    finally:
        peer.kill()
        peer.wait()
    return 8 * (min(mine, theirs) if both else mine) / 1e6


def layouts(local_steps: int) -> dict[str, dict]:
    """`shoal plan --hosts`'s frameworks at 2 hosts (one worker each), and Local SGD's groups meeting every H steps."""
    out = {name: cluster(2, 2) for name, cluster in SCALING.items()}
    out[f"Local SGD H={local_steps}"] = {"nworker_groups": 2, "nserver_groups": 2, "local_steps": local_steps}
    return {name: fields | {"nworkers_per_procs": 1, "threads_per_worker": 1} for name, fields in out.items()}


def job_text(steps: int) -> str:
    return small_mlp(DATA, steps=steps, batch=BATCH, random_skip=0, disp_freq=10, disp_after=0)


def cluster_sets(fields: dict) -> list[str]:
    return [f"cluster.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in fields.items()]


def predict(job_path: Path, fields: dict, link: Optional[Link], count: int = 2) -> tuple[float, float, str, int]:
    """(samples/s, bytes per sample between the hosts, bottleneck, samples per modelled step) for `count` hosts of
    1 core joined by `link`."""
    job = with_cluster(api.load_job(job_path), fields)
    plan = plan_job(job, cores=1, nnodes=count)
    hosts = Hosts(count=count, cores=1) if link is None else Hosts(
        count=count, cores=1, link_gbps=(link.goodput_mbit or link.rate_mbit) / 8000, latency_s=max(link.latency_s, 1e-6),
        duplex_gbps=link.duplex_mbit / 8000)
    e = estimate(plan, calibrate.calibration(plan_kernels(plan)), hosts)
    where = node_of_rank(plan.nprocs, count)  # as `shoal run --nnodes` places the ranks
    crossing = sum(sent for p in e.processes for peer, (sent, _) in p.links.items() if where[peer] != where[p.rank])
    # Local SGD's groups meet in lockstep: its estimate models one step of every group; the others one group's step
    per_step = BATCH * (e.ngroups if fields.get("local_steps") else 1)
    return e.samples_per_s, crossing / per_step, e.bottleneck, plan.nprocs


def run_both(job_path: Path, fields: dict, hosts: list[tuple[str, str]], folder: Path) -> Path:
    """`shoal run` on both hosts, each pinned to its own core; the chief's workspace."""
    port = 29600 + os.getpid() % 300
    env = dict(os.environ, SHOAL_JOB_SECRET=secrets.token_hex(32),
               PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))
    procs = []
    for rank, (ns, _) in enumerate(hosts):
        args = ["ip", "netns", "exec", ns, "taskset", "-c", str(rank % (os.cpu_count() or 1)), sys.executable, "-m", "shoal",
                "run", str(job_path), "--nnodes", "2", "--node-rank", str(rank), "--master", f"{hosts[0][1]}:{port}",
                "--workspace", str(folder / f"node{rank}"), "--no-progress"]
        for s in cluster_sets(fields):
            args += ["--set", s]
        procs.append(subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    try:
        outs = [p.communicate(timeout=1800) for p in procs]
    finally:  # interrupted or timed out: no run is left behind in a namespace about to go
        for p in procs:
            if p.poll() is None:
                p.terminate()  # `shoal run` takes its ranks down with it
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    for rank, (p, (_, err)) in enumerate(zip(procs, outs)):
        if p.returncode != 0:
            raise SystemExit(f"node {rank}: {(err.strip().splitlines() or ['failed'])[-1]}")
    return folder / "node0"


def run_one_host(job_path: Path, fields: dict, folder: Path) -> Path:
    """`shoal run` on one host of 1 core (this machine's first, no link): the scaling curves' first point."""
    args = ["taskset", "-c", "0", sys.executable, "-m", "shoal", "run", str(job_path), "--workspace", str(folder), "--no-progress"]
    for s in cluster_sets(fields):
        args += ["--set", s]
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=1800,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])))
    if proc.returncode != 0:
        raise SystemExit(f"one host: {(proc.stderr.strip().splitlines() or ['failed'])[-1]}")
    return folder


def one_host_points(steps: int, folder: Path) -> dict[str, tuple[float, float]]:
    """Each framework of `shoal plan --hosts` on 1 host of 1 core, one worker: (predicted, measured) samples/s."""
    job_path = folder / "mlp.conf"
    job_path.write_text(job_text(steps))
    points = {}
    for name, cluster in SCALING.items():
        fields = cluster(1, 1) | {"nworkers_per_procs": 1, "threads_per_worker": 1}
        predicted = predict(job_path, fields, None, count=1)[0]
        points[name] = (predicted, measure(run_one_host(job_path, fields, Path(tempfile.mkdtemp(dir=folder)))))
        print(f"  {name} on 1 host: predicted {predicted:.0f}, measured {points[name][1]:.0f} samples/s", flush=True)
    return points


def plot(rows: list[Row], one_host: dict[str, tuple[float, float]], folder: Path) -> list[Path]:
    """Per link rate, `shoal plan --hosts`'s scaling picture (predicted samples/s against hosts, one curve per
    framework) with the measured points on it: docs/shaped-links-<rate>mbit.png."""
    from shoal.report.estimates import plot_scaling

    out = []
    for rate in dict.fromkeys(r.rate_mbit for r in rows):
        mine = [r for r in rows if r.rate_mbit == rate]
        points = [{"framework": n, "hosts": 1, "samples_per_s": p, "refused": ""} for n, (p, _) in one_host.items()]
        points += [{"framework": r.framework, "hosts": 2, "samples_per_s": r.predicted_sps, "refused": ""} for r in mine]
        measured = [{"framework": n, "hosts": 1, "samples_per_s": m} for n, (_, m) in one_host.items()]
        measured += [{"framework": r.framework, "hosts": 2, "samples_per_s": r.measured_sps} for r in mine]
        out.append(plot_scaling({"points": points, "stops": {}}, folder / f"shaped-links-{rate:g}mbit.png", measured=measured,
                                title=f"MNIST MLP on hosts of 1 core, {rate:g} Mbit/s links (network namespaces)"))
    return out


def measure(workspace: Path) -> float:
    """Steady-state samples/s of the job: the chief's display windows after the first (start-up), as `shoal compare`
    (every framework's chief counts the job's samples: every group's)."""
    records = [json.loads(line) for line in (workspace / "metrics.jsonl").read_text().splitlines() if line.strip()]
    windows = [r for r in records if r.get("phase") == "train" and r.get("window_sec")][1:]
    seconds = sum(r["window_sec"] for r in windows)
    return sum(r["samples"] for r in windows) / seconds if seconds else 0.0


def machine() -> str:
    import torch

    cpu = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("model name")), platform.processor())
    return f"{platform.machine()}, {os.cpu_count()} cores ({cpu}), torch {torch.__version__}"


def table(rows: list[Row]) -> str:
    lines = ["| framework | link | predicted samples/s | measured | error | predicted B/sample | measured | error | bottleneck (predicted) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sps_err = 100 * (r.predicted_sps - r.measured_sps) / r.measured_sps if r.measured_sps else float("nan")
        b_err = 100 * (r.predicted_bytes - r.measured_bytes) / r.measured_bytes if r.measured_bytes else float("nan")
        lines.append(f"| {r.framework} | {r.rate_mbit:g} Mbit/s | {r.predicted_sps:.0f} | {r.measured_sps:.0f} | {sps_err:+.0f} % "
                     f"| {r.predicted_bytes:,.0f} | {r.measured_bytes:,.0f} | {b_err:+.0f} % | {r.bottleneck} |")
    speed = sum(r.within(r.predicted_sps, r.measured_sps) for r in rows)
    wire = sum(r.within(r.predicted_bytes, r.measured_bytes) for r in rows)
    lines += ["", f"Within 25 %: samples/s {speed} of {len(rows)}, bytes {wire} of {len(rows)}."]
    return "\n".join(lines)


def run_rows(rates: list[float], steps: int, local_steps: int, only: Optional[set[str]], folder: Path) -> list[Row]:
    job_path = folder / "mlp.conf"
    job_path.write_text(job_text(steps))
    rows = []
    for rate in rates:
        with two_hosts(rate) as (link, hosts):
            print(f"  link {rate:g} Mbit/s: {link.goodput_mbit:.0f} Mbit/s one way, {link.duplex_mbit:.0f} each way while both "
                  f"send, one-way latency {link.latency_s * 1e6:.0f} µs (measured; the prediction is given all three)", flush=True)
            for name, fields in layouts(local_steps).items():
                if only and not any(name.lower().startswith(o.lower()) for o in only):
                    continue
                sps, per_sample, bottleneck, _ = predict(job_path, fields, link)
                before = link.tx_bytes()
                ws = run_both(job_path, fields, hosts, Path(tempfile.mkdtemp(dir=folder)))
                wire = link.tx_bytes() - before
                groups = fields.get("nworker_groups", 1)
                measured_bytes = wire / (steps * BATCH * groups)
                rows.append(Row(name, rate, sps, measure(ws), per_sample, measured_bytes, bottleneck))
                print(f"  {name} at {rate:g} Mbit/s: predicted {sps:.0f}, measured {rows[-1].measured_sps:.0f} samples/s", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="1000,100", help="link rates to shape, Mbit/s each way (comma separated)")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--local-steps", type=int, default=10, help="H of the Local SGD row")
    parser.add_argument("--only", help="framework names to run (prefixes, comma separated)")
    parser.add_argument("--keep", type=Path, help="keep the workspaces here")
    parser.add_argument("--plot", type=Path, metavar="DIR",
                        help="also run each framework on 1 host and draw the scaling with the measured points, per rate, into DIR")
    args = parser.parse_args()
    # killed (a timeout, `kill`), the namespaces and the veth pair are still taken down (two_hosts' finally)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("ip", "tc", "taskset")):
        raise SystemExit("shaped_links.py needs root, iproute2 (ip, tc) and taskset")
    if not (DATA / "train_data.bin").exists():
        raise SystemExit(f"{DATA}: run `shoal prepare mnist --out {DATA}` first")
    folder = args.keep or Path(tempfile.mkdtemp(prefix="shoal-shaped-"))
    folder.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    start = time.time()
    rows = run_rows([float(r) for r in args.rates.split(",")], args.steps, args.local_steps,
                    set(args.only.split(",")) if args.only else None, folder)
    print(f"\n{datetime.date.today()}, {machine()}, load {load:.2f} at the start, {time.time() - start:.0f} s; "
          f"2 hosts (network namespaces) of 1 core each, MNIST MLP (benchmarks/mnist_mlp.py), batch {BATCH}, {args.steps} steps\n")
    print(table(rows))
    if args.plot:
        one_host = one_host_points(args.steps, folder)
        print("\n".join(f"{n} on 1 host: predicted {p:.0f}, measured {m:.0f} samples/s ({100 * (p - m) / m:+.0f} %)"
                        for n, (p, m) in one_host.items()))
        for path in plot(rows, one_host, args.plot):
            print(f"drew {path}")
    if not args.keep:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
