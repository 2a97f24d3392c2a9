"""CPU time per training step of one shoal AllReduce process against one torch DDP process on the GPT (issue 28's
"AllReduce 2 processes >= 1.0x DDP").

Wall-clock samples/s need an idle machine (benchmarks/gpt.py --systems shoal2,ddp); this measures what each
process spends per step in a way a loaded machine disturbs less: the CPU time (time.process_time) of every step
of rank 0 and rank 1, median over the steps after the first display window. Both systems run 2 processes with
1 torch thread each over gloo on the same model, global batch, rows, AdamW, clipping and schedule as gpt.py.
shoal's ranks are started here as a launcher would (env:// : RANK, WORLD_SIZE, MASTER_ADDR/PORT), so each
rank runs shoal.fit in the very process this script times; its step is the time from one Trainer.train_step
to the next (the trainer's bookkeeping, hooks and display windows included). DDP's step is gpt.plain_loop's
(rows, collate, zero_grad, forward, backward with DDP's all-reduce, clip_grad_norm_, AdamW, schedule). The
systems alternate within each round; the table gives each round's medians (rank 0 / rank 1) and the median
over rounds. CPU time leaves out the time a rank waits on its peer; wall-clock goals are gpt.py's.

    python benchmarks/gpt_sync_overhead.py [--steps 40] [--repeats 3] [--tiny] [--profile shoal|ddp] [--exchange]

--profile prints cProfile's top functions (main-thread CPU time) of rank 0's steady steps of one run instead; --exchange
prints shoal's main-thread CPU time inside its exchange per step (the hooks' _arrive and step: time.thread_time,
so the gloo threads' work is not in it), the part of a step that is shoal's own rather than the model's.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpt  # noqa: E402  (the same model, data, optimizer, clipping, schedule and rows; it puts the repo's src first)


class StepProfile:
    """cProfile (CPU time) of rank 0's steady steps only (steps D+1 .. the last), when --profile names the system."""

    def __init__(self, args, rank: int, system: str):
        import cProfile

        self.on = args.profile == system and rank == 0
        self.first, self.last = gpt.display_freq(args.steps) + 1, args.steps
        self.profiler = cProfile.Profile(time.thread_time)  # the main thread: gloo's threads would blur the attribution

    def at_step(self, step: int) -> None:
        if self.on and step == self.first:
            self.profiler.enable()
        elif self.on and step == self.last:
            self.profiler.disable()

    def report(self) -> None:
        if self.on:
            import pstats

            for order in ("tottime", "cumulative"):
                pstats.Stats(self.profiler).sort_stats(order).print_stats(40)


def shoal_rank(rank: int, args, port: int, out: str) -> None:
    import torch
    import shoal
    from shoal.runtime.trainer import Trainer

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), SHOAL_JOB_SECRET="00" * 32)
    from shoal.runtime.exchanges.sliced import SlicedExchange

    starts: list[float] = []
    exchange_cpu: list[float] = []  # per step: this thread's CPU inside the exchange (hooks and step)
    train_step, arrive, finish = Trainer.train_step, SlicedExchange._arrive, SlicedExchange.step

    def in_exchange(method):
        def timed_method(*args):
            start = time.thread_time()
            try:
                return method(*args)
            finally:
                if exchange_cpu:
                    exchange_cpu[-1] += time.thread_time() - start
        return timed_method

    profile = StepProfile(args, rank, "shoal")

    def timed(trainer, step):  # a benchmark's probe: the CPU clock at each step's start
        profile.at_step(step)
        starts.append(time.process_time())
        exchange_cpu.append(0.0)
        return train_step(trainer, step)

    Trainer.train_step = timed
    if args.exchange:
        SlicedExchange._arrive, SlicedExchange.step = in_exchange(arrive), in_exchange(finish)
    model, train, _ = gpt.build(args)
    ws = Path(out).parent / "ws"

    def run():
        shoal.fit(model, gpt.next_char_loss, train, steps=args.steps + 1, batch_size=gpt.sizes(args)["batch"], seed=gpt.SEED,
                  shuffle=True, cluster=shoal.Cluster(nworkers_per_group=2, nservers_per_group=2, threads_per_worker=1),
                  optimizer=gpt.adamw, scheduler=functools.partial(gpt.scheduler, steps=args.steps + 1),
                  clip_grad_norm=gpt.CLIP, disp_freq=gpt.display_freq(args.steps), workspace=ws, log=gpt.quiet)

    run()
    profile.report()
    per_step = exchange_cpu if args.exchange else [b - a for a, b in zip(starts, starts[1:])]
    Path(f"{out}.{rank}").write_text(json.dumps(per_step))


def ddp_rank(rank: int, args, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model, train, val = gpt.build(args)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    profile = StepProfile(args, rank, "ddp")
    ticks = []

    def clock() -> float:  # plain_loop reads it at each step's start and end
        if len(ticks) % 2 == 0:
            profile.at_step(len(ticks) // 2)
        ticks.append(time.process_time())
        return ticks[-1]

    result = gpt.plain_loop(args, ddp, train, val, rank=rank, world=2, barrier=dist.barrier, validating=False, clock=clock)
    profile.report()
    Path(f"{out}.{rank}").write_text(json.dumps(result["per_step"]))
    dist.destroy_process_group()


def run(system, args) -> list[list[float]]:
    """Each rank's CPU seconds per step."""
    import torch.multiprocessing as mp
    from shoal.comm.dist import free_port

    out = Path(tempfile.mkdtemp(prefix="gpt-sync-overhead-")) / "steps.json"
    mp.start_processes(system, args=(args, free_port(), str(out)), nprocs=2, start_method="spawn")
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)]


SYSTEMS = {"shoal AllReduce": shoal_rank, "DDP": ddp_rank}


def steady_median(per_step: list[float], steps: int) -> float:
    return statistics.median(per_step[gpt.display_freq(steps) + 1: steps])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data", type=Path, default=gpt.REPO / "examples/gpt/data")
    parser.add_argument("--tiny", action="store_true", help="gpt.py's tiny model: per-step overhead weighs most")
    parser.add_argument("--profile", choices=["shoal", "ddp"])
    parser.add_argument("--exchange", action="store_true",
                        help="shoal's main-thread CPU inside its exchange per step (hooks and step) instead")
    args = parser.parse_args()
    args.data = args.data.resolve()
    if args.profile:
        run(shoal_rank if args.profile == "shoal" else ddp_rank, args)
        return
    if args.exchange:
        ms = [[steady_median(ranks, args.steps) * 1e3 for ranks in run(shoal_rank, args)] for _ in range(args.repeats)]
        print("shoal AllReduce, main-thread CPU ms per step in the exchange (SlicedExchange._arrive and step; rank 0 / rank 1):")
        print("  " + ", ".join(f"{a:.2f} / {b:.2f}" for a, b in ms) + f"; load {gpt.load()}")
        return
    s = gpt.sizes(args)
    print(f"GPT {s['layers']} layers, {s['width']} wide, block {s['block']}, global batch {s['batch']}; 2 processes x 1 torch "
          f"thread, gloo; median CPU ms per step (rank 0 / rank 1) over steps {gpt.display_freq(args.steps) + 1}.."
          f"{args.steps - 1}; load {gpt.load()}")
    names = list(SYSTEMS)
    results: dict[str, list[list[float]]] = {n: [] for n in names}
    print(f"{'round':<6} | " + " | ".join(f"{n:>17}" for n in names) + " | DDP / shoal (rank 0)")
    for round_ in range(args.repeats):
        for name in names if round_ % 2 == 0 else names[::-1]:
            results[name].append([steady_median(ranks, args.steps) * 1e3 for ranks in run(SYSTEMS[name], args)])
        (s0, s1), (d0, d1) = (results[n][-1] for n in names)
        print(f"{round_:<6} | {s0:>8.2f} /{s1:>7.2f} | {d0:>8.2f} /{d1:>7.2f} | {d0 / s0:.3f}", flush=True)
    (s0, s1), (d0, d1) = ([statistics.median(r[k] for r in results[n]) for k in range(2)] for n in names)
    print(f"{'median':<6} | {s0:>8.2f} /{s1:>7.2f} | {d0:>8.2f} /{d1:>7.2f} | {d0 / s0:.3f}")
    print(f"load average after: {gpt.load()}")


if __name__ == "__main__":
    main()
