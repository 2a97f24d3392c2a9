"""Measure this machine for the cost model (shoal.planning.costs.Calibration), once, and cache it.

What is measured, in about 10 s the first time on a host:
- the GEMM rate (GFLOP/s of a 1024² float32 product) with 1 thread and with every core;
- the memory bandwidth (bytes read + written per second by a 64 MB copy), same thread counts;
- two processes exchanging messages over gloo on loopback (shoal.comm): bandwidth each way while
  both send 4 MB buckets at once (as a synchronous exchange does), and latency of a tiny message;
- each GPU's GEMM rate, memory bandwidth and host-to-device bandwidth, where CUDA is available;
- the dense kernels a job runs (its matrix products and convolutions at its shapes and thread
  counts), each added to the cache the first time a job needs it, within the time budget.

The cache is $SHOAL_HOME/calibration/<host>.json (default ~/.shoal), plain JSON; `shoal plan
--estimate --recalibrate` measures again. No dataset is read.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import multiprocessing
import os
import socket
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F

from shoal.planning.costs import Calibration, Kernel

BUDGET_S = 10.0


def cache_path(host: Optional[str] = None) -> Path:
    home = Path(os.environ.get("SHOAL_HOME", Path.home() / ".shoal"))
    return home / "calibration" / f"{host or socket.gethostname()}.json"


def load(path: Optional[Path] = None) -> Optional[Calibration]:
    """The cached calibration of this host, or None (absent, unreadable, or from another core count)."""
    path = path or cache_path()
    try:
        calib = Calibration.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return calib if calib.cores == _cores() else None


def save(calib: Calibration, path: Optional[Path] = None) -> Path:
    path = path or cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(calib.to_json(), indent=1, sort_keys=True))
    tmp.replace(path)
    return path


def calibration(kernels: Iterable[Kernel] = (), recalibrate: bool = False, budget_s: float = BUDGET_S,
                log: Callable[[str], None] = lambda line: None, path: Optional[Path] = None) -> Calibration:
    """This host's calibration from the cache, measuring what is missing (all of it with `recalibrate`).

    The machine's rates take a few seconds, once; a job's kernels not yet in the cache are measured
    (largest first) until `budget_s` runs out, the rest timed at the GEMM rate.
    """
    calib = None if recalibrate else load(path)
    changed = calib is None
    if calib is None:
        log("calibrating this machine (once; cached)...")
        calib = measure_machine()
    wanted = [k for k in kernels if k.key not in calib.kernels and k.device == "cpu"]
    if wanted:
        measured = dict(calib.kernels)
        deadline = time.perf_counter() + budget_s  # the job's kernels get their own budget
        for k in sorted(wanted, key=lambda k: -k.flops):  # the costly kernels decide the estimate: first
            if time.perf_counter() > deadline:
                log(f"calibration: {len([k for k in wanted if k.key not in measured])} kernel(s) left to the GEMM rate (budget {budget_s:g} s)")
                break
            measured[k.key] = time_kernel(k)
        calib = Calibration(**{**calib.__dict__, "kernels": measured})
        changed = True
    if changed:
        save(calib, path)
    return calib


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def measure_machine() -> Calibration:
    started = time.perf_counter()
    cores = _cores()
    link_gbps, latency = probe_link()
    counts = sorted({1, cores})
    gemm, mem = {}, {}
    for t in counts:
        with _threads(t):
            gemm[t] = round(gemm_gflops(), 2)
            mem[t] = round(memory_gbps(), 2)
    devices = {f"cuda:{i}": gpu_speeds(i) for i in range(torch.cuda.device_count())} if torch.cuda.is_available() else {}
    took = time.perf_counter() - started
    return Calibration(
        host=socket.gethostname(), cores=cores, gemm_gflops=gemm, mem_gbps=mem, link_gbps=round(link_gbps, 3),
        link_latency_s=latency, devices=devices,
        measured=f"{datetime.datetime.now().isoformat(timespec='seconds')} in {took:.1f} s, load {os.getloadavg()[0]:.1f}, torch {torch.__version__}",
    )


@contextlib.contextmanager
def _threads(count: int):
    """Measure at `count` intra-op threads; torch's own count is restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _best(fn: Callable[[], None], reps: int = 3, min_s: float = 0.0) -> float:
    """The fastest of at least `reps` timed calls after one warm-up: what the machine can do, least
    disturbed by other load (a shared machine's load is reported with the calibration, not baked in)."""
    fn()
    times: list[float] = []
    while len(times) < reps or (sum(times) < min_s and len(times) < 50):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def gemm_gflops(n: int = 1024) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / _best(lambda: torch.mm(a, b)) / 1e9


def memory_gbps(mb: int = 64) -> float:
    src = torch.ones(mb * 2**20 // 4)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _best(lambda: dst.copy_(src)) / 1e9


def time_kernel(kernel: Kernel) -> float:
    """Seconds of one run of the kernel at its thread count (random operands)."""
    with _threads(kernel.threads):
        if kernel.op == "mm":
            m, k, n = kernel.dims
            a, b = torch.randn(m, k), torch.randn(k, n)
            return _best(lambda: torch.mm(a, b), reps=3, min_s=0.05)
        n, c, h, w, f, kh, kw, sh, sw, ph, pw, input_grad = kernel.dims
        x = torch.randn(n, c, h, w, requires_grad=bool(input_grad))
        weight = torch.randn(f, c, kh, kw, requires_grad=True)
        if kernel.op == "conv":
            with torch.no_grad():
                return _best(lambda: F.conv2d(x, weight, None, (sh, sw), (ph, pw)), reps=3, min_s=0.05)
        y = F.conv2d(x, weight, None, (sh, sw), (ph, pw))
        dy = torch.randn_like(y)
        wrt = [weight, x] if input_grad else [weight]
        return _best(lambda: torch.autograd.grad(y, wrt, dy, retain_graph=True), reps=3, min_s=0.05)


def gpu_speeds(index: int) -> dict[str, float]:
    device = torch.device("cuda", index)
    n = 4096
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)

    def timed(fn) -> float:
        def run():
            fn()
            torch.cuda.synchronize(device)
        return _best(run, reps=5)

    src = torch.ones(64 * 2**20, device=device)
    dst = torch.empty_like(src)
    host = torch.ones(16 * 2**20).pin_memory()
    return {
        "gflops": round(2 * n**3 / timed(lambda: torch.mm(a, b)) / 1e9, 1),
        "mem_gbps": round(2 * src.numel() * 4 / timed(lambda: dst.copy_(src)) / 1e9, 1),
        "h2d_gbps": round(host.numel() * 4 / timed(lambda: host.to(device, non_blocking=True)) / 1e9, 2),
    }


# -- two processes over gloo on loopback ------------------------------------------------------
def probe_link(mb: float = 4.0, rounds: int = 8, pings: int = 30) -> tuple[float, float]:
    """(GB/s each way while both processes send buckets at once, one-way latency in s) over gloo."""
    from shoal.comm import dist as comm

    # fork: a spawned interpreter would spend seconds importing torch; the children compute nothing
    # (one intra-op thread, message buffers only), so no thread pool of this process is needed there
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    port = comm.free_port()
    here, there = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=_probe_rank, args=(rank, port, mb, rounds, pings, there if rank == 0 else None), daemon=True) for rank in (0, 1)]
    for p in procs:
        p.start()
    try:
        if not here.poll(60):
            raise RuntimeError("the loopback probe did not answer in 60 s")
        result = json.loads(here.recv_bytes().decode())
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return result["gbps"], result["latency"]


def _probe_rank(rank: int, port: int, mb: float, rounds: int, pings: int, out) -> None:
    from shoal.comm import dist as comm

    torch.set_num_threads(1)
    comm.init(rank, 2, "127.0.0.1", port, interface="lo", timeout_s=30)
    peer = 1 - rank
    send, recv = torch.ones(int(mb * 2**20 / 4)), torch.empty(int(mb * 2**20 / 4))
    tiny = torch.zeros(1)

    def exchange():
        works = [comm.isend(send, peer, 1), comm.irecv(recv, peer, 1)]
        for w in works:
            w.wait()

    exchange()
    start = time.perf_counter()
    for _ in range(rounds):
        exchange()
    each_way = send.numel() * 4 * rounds / (time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(pings):  # ping-pong: two one-way trips each
        if rank == 0:
            comm.send(tiny, peer, 2)
            comm.recv(tiny, peer, 3)
        else:
            comm.recv(tiny, peer, 2)
            comm.send(tiny, peer, 3)
    latency = (time.perf_counter() - start) / pings / 2
    if out is not None:
        out.send_bytes(json.dumps({"gbps": each_way / 1e9, "latency": latency}).encode())
    comm.shutdown()
