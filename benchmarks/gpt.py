"""Claims about shoal.fit's module path on the character GPT of examples/gpt (issue 28, "Measure"):

1. One shoal worker (`shoal.fit`: examples/gpt's GPT and CharWindows, AdamW with nanoGPT's decay
   groups, clip_grad_norm=1.0, a warm-up + cosine LambdaLR) against a plain PyTorch loop doing
   exactly the same: same seed and init, the same rows in the same order (the loop draws shoal's
   per-epoch permutation itself: torch.randperm seeded from numpy's SeedSequence([seed, epoch]), as
   src/shoal/data/in_place.py does), same optimizer, clipping and schedule, same torch threads.
   The validation loss at every evaluation is equal (bit-exact where the ops are deterministic);
   samples/s of shoal >= 0.97x the loop's.
2. Synchronous training over 2 processes (AllReduce: cluster nworkers_per_group=2,
   nservers_per_group=2) against torch DistributedDataParallel (gloo, 2 processes), same model,
   global batch, rows, optimizer, clipping and schedule, threads = cores / 2 each: samples/s >= 1.0x
   DDP, and the final validation loss equal to one worker's.

Every system runs in a fresh process of its own; the systems alternate within each round (--repeats
rounds) and the table reports medians. Samples/s are steady state and count training only: the
first display window (steps 0 .. D, D = 10, or steps // 3 when shorter) is left out as start-up,
and validation is not timed. shoal's from its metrics.jsonl display windows after step D (samples /
window_sec, which excludes validation); the loop's and DDP's from the same steps, timed per step.
Validation: every steps // 4 steps (before that step trains, as shoal does) and after the last step
(shoal: the validation set given as test_data too, tested once at the end), over the first
--val-windows non-overlapping windows of val.txt.

The loop and each DDP rank run one function (plain_loop). On a machine that is not idle, compare CPU time per
step instead: benchmarks/gpt_overhead.py.

On a GPU (--device cuda:0) every system computes there: the one-worker pair is the same, and the two-process
pair shares the one GPU (NCCL refuses two ranks on one device), so both shoal's groups and DDP run over gloo,
staging CUDA tensors through host memory.

    python benchmarks/gpt.py [--steps 200] [--repeats 3] [--data examples/gpt/data] [--tiny] [--device cuda:0]
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples" / "gpt"))  # the example's data.py and model.py, as train.py imports them
sys.path.insert(0, str(REPO / "src"))

SEED = 1337
LR = 1e-3
CLIP = 1.0
SYSTEMS = ("shoal, 1 worker", "loop", "shoal AllReduce, 2 procs", "DDP, 2 procs")


# ---------------------------------------------------------------- shared by every system

def sizes(args) -> dict:
    if args.tiny:
        return dict(layers=1, heads=2, width=32, block=16, batch=8, val_windows=64)
    return dict(layers=4, heads=4, width=128, block=64, batch=12, val_windows=2000)


def display_freq(steps: int) -> int:
    return 10 if steps >= 30 else max(1, steps // 3)


def val_freq(steps: int) -> int:
    return max(1, steps // 4)


def warmup_cosine(step: int, steps: int) -> float:
    """LR multiplier: linear warm-up over the first 10 % of the steps, then cosine down to 0.1."""
    warm = max(1, steps // 10)
    if step < warm:
        return (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, steps - warm))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def decay_groups(named_params) -> list[dict]:
    """nanoGPT's groups: weight decay 0.1 on matrices and embeddings, none on biases and norms."""
    named_params = list(named_params)
    return [{"params": [(n, p) for n, p in named_params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [(n, p) for n, p in named_params if p.dim() < 2], "weight_decay": 0.0}]


def adamw(named_params):
    import torch
    return torch.optim.AdamW(decay_groups(named_params), lr=LR, betas=(0.9, 0.99))


def plain_adamw(model):
    """The same optimizer as a plain loop builds it (params, not (name, param) pairs)."""
    import torch
    groups = [{"params": [p for _, p in g["params"]], "weight_decay": g["weight_decay"]} for g in decay_groups(model.named_parameters())]
    return torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.99))


def scheduler(optimizer, steps):
    import torch
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(warmup_cosine, steps=steps))


def next_char_loss(model, batch):
    import torch.nn.functional as F
    logits = model(batch["x"])
    return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())


def build(args):
    """(model, train set, validation set), the model initialised from SEED as train.py does."""
    import torch
    from torch.utils.data import Subset
    from data import CharWindows, read_vocab
    from model import GPT, GPTConfig

    s = sizes(args)
    vocab = read_vocab(args.data / "vocab.txt")
    train = CharWindows.from_file(args.data / "train.txt", vocab, s["block"])
    val = CharWindows.from_file(args.data / "val.txt", vocab, s["block"], stride=s["block"])
    val = Subset(val, range(min(len(val), s["val_windows"])))
    torch.manual_seed(SEED)
    model = GPT(GPTConfig(vocab_size=len(vocab), block_size=s["block"], n_layer=s["layers"], n_head=s["heads"], n_embd=s["width"]))
    return model, train, val


def epoch_order(n: int, seed: int, epoch: int):
    """shoal's reading order of an epoch (src/shoal/data/in_place.py), written out here."""
    import numpy as np
    import torch
    g = int(np.random.SeedSequence([seed, epoch]).generate_state(2, np.uint32).view(np.uint64)[0] >> np.uint64(1))
    return torch.randperm(n, generator=torch.Generator().manual_seed(g))


class Rows:
    """The dataset indices at positions start .. start + count (position p: sample order(p // N)[p % N])."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.orders = n, seed, {}

    def __call__(self, start: int, count: int) -> list[int]:
        out = []
        for p in range(start, start + count):
            epoch, i = divmod(p, self.n)
            if epoch not in self.orders:
                self.orders[epoch] = epoch_order(self.n, self.seed, epoch)
            out.append(int(self.orders[epoch][i]))
        return out


def eval_batch(n: int, batch: int = 100) -> int:
    """shoal.fit's evaluation batch: the largest divisor of the set's size up to `batch` (when >= batch / 4)."""
    for b in range(min(batch, n), 0, -1):
        if n % b == 0:
            return b if b * 4 >= min(batch, n) else min(batch, n)
    return min(batch, n)


def on(batch, device: str):
    """A collated batch (a dict of tensors) on `device`."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def synchronized(device: str):
    """A clock that waits for the device's queued work first, so a step's time includes its kernels."""
    import torch
    if device.startswith("cuda"):
        return lambda: (torch.cuda.synchronize(device), time.perf_counter())[1]
    return time.perf_counter


def validate(model, val, device: str = "cpu") -> float:
    """The sample-weighted mean loss over the validation set, in eval mode, as shoal's MetricWindow averages it."""
    import torch
    from torch.utils.data import default_collate
    b = eval_batch(len(val))
    if len(val) % b:
        raise SystemExit(f"validation set of {len(val)} windows has no batch divisor near 100: choose another size")
    model.eval()
    total = 0.0
    with torch.no_grad():
        for start in range(0, len(val), b):
            loss = next_char_loss(model, on(default_collate([val[i] for i in range(start, start + b)]), device))
            total += float(loss) * b
    model.train()
    return total / len(val)


def steady(per_step: dict[int, float], batch: int, steps: int) -> float:
    """Samples/s over steps D+1 .. the last display step, the steps shoal's windows after step D cover."""
    d = display_freq(steps)
    last = ((steps - 1) // d) * d
    chosen = [per_step[s] for s in range(d + 1, last + 1)]
    return batch * len(chosen) / sum(chosen) if chosen else float("nan")


# ---------------------------------------------------------------- the four systems (each in its own process)

def quiet(_line: str) -> None:
    pass


def run_shoal(args, procs: int) -> dict:
    import torch
    import shoal

    model, train, val = build(args)
    s = sizes(args)
    threads = max(1, args.threads // procs)
    cluster = (shoal.Cluster(nworkers_per_group=2, nservers_per_group=2, threads_per_worker=threads) if procs == 2
               else shoal.Cluster(threads_per_worker=threads))
    torch.set_num_threads(threads)
    ws = Path(tempfile.mkdtemp(prefix="shoal-gpt-bench-")) / "ws"
    history = shoal.fit(model, next_char_loss, train, val_data=val, val_freq=val_freq(args.steps), val_batch=100,
                        steps=args.steps, batch_size=s["batch"], seed=SEED, shuffle=True, cluster=cluster,
                        optimizer=adamw, scheduler=functools.partial(scheduler, steps=args.steps), clip_grad_norm=CLIP,
                        disp_freq=display_freq(args.steps), workspace=ws, log=quiet, device=args.device)
    d = display_freq(args.steps)
    windows = [r for r in history.phase("train") if r["step"] > d]
    sps = sum(r["samples"] for r in windows) / sum(r["window_sec"] for r in windows) if windows else float("nan")
    vals = [[r["step"], r["loss"]] for r in history.phase("validate")]  # every val_freq steps and after the last
    return {"val": vals, "sps": sps}


def plain_loop(args, model, train, val, rank: int = 0, world: int = 1, barrier=None, validating: bool = True,
               clock=None) -> dict:
    """The plain PyTorch loop: this rank's rows of each global batch (the batch split in `world` in order),
    zero_grad, forward and backward, clip_grad_norm_, AdamW, the scheduler; validation on rank 0 before
    every val_freq-th step and after the last (untimed; `barrier` keeps the ranks' timed steps together) unless
    not `validating`; each step timed by `clock` ("per_step", seconds)."""
    import torch
    from torch.utils.data import default_collate

    batch, steps = sizes(args)["batch"], args.steps
    device = getattr(args, "device", "cpu")
    clock = clock or synchronized(device)
    share = batch // world
    opt = plain_adamw(model)
    sched = scheduler(opt, steps)
    rows = Rows(len(train), SEED)
    vf, vals, per_step = val_freq(steps), [], {}
    # DDP's own module: rank 0 validates alone, outside DDP's collectives
    plain = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    model.train()
    for step in range(steps):
        if step % vf == 0 and rank == 0 and validating:
            vals.append([step, validate(plain, val, device)])
        if barrier is not None:
            barrier()
        start = clock()
        mine = rows(step * batch, batch)[rank * share:(rank + 1) * share]
        b = on(default_collate([train[i] for i in mine]), device)
        opt.zero_grad(set_to_none=True)
        next_char_loss(model, b).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        per_step[step] = clock() - start
    if barrier is not None:
        barrier()
    if rank == 0 and validating:
        vals.append([steps, validate(plain, val, device)])
    return {"val": vals, "sps": steady(per_step, batch, steps), "per_step": [per_step[s] for s in range(steps)]}


def run_loop(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    model, train, val = build(args)
    return plain_loop(args, model.to(args.device), train, val)


def ddp_worker(rank: int, args, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, args.threads // 2))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model, train, val = build(args)  # the same init on both ranks (and DDP broadcasts rank 0's anyway)
    model = model.to(args.device)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[torch.device(args.device).index or 0] if args.device != "cpu" else None)
    result = plain_loop(args, ddp, train, val, rank=rank, world=2, barrier=dist.barrier)
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def run_ddp(args) -> dict:
    import torch.multiprocessing as mp
    from shoal.comm.dist import free_port

    out = Path(tempfile.mkdtemp(prefix="ddp-gpt-bench-")) / "ddp.json"
    mp.start_processes(ddp_worker, args=(args, free_port(), str(out)), nprocs=2, start_method="spawn")
    return json.loads(out.read_text())


def child(args) -> None:
    result = {"shoal1": lambda: run_shoal(args, 1), "loop": lambda: run_loop(args),
              "shoal2": lambda: run_shoal(args, 2), "ddp": lambda: run_ddp(args)}[args.child]()
    Path(args.out).write_text(json.dumps(result))


def spawn(args, which: str) -> dict:
    out = Path(tempfile.mkdtemp(prefix="gpt-bench-")) / f"{which}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", which, "--out", str(out), "--steps", str(args.steps),
           "--data", str(args.data), "--threads", str(args.threads), "--device", args.device] + (["--tiny"] if args.tiny else [])
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        sys.exit(f"{which} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


# ---------------------------------------------------------------- the table

def machine() -> str:
    import torch
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} cores, {model}; torch {torch.__version__}, python {platform.python_version()}"


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3, help="rounds; the four systems alternate within each")
    parser.add_argument("--data", type=Path, default=REPO / "examples/gpt/data",
                        help="prepared by `shoal prepare shakespeare --out examples/gpt/data`")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (1 layer, 32 wide, block 16): a smoke run")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads of one worker (2 processes: half each)")
    parser.add_argument("--systems", default=",".join(("shoal1", "loop", "shoal2", "ddp")),
                        help="which systems to run, of shoal1,loop,shoal2,ddp (a pair's ratio needs both)")
    parser.add_argument("--device", default="cpu", help="where every system computes: cpu or cuda:N")
    parser.add_argument("--child", choices=["shoal1", "loop", "shoal2", "ddp"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.data = args.data.resolve()
    if args.child:
        return child(args)

    missing = [n for n in ("train.txt", "val.txt", "vocab.txt") if not (args.data / n).is_file()]
    if missing:
        print(f"{args.data}: no {', '.join(missing)}; run `shoal prepare shakespeare --out {args.data}` first")
        sys.exit(2)
    s = sizes(args)
    before = load()
    start_load = float(before.split()[0])
    print(f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"machine: {machine()}")
    print(f"load average before: {before}")
    cores = os.cpu_count() or 1
    timings_ok = start_load <= max(1.0, cores / 2)  # idle: below 1 on 2 cores, half the cores on a bigger machine
    if not timings_ok:
        print(f"WARNING: 1-min load average {start_load:.2f} > {max(1.0, cores / 2):g} on {cores} cores at the start: "
              "the machine is not idle; samples/s are not reported")
    print(f"GPT {s['layers']} layers, {s['heads']} heads, {s['width']} wide, block {s['block']}; global batch {s['batch']}; "
          f"{args.steps} steps; AdamW lr {LR} (decay 0.1 on matrices), clip {CLIP}, warm-up + cosine; seed {SEED}; "
          f"threads {args.threads} (1 worker), {max(1, args.threads // 2)} per process (2 processes); on {args.device}"
          + (f" ({__import__('torch').cuda.get_device_name(args.device)})" if args.device != "cpu" else ""))
    print(f"steady state: steps {display_freq(args.steps) + 1} .. end, training only (start-up window and validation left out)\n")

    keys = dict(zip(SYSTEMS, ("shoal1", "loop", "shoal2", "ddp")))
    chosen = set(args.systems.split(","))
    if not chosen or not chosen <= set(keys.values()):
        sys.exit(f"--systems: choose from shoal1,loop,shoal2,ddp, got {args.systems!r}")
    results: dict[str, list[dict]] = {name: [] for name in SYSTEMS}
    print(f"{'round':<6} | " + " | ".join(f"{name:>24}" for name in SYSTEMS) + "   (samples/s)", flush=True)
    for round_ in range(args.repeats):
        order = SYSTEMS if round_ % 2 == 0 else SYSTEMS[::-1]  # alternate who goes first
        row = {}
        for name in order:
            row[name] = spawn(args, keys[name]) if keys[name] in chosen else None
            results[name].append(row[name])
        print(f"{round_:<6} | " + " | ".join((f"{row[n]['sps']:>24.1f}" if timings_ok and row[n] else f"{'-':>24}") for n in SYSTEMS), flush=True)
    ran = next(runs[0] for runs in results.values() if runs[0] is not None)
    for name, runs in results.items():  # a system not chosen: its figures are nan
        if runs[0] is None:
            results[name] = [{"sps": float("nan"), "val": [[step, float("nan")] for step, _ in ran["val"]]}]

    # validation losses: deterministic, so round 0's (and every round is checked equal to it)
    first = {name: runs[0]["val"] for name, runs in results.items()}
    print(f"\n{'step':>6} | " + " | ".join(f"{name:>24}" for name in SYSTEMS) + " | shoal 1w - loop")
    for i, (step, _) in enumerate(first["loop"]):
        losses = [first[name][i][1] if i < len(first[name]) else float("nan") for name in SYSTEMS]
        print(f"{step:>6} | " + " | ".join(f"{v:>24.7f}" for v in losses) + f" | {losses[0] - losses[1]:+.2e}")
    for name, runs in results.items():
        if any(r["val"] != runs[0]["val"] for r in runs[1:]):
            print(f"note: {name}'s validation losses differ between rounds")

    def med(name):
        return statistics.median(r["sps"] for r in results[name])

    one, loop, two, ddp = (med(n) for n in SYSTEMS)
    same_every_eval = all(a[1] == b[1] for a, b in zip(first[SYSTEMS[0]], first["loop"]))
    worst = max(abs(a[1] - b[1]) for a, b in zip(first[SYSTEMS[0]], first["loop"]))
    final_1w, final_2p, final_ddp = first[SYSTEMS[0]][-1][1], first[SYSTEMS[2]][-1][1], first[SYSTEMS[3]][-1][1]
    print(f"\n{'claim':<58} | {'measured':>30} | goal")
    print("-" * 100)
    print(f"{'1. validation loss, shoal 1 worker vs loop, every eval':<58} | "
          f"{('bit-exact' if same_every_eval else f'max |diff| {worst:.2e}'):>30} | equal")
    if timings_ok:
        print(f"{'1. samples/s shoal 1 worker / loop (median)':<58} | {f'{one:.1f} / {loop:.1f} = {one / loop:.3f}':>30} | >= 0.97")
        print(f"{'2. samples/s shoal AllReduce 2 procs / DDP (median)':<58} | {f'{two:.1f} / {ddp:.1f} = {two / ddp:.3f}':>30} | >= 1.00")
    else:
        print(f"{'samples/s':<58} | {'not reported (load > 1 at start)':>30} |")
    print(f"{'2. final validation loss, AllReduce 2 procs vs 1 worker':<58} | "
          f"{f'{final_2p:.7f} vs {final_1w:.7f} ({final_2p - final_1w:+.1e})':>30} | equal")
    print(f"{'   final validation loss, DDP vs 1 worker':<58} | {f'{final_ddp:.7f} ({final_ddp - final_1w:+.1e})':>30} |")
    print(f"\nload average after: {load()}")


if __name__ == "__main__":
    main()
