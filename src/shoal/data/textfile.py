"""SINGA's `textfile` store: one CSV line per record, keyed by its line number.

kCSVInput splits a line at every character of `store_conf.separator` (SINGA's
Tokenizer uses find_first_of) and, when `has_label`, reads the first field as
the label. Writers join fields with the separator's first character.
"""
from __future__ import annotations

import math
import os
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from shoal.data.errors import StoreError
from shoal.data.files import regular_file

PathLike = str | Path


def read_textfile_lines(path: PathLike) -> Iterator[tuple[bytes, str]]:
    """Yield (key, line) records as SINGA's TextFileStore: key = the 0-based line number.

    A line that is not UTF-8 text (a kvfile read as a textfile, say) is a StoreError naming it.
    """
    path = regular_file(Path(path))
    with open(path, "rb") as f:
        for number, raw in enumerate(f):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise StoreError(
                    f"{path}:{number + 1}:{err.start + 1}: byte 0x{raw[err.start]:02x} is not text"
                    " (is the store a kvfile? store_conf.backend says how to read it)"
                ) from None
            yield str(number).encode(), line.rstrip("\r\n")


def split_fields(line: str, separator: str = ",") -> list[str]:
    """A line's fields, split at any character of `separator`; a trailing separator is ignored."""
    if not separator:
        raise ValueError("store_conf.separator is empty")
    fields = line.split(separator) if len(separator) == 1 else re.split(f"[{re.escape(separator)}]", line)
    if len(fields) > 1 and not fields[-1].strip():
        fields.pop()
    return fields


def read_textfile(path: PathLike, has_label: bool = True, separator: str = ",") -> tuple[np.ndarray, np.ndarray | None]:
    """All rows as (N, D) float32 plus (N,) int64 labels (None unless has_label); blank lines are skipped."""
    path = regular_file(Path(path))
    table = _load_fast(path, separator)
    if table is None:
        return _load_checked(path, has_label, separator)
    if has_label:
        labels = table[:, 0]
        if not np.array_equal(labels, np.round(labels)) or np.abs(labels).max() >= 2**31:
            return _load_checked(path, has_label, separator)  # for the message naming the line
        return np.ascontiguousarray(table[:, 1:], dtype=np.float32), labels.astype(np.int64)
    return table.astype(np.float32), None


def _load_fast(path: Path, separator: str) -> np.ndarray | None:
    """numpy's C parser for the common case; None when the file needs the line-by-line parser."""
    if len(separator) != 1:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an empty file warns; the checked parser reports it
            table = np.loadtxt(path, delimiter=separator, dtype=np.float64, ndmin=2, comments=None, encoding="utf-8")
    except ValueError:
        return None
    return table if table.size else None


def _load_checked(path: Path, has_label: bool, separator: str) -> tuple[np.ndarray, np.ndarray | None]:
    rows, labels, width, first = [], [], None, None
    for key, line in read_textfile_lines(path):
        lineno = int(key) + 1
        if not line.strip():
            continue
        try:
            values = [float(v) for v in split_fields(line, separator)]
        except ValueError as err:
            raise StoreError(f"{path}:{lineno}: {err}") from None
        if has_label:
            if not values or not math.isfinite(values[0]) or values[0] != int(values[0]) or abs(values[0]) >= 2**31:
                raise StoreError(f"{path}:{lineno}: the first field must be an integer label (store_conf.has_label)")
            labels.append(int(values.pop(0)))
        if width is None:
            width, first = len(values), lineno
        elif len(values) != width:
            raise StoreError(f"{path}:{lineno}: {len(values)} values, line {first} has {width}")
        rows.append(values)
    if not rows:
        raise StoreError(f"{path}: the store holds no records")
    return np.asarray(rows, dtype=np.float32), (np.asarray(labels, dtype=np.int64) if has_label else None)


def format_rows(data: np.ndarray, labels: np.ndarray | None = None, separator: str = ",") -> str:
    """CSV lines (label first when given), floats with enough digits to read back exactly."""
    sep = separator[:1] or ","
    lines = []
    for i, row in enumerate(np.asarray(data).reshape(len(data), -1)):
        fields = ([str(int(labels[i]))] if labels is not None else []) + [f"{v:.9g}" for v in row]
        lines.append(sep.join(fields) + "\n")
    return "".join(lines)


def write_textfile(path: PathLike, data: np.ndarray, labels: np.ndarray | None = None, separator: str = ",") -> None:
    """Write a textfile store atomically (PATH.tmp, then renamed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(format_rows(data, labels, separator))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def append_textfile(path: PathLike, data: np.ndarray, labels: np.ndarray | None = None, separator: str = ",") -> None:
    """Append rows (label first when given); kCSVOutput writes one batch at a time."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(format_rows(data, labels, separator))
