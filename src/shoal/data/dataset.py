"""In-memory datasets: a store is read once into numpy, then batches are slices.

SINGA's input layers parse records one by one while training. Holding the
whole store in memory instead (MNIST is 190 MB as float32, CIFAR-10 600 MB)
keeps batching off the critical path, and every net, worker and phase of a
process that opens the same file shares the same arrays.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from shoal.config import job_pb2
from shoal.data.errors import StoreError
from shoal.data.files import regular_file
from shoal.data.kvfile import scan_kvfile, store_file
from shoal.data.records import RecordDecodeError, decode_proto, record_values
from shoal.data.textfile import read_textfile, read_textfile_lines, split_fields

PathLike = str | Path
BACKENDS = ("kvfile", "textfile")


@dataclass
class Dataset:
    """A whole store in memory: values converted to float32 (not normalised) and labels."""

    data: np.ndarray  # (N, *shape) float32
    labels: np.ndarray | None  # (N,) int64, None when the records carry no label
    path: str
    backend: str = ""  # kvfile or textfile: how to find a record again for a message
    file: str = ""  # the file read (a kvfile folder's shard.dat)
    labels_checked: set = field(default_factory=set, repr=False, compare=False)  # (layer, classes) already checked

    def __len__(self) -> int:
        return len(self.data)

    def rows(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Rows start .. start+count-1 as fresh contiguous arrays, wrapping past the end
        (SINGA's store readers seek back to the first record when they reach the last)."""
        n = len(self.data)
        if n == 0 or count < 0:
            raise ValueError(f"{self.path}: cannot take {count} rows of a store with {n}")
        first = start % n
        if first + count <= n:  # one slice: copy it, so callers never alias the shared arrays
            taken = slice(first, first + count)
            return self.data[taken].copy(), None if self.labels is None else self.labels[taken].copy()
        index = (first + np.arange(count)) % n
        return self.data[index], None if self.labels is None else self.labels[index]


@dataclass(frozen=True)
class _Table:
    """A store as read from disk: flat (N, D) values, labels, and the records' declared shape."""

    values: np.ndarray
    labels: np.ndarray | None
    record_shape: tuple[int, ...]


_TABLES: dict[tuple, _Table] = {}
_DATASETS: dict[tuple, Dataset] = {}
_LOCK = threading.Lock()


def open_store(conf: job_pb2.StoreProto, base_dir: PathLike = ".") -> Dataset:
    """Read the store a `store_conf` names (kvfile or textfile) into memory, once per process.

    A relative `path` is resolved against `base_dir`. When `shape` is given each
    record must hold prod(shape) values, and the data comes back as (N, *shape).
    Opening an unchanged file again (same path, mtime and size) returns the same
    arrays; normalisation is left to the input layer (see `normalise`).
    """
    backend = conf.backend or "kvfile"
    if backend not in BACKENDS:
        raise StoreError(f"{conf.path}: store backend {backend!r} is not supported (use kvfile or textfile)")
    path = Path(conf.path)
    if not path.is_absolute():
        path = Path(base_dir) / path
    file = regular_file(store_file(path) if backend == "kvfile" else path)
    stat = file.stat()
    # only what changes the parsed values belongs in the key, so that e.g. train and test
    # layers with different batch sizes share one copy
    table_key = (str(file.resolve()), stat.st_mtime_ns, stat.st_size, backend)
    if backend == "textfile":
        table_key += (conf.has_label, conf.separator)
    shape = tuple(conf.shape)
    with _LOCK:
        dataset = _DATASETS.get(table_key + (shape,))
        if dataset is not None:
            return dataset
        table = _TABLES.get(table_key)
        if table is None:
            table = _read_kvfile(file) if backend == "kvfile" else _read_textfile(file, conf.has_label, conf.separator)
            _check_finite(table, file, backend)
            table.values.setflags(write=False)  # shared by every user of the store
            _TABLES[table_key] = table
        dataset = Dataset(_shaped(table, shape, file, backend), table.labels, str(path), backend, str(file))
        _DATASETS[table_key + (shape,)] = dataset
        return dataset


def check_labels(dataset: Dataset, reader: tuple[str, int] | None) -> None:
    """Refuse a store whose labels the layer `reader` names (layer, class count) cannot read as class ids.

    One pass over the labels in memory, once per store and reader, when the store
    is opened: a label out of range would otherwise surface mid-run as a
    traceback from the loss. The message names the store, the first bad record
    (its line in a textfile, its byte offset in a kvfile), the label and the layer.
    """
    if reader is None or reader in dataset.labels_checked:
        return
    name, classes = reader
    if dataset.labels is None:
        raise StoreError(f"{dataset.path}: the records carry no labels, and layer {name!r} reads them (store_conf.has_label)")
    bad = np.flatnonzero((dataset.labels < 0) | (dataset.labels >= classes))
    if bad.size:
        index = int(bad[0])
        more = f"; {bad.size} of the {len(dataset.labels)} records are out of range" if bad.size > 1 else ""
        raise StoreError(
            f"{_record_place(dataset, index)}: label {dataset.labels[index]} is out of range for layer {name!r},"
            f" which has {classes} classes (labels 0..{classes - 1}){more}"
        )
    dataset.labels_checked.add(reader)


def _record_place(dataset: Dataset, index: int) -> str:
    """`FILE:LINE: record I` (textfile) or `FILE: byte B: record I` (kvfile): found again by reading the file (on errors only)."""
    if dataset.backend == "textfile":
        records = (int(key) + 1 for key, line in read_textfile_lines(dataset.file) if line.strip())
        line = next((n for i, n in enumerate(records) if i == index), None)
        return f"{dataset.file}:{line}: record {index}" if line else f"{dataset.file}: record {index}"
    if dataset.backend == "kvfile":
        offset = next((offset for i, (offset, _, _) in enumerate(scan_kvfile(dataset.file)) if i == index), None)
        return f"{dataset.file}: byte {offset}: record {index}" if offset is not None else f"{dataset.file}: record {index}"
    return f"{dataset.path}: record {index}"


def _check_finite(table: _Table, path: Path, backend: str) -> None:
    """NaN or infinite values in a store would turn the params into NaN a few steps later: refuse them here."""
    finite = np.isfinite(table.values).all(axis=1)
    if not finite.all():
        index = int(np.flatnonzero(~finite)[0])
        where = Dataset(table.values, table.labels, str(path), backend, str(path))
        raise StoreError(f"{_record_place(where, index)}: holds a NaN or infinite value")


def clear_cache() -> None:
    """Forget every store read so far (tests; long-lived processes that reread data)."""
    with _LOCK:
        _TABLES.clear()
        _DATASETS.clear()


def _shaped(table: _Table, shape: tuple[int, ...], path: Path, backend: str) -> np.ndarray:
    n, size = table.values.shape
    if not shape:  # the records' own shape when it fits, else flat
        declared = table.record_shape
        shape = declared if declared and math.prod(declared) == size else (size,)
    elif math.prod(shape) != size:
        # every record has the same size (checked on reading), so the first one is the first culprit
        where = "byte 0: record 0" if backend == "kvfile" else "record 0"
        raise StoreError(f"{path}: {where} has {size} values, store_conf.shape {list(shape)} needs {math.prod(shape)}")
    return table.values.reshape((n,) + tuple(shape))


def _read_kvfile(path: Path) -> _Table:
    rows: list[np.ndarray] = []
    labels: list[int] = []
    labelled = 0
    record_shape: tuple[int, ...] = ()
    for index, (offset, _, value) in enumerate(scan_kvfile(path)):
        try:
            rec = decode_proto(value)
            values = record_values(rec)
        except RecordDecodeError as err:
            raise StoreError(f"{path}: byte {offset}: record {index} {err}") from None
        if not rows:
            record_shape = tuple(rec.shape)
        elif values.size != rows[0].size:
            raise StoreError(f"{path}: byte {offset}: record {index} has {values.size} values, record 0 has {rows[0].size}")
        rows.append(values)
        labels.append(rec.label)  # 0 when unset, as SINGA's image.label()
        labelled += rec.HasField("label")
    if not rows:
        raise StoreError(f"{path}: byte 0: the store holds no records")
    # concatenating the uint8 pixels first converts to float32 in one pass
    values = np.concatenate(rows).astype(np.float32, copy=False).reshape(len(rows), -1)
    return _Table(values, np.asarray(labels, dtype=np.int64) if labelled else None, record_shape)


def _read_textfile(path: Path, has_label: bool, separator: str) -> _Table:
    values, labels = read_textfile(path, has_label, separator)
    return _Table(values, labels, ())


def load_mean(path: PathLike, backend: str = "kvfile", separator: str = ",") -> np.ndarray:
    """SINGA's mean (or std) file: the first record of a store of the layer's backend.

    kvfile: a RecordProto whose values (normally `data`) are the mean image,
    returned in its declared shape; textfile: the first line, all values (no label).
    """
    path = Path(path)
    file = store_file(path) if backend == "kvfile" else path
    if not file.exists():
        raise StoreError(f"{path}: no such mean file (`shoal prepare cifar10` writes image_mean.bin)")
    regular_file(file, "mean file")
    if backend == "textfile":
        for _, line in read_textfile_lines(path):
            try:
                return np.asarray([float(v) for v in split_fields(line, separator)], dtype=np.float32)
            except ValueError as err:
                raise StoreError(f"{path}:1: {err}") from None
    else:
        for offset, _, value in scan_kvfile(path):
            try:
                rec = decode_proto(value)
                values = record_values(rec).astype(np.float32)
            except RecordDecodeError as err:
                raise StoreError(f"{path}: byte {offset}: record 0 {err}") from None
            declared = tuple(rec.shape)
            return values.reshape(declared) if declared and math.prod(declared) == values.size else values
    raise StoreError(f"{path}: byte 0: the mean file holds no record")


def normalise(batch: np.ndarray, conf: job_pb2.StoreProto, mean: np.ndarray | None = None, std: np.ndarray | None = None) -> np.ndarray:
    """x = (x - mean) / std over a batch (N, *sample), as SINGA's RecordInput/CSVInput layers.

    mean: the `mean_file` image (load it with load_mean, pass it as `mean`), else
    `mean_value`, else nothing is subtracted. std: the `std_file` values (`std`),
    else `std_value`, else no division. SINGA tests presence (proto2 has_*): an
    absent `mean_value` and an explicit 0 agree, but an explicit `std_value: 0`
    is an error, not "unset". Returns a new float32 array.
    """
    x = np.array(batch, dtype=np.float32)  # a copy: the batch may be a view of a shared store
    sample = x.shape[1:]
    if mean is None and conf.HasField("mean_file"):
        raise ValueError(f"store_conf.mean_file {conf.mean_file!r}: pass its image (load_mean) as `mean`")
    if std is None and conf.HasField("std_file"):
        raise ValueError(f"store_conf.std_file {conf.std_file!r}: pass its values (load_mean) as `std`")
    if mean is not None:
        x -= _per_sample(mean, sample, "mean")
    elif conf.HasField("mean_value"):
        x -= np.float32(conf.mean_value)
    if std is not None:
        x /= _per_sample(std, sample, "std")
    elif conf.HasField("std_value"):
        if conf.std_value == 0:
            raise StoreError(f"{conf.path}: store_conf.std_value is 0 (SINGA rejects it too)")
        x /= np.float32(conf.std_value)
    return x


def _per_sample(values: np.ndarray, sample: tuple[int, ...], what: str) -> np.ndarray:
    values = np.asarray(values, dtype=np.float32)
    if values.size != math.prod(sample):
        raise StoreError(f"the {what} file holds {values.size} values, a sample has {math.prod(sample)} {list(sample)}")
    return values.reshape(sample)
