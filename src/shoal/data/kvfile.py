"""SINGA's KVFile store: a sequence of records (key length, key, value length, value).

Both lengths are C `size_t`, which SINGA wrote raw on x86-64: 8 bytes,
little-endian. As in SINGA, a path that is a folder means the file
`shard.dat` inside it (the old DataShard layout).
"""
from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from pathlib import Path

from shoal.data.errors import StoreError
from shoal.data.files import regular_file

PathLike = str | Path
SIZE_T = struct.Struct("<Q")


def store_file(path: PathLike) -> Path:
    """The file a kvfile path names (FOLDER/shard.dat for a folder, as SINGA's KVFile)."""
    path = Path(path)
    return path / "shard.dat" if path.is_dir() else path


class KVFileWriter:
    """Writes a kvfile. A new store goes to PATH.tmp and is renamed to PATH on close,
    so readers never see half a store; `appending` adds records to PATH in place."""

    def __init__(self, path: PathLike, append: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._target = self.path if append else self.path.with_name(self.path.name + ".tmp")
        self._file = open(self._target, "ab" if append else "wb")
        self.count = 0  # records written by this writer

    @classmethod
    def appending(cls, path: PathLike) -> KVFileWriter:
        """A writer adding records at the end of PATH (created if missing), as kRecordOutput does per batch."""
        return cls(path, append=True)

    def write(self, key: bytes | str, value: bytes) -> None:
        key = key.encode() if isinstance(key, str) else bytes(key)
        self._file.write(SIZE_T.pack(len(key)) + key + SIZE_T.pack(len(value)) + value)
        self.count += 1

    def close(self) -> None:
        """Finish the store: flush, and for a new store sync it and rename PATH.tmp to PATH."""
        if self._file.closed:
            return
        self._file.flush()
        if self._target != self.path:
            # the data must be on disk before the rename makes it visible, or a crash could publish garbage
            os.fsync(self._file.fileno())
        self._file.close()
        if self._target != self.path:
            os.replace(self._target, self.path)

    def abort(self) -> None:
        """Drop a new store (its PATH.tmp); records already appended to an existing store stay."""
        self._file.close()
        if self._target != self.path:
            self._target.unlink(missing_ok=True)

    def __enter__(self) -> KVFileWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def scan_kvfile(path: PathLike) -> Iterator[tuple[int, bytes, bytes]]:
    """Yield (byte offset, key, value) of every record.

    A cut or corrupt file raises StoreError, one line naming the file, the byte
    offset and the record index; lengths are checked against the bytes left
    before anything is read, so a corrupt length cannot cause a huge allocation.
    """
    path = regular_file(store_file(path))
    try:
        buf = memoryview(path.read_bytes())
    except OSError as err:
        raise StoreError(f"{path}: cannot read the store ({err.strerror})") from None
    end, pos, index = len(buf), 0, 0
    while pos < end:
        start = pos
        fields = []
        for what in ("key", "value"):
            left = end - pos
            if left < SIZE_T.size:
                raise StoreError(f"{path}: byte {start}: truncated record {index} (its {what} length needs 8 bytes, {left} left)")
            (length,) = SIZE_T.unpack_from(buf, pos)
            pos += SIZE_T.size
            left -= SIZE_T.size
            if length > left:
                # a length beyond the whole file was never written by a writer: the bytes are garbage
                problem = "corrupt" if length > end else "truncated"
                raise StoreError(f"{path}: byte {start}: {problem} record {index} ({what} length {length}, {left} bytes left)")
            fields.append(bytes(buf[pos : pos + length]))
            pos += length
        yield start, fields[0], fields[1]
        index += 1


def read_kvfile(path: PathLike) -> Iterator[tuple[bytes, bytes]]:
    """Yield the (key, value) records of a kvfile, in order; StoreError if it is cut or corrupt."""
    for _, key, value in scan_kvfile(path):
        yield key, value
