"""Train the character GPT on Shakespeare with shoal.fit.

    shoal prepare shakespeare --out examples/gpt/data
    shoal run examples/gpt/train.py                                    # one worker
    shoal run examples/gpt/train.py --set cluster.nworkers_per_group=2 --set cluster.nworkers_per_procs=2  # 2 threads
    shoal run examples/gpt/train.py --set cluster.nworkers_per_group=2 --set cluster.nservers_per_group=2   # AllReduce, 2 processes
    shoal run examples/gpt/train.py --set cluster.nworker_groups=2 --set cluster.nworkers_per_procs=2  # in-memory Hogwild
    shoal run examples/gpt/train.py --set cluster.nworker_groups=2 --set cluster.local_steps=50        # Local SGD, 2 groups

Arguments after the script's name (or after --) are the script's: --steps, --batch, --lr, --optimizer, the model's size
(--layers --heads --width --block) and --data (the prepared folder, default data/ beside this file).
"""
from __future__ import annotations

import argparse
import functools
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import Subset

import shoal
from data import CharWindows, read_vocab
from model import GPT, GPTConfig


def next_char_loss(model, batch):
    """Mean cross-entropy of the next character over every position of every window (loss_fn(model, batch))."""
    logits = model(batch["x"])
    return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())


def adamw(named_params, lr):
    """AdamW as nanoGPT sets it up: weight decay 0.1 on matrices and embeddings, none on biases and norms.
    shoal calls it with the model's (name, param) pairs, as its first parameter's name (`named_…`) asks."""
    named_params = list(named_params)
    return torch.optim.AdamW([{"params": [(n, p) for n, p in named_params if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [(n, p) for n, p in named_params if p.dim() < 2], "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.99))


def main(argv=None):
    here = Path(__file__).resolve().parent
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=here / "data", help="folder of train.txt, val.txt, vocab.txt")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=12, help="windows per step (of the whole group)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--optimizer", choices=["adamw", "kAdam"], default="adamw",
                   help="adamw: torch's AdamW (every layout); kAdam: SINGA's Adam "
                        "(no bias correction), under every layout")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--val-freq", type=int, default=200, help="validate every N steps (0: never)")
    p.add_argument("--val-windows", type=int, default=2000, help="validation windows read at each validation (0: all)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--workspace", default="gpt-workspace")
    args = p.parse_args(argv)

    for name in ("train.txt", "val.txt", "vocab.txt"):
        if not (args.data / name).is_file():
            raise SystemExit(f"{args.data / name}: not found; run `shoal prepare shakespeare --out {args.data}` first")
    vocab = read_vocab(args.data / "vocab.txt")
    train = CharWindows.from_file(args.data / "train.txt", vocab, args.block)
    val = CharWindows.from_file(args.data / "val.txt", vocab, args.block, stride=args.block)  # non-overlapping windows
    if args.val_windows and len(val) > args.val_windows:  # the same windows at every validation
        val = Subset(val, range(args.val_windows))
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig(vocab_size=len(vocab), block_size=args.block, n_layer=args.layers, n_head=args.heads, n_embd=args.width))
    history = shoal.fit(
        model, next_char_loss, train, val_data=val, val_freq=args.val_freq, val_batch=100,
        steps=args.steps, batch_size=args.batch, seed=args.seed, workspace=args.workspace, disp_freq=max(1, args.steps // 20),
        **({"optimizer": functools.partial(adamw, lr=args.lr)} if args.optimizer == "adamw"
           else {"updater": {"type": "kAdam", "learning_rate": {"base_lr": args.lr}}}),
    )
    vals = history.phase("validate")
    if vals:
        last = vals[-1]
        print(f"validation loss {last['loss']:.4f} (perplexity {math.exp(last['loss']):.2f}) at step {last['step']}")
    return history


if __name__ == "__main__":
    main()
