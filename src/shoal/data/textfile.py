"""SINGA's `textfile` backend: one CSV line per record, the label first when has_label."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

import numpy as np

from shoal.data.errors import StoreError


def read_textfile(path: Union[str, Path], has_label: bool = True, separator: str = ",") -> tuple[np.ndarray, Optional[np.ndarray]]:
    path = Path(path)
    rows, labels = [], []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                values = [float(v) for v in line.split(separator)]
            except ValueError as err:
                raise StoreError(f"{path}:{lineno}: {err}") from None
            if has_label:
                labels.append(int(values[0]))
                values = values[1:]
            rows.append(values)
    if not rows:
        raise StoreError(f"{path}: the store holds no records")
    if len({len(r) for r in rows}) > 1:
        raise StoreError(f"{path}: lines have different numbers of values")
    return np.asarray(rows, dtype=np.float32), (np.asarray(labels, dtype=np.int64) if has_label else None)


def write_textfile(path: Union[str, Path], data: np.ndarray, labels: Optional[np.ndarray] = None, separator: str = ",") -> None:
    """Write rows (labels first) atomically: to PATH.tmp, then renamed."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    append_textfile(tmp, data, labels, separator)
    os.replace(tmp, path)


def append_textfile(path: Union[str, Path], data: np.ndarray, labels: Optional[np.ndarray] = None, separator: str = ",") -> None:
    """Append rows (label first when given); kCSVOutput writes one batch at a time."""
    with open(path, "a", encoding="utf-8") as f:
        for i, row in enumerate(np.asarray(data).reshape(len(data), -1)):
            fields = ([str(int(labels[i]))] if labels is not None else []) + [f"{v:.9g}" for v in row]
            f.write(separator.join(fields) + "\n")
