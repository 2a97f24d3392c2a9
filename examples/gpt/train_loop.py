"""Train the character GPT on Shakespeare with your own PyTorch loop: train.py's model, data, loss and optimizer, the loop
written out, and shoal.session() around it (docs/python.md, "Your own loop").

    shoal prepare shakespeare --out examples/gpt/data
    shoal run examples/gpt/train_loop.py --steps 2000                                              # one worker
    shoal run examples/gpt/train_loop.py --set cluster.nworkers_per_group=2 --set cluster.nworkers_per_procs=1  # AllReduce, 2 processes
    shoal run examples/gpt/train_loop.py --set cluster.nworker_groups=2 --set cluster.nworkers_per_procs=1 \\
        --set cluster.local_steps=50 --set cluster.outer_updater.type=kNesterov --set cluster.outer_updater.momentum=0.9 \\
        --set cluster.outer_updater.learning_rate.type=kFixed --set cluster.outer_updater.learning_rate.base_lr=0.7  # DiLoCo
    shoal run examples/gpt/train_loop.py --resume                       # on from the newest checkpoint, exactly
    shoal run examples/gpt/train_loop.py --tensorboard                  # also TensorBoard events in WORKSPACE/tensorboard

Arguments after the script's name (or after --) are the script's, as train.py's: --steps, --batch, --lr, the model's
size (--layers --heads --width --block), --val-freq, --val-windows, --seed, --data, --workspace; and --checkpoint-freq.
The validation loss goes to metrics.jsonl as shoal.fit's does (phase `validate`, every --val-freq steps and at the end),
so `shoal compare gpt-workspace gpt-loop-workspace` puts the two side by side; on the same rows, seed and steps under
one worker they record the same validation losses (tests/test_session_evaluate.py).
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from torch.utils.data import Subset

import shoal
from data import CharWindows, read_vocab
from model import GPT, GPTConfig
from train import adamw, next_char_loss


def main(argv=None):
    here = Path(__file__).resolve().parent
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=here / "data", help="folder of train.txt, val.txt, vocab.txt")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=12, help="windows per step (of the whole group)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--val-freq", type=int, default=200, help="validate every N steps (0: at the end only)")
    p.add_argument("--val-windows", type=int, default=2000, help="validation windows read at each validation (0: all)")
    p.add_argument("--checkpoint-freq", type=int, default=500, help="checkpoint every N steps (and at the end)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--workspace", default="gpt-loop-workspace")
    args = p.parse_args(argv)

    for name in ("train.txt", "val.txt", "vocab.txt"):
        if not (args.data / name).is_file():
            raise SystemExit(f"{args.data / name}: not found; run `shoal prepare shakespeare --out {args.data}` first")
    # the layout comes from `shoal run ... --set cluster.…`; under several processes this script runs once per process
    # from the top (the data is read after this line: the launching process waits here for the ranks)
    run = shoal.session(train_steps=args.steps, seed=args.seed, disp_freq=max(1, args.steps // 20), workspace=args.workspace,
                        name="gpt-loop")
    vocab = read_vocab(args.data / "vocab.txt")
    train = CharWindows.from_file(args.data / "train.txt", vocab, args.block)
    val = CharWindows.from_file(args.data / "val.txt", vocab, args.block, stride=args.block)  # non-overlapping windows
    if args.val_windows and len(val) > args.val_windows:  # the same windows at every validation
        val = Subset(val, range(args.val_windows))
    torch.manual_seed(args.seed)
    model = run.model(GPT(GPTConfig(vocab_size=len(vocab), block_size=args.block, n_layer=args.layers, n_head=args.heads,
                                    n_embd=args.width)))
    opt = run.optimizer(adamw(model.named_parameters(), args.lr))
    last = run.job.train_steps  # (--set train_steps= wins over --steps)

    for step, batch in run.batches(train, batch_size=args.batch):
        if args.val_freq and step % args.val_freq == 0:  # before step's update, as fit validates: recorded at `step`
            run.evaluate(val, next_char_loss, batch_size=100)
        loss = next_char_loss(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        run.log(step, loss=loss)
        if (args.checkpoint_freq and (step + 1) % args.checkpoint_freq == 0) or step + 1 == last:
            run.checkpoint()

    values = run.evaluate(val, next_char_loss, batch_size=100)  # the trained model's, at step `last` ({} but on rank 0)
    if values:
        print(f"validation loss {values['loss']:.4f} (perplexity {math.exp(values['loss']):.2f}) at step {last}")


if __name__ == "__main__":
    main()
