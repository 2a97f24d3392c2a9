"""In-memory datasets: a store is read once into numpy, then batches are slices.

SINGA's input layers read records one by one; holding the whole store in memory
(MNIST is 190 MB as float32, CIFAR-10 600 MB) keeps batching off the critical
path, and every net of a process shares the same arrays.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import numpy as np

from shoal.config import job_pb2
from shoal.data.errors import StoreError
from shoal.data.kvfile import read_kvfile
from shoal.data.records import decode
from shoal.data.textfile import read_textfile


@dataclass
class Dataset:
    data: np.ndarray  # (N, *shape) float32, not normalised
    labels: Optional[np.ndarray]  # (N,) int64
    path: str

    def __len__(self) -> int:
        return len(self.data)

    def rows(self, start: int, count: int) -> tuple[np.ndarray, Optional[np.ndarray]]:
        """`count` rows from `start`, wrapping at the end as SINGA's store readers do."""
        n = len(self.data)
        idx = (start + np.arange(count)) % n
        if idx[0] + count <= n:  # contiguous: a view, no gather
            sl = slice(int(idx[0]), int(idx[0]) + count)
            return self.data[sl], None if self.labels is None else self.labels[sl]
        return self.data[idx], None if self.labels is None else self.labels[idx]


_CACHE: dict[tuple, Dataset] = {}
_CACHE_LOCK = threading.Lock()


def _read_kv(path: Path, shape: tuple[int, ...]) -> Dataset:
    features, labels = [], []
    offset = 0
    for index, (key, value) in enumerate(read_kvfile(path)):
        try:
            x, y, declared = decode(value)
        except Exception:  # protobuf raises DecodeError (a plain Exception subclass)
            raise StoreError(f"{path}: byte {offset}: record {index} is not a RecordProto") from None
        if shape and x.size != math.prod(shape):
            raise StoreError(f"{path}: byte {offset}: record {index} has {x.size} values, store_conf.shape {list(shape)} needs {math.prod(shape)}")
        features.append(x)
        labels.append(-1 if y is None else y)
        offset += 16 + len(key) + len(value)
    if not features:
        raise StoreError(f"{path}: byte 0: the store holds no records")
    sizes = {f.size for f in features}
    if len(sizes) > 1:
        raise StoreError(f"{path}: records have different sizes {sorted(sizes)[:4]}; give store_conf.shape")
    data = np.stack(features)
    target = shape or declared or (data.shape[1],)
    lab = np.asarray(labels, dtype=np.int64)
    return Dataset(data.reshape((len(data),) + tuple(target)), None if (lab < 0).all() else lab, str(path))


def open_store(conf: job_pb2.StoreProto, base_dir: Union[str, Path] = ".") -> Dataset:
    """Read the store a `store_conf` names (kvfile or textfile), once per process."""
    path = Path(conf.path)
    if not path.is_absolute():
        path = Path(base_dir) / path
    if not path.is_file():
        raise StoreError(f"{path}: no such store (prepare it with `shoal prepare ...`)")
    backend = conf.backend or "kvfile"
    shape = tuple(conf.shape)
    stat = path.stat()
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size, backend, shape, conf.has_label, conf.separator)
    with _CACHE_LOCK:
        if key in _CACHE:
            return _CACHE[key]
        if backend == "kvfile":
            dataset = _read_kv(path, shape)
        elif backend == "textfile":
            data, labels = read_textfile(path, conf.has_label, conf.separator)
            if shape:
                if data.shape[1] != math.prod(shape):
                    raise StoreError(f"{path}: rows have {data.shape[1]} values, store_conf.shape {list(shape)} needs {math.prod(shape)}")
                data = data.reshape((len(data),) + shape)
            dataset = Dataset(data, labels, str(path))
        else:
            raise StoreError(f"{path}: store backend {backend!r} is not supported (use kvfile or textfile)")
        _CACHE[key] = dataset
        return dataset


def load_mean(path: Union[str, Path]) -> np.ndarray:
    """SINGA's mean file: a kvfile holding one RecordProto with the mean image."""
    for _, value in read_kvfile(path):
        features, _, shape = decode(value)
        return features.reshape(shape) if shape else features
    raise StoreError(f"{path}: byte 0: the mean file holds no record")
