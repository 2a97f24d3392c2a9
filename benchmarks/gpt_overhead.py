"""CPU time per training step of one shoal worker against the plain PyTorch loop on the GPT (issue 28's 0.97x goal).

Wall-clock samples/s need an idle machine (benchmarks/gpt.py); this measures what shoal adds to each step in
a way that a loaded machine disturbs less: both systems in this process with one torch thread, the CPU time
(time.process_time) of every step, and the median over the steps after the first display window (start-up
and the first epoch's permutation left out; a median shrugs off the steps another process disturbed). The
loop's step is its iteration (rows, collate, zero_grad, forward, backward, clip_grad_norm_, AdamW, schedule);
shoal's is the time from one Trainer.train_step to the next, so it also counts the trainer's bookkeeping,
hooks and display windows. No validation is run. The systems alternate within each round; the table gives
each round's medians and the median over rounds.

    python benchmarks/gpt_overhead.py [--steps 60] [--repeats 5] [--tiny] [--profile shoal|loop] [--calls]

--profile prints cProfile's top functions (CPU time) of one run instead. --calls counts the Python function
calls per step of each system instead (cProfile's count over N + 1 steps minus over N/2 + 1, divided by the
difference): a number no load changes, the measure of per-step Python overhead on a busy machine.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpt  # noqa: E402  (the same model, data, optimizer, clipping, schedule and rows; it puts the repo's src first)


def shoal_run(args) -> list[float]:
    import shoal
    from shoal.runtime.trainer import Trainer

    starts: list[float] = []
    train_step = Trainer.train_step

    def timed(trainer, step):  # a benchmark's probe: the CPU clock at each step's start
        starts.append(time.process_time())
        return train_step(trainer, step)

    model, train, _ = gpt.build(args)
    ws = Path(tempfile.mkdtemp(prefix="shoal-gpt-overhead-")) / "ws"
    Trainer.train_step = timed
    try:
        shoal.fit(model, gpt.next_char_loss, train, steps=args.steps + 1, batch_size=gpt.sizes(args)["batch"], seed=gpt.SEED,
                  shuffle=True, cluster=shoal.Cluster(threads_per_worker=1), optimizer=gpt.adamw,
                  scheduler=functools.partial(gpt.scheduler, steps=args.steps + 1), clip_grad_norm=gpt.CLIP,
                  disp_freq=gpt.display_freq(args.steps), workspace=ws, log=gpt.quiet)
    finally:
        Trainer.train_step = train_step
    return [b - a for a, b in zip(starts, starts[1:])]  # steps 0 .. steps - 1, each up to the next one's start


def loop_run(args) -> list[float]:
    model, train, val = gpt.build(args)
    return gpt.plain_loop(args, model, train, val, validating=False, clock=time.process_time)["per_step"]


SYSTEMS = {"shoal, 1 worker": shoal_run, "loop": loop_run}


def calls_of(run, args) -> int:
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(run, args)
    return pstats.Stats(profiler).total_calls


def steady_median(per_step: list[float], steps: int) -> float:
    return statistics.median(per_step[gpt.display_freq(steps) + 1:])


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--data", type=Path, default=gpt.REPO / "examples/gpt/data")
    parser.add_argument("--tiny", action="store_true", help="gpt.py's tiny model: shoal's per-step overhead weighs most")
    parser.add_argument("--profile", choices=["shoal", "loop"])
    parser.add_argument("--calls", action="store_true", help="Python function calls per step of each system")
    args = parser.parse_args()
    args.data = args.data.resolve()
    torch.set_num_threads(1)
    if args.profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile(time.process_time)
        profiler.runcall(SYSTEMS["shoal, 1 worker" if args.profile == "shoal" else "loop"], args)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(40)
        return
    if args.calls:
        half = argparse.Namespace(**{**vars(args), "steps": args.steps // 2})
        for name, run in SYSTEMS.items():
            run(argparse.Namespace(**{**vars(args), "steps": 12}))  # imports and first-time registrations out of the count
            print(f"{name}: {(calls_of(run, args) - calls_of(run, half)) / (args.steps - half.steps):.0f} Python calls per step")
        return
    s = gpt.sizes(args)
    print(f"GPT {s['layers']} layers, {s['width']} wide, block {s['block']}, batch {s['batch']}; 1 torch thread; "
          f"median CPU ms per step over steps {gpt.display_freq(args.steps) + 1}..{args.steps - 1}; load {gpt.load()}")
    names = list(SYSTEMS)
    results: dict[str, list[float]] = {n: [] for n in names}
    print(f"{'round':<6} | " + " | ".join(f"{n:>16}" for n in names) + " | loop / shoal")
    for round_ in range(args.repeats):
        for name in names if round_ % 2 == 0 else names[::-1]:
            results[name].append(steady_median(SYSTEMS[name](args), args.steps) * 1e3)
        shoal_ms, loop_ms = (results[n][-1] for n in names)
        print(f"{round_:<6} | {shoal_ms:>16.3f} | {loop_ms:>16.3f} | {loop_ms / shoal_ms:.3f}", flush=True)
    shoal_ms, loop_ms = (statistics.median(results[n]) for n in names)
    print(f"{'median':<6} | {shoal_ms:>16.3f} | {loop_ms:>16.3f} | {loop_ms / shoal_ms:.3f}  (goal >= 0.97)")
    print(f"load average after: {gpt.load()}")


if __name__ == "__main__":
    main()
