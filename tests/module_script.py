"""A shoal.fit script on random token data, for `shoal run` and torchrun tests of the module path (test_fit_every_feature).

    shoal run tests/module_script.py [--set cluster.…] [--workspace DIR] -- [--steps N] [--lr LR]

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


def sgd(params, lr):
    return torch.optim.SGD(params, lr=lr)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--workspace", default="module-workspace")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    import functools

    return shoal.fit(TinyLM(), next_token_loss, Tokens(), test_data=Tokens(128, seed=1), steps=args.steps, batch_size=16,
                     disp_freq=1, optimizer=functools.partial(sgd, lr=args.lr), workspace=args.workspace)


if __name__ == "__main__":
    main()
