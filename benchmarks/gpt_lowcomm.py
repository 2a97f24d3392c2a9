"""Claims about the low-communication frameworks on the character GPT of examples/gpt (issue 28, "Measure"):

3. DiLoCo, 2 groups, H = 50 (inner AdamW as benchmarks/gpt.py sets it up, outer Nesterov SGD lr 0.7 momentum 0.9:
   shoal.fit's outer_optimizer=) against synchronous training over 2 processes (AllReduce, one group of 2 workers)
   at equal tokens (the synchronous group's batch is the 2 groups' together): validation loss within 2 % of the
   synchronous run's, with >= 100x fewer bytes on the wire; and the same with top-k 1 % + error feedback on the
   pseudo-gradients (cluster.compression: kTopK, goal >= 1000x fewer bytes); and SparseLoCo (cluster.sparse_outer_step:
   chunk-wise top-k of an error-feedback accumulator that replaces the outer momentum, 2-bit values, outer lr 1),
   at the paper's 64 of every 4096 entries (1.6 %) and with a larger outer step and k.
4. Downpour, 2 groups + 1 server process, AdamW at the server, bounded lag (cluster.max_update_lag): validation loss
   at equal steps per group <= one worker's.

Every run is `shoal.fit` in a fresh process: examples/gpt's GPT and CharWindows, AdamW with nanoGPT's decay groups,
clip_grad_norm 1.0, warm-up + cosine (benchmarks/gpt.py's), torch threads 1 per worker. The schedule spans the
updates the optimizer applies: --steps for one worker, AllReduce and each DiLoCo group's inner optimizer, 2 x --steps
for Downpour's server (asynchronous schedules count server updates). Validation loss: the final test over the
first val windows of val.txt (the validation set given as test_data), in eval mode.

Bytes on the wire: each job runs in a network namespace of its own (`ip netns add`, root only), so the namespace's
loopback counter (tx_bytes) counts that job's traffic and nothing else (gloo's tensors, the rendezvous store,
heartbeats), as benchmarks/local_sgd.py does. Without root the column says n/a.

These are accuracy and byte claims, not timings: they hold on a loaded machine (the wall column is only a guide).

    shoal prepare shakespeare --out examples/gpt/data     # once
    python benchmarks/gpt_lowcomm.py [--steps 500] [--seeds 1337 1338] [--only NAME ...] [--small]
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import gpt  # noqa: E402 - the GPT benchmark's model, data, optimizer, schedule and loss
from local_sgd import in_namespace, netns_available  # noqa: E402 - one probe for every benchmark that counts a job's own bytes

LOCAL_STEPS = 50
LAG = 2  # cluster.max_update_lag for Downpour: the least allowed is 1 (2 groups, 2 updates in flight); 2 bounds it loosely

# name -> (cluster fields, groups, how many server updates each optimizer step counts: the schedule's span factor)
LAYOUTS = {
    "one worker": (dict(), 1, 1),
    "synchronous, AllReduce 2 procs": (dict(nworkers_per_group=2, nservers_per_group=2), 1, 1),
    "DiLoCo H=50, 2 groups": (dict(nworker_groups=2, local_steps=LOCAL_STEPS), 2, 1),
    "DiLoCo H=50 + top-k 1 %": (dict(nworker_groups=2, local_steps=LOCAL_STEPS, compression="kTopK", topk_fraction=0.01), 2, 1),
    "DiLoCo H=50 + top-k 10 %": (dict(nworker_groups=2, local_steps=LOCAL_STEPS, compression="kTopK", topk_fraction=0.1), 2, 1),
    "DiLoCo H=50 + bf16": (dict(nworker_groups=2, local_steps=LOCAL_STEPS, compression="kBF16"), 2, 1),
    # SparseLoCo (cluster.sparse_outer_step): the error-feedback accumulator replaces DiLoCo's outer momentum (no
    # outer_optimizer); the paper's 64 of every 4096 entries (1.6 %) in 2 bits, and with a larger outer step / k
    "SparseLoCo H=50, 64 of 4096 (1.6 %), 2-bit": (dict(nworker_groups=2, local_steps=LOCAL_STEPS, sparse_outer_step=dict()), 2, 1),
    "SparseLoCo H=50, 64 of 4096 (1.6 %), 2-bit, outer lr 2": (dict(nworker_groups=2, local_steps=LOCAL_STEPS,
                                                                    sparse_outer_step=dict(outer_lr=2.0)), 2, 1),
    "SparseLoCo H=50, 205 of 4096 (5 %), 2-bit, outer lr 2": (dict(nworker_groups=2, local_steps=LOCAL_STEPS,
                                                                   sparse_outer_step=dict(topk_per_chunk=205, outer_lr=2.0)), 2, 1),
    "Downpour, 2 groups, lag <= 2": (dict(nworker_groups=2, server_worker_separate=True, max_update_lag=LAG), 2, 2),
}
SYNC, ONE = "synchronous, AllReduce 2 procs", "one worker"


def sizes(small: bool) -> dict:
    if small:
        return dict(layers=2, heads=2, width=64, block=32, batch=8, val_windows=400)
    return dict(layers=4, heads=4, width=128, block=64, batch=12, val_windows=1000)


def nesterov_outer(params):
    """DiLoCo's outer optimizer."""
    import torch
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def build(small: bool, seed: int):
    """(model, train, val) as benchmarks/gpt.py builds them, at these sizes and this seed."""
    import torch
    from torch.utils.data import Subset
    from data import CharWindows, read_vocab
    from model import GPT, GPTConfig

    s, folder = sizes(small), REPO / "examples/gpt/data"
    vocab = read_vocab(folder / "vocab.txt")
    train = CharWindows.from_file(folder / "train.txt", vocab, s["block"])
    val = CharWindows.from_file(folder / "val.txt", vocab, s["block"], stride=s["block"])
    val = Subset(val, range(min(len(val), s["val_windows"])))
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=len(vocab), block_size=s["block"], n_layer=s["layers"], n_head=s["heads"], n_embd=s["width"]))
    return model, train, val


def run_child(name: str, steps: int, seed: int, small: bool, out: Path) -> None:
    """One layout's run (in the namespace's process): writes its final validation loss."""
    import torch
    import shoal

    fields, _, span = LAYOUTS[name]
    torch.set_num_threads(1)
    model, train, val = build(small, seed)
    batch = sizes(small)["batch"] * (2 if name == SYNC else 1)  # equal tokens: the synchronous group reads both groups' rows
    extra = {"outer_optimizer": nesterov_outer} if "DiLoCo" in name else {}
    ws = Path(tempfile.mkdtemp(prefix="shoal-lowcomm-")) / "ws"
    start = time.perf_counter()
    history = shoal.fit(model, gpt.next_char_loss, train, test_data=val, test_batch=100, steps=steps, batch_size=batch,
                        seed=seed, cluster=shoal.Cluster(threads_per_worker=1, **fields), optimizer=gpt.adamw,
                        scheduler=functools.partial(gpt.scheduler, steps=steps * span), clip_grad_norm=gpt.CLIP,
                        disp_freq=max(1, steps // 10), workspace=ws, log=lambda _line: None, **extra)
    train_records = history.phase("train")
    lags = [r["staleness_max"] for r in train_records if "staleness_max" in r]
    ran = json.loads((history.workspace / "summary.json").read_text())  # what ran: processes, workers, framework
    # every group's meetings to the last (the display records end at step 450 of 500: 9 of 10 meetings, issue 40)
    counted = ran.get("bytes_sent") if "LoCo" in name else None
    out.write_text(json.dumps({"val_loss": history.final_test["loss"], "wall_s": time.perf_counter() - start,
                               "counted_bytes": counted, "lag_max": max(lags) if lags else None,
                               "ran": {k: ran.get(k) for k in ("processes", "workers", "framework")}}))
    shutil.rmtree(ws.parent, ignore_errors=True)


def run_layout(name: str, steps: int, seed: int, small: bool, netns: bool) -> dict:
    """The layout in a fresh process (in a namespace of its own when it can be): its result and wire bytes."""
    out = Path(tempfile.mkdtemp(prefix="lowcomm-")) / "result.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--steps", str(steps), "--seeds", str(seed),
           "--out", str(out)] + (["--small"] if small else [])
    wire = None
    if netns:
        proc, wire = in_namespace(cmd, f"shoal-lowcomm-{os.getpid()}", cwd=REPO)
    else:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"{name} (seed {seed}) failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(out.read_text())
    shutil.rmtree(out.parent, ignore_errors=True)
    return result | {"wire_bytes": wire}


def measure(steps: int, seeds: list[int], small: bool, only: Optional[list[str]] = None, echo=print) -> dict[str, list[dict]]:
    """Every layout (or those whose name holds one of `only`) for every seed: name -> one result per seed."""
    netns = netns_available()
    names = [n for n in LAYOUTS if not only or any(o in n for o in only)]
    results: dict[str, list[dict]] = {}
    for name in names:
        results[name] = [run_layout(name, steps, seed, small, netns) for seed in seeds]
        r = results[name]
        wire = " ".join("n/a" if x["wire_bytes"] is None else f"{x['wire_bytes']:,}" for x in r)
        losses = " ".join(f"{x['val_loss']:.4f}" for x in r)
        walls = " ".join(f"{x['wall_s']:.0f}" for x in r)
        echo(f"| {name} | {losses} | {wire} | {walls} |")
    return results


def mean(values) -> float:
    return statistics.fmean(values)


def claims(results: dict[str, list[dict]]) -> list[tuple[str, str, str, bool]]:
    """(claim, measured, goal, met) for every claim whose layouts were run; losses and bytes are means over seeds."""
    out = []
    loss = {n: mean(x["val_loss"] for x in r) for n, r in results.items()}
    wire = {n: (mean(x["wire_bytes"] for x in r) if all(x["wire_bytes"] for x in r) else None) for n, r in results.items()}
    sparse = [(n, 1000) for n in LAYOUTS if n.startswith("SparseLoCo")]
    for name, goal in (("DiLoCo H=50, 2 groups", 100), ("DiLoCo H=50 + bf16", 100), ("DiLoCo H=50 + top-k 1 %", 1000), *sparse):
        if name in loss and SYNC in loss:
            rel = loss[name] / loss[SYNC] - 1
            out.append((f"{name}: validation loss vs synchronous", f"{loss[name]:.4f} vs {loss[SYNC]:.4f} ({rel:+.2%})",
                        "within 2 %", rel <= 0.02))
            if wire.get(name) and wire.get(SYNC):
                ratio = wire[SYNC] / wire[name]
                shown = f"{ratio:,.0f}" if ratio >= 1000 else f"{ratio:.2f}"  # 99.99x is not 100x
                out.append((f"{name}: bytes on the wire, synchronous / it", f"{wire[SYNC]:,.0f} / {wire[name]:,.0f} = {shown}x",
                            f">= {goal}x", ratio >= goal))
    down = "Downpour, 2 groups, lag <= 2"
    if down in loss and ONE in loss:
        out.append((f"{down}: validation loss vs one worker (equal steps per group)",
                    f"{loss[down]:.4f} vs {loss[ONE]:.4f}", "<= one worker's", loss[down] <= loss[ONE]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=500, help="steps per group (a multiple of H = 50)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1337, 1338])
    parser.add_argument("--only", nargs="+", help="layouts whose name holds one of these")
    parser.add_argument("--small", action="store_true", help="2 layers, 64 wide, block 32, batch 8 (the slow test's size)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return run_child(args.child, args.steps, args.seeds[0], args.small, args.out)
    if any(not (REPO / "examples/gpt/data" / n).is_file() for n in ("train.txt", "val.txt", "vocab.txt")):
        raise SystemExit("examples/gpt/data: run `shoal prepare shakespeare --out examples/gpt/data` first")
    s = sizes(args.small)
    print(f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"machine: {gpt.machine()}; load average before: {gpt.load()} (accuracy and bytes only: no timing claims)")
    print(f"GPT {s['layers']} layers, {s['heads']} heads, {s['width']} wide, block {s['block']}; batch {s['batch']} per group "
          f"(synchronous: {2 * s['batch']}); {args.steps} steps per group; AdamW lr {gpt.LR}, clip {gpt.CLIP}, warm-up + cosine; "
          f"seeds {args.seeds}; validation: {s['val_windows']} windows of val.txt; bytes: "
          f"{'one network namespace per job' if netns_available() else 'n/a (needs root and ip netns)'}\n")
    print("| layout | validation loss per seed | bytes on the wire per seed | wall s per seed |")
    print("|---|---|---|---|", flush=True)
    results = measure(args.steps, args.seeds, args.small, args.only, echo=lambda line: print(line, flush=True))
    print(f"\n| claim | measured (mean over seeds) | goal | met |\n|---|---|---|---|")
    for claim, measured, goal, met in claims(results):
        print(f"| {claim} | {measured} | {goal} | {'yes' if met else 'NO'} |")
    print(f"\nload average after: {gpt.load()}")


if __name__ == "__main__":
    main()
