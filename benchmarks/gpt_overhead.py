"""CPU time per training step of one shoal worker against the plain PyTorch loop on the GPT (issue 28's 0.97x goal).

Wall-clock samples/s need an idle machine (benchmarks/gpt.py); this measures what shoal adds to each step in
a way that survives a loaded one: both systems in this process with one torch thread, CPU time
(time.process_time) of a run of 2N steps minus a run of N steps, so start-up (imports, the model, the first
epoch's permutation, shoal's planning and workspace) cancels out and only N steady steps remain. Each system
runs 3 steps first, outside the rounds (imports, first-time registrations). No validation is run. The systems
alternate within each round; the table gives each round and the median of each (start-up varies by tens of
ms from run to run: take N large enough that this is small against N steps).

    python benchmarks/gpt_overhead.py [--steps 60] [--repeats 5] [--tiny] [--profile shoal|loop]

--profile prints cProfile's top functions (CPU time) of one 2N-step run instead.
"""
from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpt  # noqa: E402  (the same model, data, optimizer, clipping, schedule and rows)


def shoal_run(args, steps: int) -> None:
    import shoal

    model, train, _ = gpt.build(args)
    ws = Path(tempfile.mkdtemp(prefix="shoal-gpt-overhead-")) / "ws"
    shoal.fit(model, gpt.next_char_loss, train, steps=steps, batch_size=gpt.sizes(args)["batch"], seed=gpt.SEED, shuffle=True,
              cluster=shoal.Cluster(threads_per_worker=1), optimizer=gpt.adamw,
              scheduler=functools.partial(gpt.scheduler, steps=steps), clip_grad_norm=gpt.CLIP,
              disp_freq=gpt.display_freq(steps), workspace=ws, log=gpt.quiet)


def loop_run(args, steps: int) -> None:
    model, train, val = gpt.build(args)
    gpt.plain_loop(argparse.Namespace(**{**vars(args), "steps": steps}), model, train, val, validating=False)


SYSTEMS = {"shoal, 1 worker": shoal_run, "loop": loop_run}


def cpu_of(run, args, steps: int) -> float:
    gc.collect()  # the last run's garbage is not this one's
    start = time.process_time()
    run(args, steps)
    return time.process_time() - start


def per_step(run, args) -> float:
    """CPU seconds of one steady step: (2N steps - N steps) / N."""
    return (cpu_of(run, args, 2 * args.steps) - cpu_of(run, args, args.steps)) / args.steps


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="N: runs of N and 2N steps")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--data", type=Path, default=gpt.REPO / "examples/gpt/data")
    parser.add_argument("--tiny", action="store_true", help="gpt.py's tiny model: shoal's per-step overhead dominates")
    parser.add_argument("--profile", choices=["shoal", "loop"])
    args = parser.parse_args()
    args.data = args.data.resolve()
    torch.set_num_threads(1)
    if args.profile:
        import cProfile
        import pstats

        run = SYSTEMS["shoal, 1 worker" if args.profile == "shoal" else "loop"]
        profiler = cProfile.Profile(time.process_time)
        profiler.runcall(run, args, 2 * args.steps)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(40)
        return
    s = gpt.sizes(args)
    print(f"GPT {s['layers']} layers, {s['width']} wide, block {s['block']}, batch {s['batch']}; 1 torch thread; "
          f"CPU ms per step = (CPU of {2 * args.steps} steps - CPU of {args.steps}) / {args.steps}; load {gpt.load()}")
    names = list(SYSTEMS)
    for name in names:  # first-time costs (imports, registrations, allocator growth) out of the rounds
        SYSTEMS[name](args, 3)
    results: dict[str, list[float]] = {n: [] for n in names}
    print(f"{'round':<6} | " + " | ".join(f"{n:>16}" for n in names) + " | loop / shoal")
    for round_ in range(args.repeats):
        for name in names if round_ % 2 == 0 else names[::-1]:
            results[name].append(per_step(SYSTEMS[name], args) * 1e3)
        shoal_ms, loop_ms = (results[n][-1] for n in names)
        print(f"{round_:<6} | {shoal_ms:>16.3f} | {loop_ms:>16.3f} | {loop_ms / shoal_ms:.3f}", flush=True)
    shoal_ms, loop_ms = (statistics.median(results[n]) for n in names)
    print(f"{'median':<6} | {shoal_ms:>16.3f} | {loop_ms:>16.3f} | {loop_ms / shoal_ms:.3f}  (goal >= 0.97)")
    print(f"load average after: {gpt.load()}")


if __name__ == "__main__":
    main()
