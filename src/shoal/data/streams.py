"""shoal.fit's other two inputs, addressed by position as map-style Datasets are (data/in_place.py).

- `IterableSource`: a torch IterableDataset. Position p is sample p % N of epoch p // N, where an
  epoch is one iteration of the dataset (after `set_epoch(epoch)` when it has one) and N is its
  `len()` when it defines one, else the count of epoch 0's samples. A reader keeps one live
  iterator and moves it forward to each position it is asked for; a position behind it (a resume,
  another epoch, an evaluation starting over) starts the epoch's iteration again and skips to it.
  So every reader (each worker of each group) iterates the whole stream and keeps its own rows,
  and the rows at a position are the same in every process and after a resume, provided each
  epoch's iteration is a function of the epoch alone.
- `LoaderSource`: a DataLoader factory, `make_loader(batch_sampler) -> DataLoader`. shoal decides
  which samples each reader takes at each step (the same positions, order and shuffling as for the
  factory's map-style dataset given directly) and hands them over as the DataLoader's
  `batch_sampler`; the loader fetches and collates them (its workers, collate_fn, pin_memory).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Iterator

from torch.utils.data import DataLoader, IterableDataset, default_collate

from shoal.data.errors import StoreError
from shoal.data.in_place import PositionReader, PositionSource

_EPOCH_LOCK = threading.Lock()  # set_epoch + the iteration's first sample, atomically: readers on threads share the dataset


class IterableSource(PositionSource):
    """An IterableDataset as a sequence of positions (picklable: holds only the dataset and what it learned)."""

    def __init__(self, dataset: IterableDataset, what: str):
        self.dataset, self.what = dataset, what
        self._len: int | None = None

    def __len__(self) -> int:
        if self._len is None:
            try:
                self._len = len(self.dataset)  # type: ignore[arg-type]
            except TypeError:  # no __len__: count one epoch (once per process)
                self._len = sum(1 for _ in self.epoch(0))
            if self._len <= 0:
                raise StoreError(f"{self.what}: the IterableDataset yields no samples")
        return self._len

    def epoch(self, epoch: int) -> Iterator[Any]:
        """One iteration of the dataset, told its epoch first when it can be (set_epoch)."""
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if set_epoch is None:
            return iter(self.dataset)
        with _EPOCH_LOCK:  # a generator reads its epoch when it starts: start it before another reader sets one
            set_epoch(epoch)
            it = iter(self.dataset)
            first = next(it, _END)
        return _chain_first(first, it)

    def first_batch(self) -> Any:
        return default_collate([self.first_sample()])

    def first_sample(self) -> Any:
        for sample in self.epoch(0):
            return sample
        raise StoreError(f"{self.what}: the IterableDataset yields no samples")

    def reader(self, seed: int, shuffle: bool, stride: int) -> "StreamReader":
        return StreamReader(self)


_END = object()


def _chain_first(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    if first is _END:
        return
    yield first
    yield from rest


class StreamReader:
    """Reads positions of an IterableSource through one live iterator (the dataset's order is its own: no shuffle)."""

    def __init__(self, source: IterableSource):
        self.source = source
        self._epoch, self._next, self._it = -1, 0, iter(())

    def _sample(self, position: int) -> Any:
        n = len(self.source)
        epoch, index = divmod(position, n)
        if epoch != self._epoch or index < self._next:
            self._epoch, self._next, self._it = epoch, 0, self.source.epoch(epoch)
        while True:
            sample = next(self._it, _END)
            if sample is _END:
                raise StoreError(f"{self.source.what}: the IterableDataset ended after {self._next} samples in epoch {epoch}; "
                                 f"every epoch must yield {n} (its len(), or epoch 0's count)")
            self._next += 1
            if self._next > index:
                return sample

    def batch(self, start: int, count: int) -> Any:
        return default_collate([self._sample(p) for p in range(start, start + count)])


class PositionBatchSampler:
    """A DataLoader's batch_sampler: the dataset indices of positions start, start + stride, … (`count` each)."""

    def __init__(self, indices: Callable[[int, int], list[int]], start: int, count: int, stride: int):
        self.indices, self.start, self.count, self.stride = indices, start, count, stride

    def __iter__(self) -> Iterator[list[int]]:
        start = self.start
        while True:
            yield self.indices(start, self.count)
            start += self.stride


class LoaderSource(PositionSource):
    """A DataLoader factory `make_loader(batch_sampler) -> DataLoader` over a map-style dataset."""

    def __init__(self, make_loader: Callable, what: str):
        self.make_loader, self.what = make_loader, what
        self._dataset = None

    def __getstate__(self):  # the factory travels; a built loader (and its dataset copy) is remade in each process
        return {"make_loader": self.make_loader, "what": self.what, "_dataset": None}

    def loader(self, batch_sampler) -> DataLoader:
        try:
            loader = self.make_loader(batch_sampler)
        except (ValueError, TypeError) as err:  # DataLoader's own refusals (batch_size/shuffle/sampler with a batch_sampler), a wrong signature
            raise StoreError(f"{self.what}: the DataLoader factory failed: {err}") from None
        if not isinstance(loader, DataLoader):
            raise StoreError(f"{self.what}: a DataLoader factory must return a torch DataLoader built with "
                             f"batch_sampler=the argument it is given, got {type(loader).__name__}")
        if isinstance(loader.dataset, IterableDataset):
            raise StoreError(f"{self.what}: a DataLoader factory needs a map-style dataset (give an IterableDataset "
                             "to shoal.fit directly)")
        if loader.batch_sampler is not batch_sampler:
            raise StoreError(f"{self.what}: the DataLoader factory must pass its argument as batch_sampler=")
        return loader

    @property
    def dataset(self):
        if self._dataset is None:
            self._dataset = self.loader([[0]]).dataset
        return self._dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def first_batch(self) -> Any:
        probe = self.loader([[0]])
        return probe.collate_fn([probe.dataset[0]])

    def reader(self, seed: int, shuffle: bool, stride: int) -> "LoaderReader":
        return LoaderReader(self, seed, shuffle, stride)


class LoaderReader:
    """Batches of a LoaderSource: one loader iterator per (next position, rows) a reader is due to ask for.

    A worker asks for its rows of successive batches (`stride` apart), or with micro-batches for
    several row ranges of each; each range keeps a live iterator, so prefetching loaders run ahead,
    and any other position (a resume, an evaluation starting over) builds a new one.
    """

    KEEP = 8  # live iterators at most (a balancer moving shares leaves old ones behind)

    def __init__(self, source: LoaderSource, seed: int, shuffle: bool, stride: int):
        self.source, self.stride = source, stride
        self.positions = PositionReader(source.dataset, seed, shuffle)
        self._live: OrderedDict[tuple[int, int], Iterator[Any]] = OrderedDict()

    def batch(self, start: int, count: int) -> Any:
        it = self._live.pop((start, count), None)
        if it is None:
            it = iter(self.source.loader(PositionBatchSampler(self.positions.indices, start, count, self.stride)))
            while len(self._live) >= self.KEEP:
                self._live.popitem(last=False)
        batch = next(it)
        self._live[(start + self.stride, count)] = it
        return batch
