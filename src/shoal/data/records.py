"""RecordProto values of record stores: encode pixels or floats, decode to numpy."""
from __future__ import annotations

from typing import Optional

import numpy as np

from shoal.config import job_pb2


def encode_pixels(pixels: np.ndarray, label: Optional[int]) -> bytes:
    """A uint8 image as SINGA's create_data programs wrote it (shape, label, pixel bytes)."""
    rec = job_pb2.RecordProto(shape=list(pixels.shape), pixel=np.ascontiguousarray(pixels, dtype=np.uint8).tobytes())
    if label is not None:
        rec.label = int(label)
    return rec.SerializeToString()


def encode_floats(values: np.ndarray, label: Optional[int] = None) -> bytes:
    rec = job_pb2.RecordProto(shape=list(values.shape))
    rec.data.extend(np.asarray(values, dtype=np.float32).ravel().tolist())
    if label is not None:
        rec.label = int(label)
    return rec.SerializeToString()


def decode(value: bytes) -> tuple[np.ndarray, Optional[int], tuple[int, ...]]:
    """(flat float32 features, label or None, declared shape)."""
    rec = job_pb2.RecordProto.FromString(value)
    if rec.pixel:
        features = np.frombuffer(rec.pixel, dtype=np.uint8).astype(np.float32)
    else:
        features = np.asarray(rec.data, dtype=np.float32)
    label = rec.label if rec.HasField("label") else None
    return features, label, tuple(rec.shape)
