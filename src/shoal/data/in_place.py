"""Batches of a torch map-style Dataset read in place, addressed by position (shoal.fit's module path).

A position is a count of samples consumed since the start of training (plus a
group's starting offset). Position p reads sample `order(epoch)[p % N]` of
epoch `p // N`, where `order(epoch)` is the identity, or, shuffled, a
permutation drawn from a torch.Generator seeded with (seed, epoch). So the
rows of a batch are a pure function of the position: a resumed run reads what
the uninterrupted one would, and a batch split over workers reads the rows one
worker would. The samples are collated with torch's `default_collate`, so a
batch keeps the dataset's structure (tensor, tuple, dict) and dtypes.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, default_collate

from shoal.data.errors import StoreError


class PositionSource:
    """What shoal reads by position besides a map-style Dataset (shoal.data.streams: an IterableDataset, a DataLoader
    factory): its positions per epoch (`__len__`), a batch of its first sample, and its reader."""

    def __len__(self) -> int:
        raise NotImplementedError

    def first_batch(self) -> Any:
        raise NotImplementedError

    def first_sample(self) -> Any:
        """The first sample as default_collate would receive it (None: this source collates with its own function)."""
        return None

    def reader(self, seed: int, shuffle: bool, stride: int):
        raise NotImplementedError


def check_dataset(dataset: Any, what: str) -> int:
    """The number of samples (positions per epoch) of a map-style dataset or a PositionSource; a one-line StoreError
    for anything else."""
    if isinstance(dataset, IterableDataset):
        raise StoreError(f"{what}: an IterableDataset is read through shoal.data.streams.IterableSource (shoal.fit wraps it)")
    if not (isinstance(dataset, PositionSource) or hasattr(dataset, "__getitem__")) or not hasattr(dataset, "__len__"):
        raise StoreError(f"{what}: expected a torch Dataset (map-style or iterable), a DataLoader factory or a pair of "
                         f"tensors, got {type(dataset).__name__}")
    n = len(dataset)
    if n <= 0:
        raise StoreError(f"{what}: the dataset is empty")
    sample = dataset.first_sample() if isinstance(dataset, PositionSource) else dataset[0]
    listed = python_list_in(sample, f"{what}[0]")
    if listed is not None:
        raise StoreError(listed)
    return n


NUMBER_KINDS = ((bool, "bools"), (int, "ints"), (float, "floats"))


def python_list_in(sample: Any, where: str) -> Optional[str]:
    """A line naming the first Python list of numbers (or of lists) in a sample, or None. default_collate turns a
    list of N numbers into N tensors, one per position, each holding the batch's values there: no model expects
    that, and the failure comes later, from inside the model or the loss."""
    if isinstance(sample, list) and sample and all(isinstance(v, (int, float, list)) for v in sample):
        kinds = [name for kind, name in NUMBER_KINDS if all(isinstance(v, kind) for v in sample)]
        kind = kinds[0] if kinds else "lists" if all(isinstance(v, list) for v in sample) else "numbers"
        return f"{where} is a list of {len(sample)} {kind}: return tensors (torch.tensor(...))"
    if isinstance(sample, dict):
        items = ((f"{where}[{k!r}]", v) for k, v in sample.items())
    elif isinstance(sample, (list, tuple)):
        items = ((f"{where}[{i}]", v) for i, v in enumerate(sample))
    else:
        return None
    return next((found for found in (python_list_in(v, w) for w, v in items) if found is not None), None)


def first_batch(dataset: Any) -> Any:
    """A batch of the first sample, collated as training batches are (for shape probes)."""
    if isinstance(dataset, PositionSource):
        return dataset.first_batch()
    return default_collate([dataset[0]])


def reader_for(dataset: Any, seed: int, shuffle: bool, stride: int):
    """What reads a feed's positions: `batch(start, count)` (stride: positions between a reader's successive batches)."""
    if isinstance(dataset, PositionSource):
        return dataset.reader(seed, shuffle, stride)
    return PositionReader(dataset, seed, shuffle)


def epoch_seed(seed: int, epoch: int) -> int:
    """One 63-bit generator seed per (seed, epoch), well mixed (numpy's SeedSequence)."""
    return int(np.random.SeedSequence([seed, epoch]).generate_state(2, np.uint32).view(np.uint64)[0] >> np.uint64(1))


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """The sample indices of `epoch` in reading order."""
    if not shuffle:
        return torch.arange(n)
    return torch.randperm(n, generator=torch.Generator().manual_seed(epoch_seed(seed, epoch)))


class PositionReader:
    """Reads the samples at positions of a dataset; remembers the last two epochs' orders (a memo, not state)."""

    def __init__(self, dataset: Dataset, seed: int, shuffle: bool):
        self.dataset, self.seed, self.shuffle = dataset, seed, shuffle
        self.n = len(dataset)
        self._orders: dict[int, torch.Tensor] = {}

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            if len(self._orders) >= 2:
                self._orders.pop(min(self._orders))
            self._orders[epoch] = epoch_order(self.n, self.seed, epoch, self.shuffle)
        return self._orders[epoch]

    def indices(self, start: int, count: int) -> list[int]:
        """The dataset indices read at positions start .. start + count."""
        out = []
        for p in range(start, start + count):
            epoch, i = divmod(p, self.n)
            out.append(int(self._order(epoch)[i]))
        return out

    def batch(self, start: int, count: int) -> Any:
        indices = self.indices(start, count)
        getitems = getattr(self.dataset, "__getitems__", None)  # torch's batched-read protocol (DataLoader uses it too)
        samples = getitems(indices) if getitems is not None else [self.dataset[i] for i in indices]
        return default_collate(samples)


def to_device(batch: Any, device: torch.device) -> Any:
    """The batch with every tensor on `device` (structure kept)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [to_device(v, device) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch


def first_tensor(batch: Any) -> torch.Tensor | None:
    """The first tensor of a batch in structure order (a dict's in insertion order)."""
    if isinstance(batch, torch.Tensor):
        return batch
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for value in values:
        found = first_tensor(value)
        if found is not None:
            return found
    return None


def batch_rows(batch: Any) -> int:
    """The rows of a collated batch: the leading size of its first tensor."""
    tensor = first_tensor(batch)
    return int(tensor.shape[0]) if tensor is not None and tensor.dim() > 0 else 1


class TensorPairs(Dataset):
    """(inputs, targets) tensors as a map-style dataset of (x[i], y[i]) pairs, read in place (no copy)."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor):
        if len(inputs) != len(targets):
            raise StoreError(f"{len(inputs)} inputs but {len(targets)} targets")
        self.inputs, self.targets = inputs, targets

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i: int):
        return self.inputs[i], self.targets[i]
