"""The example GPT's training loop written with shoal's session calls: the loop benchmarks/own_loop.py measures.

    shoal run benchmarks/own_loop_scripts/session_loop.py --workspace WS [--set cluster.…] -- --out DIR [--steps N] ...

The same loop as plain_loop.py beside it (the same model, rows, AdamW, clipping and schedule, in the same order), with
the five calls of issue 39 (`shoal.session()`, `run.model`, `run.optimizer`, `run.batches`, `run.log`); the layout comes
from `--set cluster.…`. What the benchmark adds around the loop (own_loop.StepClock: the step times and the untimed
validation, on every process) is the same in both scripts. Rank 0 writes DIR/result.json and DIR/params.safetensors.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: gpt.py (the example's model and data) and own_loop.py
import gpt  # noqa: E402
import own_loop  # noqa: E402

import torch  # noqa: E402

import shoal  # noqa: E402

args = own_loop.loop_arguments()
torch.set_num_threads(args.threads)  # one process; under several, the session sets cluster.threads_per_worker
model, train, val = gpt.build(args)  # initialised from gpt.SEED on every process

run = shoal.session(train_steps=args.steps, seed=gpt.SEED, disp_freq=gpt.display_freq(args.steps))
model = run.model(model)
opt = run.optimizer(gpt.plain_adamw(model))
sched = gpt.scheduler(opt, args.steps)
clock = own_loop.StepClock(model, val, gpt.val_freq(args.steps), args, run.rank)
for step, batch in run.batches(train, batch_size=args.batch):
    clock.start(step)  # validates first every val_freq steps, untimed
    loss = gpt.next_char_loss(model, batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), gpt.CLIP)
    opt.step()
    opt.zero_grad()
    sched.step()
    run.log(step, loss=loss)
clock.finish(args.steps)
if run.rank == 0:
    # Local SGD / DiLoCo: the chief's count of every group's payload to the last meeting (fit's summary.json bytes_sent)
    sent = getattr(run.exchange, "job_bytes_sent", None)
    own_loop.write_result(args.out, model, clock, args.batch * max(1, run.plan.cluster.nworker_groups), args.steps,
                          label=run.label, processes=run.processes, bytes_sent=sent)
