"""Claims about a user's own training loop through `shoal.session()` on the character GPT of examples/gpt (issue 39,
"Measure"):

1. One worker: the example GPT's plain PyTorch loop (own_loop_scripts/plain_loop.py: examples/gpt's GPT and
   CharWindows, AdamW with nanoGPT's decay groups, clip_grad_norm_ 1.0, a warm-up + cosine LambdaLR, as gpt.py sets
   them up) against the same loop written with the session's calls (own_loop_scripts/session_loop.py: shoal.session(),
   run.model, run.optimizer, run.batches, run.log) under `shoal run`. The same rows: the plain loop draws the rows
   run.batches draws (shoal's per-epoch permutation from the seed, gpt.Rows). The validation loss at every evaluation
   is equal to the bit; samples/s of the session >= 0.97x the plain loop's.
2. AllReduce over 2 processes (`shoal run session_loop.py --set cluster.nworkers_per_group=2 --set
   cluster.nworkers_per_procs=1`) against torch DDP under torchrun (`torchrun --standalone --nproc-per-node 2
   plain_loop.py`: DistributedDataParallel, gloo), the same global batch split the same way over the 2 processes (the
   same rows per rank), threads = --threads / 2 per process: samples/s >= 1.0x DDP's; the final params and validation
   loss equal to one worker's (within float rounding: the mean of two half-batch means sums in another order).
3. DiLoCo, 2 groups, H = 50 (the session loop under `--set cluster.nworker_groups=2 --set cluster.local_steps=50`,
   outer kNesterov lr 0.7 momentum 0.9: docs/python.md's DiLoCo), the batch per group, --diloco-steps per group, against
   the synchronous run of both groups' rows (the session loop under AllReduce over 2 processes, twice the batch: equal
   tokens, as gpt_lowcomm.py compares them): final validation loss within 2 %; its bytes (the chief's count of every
   group's payload to the last meeting, `run.exchange.job_bytes_sent`) equal to shoal.fit's DiLoCo on the same model,
   data and settings (summary.json's bytes_sent), whose validation loss is shown beside it. At the example's size the
   gap closes with the run's length (gpt_lowcomm.py: +2.9 % after 500 steps, +0.70 % after 2000): hence 2000.

Every system runs in fresh processes of its own, started as a user starts them (`shoal run`, `python`, `torchrun`); the
timed systems alternate within each round (--repeats rounds) and the table reports medians; the DiLoCo runs (losses and
bytes, not timed) run once. Samples/s are steady state and count training only: each loop times itself on rank 0 from
one step's start to the next's (the reading of the batch, the session's work between steps and, under 2 processes, the
wait for the peer included), the validation subtracted, over the steps gpt.py times (D+1 .. the last display step,
D = 10, or steps // 3 when shorter; gpt.steady). Validation: on every process (the same work on each, so no rank waits
on another's), before every steps // 4-th step and after the last, over the first val windows of val.txt
(gpt.validate).

    shoal prepare shakespeare --out examples/gpt/data       # once
    python benchmarks/own_loop.py --quick        # a check: tiny model, 100 steps, 1 round (1-2 minutes)
    python benchmarks/own_loop.py                # the measurement (idle machine): 4 layers x 128, block 64, batch 12;
                                                 # timed: 200 steps x 3 rounds; DiLoCo: 2000 steps per group
    python benchmarks/own_loop.py --profile session2 [--tiny --steps 60]   # where rank 0's main thread spends a step
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import gpt  # noqa: E402 - the example GPT's model, data, rows, optimizer, schedule, loss, validation and steady rate

SCRIPTS = REPO / "benchmarks" / "own_loop_scripts"
FOLDERS: list[Path] = []  # the runs' folders, removed at the end (kept with OWN_LOOP_KEEP=1, to read their workspaces)
H = 50
TIMED = ("plain loop, 1 process", "session, 1 worker", "session AllReduce, 2 procs", "DDP (torchrun), 2 procs")
KEYS = dict(zip(TIMED, ("loop", "session1", "session2", "ddp")))
DILOCO = ("session AllReduce, 2 procs, both groups' rows", "session DiLoCo H=50, 2 groups", "shoal.fit DiLoCo H=50, 2 groups")
ALLREDUCE_SETS = ["cluster.nworkers_per_group=2", "cluster.nworkers_per_procs=1"]
DILOCO_SETS = ["cluster.nworker_groups=2", "cluster.nworkers_per_procs=1", f"cluster.local_steps={H}",
               "cluster.outer_updater.type=kNesterov", "cluster.outer_updater.momentum=0.9",
               "cluster.outer_updater.learning_rate.type=kFixed", "cluster.outer_updater.learning_rate.base_lr=0.7"]


# ---------------------------------------------------------------- inside the loop scripts (own_loop_scripts/)

def loop_arguments(argv=None) -> argparse.Namespace:
    """A loop script's own arguments (after `--` under `shoal run`)."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True, help="folder for rank 0's result.json and params.safetensors")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=12, help="the group's batch per step (split over its processes)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of this process")
    p.add_argument("--tiny", action="store_true", help="gpt.py's tiny model")
    p.add_argument("--data", type=Path, default=REPO / "examples/gpt/data")
    p.add_argument("--profile", action="store_true", help="print cProfile's top functions of rank 0's steady steps")
    return p.parse_args(argv)


class StepClock:
    """Each step's seconds from its start to the next step's start, less the validation run at its start (every
    `every` steps, before the step trains, and after the last): the same clock in the plain and the session loop.
    With `profiling`, rank 0's steady steps are profiled (gpt_sync_overhead.StepProfile: main-thread CPU time)."""

    def __init__(self, model, val, every: int, args=None, rank: int = 0):
        self.model, self.val, self.every = model, val, every
        self.profile = None
        if args is not None and args.profile:
            from gpt_sync_overhead import StepProfile

            self.profile = StepProfile(argparse.Namespace(profile="on", steps=args.steps), rank, "on")
        self.per_step: dict[int, float] = {}
        self.vals: list[list] = []
        self._step, self._started, self._validating = None, 0.0, 0.0

    def _close(self, now: float) -> None:
        if self._step is not None:
            self.per_step[self._step] = now - self._started - self._validating

    def start(self, step: int) -> None:
        now = time.perf_counter()
        self._close(now)
        self._step, self._started, self._validating = step, now, 0.0
        if step % self.every == 0:
            self.vals.append([step, gpt.validate(self.model, self.val)])
            self._validating = time.perf_counter() - now
        if self.profile is not None:
            self.profile.at_step(step)

    def finish(self, steps: int) -> None:
        self._close(time.perf_counter())
        self._step = None
        if self.profile is not None:
            self.profile.at_step(steps)
            self.profile.report()
        self.vals.append([steps, gpt.validate(self.model, self.val)])


def write_result(out: Path, model, clock: StepClock, samples_per_step: int, steps: int, **fields) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, str(out / "params.safetensors"))
    result = {"val": clock.vals, "sps": gpt.steady(clock.per_step, samples_per_step, steps)} | fields
    (out / "result.json").write_text(json.dumps(result))


# ---------------------------------------------------------------- the systems, each started as a user starts it

def loop_options(args, steps: int, batch: int, threads: int, out: Path) -> list[str]:
    return ["--out", str(out), "--steps", str(steps), "--batch", str(batch), "--threads", str(threads),
            "--data", str(args.data)] + (["--tiny"] if args.tiny else []) + (["--profile"] if args.profile else [])


def command(args, which: str, out: Path) -> list[str]:
    """The command that runs system `which`: the timed ones at --steps and the batch; DiLoCo's at --diloco-steps, each
    group the batch, beside a synchronous run of both groups' rows (AllReduce, twice the batch: equal tokens)."""
    batch, half = gpt.sizes(args)["batch"], max(1, args.threads // 2)
    python = sys.executable
    if which == "loop":
        return [python, str(SCRIPTS / "plain_loop.py")] + loop_options(args, args.steps, batch, args.threads, out)
    if which == "ddp":
        return ([python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPTS / "plain_loop.py")]
                + loop_options(args, args.steps, batch, half, out))
    if which == "fit-diloco":
        return [python, str(Path(__file__).resolve()), "--child", "fit-diloco", "--out", str(out),
                "--diloco-steps", str(args.diloco_steps), "--threads", str(args.threads), "--data", str(args.data)] + (
                    ["--tiny"] if args.tiny else [])
    sets = {"session1": [], "session2": ALLREDUCE_SETS, "sync-reference": ALLREDUCE_SETS, "session-diloco": DILOCO_SETS}[which]
    threads = args.threads if which == "session1" else half
    steps = args.diloco_steps if which in ("sync-reference", "session-diloco") else args.steps
    options = [o for s in sets + [f"cluster.threads_per_worker={threads}"] for o in ("--set", s)]
    return ([python, "-m", "shoal", "run", str(SCRIPTS / "session_loop.py"), "--workspace", str(out / "ws"), "--no-progress",
             *options, "--"] + loop_options(args, steps, 2 * batch if which == "sync-reference" else batch, threads, out))


def spawn(args, which: str) -> dict:
    """One system's run in fresh processes: rank 0's result (its final params as `params`, a file path)."""
    out = Path(tempfile.mkdtemp(prefix=f"own-loop-{which}-"))
    FOLDERS.append(out)
    done = subprocess.run(command(args, which, out), capture_output=True, text=True, cwd=out)
    if done.returncode != 0:
        tail = (done.stderr.strip() or done.stdout.strip())[-3000:]
        sys.exit(f"{which} failed (exit {done.returncode}):\n{tail}")
    return json.loads((out / "result.json").read_text()) | {"params": str(out / "params.safetensors"),
                                                           "stdout": done.stdout}


def fit_diloco(args) -> None:
    """shoal.fit's DiLoCo on the same model, data, inner AdamW, clipping, schedule, group batch and outer updater as the
    session's: its final validation loss and summary.json's bytes_sent."""
    import torch
    import shoal

    model, train, val = gpt.build(args)
    steps = args.diloco_steps
    threads = max(1, args.threads // 2)
    torch.set_num_threads(threads)
    outer = dict(type="kNesterov", momentum=0.9, learning_rate=dict(type="kFixed", base_lr=0.7))
    cluster = shoal.Cluster(nworker_groups=2, nworkers_per_procs=1, local_steps=H, threads_per_worker=threads,
                            outer_updater=outer)
    ws = args.out / "ws"
    history = shoal.fit(model, gpt.next_char_loss, train, test_data=val, test_batch=100, steps=steps,
                        batch_size=gpt.sizes(args)["batch"], seed=gpt.SEED, shuffle=True, cluster=cluster,
                        optimizer=gpt.adamw, scheduler=functools.partial(gpt.scheduler, steps=steps), clip_grad_norm=gpt.CLIP,
                        disp_freq=gpt.display_freq(steps), workspace=ws, log=gpt.quiet)
    summary = json.loads((ws / "summary.json").read_text())
    (args.out / "result.json").write_text(json.dumps({"val": [[steps, history.final_test["loss"]]],
                                                      "bytes_sent": summary.get("bytes_sent"), "sps": float("nan")}))
    from safetensors.torch import save_file
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, str(args.out / "params.safetensors"))


# ---------------------------------------------------------------- the table

def max_param_diff(a: str, b: str) -> float:
    from safetensors.torch import load_file

    x, y = load_file(a), load_file(b)
    if x.keys() != y.keys():
        return float("inf")
    return max(float((x[k].double() - y[k].double()).abs().max()) for k in x)


def fmt_bytes(n) -> str:
    return "n/a" if n is None else f"{n:,}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="steps of the timed systems (claims 1 and 2)")
    parser.add_argument("--diloco-steps", type=int, default=2000,
                        help=f"steps of the DiLoCo runs and their synchronous reference (claim 3; a multiple of H = {H})")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the timed systems, alternating within each")
    parser.add_argument("--quick", action="store_true", help="a check: --tiny --steps 100 --diloco-steps 100 --repeats 1")
    parser.add_argument("--tiny", action="store_true", help="gpt.py's tiny model (1 layer, 32 wide, block 16, batch 8)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads of one process (2 processes: half each)")
    parser.add_argument("--data", type=Path, default=REPO / "examples/gpt/data",
                        help="prepared by `shoal prepare shakespeare --out examples/gpt/data`")
    parser.add_argument("--no-diloco", action="store_true", help="the timed systems only (claims 1 and 2)")
    parser.add_argument("--json", type=Path, help="also write what was measured to this file")
    parser.add_argument("--profile", choices=list(KEYS.values()),
                        help="run this system once and print cProfile's top functions of rank 0's steady steps (main-thread "
                             "CPU time) instead of the table")
    parser.add_argument("--child", choices=["fit-diloco"], help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.tiny, args.steps, args.diloco_steps, args.repeats = True, 100, 100, 1
    args.data = args.data.resolve()
    if args.child:
        return fit_diloco(args)
    missing = [n for n in ("train.txt", "val.txt", "vocab.txt") if not (args.data / n).is_file()]
    if missing:
        sys.exit(f"{args.data}: no {', '.join(missing)}; run `shoal prepare shakespeare --out {args.data}` first")
    if args.profile:
        result = spawn(args, args.profile)
        lines = result["stdout"].splitlines()
        print("\n".join(lines[next((i for i, line in enumerate(lines) if "function calls" in line), 0):]))
        print(f"samples/s: {result['sps']:.1f} (profiled); load average {gpt.load()}")
        return
    if not args.no_diloco and (args.diloco_steps < H or args.diloco_steps % H):
        sys.exit(f"--diloco-steps must be a multiple of H = {H} (or give --no-diloco)")
    s = gpt.sizes(args)
    if s["batch"] % 2:
        sys.exit(f"the batch ({s['batch']}) must split in 2")
    before = gpt.load()
    start_load = float(before.split()[0])
    cores = os.cpu_count() or 1
    idle = start_load <= max(1.0, cores / 2)
    print(f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"machine: {gpt.machine()}")
    print(f"load average before: {before}")
    if not idle:
        print(f"WARNING: 1-min load average {start_load:.2f} > {max(1.0, cores / 2):g} on {cores} cores at the start: "
              "the machine is not idle; samples/s below are marked (*) and are not a measurement")
    print(f"GPT {s['layers']} layers, {s['heads']} heads, {s['width']} wide, block {s['block']}; batch {s['batch']} per step "
          f"(2 processes: {s['batch'] // 2} each); {args.steps} steps; AdamW lr {gpt.LR} "
          f"(decay 0.1 on matrices), clip {gpt.CLIP}, warm-up + cosine; seed {gpt.SEED}; threads {args.threads} (1 process), "
          f"{max(1, args.threads // 2)} per process (2 processes)")
    print(f"steady state: steps {gpt.display_freq(args.steps) + 1} .. the last display step, rank 0's clock, validation "
          f"subtracted\n")

    mark = "" if idle else "*"
    results: dict[str, list[dict]] = {name: [] for name in TIMED}
    print(f"{'round':<6} | " + " | ".join(f"{name:>26}" for name in TIMED) + "   (samples/s)", flush=True)
    for round_ in range(args.repeats):
        order = TIMED if round_ % 2 == 0 else TIMED[::-1]  # alternate who goes first
        for name in order:
            results[name].append(spawn(args, KEYS[name]))
        print(f"{round_:<6} | " + " | ".join(f"{results[n][-1]['sps']:>25.1f}{mark or ' '}" for n in TIMED), flush=True)
    diloco = {}
    if not args.no_diloco:
        print(f"\nDiLoCo: {args.diloco_steps} steps per group, batch {s['batch']} per group, H = {H}, outer kNesterov lr 0.7 "
              f"momentum 0.9; synchronous reference: session AllReduce over 2 processes, batch {2 * s['batch']} "
              f"({s['batch']} each), {args.diloco_steps} steps", flush=True)
        diloco = {name: spawn(args, key) for name, key in zip(DILOCO, ("sync-reference", "session-diloco", "fit-diloco"))}

    first = {name: runs[0] for name, runs in results.items()}
    loop, one, two, ddp = (first[n] for n in TIMED)
    print(f"\n{'step':>6} | " + " | ".join(f"{name:>26}" for name in TIMED) + " | session 1w - loop")
    for i, (step, _) in enumerate(loop["val"]):
        losses = [first[n]["val"][i][1] for n in TIMED]
        print(f"{step:>6} | " + " | ".join(f"{v:>26.7f}" for v in losses) + f" | {losses[1] - losses[0]:+.2e}")
    for name, runs in results.items():
        if any(r["val"] != runs[0]["val"] for r in runs[1:]):
            print(f"note: {name}'s validation losses differ between rounds")

    def med(name):
        return statistics.median(r["sps"] for r in results[name])

    final = {n: first[n]["val"][-1][1] for n in TIMED}
    m_loop, m_one, m_two, m_ddp = (med(n) for n in TIMED)
    measured = {"idle": idle, "steps": args.steps, "tiny": args.tiny, "repeats": args.repeats,
                "vals": {name: first[name]["val"] for name in TIMED},
                "sps": {name: [r["sps"] for r in results[name]] for name in TIMED},
                "session_vs_loop_sps": m_one / m_loop, "allreduce_vs_ddp_sps": m_two / m_ddp,
                "session_vs_loop_params": max_param_diff(one["params"], loop["params"]),
                "allreduce_vs_one_params": max_param_diff(two["params"], one["params"]),
                "allreduce_vs_ddp_params": max_param_diff(two["params"], ddp["params"])}
    same_every_eval = loop["val"] == one["val"]
    worst = max(abs(a[1] - b[1]) for a, b in zip(loop["val"], one["val"]))
    print(f"\n{'claim':<62} | {'measured':>40} | goal")
    print("-" * 118)
    print(f"{'1. validation loss, session 1 worker vs plain loop, every eval':<62} | "
          f"{('bit-identical' if same_every_eval else f'max |diff| {worst:.2e}'):>40} | bit-identical")
    print(f"{'   final params, session 1 worker vs plain loop, max |diff|':<62} | "
          f"{measured['session_vs_loop_params']:>40.2e} | 0")
    print(f"{'1. samples/s session 1 worker / plain loop (median)':<62} | "
          f"{f'{m_one:.1f} / {m_loop:.1f} = {m_one / m_loop:.3f}{mark}':>40} | >= 0.97")
    print(f"{'2. samples/s session AllReduce 2 procs / DDP (median)':<62} | "
          f"{f'{m_two:.1f} / {m_ddp:.1f} = {m_two / m_ddp:.3f}{mark}':>40} | >= 1.00")
    print(f"{'2. final validation loss, AllReduce 2 procs vs 1 worker':<62} | "
          f"{f'{final[TIMED[2]]:.7f} vs {final[TIMED[1]]:.7f} ({final[TIMED[2]] - final[TIMED[1]]:+.1e})':>40} | equal")
    print(f"{'   final params, AllReduce 2 procs vs 1 worker, max |diff|':<62} | "
          f"{measured['allreduce_vs_one_params']:>40.2e} | float rounding")
    print(f"{'   final params, AllReduce 2 procs vs DDP, max |diff|':<62} | {measured['allreduce_vs_ddp_params']:>40.2e} |")
    print(f"{'   final validation loss, DDP vs 1 worker':<62} | "
          f"{f'{final[TIMED[3]]:.7f} ({final[TIMED[3]] - final[TIMED[1]]:+.1e})':>40} |")
    if diloco:
        reference, own, fit = (diloco[name] for name in DILOCO)
        sync, own_loss, fit_loss = reference["val"][-1][1], own["val"][-1][1], fit["val"][-1][1]
        rel = own_loss / sync - 1
        measured |= {"diloco_steps": args.diloco_steps, "sync_val": sync, "diloco_val": own_loss, "fit_diloco_val": fit_loss,
                     "diloco_vs_sync": rel, "sync_bytes": reference["bytes_sent"],
                     "diloco_bytes": own["bytes_sent"], "fit_diloco_bytes": fit["bytes_sent"],
                     "diloco_label": own.get("label")}
        print(f"{'3. final validation loss, session DiLoCo vs synchronous':<62} | "
              f"{f'{own_loss:.4f} vs {sync:.4f} ({rel:+.2%})':>40} | within 2 %")
        sent = f"{fmt_bytes(own['bytes_sent'])} vs {fmt_bytes(fit['bytes_sent'])}"
        print(f"{'3. bytes, session DiLoCo vs shoal.fit DiLoCo':<62} | {sent:>40} | the same")
        if reference["bytes_sent"] and own["bytes_sent"]:
            fewer = f"{fmt_bytes(reference['bytes_sent'])} / {fmt_bytes(own['bytes_sent'])} = " \
                    f"{reference['bytes_sent'] / own['bytes_sent']:.1f}x"
            print(f"{'   bytes, synchronous / session DiLoCo':<62} | {fewer:>40} |")
        print(f"{'   final validation loss, shoal.fit DiLoCo (same settings)':<62} | "
              f"{f'{fit_loss:.4f} ({fit_loss - own_loss:+.1e} vs the session)':>40} |")
    if args.json:
        args.json.write_text(json.dumps(measured, indent=1))
    print(f"\nload average after: {gpt.load()}")


def measure_and_clean() -> None:
    try:
        main()
    finally:
        if not os.environ.get("OWN_LOOP_KEEP"):
            for folder in FOLDERS:
                shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    measure_and_clean()
