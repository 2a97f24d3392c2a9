"""SINGA's KVFile store: a sequence of (size_t key length, key, size_t value length, value).

size_t is written as 8-byte little-endian, as SINGA wrote it on x86-64.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Iterator, Union

from shoal.data.errors import StoreError

_SIZE = struct.Struct("<Q")


class KVFileWriter:
    """Writes a kvfile atomically: records go to PATH.tmp, renamed to PATH on close."""

    def __init__(self, path: Union[str, Path], append: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # appending (kRecordOutput, batch by batch) writes in place; a fresh store goes via a temp file
        self._tmp = self.path if append else self.path.with_name(self.path.name + ".tmp")
        self._file = open(self._tmp, "ab" if append else "wb")
        self.count = 0

    @classmethod
    def appending(cls, path: Union[str, Path]) -> "KVFileWriter":
        return cls(path, append=True)

    def write(self, key: Union[bytes, str], value: bytes) -> None:
        key = key.encode() if isinstance(key, str) else key
        self._file.write(_SIZE.pack(len(key)) + key + _SIZE.pack(len(value)) + value)
        self.count += 1

    def close(self) -> None:
        if self._file.closed:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        if self._tmp != self.path:
            os.replace(self._tmp, self.path)

    def abort(self) -> None:
        self._file.close()
        if self._tmp != self.path:
            self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> "KVFileWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def read_kvfile(path: Union[str, Path]) -> Iterator[tuple[bytes, bytes]]:
    """Yield (key, value) pairs; StoreError naming the byte offset if the file is cut or corrupt."""
    path = Path(path)
    try:
        buf = memoryview(path.read_bytes())
    except FileNotFoundError:
        raise StoreError(f"{path}: no such store (prepare it with `shoal prepare ...`)") from None
    end, pos = len(buf), 0
    while pos < end:
        start = pos
        fields = []
        for what in ("key", "value"):
            if end - pos < _SIZE.size:
                raise StoreError(f"{path}: byte {pos}: truncated record (a {what} length needs 8 bytes, {end - pos} left)")
            (length,) = _SIZE.unpack_from(buf, pos)
            pos += _SIZE.size
            if length > end - pos:
                raise StoreError(f"{path}: byte {pos - _SIZE.size}: truncated or corrupt record ({what} length {length}, {end - pos} bytes left)")
            fields.append(bytes(buf[pos : pos + length]))
            pos += length
        del start
        yield fields[0], fields[1]
