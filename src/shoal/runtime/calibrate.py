"""Measure this machine for the cost model (shoal.planning.costs.Calibration), once, and cache it.

What is measured, in about 10 s the first time on a host:
- the GEMM rate (GFLOP/s of a 1024² float32 product) with 1 thread and with every core;
- the memory bandwidth (bytes read + written per second by a 64 MB copy), same thread counts;
- two processes exchanging messages over gloo on loopback (shoal.comm): bandwidth each way while
  both send 4 MB buckets at once (as a synchronous exchange does), latency of a tiny message, and
  the fixed cost of one small collective (reduce, broadcast, all-reduce through shoal.comm.collectives,
  as the exchanges issue them): what every collective of a step pays whatever its size;
- each GPU's GEMM rate, memory bandwidth and host-to-device bandwidth, where CUDA is available;
- the dense kernels a job runs (its matrix products and convolutions at its shapes and thread
  counts), its updater's pass over its params, and a shoal.fit module's forward and backward on
  real batches of 1 and 16 samples; each added to the cache the first time a job needs it, within
  the time budget.

The cache is $SHOAL_HOME/calibration/<host>.json (default ~/.shoal), plain JSON; `shoal plan
--estimate --recalibrate` measures again. No dataset is read.

A timing is only as good as the machine was quiet (docs/planning.md, "The calibration"): every
calibration records the load average before and after, the CPU time the timing thread got against
the wall time it took, and the spread between repeats. One taken under contention is measured
again (SHOAL_CALIBRATION_ATTEMPTS times in all, default 3, with a short backoff); still contended,
it is kept marked `contended` and says so in one line, and it never replaces a clean one. The cache
records when, under what load, for which torch, CPU model and core count; it is measured again when
any of those differ, or when older than MAX_AGE (a contended one: CONTENDED_MAX_AGE). A contended
entry, or a contended timing an estimate reads, is measured again at the next estimate that finds the
machine quiet (busy_now(): a short GEMM probe judged as a calibration is). Writers hold a
file lock and merge with what is there, the cleaner entry winning, so concurrent calibrations leave
the better of theirs. The file is read as input: size-limited, every field type-checked, JSON only.
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import multiprocessing
import os
import platform
import socket
import stat
import statistics
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F

from shoal.errors import warn
from shoal.planning.costs import Calibration, Kernel

BUDGET_S = 10.0
MAX_AGE = datetime.timedelta(days=30)  # hardware and drivers change under a cache; a re-take costs seconds
CONTENDED_MAX_AGE = datetime.timedelta(hours=1)  # a contended one is tried again once the machine may be quiet
MAX_CACHE_BYTES = 4 * 2**20  # thousands of kernels; anything larger is not a cache shoal wrote
ATTEMPTS = 3  # SHOAL_CALIBRATION_ATTEMPTS overrides (at least 1)
BACKOFF_S = 0.5  # before the second attempt; doubled before each next one
# a whole net's passes are averaged over NET_PASSES of them, or as many as NET_TIMING_S allows (at least 3): on an idle
# machine they differ (the MNIST MLP's at 2 threads ran 37 ms for stretches of about ten, 50 ms between: fastest 37,
# mean 49.6, a run's steps 52)
NET_PASSES, NET_TIMING_S = 30, 1.5
# contended when any holds: the timing thread got under this share of the wall time (it was descheduled),
CONTENDED_CPU_SHARE = 0.75
# the 1-minute load average exceeded the cores by half (more runnable work than cores, for a while),
CONTENDED_LOAD_PER_CORE = 1.5
# or one timing's typical (median) repeat took over twice its best (the machine's speed changed under it)
CONTENDED_SPREAD = 1.0
# whether the machine is quiet enough to measure a contended entry again: a GEMM at each calibrated thread count for
# at least this long, judged by verdict() as a calibration is (about 0.3 s in all); its answer holds for QUIET_MEMO_S,
# so that an estimate that reads the cache for several layouts probes once
QUIET_PROBE_S, QUIET_MEMO_S = 0.1, 30.0


class CacheError(ValueError):
    """A calibration cache file that cannot be used (the message names what is wrong)."""


def cache_path(host: Optional[str] = None) -> Path:
    home = Path(os.environ.get("SHOAL_HOME", Path.home() / ".shoal"))
    return home / "calibration" / f"{host or socket.gethostname()}.json"


def read(path: Path) -> Calibration:
    """The calibration a cache file holds; FileNotFoundError when absent, CacheError when unusable."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # non-blocking: a FIFO planted there cannot hang us
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CacheError("not a regular file")
        raw = f.read(MAX_CACHE_BYTES + 1)
    if len(raw) > MAX_CACHE_BYTES:
        raise CacheError(f"larger than {MAX_CACHE_BYTES // 2**20} MB")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CacheError(f"not JSON ({err})") from None
    except RecursionError:
        raise CacheError("not JSON (nested too deep)") from None
    try:
        return Calibration.from_json(data)
    except ValueError as err:
        raise CacheError(str(err)) from None


def load(path: Optional[Path] = None, log: Callable[[str], None] = warn) -> Optional[Calibration]:
    """The cached calibration of this host, or None: absent, unusable or stale (then `log` says why, in one line)."""
    path = path or cache_path()
    try:
        calib = read(path)
    except FileNotFoundError:
        return None
    except OSError as err:
        log(f"{path}: cannot read the calibration cache ({err.strerror}); measuring this machine again")
        return None
    except CacheError as err:
        log(f"{path}: not a usable calibration cache ({err}); measuring this machine again")
        return None
    why = stale(calib)
    if why:
        log(f"calibration of {calib.taken_at or 'an unknown date'} is stale ({why}); measuring this machine again")
        return None
    return calib


def stale(calib: Calibration, now: Optional[datetime.datetime] = None) -> Optional[str]:
    """Why `calib` no longer describes this machine (None: it still does)."""
    if calib.cores != _cores():
        return f"taken on {calib.cores} cores, this process has {_cores()}"
    if calib.torch != torch.__version__:
        return f"taken with torch {calib.torch or 'unknown'}, this is {torch.__version__}"
    if calib.cpu_model != cpu_model():
        return f"taken on CPU {calib.cpu_model or 'unknown'!r}, this is {cpu_model()!r}"
    if not calib.collective_s:
        return "no per-collective cost measured (an older cache)"
    age = age_of(calib, now)
    if age is None:
        return "no date recorded"
    if age < -datetime.timedelta(minutes=5):
        return "dated in the future"
    if age > MAX_AGE:
        return f"older than {MAX_AGE.days} days"
    if calib.contended and age > CONTENDED_MAX_AGE:
        return f"taken under contention over {CONTENDED_MAX_AGE.seconds // 3600} h ago"
    return None


def age_of(calib: Calibration, now: Optional[datetime.datetime] = None) -> Optional[datetime.timedelta]:
    try:
        taken = datetime.datetime.fromisoformat(calib.taken_at)
    except ValueError:
        return None
    if taken.tzinfo is None:
        return None
    return (now or datetime.datetime.now(datetime.timezone.utc)) - taken


def this_machine() -> dict:
    """What a calibration taken now, here, records about where and when (the fields stale() compares)."""
    return {"host": socket.gethostname(), "cores": _cores(), "torch": torch.__version__, "cpu_model": cpu_model(),
            "taken_at": datetime.datetime.now(datetime.timezone.utc).astimezone().isoformat(timespec="seconds")}


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what platform knows."""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model"):
                    return value.strip()[:200]
    return (platform.processor() or platform.machine())[:200]


def save(calib: Calibration, path: Optional[Path] = None) -> Calibration:
    """Write `calib` into the cache, merged with a usable entry already there; returns what the cache now holds.

    Under an exclusive lock: read, merge (merge() keeps the cleaner machine entry and each kernel's
    cleaner timing), write a temp file and rename it over the cache, so readers never see half a file
    and concurrent writers never lose the better of their measurements.
    """
    path = path or cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            current = read(path)
        except (OSError, CacheError):
            current = None
        # an older cache lacking only the per-collective cost still merges (merge() takes the new one's)
        if current is not None and stale(replace(current, collective_s=current.collective_s or calib.collective_s)) is None:
            calib = merge(current, calib)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(calib.to_json(), f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    return calib


def merge(old: Calibration, new: Calibration) -> Calibration:
    """The machine entry of the better of two calibrations of one machine, with each kernel's better timing.

    Better: clean over contended; of two clean ones the newer; of two contended ones the less
    disturbed (more CPU share). A kernel timed clean beats one timed under contention; of two
    alike, the faster (the least disturbed, as every timing here).
    """
    if old.contended != new.contended:
        base = new if old.contended else old
    elif not new.contended:
        base = new
    else:
        base = new if new.cpu_share >= old.cpu_share else old
    kernels, dirty = {}, set()
    for key in set(old.kernels) | set(new.kernels):
        options = [(key in c.contended_kernels, c.kernels[key]) for c in (old, new) if key in c.kernels]
        was_dirty, seconds = min(options)
        kernels[key] = seconds
        if was_dirty:
            dirty.add(key)
    other = old if base is new else new
    return replace(base, kernels=kernels, contended_kernels=tuple(sorted(dirty)), collective_s=base.collective_s or other.collective_s)


def calibration(kernels: Iterable[Kernel] = (), recalibrate: bool = False, budget_s: float = BUDGET_S,
                log: Callable[[str], None] = lambda line: None, path: Optional[Path] = None) -> Calibration:
    """This host's calibration from the cache, measuring what is missing (all of it with `recalibrate`).

    The machine's rates take a few seconds, once (again when stale); a job's kernels not yet in the
    cache are measured (largest first) until `budget_s` runs out, the rest timed at the GEMM rate. A
    cached entry taken under contention, or a contended timing of `kernels`, is measured again when
    busy_now() finds the machine quiet (one line on stderr says so); still busy, it is kept.
    Progress goes to `log`; a measurement taken under contention is said in one line on stderr.
    """
    path = path or cache_path()
    calib = None if recalibrate else load(path)
    fresh = calib is None
    kernels, healed = list(kernels), False
    if calib is not None and calib.contended and busy_now(calib.cores) is None:
        # taken under contention, and the machine is quiet now: its rates again (seconds), its kernel timings kept
        warn(f"calibration of {calib.taken_at} was taken under contention ({describe_contention(calib)}); "
             "the machine is quiet now: measuring it again")
        cached, fresh, healed = calib, True, True
        calib = replace(measure_machine(log=log), kernels=cached.kernels, contended_kernels=cached.contended_kernels)
        _quiet.update(at=time.monotonic(), busy=describe_contention(calib) if calib.contended else None)
    elif calib is None:
        log("calibrating this machine (once; cached)...")
        calib = measure_machine(log=log)
    # a kernel timed under contention that this estimate reads is timed again once the machine is quiet (the cleaner
    # timing then wins); the probe runs only when there is one
    redo = [k for k in kernels if k.device == "cpu" and k.key in calib.contended_kernels and k.key in calib.kernels]
    quiet = bool(redo) and busy_now(calib.cores) is None
    if quiet and not healed:  # (healed: the line above said it)
        warn(f"calibration: {len({k.key for k in redo})} of the job's kernel timing(s) taken under contention; "
             "the machine is quiet now: timing them again")
    wanted = [k for k in kernels if k.device == "cpu" and (k.key not in calib.kernels or (quiet and k.key in calib.contended_kernels))]
    dirty: list[str] = []
    clean: list[str] = []
    if wanted:
        measured = dict(calib.kernels)
        deadline = time.perf_counter() + budget_s  # the job's kernels get their own budget
        for k in sorted(wanted, key=lambda k: (k.op != "net", -k.flops)):  # the whole net, then the costly kernels: first
            if time.perf_counter() > deadline:
                log(f"calibration: {len([k for k in wanted if k.key not in measured])} kernel(s) left to the GEMM rate (budget {budget_s:g} s)")
                break
            meter, load_before = Meter(), _load()
            seconds = time_kernel(k, meter)
            if seconds is None:  # an updater this process cannot build: the model keeps its bytes
                continue
            if verdict(max(load_before, _load()), calib.cores, meter):
                dirty.append(k.key)
                seconds = min(seconds, measured.get(k.key, seconds))  # two disturbed timings: the less disturbed
            else:
                clean.append(k.key)
            measured[k.key] = seconds
        if quiet and dirty:  # the probe said quiet, the timings say otherwise: no more tries this while
            _quiet.update(at=time.monotonic(), busy=f"{len(dirty)} kernel timing(s) taken under contention")
        contended = (set(calib.contended_kernels) - set(clean)) | set(dirty)
        calib = replace(calib, kernels=measured, contended_kernels=tuple(sorted(contended)))
    if fresh or wanted:
        taken = calib
        calib = save(calib, path)
        if fresh and taken.contended:
            kept = f"kept the clean calibration of {calib.taken_at}" if not calib.contended else "estimates may be low"
            warn(f"calibration taken under contention ({describe_contention(taken)}): {kept}; "
                 "measured again by itself at the next estimate on a quiet machine")
        elif dirty and set(dirty) & set(calib.contended_kernels) and not _said["kernels"]:
            _said["kernels"] = True  # once a process: --compare calibrates for seven layouts
            warn(f"calibration: {len(set(dirty) & set(calib.contended_kernels))} of the job's kernel timing(s) taken under contention "
                 f"(load {_load():.1f} on {calib.cores} cores): estimates may be low; measured again by itself at the next estimate on a quiet machine")
    return calib


_said = {"kernels": False}
_quiet: dict = {"at": None, "busy": None}  # busy_now()'s last answer and when (time.monotonic())


def busy_now(cores: int) -> Optional[str]:
    """None when the machine is quiet now; else how it is busy (describe_contention's words).

    A 1024² GEMM at 1 thread and at `cores` threads, each repeated for QUIET_PROBE_S, judged by verdict() as a
    calibration is: the CPU share the timing thread got, the spread of its repeats, the 1-minute load average. The
    answer holds for QUIET_MEMO_S in this process."""
    now = time.monotonic()
    if _quiet["at"] is not None and now - _quiet["at"] < QUIET_MEMO_S:
        return _quiet["busy"]
    meter, load_before = Meter(), _load()
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    for count in sorted({1, cores}):
        with _threads(count):
            _best(lambda: torch.mm(a, b), min_s=QUIET_PROBE_S, meter=meter)
    load = max(load_before, _load())
    busy = None
    if verdict(load, cores, meter):
        busy = describe_contention(Calibration(load=load, cores=cores, cpu_share=meter.share, spread=meter.spread))
    _quiet.update(at=time.monotonic(), busy=busy)
    return busy


def describe_contention(calib: Calibration) -> str:
    spread = f", a typical repeat {calib.spread + 1:.1f}× the best" if calib.spread > CONTENDED_SPREAD else ""
    return f"load {calib.load:.1f} on {calib.cores} cores, CPU {calib.cpu_share:.0%} of wall{spread}"


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


@dataclass
class Meter:
    """CPU time the timing thread got and the wall time it took, over every timed call; each timing's spread."""

    cpu_s: float = 0.0
    wall_s: float = 0.0
    spreads: list[float] = field(default_factory=list)

    @property
    def share(self) -> float:
        return min(1.0, self.cpu_s / self.wall_s) if self.wall_s > 0 else 1.0

    @property
    def spread(self) -> float:
        return statistics.median(self.spreads) if self.spreads else 0.0


def verdict(load: float, cores: int, meter: Meter) -> bool:
    """Whether timings taken at this load with this CPU share and spread were taken under contention."""
    return meter.share < CONTENDED_CPU_SHARE or load > CONTENDED_LOAD_PER_CORE * cores or meter.spread > CONTENDED_SPREAD


def attempts() -> int:
    try:
        return max(1, int(os.environ.get("SHOAL_CALIBRATION_ATTEMPTS", ATTEMPTS)))
    except ValueError:
        return ATTEMPTS


def measure_machine(log: Callable[[str], None] = lambda line: None) -> Calibration:
    """The machine's rates, measured again while contended (attempts() in all, backing off); the least disturbed."""
    best: Optional[Calibration] = None
    tries = attempts()
    for attempt in range(tries):
        calib = measure_once()
        if best is None or (best.contended and (not calib.contended or calib.cpu_share > best.cpu_share)):
            best = calib
        if not calib.contended or attempt + 1 == tries:
            break
        pause = BACKOFF_S * 2**attempt
        log(f"calibration: the machine is busy ({describe_contention(calib)}); measuring again in {pause:g} s ({attempt + 2} of {tries})")
        time.sleep(pause)
    return best


def measure_once() -> Calibration:
    started = time.perf_counter()
    load_before = _load()
    cores = _cores()
    link_gbps, latency, collective = probe_link()
    counts = sorted({1, cores})
    gemm, mem = {}, {}
    meter = Meter()
    for t in counts:
        with _threads(t):
            gemm[t] = round(gemm_gflops(meter=meter), 2)
            mem[t] = round(memory_gbps(meter=meter), 2)
    devices = {f"cuda:{i}": gpu_speeds(i) for i in range(torch.cuda.device_count())} if torch.cuda.is_available() else {}
    load = max(load_before, _load())
    return Calibration(
        gemm_gflops=gemm, mem_gbps=mem, link_gbps=round(link_gbps, 3), link_latency_s=latency, collective_s=collective, devices=devices,
        took_s=round(time.perf_counter() - started, 2), load=round(load, 2), cpu_share=round(meter.share, 3),
        spread=round(meter.spread, 3), contended=verdict(load, cores, meter), **this_machine(),
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


def _best(fn: Callable[[], None], reps: int = 3, min_s: float = 0.0, meter: Optional[Meter] = None) -> float:
    """The fastest of at least `reps` timed calls after one warm-up: what the machine can do, least
    disturbed by other load; `meter` adds up how much CPU this thread got meanwhile (the calling
    thread takes part in every intra-op parallel kernel, so its share is the whole kernel's)."""
    return min(_repeats(fn, reps, min_s, meter))


def _mean(fn: Callable[[], None], reps: int = 3, min_s: float = 0.0, meter: Optional[Meter] = None) -> float:
    """The mean of at least `reps` timed calls after one warm-up (for `min_s` seconds up to 50 calls, as _best's): a
    pass as a run's steps take it, on average, where the passes themselves differ on an idle machine."""
    return statistics.mean(_repeats(fn, reps, min_s, meter))


def _repeats(fn: Callable[[], None], reps: int, min_s: float, meter: Optional[Meter]) -> list[float]:
    meter = meter if meter is not None else Meter()
    fn()
    times: list[float] = []
    while len(times) < reps or (sum(times) < min_s and len(times) < 50):
        start, cpu = time.perf_counter(), time.thread_time()
        fn()
        times.append(time.perf_counter() - start)
        meter.cpu_s += time.thread_time() - cpu
        meter.wall_s += times[-1]
    # the typical repeat against the best: the slowest of up to 50 repeats of a short kernel is an interrupt, not load
    meter.spreads.append(statistics.median(times) / min(times) - 1 if min(times) > 0 else 0.0)
    return times


def gemm_gflops(n: int = 1024, meter: Optional[Meter] = None) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / _best(lambda: torch.mm(a, b), meter=meter) / 1e9


def memory_gbps(mb: int = 64, meter: Optional[Meter] = None) -> float:
    src = torch.ones(mb * 2**20 // 4)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _best(lambda: dst.copy_(src), meter=meter) / 1e9


def time_kernel(kernel: Kernel, meter: Optional[Meter] = None) -> Optional[float]:
    """Seconds of one run of the kernel at its thread count (random operands); None: an updater not buildable here."""
    with _threads(kernel.threads):
        if kernel.op == "update":
            return time_update(kernel, meter)
        if kernel.op == "module":
            return time_module(kernel, meter)
        if kernel.op == "layer":
            return time_layer(kernel, meter)
        if kernel.op == "net":
            return time_net(kernel, meter)
        if kernel.op == "mm":
            m, k, n = kernel.dims
            a, b = torch.randn(m, k), torch.randn(k, n)
            return _best(lambda: torch.mm(a, b), reps=3, min_s=0.05, meter=meter)
        n, c, h, w, f, kh, kw, sh, sw, ph, pw, input_grad = kernel.dims
        x = torch.randn(n, c, h, w, requires_grad=bool(input_grad))
        weight = torch.randn(f, c, kh, kw, requires_grad=True)
        if kernel.op == "conv":
            with torch.no_grad():
                return _best(lambda: F.conv2d(x, weight, None, (sh, sw), (ph, pw)), reps=3, min_s=0.05, meter=meter)
        y = F.conv2d(x, weight, None, (sh, sw), (ph, pw))
        dy = torch.randn_like(y)
        wrt = [weight, x] if input_grad else [weight]
        return _best(lambda: torch.autograd.grad(y, wrt, dy, retain_graph=True), reps=3, min_s=0.05, meter=meter)


def time_update(kernel: Kernel, meter: Optional[Meter] = None) -> Optional[float]:
    """Seconds of one `update_many` of the job's updater over its params (random values and gradients), as an owner
    of whole params runs it: SINGA's updaters and torch optimizers, with their real number of passes over memory."""
    from shoal.config import job_pb2
    from shoal.neuralnet.updaters import ParamUpdate, make_updater

    try:
        conf = job_pb2.UpdaterProto()
        conf.ParseFromString(kernel.spec)
        updater = make_updater(conf)
        params = []
        for name, shape in kernel.params:
            value = torch.randn(shape)
            params.append(ParamUpdate(value, torch.randn(shape) * 1e-3, updater.init_shard_state(value, (name, 0, value.numel()))))
        step = iter(range(1, 1_000_000))
        return _best(lambda: updater.update_many(next(step), params), reps=3, min_s=0.05, meter=meter)
    except Exception:  # noqa: BLE001 (a user's optimizer factory that needs its own process: timed by its bytes)
        return None


def time_layer(kernel: Kernel, meter: Optional[Meter] = None) -> Optional[float]:
    """Seconds of one forward and backward (when its input takes a gradient) of a paramless neuron layer built from its
    conf, on random inputs of its shapes; None when it cannot run alone (it needs labels or a context)."""
    from shoal.config import job_pb2
    from shoal.neuralnet.layers.registry import layer_class

    rows, input_grad = kernel.dims
    try:
        conf = job_pb2.LayerProto.FromString(kernel.spec)
        layer = layer_class(conf)(conf, [tuple(s) for s in kernel.params])
        xs = [torch.randn(rows, *shape, requires_grad=bool(input_grad)) for shape in kernel.params]

        def run() -> None:
            out = layer.forward(xs, [], [None] * len(xs), None)
            out = out[0] if isinstance(out, tuple) else out
            if input_grad and out.requires_grad:
                torch.autograd.grad(out, xs, torch.ones_like(out))

        return _best(run, reps=3, min_s=0.02, meter=meter)
    except Exception:  # noqa: BLE001 (a layer that needs more than its inputs: its bytes stand)
        return None


def time_net(kernel: Kernel, meter: Optional[Meter] = None) -> Optional[float]:
    """Seconds of one forward and backward of the job's whole train net (built from its NetProto, params initialised
    as the job says) on `rows` random rows fed to its store input layers, labels 0, while `concurrent` copies run at
    once (threads of this process, each with its own params, as workers computing side by side on the host's other
    cores: torch's kernels release the GIL): the kernels together as a worker runs them, Python and autograd included,
    sharing the cache and memory with the others. The slowest copy of each round counts, and the rounds' mean (their
    fastest is what the kernels' timings take; a run's steps take them all). None when it cannot run on
    random rows (an input layer that reads its own data, a net that fails without real records): the kernels' sum
    stands."""
    from concurrent.futures import ThreadPoolExecutor

    rows, concurrent = kernel.dims
    try:
        runs = [_net_run(kernel.spec, rows) for _ in range(concurrent)]
        if any(run is None for run in runs):
            return None
        start = time.perf_counter()
        runs[0]()  # a first pass: how long one takes decides how many the timing can afford (a few seconds in all)
        reps = max(3, min(NET_PASSES, int(NET_TIMING_S / max(time.perf_counter() - start, 1e-6))))
        if concurrent == 1:
            return _mean(runs[0], reps=reps, meter=meter)
        with ThreadPoolExecutor(concurrent - 1, thread_name_prefix="shoal-calibrate-net") as pool:
            def together() -> None:
                others = [pool.submit(run) for run in runs[1:]]
                runs[0]()
                for other in others:
                    other.result()

            return _mean(together, reps=reps, meter=meter)
    except Exception:  # noqa: BLE001 (a net that needs more than random rows: its kernels' sum stands)
        return None


def _net_run(spec: bytes, rows: int) -> Optional[Callable[[], None]]:
    """One forward and backward of the train net of NetProto `spec` on `rows` random rows: a function; None when its
    input layers are not store inputs (they read their own data)."""
    from shoal.config import job_pb2
    from shoal.neuralnet.layers.base import Context
    from shoal.neuralnet.net import NeuralNet
    from shoal.neuralnet.params import ParamStore
    from shoal.report.metrics import MetricWindow

    net = NeuralNet(job_pb2.NetProto.FromString(spec), job_pb2.kTrain, ParamStore(), torch.Generator().manual_seed(0))
    feeds = {}
    for node in net.input_nodes():
        layer = node.layer
        if not layer.conf.HasField("store_conf") or getattr(layer, "shape", None) is None:
            return None
        shape = tuple(layer.shape)
        store = layer.conf.store_conf
        if store.HasField("mean_file"):  # the statistics' values do not change the time
            layer.mean = torch.zeros(shape)
        if store.HasField("std_file"):
            layer.std = torch.ones(shape)
        feeds[node.name] = (torch.randn(rows, *shape), torch.zeros(rows, dtype=torch.int64))
    generator, window = torch.Generator().manual_seed(1), MetricWindow()

    def run() -> None:
        net.zero_grad()
        ctx = Context(phase=job_pb2.kTrain, generator=generator, feeds=feeds, report=window.report,
                      device=torch.device("cpu"), rows=(0, rows, rows))
        loss, _ = net.forward(ctx)
        loss.backward()

    return run


def time_module(kernel: Kernel, meter: Optional[Meter] = None) -> Optional[float]:
    """Seconds of one forward and backward of a shoal.fit module on `rows` samples (its probe: frontend/module_measure.py),
    Python, dispatch, attention and norms included; None when it has no probe here or the probe fails."""
    if kernel.probe is None:
        return None
    rows = kernel.dims[0]
    try:
        return _best(lambda: kernel.probe(rows), reps=3, min_s=0.05, meter=meter)
    except Exception:  # noqa: BLE001 (a user's module: its counted FLOPs stand)
        return None


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
def probe_link(mb: float = 4.0, rounds: int = 8, pings: int = 30, calls: int = 20) -> tuple[float, float, float]:
    """(GB/s each way while both processes send buckets at once, one-way latency in s, seconds of one small collective)
    over gloo."""
    from shoal.comm import dist as comm
    from shoal.config.plugins import forkserver_context

    # forked from multiprocessing's forkserver, which imported torch once (a spawned interpreter spends seconds on
    # it); never a plain fork of this process: its threads (torch's pools, gloo's, a notebook's) can hold locks
    # the child would wait on for ever (seen: a probe from a process that had trained before hung)
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = forkserver_context([__name__])  # started without the working folder on its import path
    else:
        ctx = multiprocessing.get_context("spawn")
    port = comm.free_port()
    here, there = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=_probe_rank, args=(rank, port, mb, rounds, pings, calls, there if rank == 0 else None), daemon=True) for rank in (0, 1)]
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
    return result["gbps"], result["latency"], result["collective"]


def _own_core(rank: int) -> None:
    """Each probe process on a core of its own where there are two, as a job's processes run. Left to the scheduler,
    the two sometimes shared a core and handed each message over in a context switch, sometimes woke the other core
    for it: on the 2-core VM a collective measured 230-330 µs on one core, 860-1470 µs on two, and calibrations of
    one day took 534, 654, 796 and 1267 µs; between hosts of one core each, runs paid about 1.2 ms."""
    try:
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) > 1:
            os.sched_setaffinity(0, {cores[rank % len(cores)]})
    except (AttributeError, OSError):  # no affinity on this platform: left to the scheduler
        pass


def _probe_rank(rank: int, port: int, mb: float, rounds: int, pings: int, calls: int, out) -> None:
    from shoal.comm import collectives, dist as comm
    from shoal.planning.process_groups import ProcessGroupPlan

    torch.set_num_threads(1)
    _own_core(rank)
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
    # the kinds of collective a step issues (a bucket's gather, a broadcast between two members, and its values'
    # broadcast; compressed, the flags' reduce; a clip's or a meeting's all-reduce), each of a few bytes, issued and waited one at a time: their fixed cost, the fastest of 3 rounds
    group = collectives.create([ProcessGroupPlan("probe", (0, 1), False)])["probe"]
    small = torch.zeros(16)
    rounds_s = []
    for _ in range(4):  # the first warms gloo's buffers up
        start = time.perf_counter()
        for _ in range(calls):
            group.reduce_sum(small, 0).wait()
            group.broadcast(small, 0).wait()
            group.all_reduce_sum(small).wait()
        rounds_s.append((time.perf_counter() - start) / (3 * calls))
    if out is not None:
        out.send_bytes(json.dumps({"gbps": each_way / 1e9, "latency": latency, "collective": min(rounds_s[1:])}).encode())
    comm.shutdown()
