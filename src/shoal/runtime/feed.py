"""Feeds input layers from in-memory stores, addressed by position.

A feed never holds an iterator: the rows of a batch are a pure function of a
cursor (samples consumed so far in this phase), the random skip drawn once at
start, and this worker's share of the batch. That makes resuming exact (the
cursor is in the checkpoint) and makes every batch split over workers read the
same rows a single worker would.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from shoal.config import job_pb2
from shoal.data.dataset import Dataset, check_labels, load_mean, open_store
from shoal.data.errors import StoreError
from shoal.data.in_place import reader_for, to_device
from shoal.neuralnet.layers.char_rnn import CharRNNOutput, char_windows, encode_text, read_vocab
from shoal.planning.shares import batch_conf, batch_shares


@dataclass
class InputFeed:
    """One input layer's store plus where this worker reads in each batch."""

    layer_name: str
    dataset: Dataset
    global_batch: int
    offset: int  # first row of this worker's share within a global batch
    share: int
    skip: int = 0  # SINGA's random_skip, drawn once per run

    def rows(self, cursor: int) -> tuple[np.ndarray, Optional[np.ndarray]]:
        return self.dataset.rows(self.skip + cursor + self.offset, self.share)

    def batch(self, cursor: int, device: torch.device) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        data, labels = self.rows(cursor)
        x = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).to(device)
        y = None if labels is None else torch.from_numpy(np.ascontiguousarray(labels, dtype=np.int64)).to(device)
        return x, y


@dataclass
class TextFeed:
    """kCharRNN's feed: a text as character ids, cut into windows as SINGA's CharRNNInputLayer (`char_windows`).

    The rows of batch `cursor // global_batch` are the same whatever the number
    of workers; this worker takes rows offset .. offset + share.
    """

    layer_name: str
    ids: np.ndarray
    unroll_len: int
    global_batch: int
    offset: int
    share: int
    skip: int = 0  # no random skip: kept for the checkpoint's feed state

    def batch(self, cursor: int, device: torch.device) -> tuple[torch.Tensor, None]:
        windows = char_windows(self.ids, self.global_batch, self.unroll_len, cursor // self.global_batch)
        return torch.from_numpy(windows[self.offset : self.offset + self.share]).to(device), None


@dataclass
class DatasetFeed:
    """A torch Dataset read in place (shoal.fit's module path): batches of any structure and dtype.

    Rows offset .. offset + share of the global batch at `cursor` are the samples at positions
    skip + cursor + offset onwards (shoal.data.in_place: shuffled per epoch from the job's seed; an
    IterableDataset or a DataLoader factory through shoal.data.streams).
    """

    layer_name: str
    dataset: "torch.utils.data.Dataset"
    global_batch: int
    offset: int
    share: int
    skip: int = 0  # a group's first position (disjoint shards); checkpointed with the other feeds' skips
    seed: int = 0
    shuffle: bool = False

    def __post_init__(self):
        self.reader = reader_for(self.dataset, self.seed, self.shuffle, self.global_batch)

    def batch(self, cursor: int, device: torch.device) -> tuple[object, None]:
        return to_device(self.reader.batch(self.skip + cursor + self.offset, self.share), device), None


def open_text(conf: job_pb2.CharRNNProto, base_dirs: list[Path]) -> np.ndarray:
    """The ids of char_rnn_conf.path's characters under char_rnn_conf.vocab_path (ValueError naming the file)."""
    path, vocab_path = resolve_data_path(conf.path, base_dirs), resolve_data_path(conf.vocab_path, base_dirs)
    for p, field in ((path, "path"), (vocab_path, "vocab_path")):
        if not p.is_file():
            raise StoreError(f"char_rnn_conf.{field}: {p} is not a file")
    try:
        return encode_text(path.read_text(encoding="utf-8"), read_vocab(vocab_path))
    except (KeyError, UnicodeDecodeError) as err:
        raise StoreError(f"{path}: {err.args[0] if isinstance(err, KeyError) else err} (vocabulary {vocab_path})") from None


def resolve_data_path(path: str, base_dirs: list[Path]) -> Path:
    """SINGA resolves store paths against the working directory; shoal also tries the job file's folder."""
    p = Path(path)
    if p.is_absolute():
        return p
    for base in base_dirs:
        if (Path(base) / p).exists():
            return Path(base) / p
    return Path(base_dirs[0]) / p if base_dirs else p


def make_feeds(net, base_dirs: list[Path], partition: int, npartitions: int, rng: np.random.Generator, device: torch.device) -> dict[str, InputFeed]:
    """Open the store of every input layer of `net` (shared in memory by all nets of a process)."""
    feeds = {}
    for node in net.nodes:
        meanfile = node.layer.conf.rgbimage_conf.meanfile if node.layer.conf.HasField("rgbimage_conf") else ""
        if meanfile:
            node.layer.mean = torch.from_numpy(np.asarray(load_mean(resolve_data_path(meanfile, base_dirs)), dtype=np.float32)).to(device)
        if isinstance(node.layer, CharRNNOutput):
            node.layer.vocab = read_vocab(resolve_data_path(node.layer.conf.char_rnn_conf.vocab_path, base_dirs))
    texts: dict[tuple[str, str], np.ndarray] = {}
    for node in net.input_nodes():
        conf = node.layer.conf
        if conf.type == job_pb2.kCharRNN:
            c = conf.char_rnn_conf
            if (c.path, c.vocab_path) not in texts:
                texts[(c.path, c.vocab_path)] = open_text(c, base_dirs)
            shares = batch_shares(batch_conf(conf), npartitions)
            feeds[node.name] = TextFeed(node.name, texts[(c.path, c.vocab_path)], c.unroll_len, sum(shares), sum(shares[:partition]), shares[partition])
            continue
        if hasattr(node.layer, "torch_dataset"):  # shoal.fit's module path: a torch Dataset read in place
            shares = batch_shares(batch_conf(conf), npartitions)
            layer = node.layer
            feeds[node.name] = DatasetFeed(node.name, layer.torch_dataset, sum(shares), sum(shares[:partition]), shares[partition],
                                           seed=layer.shuffle_seed, shuffle=layer.shuffle)
            continue
        if hasattr(node.layer, "open_dataset"):  # a plugin's input layer reads its own data (docs/layers.md)
            shares = batch_shares(batch_conf(conf), npartitions)
            feeds[node.name] = InputFeed(node.name, node.layer.open_dataset(base_dirs), sum(shares), sum(shares[:partition]), shares[partition])
            continue
        if not conf.HasField("store_conf"):
            continue
        store = job_pb2.StoreProto()
        store.CopyFrom(conf.store_conf)
        store.path = str(resolve_data_path(store.path, base_dirs))
        for field, attribute in (("mean_file", "mean"), ("std_file", "std")):
            if store.HasField(field):
                setattr(store, field, str(resolve_data_path(getattr(store, field), base_dirs)))
                values = load_mean(getattr(store, field), store.backend or "kvfile", store.separator)
                setattr(node.layer, attribute, torch.from_numpy(np.asarray(values, dtype=np.float32)).to(device))
        dataset = open_store(store, ".")
        check_labels(dataset, node.layer.label_reader)  # labels a loss reads as class ids: in range, once per store
        shares = batch_shares(store, npartitions)
        skip = int(rng.integers(0, store.random_skip + 1)) if store.random_skip > 0 else 0
        feeds[node.name] = InputFeed(node.name, dataset, sum(shares), sum(shares[:partition]), shares[partition], skip)
    return feeds
