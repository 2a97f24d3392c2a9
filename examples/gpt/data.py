"""Character windows of a prepared text (`shoal prepare shakespeare --out DIR`: train.txt, val.txt, vocab.txt).

Sample i is the window of block_size + 1 characters starting at i * stride, as int64 ids:
{"x": its first block_size ids, "y": the block_size ids after each of them} — next-character targets.
A map-style Dataset: shoal reads it in place, shuffles it per epoch and shards it over workers by index.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset


def read_vocab(path: str | Path) -> str:
    """vocab.txt: every character of the corpus once, in id order."""
    return Path(path).read_text(encoding="utf-8")


def encode(text: str, vocab: str) -> torch.Tensor:
    index = {ch: i for i, ch in enumerate(vocab)}
    unknown = sorted(set(text) - set(index))
    if unknown:
        raise ValueError(f"characters {''.join(unknown[:10])!r} are not in the vocabulary")
    return torch.tensor([index[ch] for ch in text], dtype=torch.int64)


class CharWindows(Dataset):
    def __init__(self, ids: torch.Tensor, block_size: int, stride: int = 1):
        if len(ids) < block_size + 1:
            raise ValueError(f"{len(ids)} characters: fewer than one window of {block_size + 1}")
        self.ids, self.block_size, self.stride = ids, block_size, stride

    @classmethod
    def from_file(cls, text_path: str | Path, vocab: str, block_size: int, stride: int = 1) -> "CharWindows":
        return cls(encode(Path(text_path).read_text(encoding="utf-8"), vocab), block_size, stride)

    def __len__(self) -> int:
        return (len(self.ids) - self.block_size - 1) // self.stride + 1

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        chunk = self.ids[i * self.stride : i * self.stride + self.block_size + 1]
        return {"x": chunk[:-1], "y": chunk[1:]}
