"""RecordProto values of record stores: encode pixels or floats, decode to numpy.

A record holds `shape`, an optional `label`, and its values either as `data`
(floats) or as `pixel` (one byte per value). As SINGA's RecordInputLayer,
`data` wins when a record has both.
"""
from __future__ import annotations

import numpy as np
from google.protobuf.message import DecodeError

from shoal.config import job_pb2
from shoal.errors import ShoalError


class RecordDecodeError(ShoalError, ValueError):
    """A store value is not a RecordProto shoal can read (the caller adds file and offset)."""


def encode_pixels(pixels: np.ndarray, label: int | None = None) -> bytes:
    """A uint8 image as SINGA's create_data programs wrote it (shape, label, pixel bytes)."""
    pixels = np.asarray(pixels)
    if pixels.dtype != np.uint8:
        raise ValueError(f"pixel records hold uint8 values, got {pixels.dtype}")
    rec = job_pb2.RecordProto(shape=list(pixels.shape), pixel=np.ascontiguousarray(pixels).tobytes())
    if label is not None:
        rec.label = int(label)
    return rec.SerializeToString()


def encode_floats(values: np.ndarray, label: int | None = None) -> bytes:
    """Float values (shape, optional label, `data`), as mean files and kRecordOutput write them."""
    values = np.asarray(values, dtype=np.float32)
    rec = job_pb2.RecordProto(shape=list(values.shape), data=values.ravel().tolist())
    if label is not None:
        rec.label = int(label)
    return rec.SerializeToString()


def decode_proto(value: bytes) -> job_pb2.RecordProto:
    try:
        return job_pb2.RecordProto.FromString(value)
    except DecodeError:
        raise RecordDecodeError("is not a RecordProto") from None


def record_values(rec: job_pb2.RecordProto) -> np.ndarray:
    """The record's values, flat: float32 from `data`, else uint8 from `pixel`."""
    if len(rec.data):
        return np.asarray(rec.data, dtype=np.float32)
    if rec.pixel:
        return np.frombuffer(rec.pixel, dtype=np.uint8)
    if rec.image:
        raise RecordDecodeError("holds an encoded image (`image`, store_conf.encoded), which shoal does not decode")
    raise RecordDecodeError("holds neither `data` nor `pixel` values")


def decode(value: bytes) -> tuple[np.ndarray, int | None, tuple[int, ...]]:
    """(flat float32 values, label or None, declared shape) of one serialized RecordProto."""
    rec = decode_proto(value)
    label = rec.label if rec.HasField("label") else None
    return record_values(rec).astype(np.float32, copy=False), label, tuple(rec.shape)
