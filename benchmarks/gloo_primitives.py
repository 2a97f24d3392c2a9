"""Which gloo primitive moves a synchronous group's gradients and values fastest over loopback?

Two (or --world) processes exchange the MNIST MLP's 12.0 M float32 gradients (48 MB) cut into
buckets, every call asynchronous (async_op=True, all handles waited at the end), as the
exchange of a worker group does each step. Every rank owns an equal contiguous chunk
(SINGA's slicing of a co-located AllReduce group). Per primitive: whether gloo in this torch
accepts it asynchronously, the time per step and the bytes sent on `lo` per step per rank.

  all_reduce        every rank gets the whole sum (what DDP does; no owner)
  reduce+broadcast  per bucket: reduce to the owner, then the owner broadcasts the bucket
  gather+broadcast  per bucket: gather every rank's part at the owner, which sums them (what
                    shoal's synchronous exchange does), then the owner broadcasts the bucket
  reduce_scatter    per bucket: reduce_scatter_single + all_gather_single (formerly *_tensor)
  send/recv         per bucket: each rank isends its part to the owner, the owner sums the
                    irecv'd parts and isends the result back (a direct reduce-scatter and all-gather)

    python benchmarks/gloo_primitives.py [--world 2] [--mb 4] [--repeats 5]

Uses torch.distributed directly: this is a probe of the library, not shoal code.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

NUMEL = 12_000_000  # ~ the MNIST MLP's params


def lo_bytes() -> int:
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "lo":
            return int(rest.split()[8])
    return 0


def buckets(numel: int, world: int, bucket: int) -> list[tuple[int, int, int]]:
    """(start, stop, owner): each rank's equal chunk cut into buckets of at most `bucket` elements."""
    chunk = -(-numel // world)
    out = []
    for owner in reversed(range(world)):  # backward produces the last layers first
        lo, hi = owner * chunk, min(numel, (owner + 1) * chunk)
        for start in range(lo, hi, bucket):
            out.append((start, min(hi, start + bucket), owner))
    return out


def all_reduce(flat, plan, rank, world):
    works = [dist.all_reduce(flat[a:b], async_op=True) for a, b, _ in plan]
    for w in works:
        w.wait()


def reduce_broadcast(flat, plan, rank, world):
    works = [dist.reduce(flat[a:b], dst=o, async_op=True) for a, b, o in plan]
    for w in works:
        w.wait()
    works = [dist.broadcast(flat[a:b], src=o, async_op=True) for a, b, o in plan]
    for w in works:
        w.wait()


def gather_broadcast(flat, plan, rank, world):
    works, summed = [], []
    for a, b, o in plan:
        parts = [torch.empty(b - a) for _ in range(world)] if o == rank else None
        works.append(dist.gather(flat[a:b], parts, dst=o, async_op=True))
        if parts is not None:
            summed.append((a, b, parts))
    for w in works:
        w.wait()
    for a, b, parts in summed:
        for part in parts[1:]:
            parts[0].add_(part)
        flat[a:b].copy_(parts[0])
    works = [dist.broadcast(flat[a:b], src=o, async_op=True) for a, b, o in plan]
    for w in works:
        w.wait()


def reduce_scatter(flat, plan, rank, world):
    # reduce_scatter needs equal parts per rank: cut the whole buffer into world x bucket pieces
    size = (plan[0][1] - plan[0][0]) * world
    pieces = [(a, min(a + size, flat.numel())) for a in range(0, flat.numel(), size)]
    outs, works = [], []
    for a, b in pieces:
        n = (b - a) // world
        if n == 0:
            continue
        out = torch.empty(n)
        outs.append((out, a, n))
        works.append(dist.reduce_scatter_single(out, flat[a : a + n * world], async_op=True))
    for w in works:
        w.wait()
    works = [dist.all_gather_single(flat[a : a + n * world], out, async_op=True) for out, a, n in outs]
    for w in works:
        w.wait()


def send_recv(flat, plan, rank, world):
    works, received = [], []
    for tag, (a, b, o) in enumerate(plan):
        if o == rank:
            bufs = [torch.empty(b - a) for _ in range(world - 1)]
            peers = [r for r in range(world) if r != rank]
            works += [dist.irecv(buf, src=p, tag=tag) for buf, p in zip(bufs, peers)]
            received.append((a, b, bufs))
        else:
            works.append(dist.isend(flat[a:b], dst=o, tag=tag))
    for w in works:
        w.wait()
    for a, b, bufs in received:
        for buf in bufs:
            flat[a:b].add_(buf)
    works = []
    for tag, (a, b, o) in enumerate(plan):
        if o == rank:
            works += [dist.isend(flat[a:b], dst=p, tag=len(plan) + tag) for p in range(world) if p != rank]
        else:
            works.append(dist.irecv(flat[a:b], src=o, tag=len(plan) + tag))
    for w in works:
        w.wait()


PRIMITIVES = {"all_reduce": all_reduce, "reduce+broadcast": reduce_broadcast, "gather+broadcast": gather_broadcast,
              "reduce_scatter": reduce_scatter, "send/recv": send_recv}


def worker(rank, world, port, bucket_mb, repeats, queue):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    plan = buckets(NUMEL, world, int(bucket_mb * 2**20 / 4))
    for name, fn in PRIMITIVES.items():
        flat = torch.full((NUMEL,), float(rank + 1))
        try:
            fn(flat, plan, rank, world)  # warm-up, and the check that gloo accepts it
            expected = world * (world + 1) / 2
            ok = bool(torch.all(flat == expected))
        except (RuntimeError, ValueError) as err:
            dist.barrier()
            if rank == 0:
                queue.put((name, f"unsupported: {str(err).splitlines()[0][:80]}", None, None))
            continue
        dist.barrier()
        before = lo_bytes()
        start = time.perf_counter()
        for _ in range(repeats):
            fn(flat, plan, rank, world)
        dist.barrier()
        seconds = (time.perf_counter() - start) / repeats
        moved = (lo_bytes() - before) / repeats / world
        if rank == 0:
            queue.put((name, "ok" if ok else "WRONG SUM", seconds, moved))
    dist.destroy_process_group()
    if rank == 0:
        queue.put(None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--mb", type=float, default=4.0, help="bucket size in MB")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from shoal.comm.dist import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(worker, args=(args.world, free_port(), args.mb, args.repeats, queue), nprocs=args.world, start_method="spawn", join=False)
    p = 4 * NUMEL
    print(f"torch {torch.__version__}, gloo, {args.world} ranks on loopback, {os.cpu_count()} cores; {p / 1e6:.0f} MB in {args.mb:g} MB buckets")
    print(f"analytic bytes per rank for reduce-scatter + all-gather: {2 * p * (args.world - 1) / args.world / 1e6:.1f} MB")
    print(f"{'primitive':<18} | {'async':<40} | {'ms/step':>8} | {'lo MB/step/rank':>15}")
    print("-" * 92)
    while (row := queue.get()) is not None:
        name, status, seconds, moved = row
        if seconds is None:
            print(f"{name:<18} | {status:<40} | {'-':>8} | {'-':>15}")
        else:
            print(f"{name:<18} | {status:<40} | {seconds * 1e3:>8.0f} | {moved / 1e6:>15.1f}")


if __name__ == "__main__":
    main()
