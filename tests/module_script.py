"""A shoal.fit script on random token data, for `shoal run` and torchrun tests of the module path (test_fit_every_feature).

    shoal run tests/module_script.py [--set cluster.…] [--workspace DIR] -- [--steps N] [--lr LR] [--slow S [--slow-rank R]]

--slow S: each step of process R (every process without --slow-rank) computes S seconds longer, in the loss (fit's loop
on the session runs no fault hook: SHOAL_SLOW_WORKER slows the job path's workers only).

The task: the next token is the last one plus one (mod 16); a small embedding model learns it in tens of steps.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import shoal

VOCAB, BLOCK = 16, 8


class Tokens(torch.utils.data.Dataset):
    """Random windows of int64 token ids, each with its next token."""

    def __init__(self, n: int = 512, seed: int = 0):
        self.x = torch.randint(0, VOCAB, (n, BLOCK), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": (self.x[i, -1] + 1) % VOCAB}


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.head = torch.nn.Linear(16 * BLOCK, VOCAB)

    def forward(self, x):
        return self.head(self.embed(x).flatten(1))


def next_token_loss(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"])


def slowed_loss(seconds, rank, model, batch):
    """next_token_loss, `seconds` slower in process `rank` (None: in every process), its rank the job's world's."""
    import time

    import torch.distributed as dist

    if rank is None or (dist.is_initialized() and dist.get_rank() == rank):
        time.sleep(seconds)
    return next_token_loss(model, batch)


def sgd(params, lr):
    return torch.optim.SGD(params, lr=lr)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--workspace", default="module-workspace")
    p.add_argument("--slow", type=float, default=0.0)
    p.add_argument("--slow-rank", type=int, default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    import functools

    loss = functools.partial(slowed_loss, args.slow, args.slow_rank) if args.slow else next_token_loss
    return shoal.fit(TinyLM(), loss, Tokens(), test_data=Tokens(128, seed=1), steps=args.steps, batch_size=16,
                     disp_freq=1, optimizer=functools.partial(sgd, lr=args.lr), workspace=args.workspace, loss_takes="model")


if __name__ == "__main__":
    main()
