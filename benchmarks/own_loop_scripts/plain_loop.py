"""The example GPT's plain PyTorch training loop (no shoal); under torchrun, the same loop with DistributedDataParallel.

    python benchmarks/own_loop_scripts/plain_loop.py --out DIR [--steps N] ...                  # one process
    torchrun --standalone --nproc-per-node 2 benchmarks/own_loop_scripts/plain_loop.py --out DIR ...   # DDP, gloo

The rows are the ones session_loop.py's `run.batches` reads: shoal's per-epoch order from the seed (gpt.Rows), each
rank the same share of each step's batch as a session worker (the batch split in order over the ranks). Rank 0 writes
DIR/result.json and DIR/params.safetensors.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: gpt.py (the example's model and data) and own_loop.py
import gpt  # noqa: E402
import own_loop  # noqa: E402

import torch  # noqa: E402
from torch.utils.data import default_collate  # noqa: E402

args = own_loop.loop_arguments()
torch.set_num_threads(args.threads)
model, train, val = gpt.build(args)  # initialised from gpt.SEED on every process
world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
trained = model
if world > 1:  # torchrun started this process
    import torch.distributed as dist

    dist.init_process_group("gloo")
    trained = torch.nn.parallel.DistributedDataParallel(model)

opt = gpt.plain_adamw(model)
sched = gpt.scheduler(opt, args.steps)
rows = gpt.Rows(len(train), gpt.SEED)
share = args.batch // world
clock = own_loop.StepClock(model, val, gpt.val_freq(args.steps), args, rank)
for step in range(args.steps):
    clock.start(step)  # validates first every val_freq steps, untimed
    mine = rows(step * args.batch, args.batch)[rank * share:(rank + 1) * share]
    batch = default_collate([train[i] for i in mine])
    loss = gpt.next_char_loss(trained, batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), gpt.CLIP)
    opt.step()
    opt.zero_grad()
    sched.step()
clock.finish(args.steps)
if rank == 0:
    own_loop.write_result(args.out, model, clock, args.batch, args.steps, label="DDP" if world > 1 else "plain loop",
                          processes=world)
if world > 1:
    dist.destroy_process_group()
