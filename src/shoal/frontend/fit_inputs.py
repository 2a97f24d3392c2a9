"""What shoal.fit and the session read their inputs as: a dataset given in any of fit's forms, the autocast keyword,
an evaluation set's batch (shared by frontend/fit.py, session.py, session_eval.py and session_worker.py, so that the
session's modules need not import fit, whose loop they run: frontend/fit_loop.py)."""
from __future__ import annotations

import math
from typing import Callable, Optional, Union

import torch

from shoal.data.in_place import TensorPairs, check_dataset
from shoal.data.streams import IterableSource, LoaderSource
from shoal.errors import ShoalError
from shoal.frontend.fit_metrics import FitError

Data = Union[tuple, torch.utils.data.Dataset, Callable]


def as_dataset(data: Data, what: str):
    """What a feed reads in place: a map-style Dataset itself, a pair of tensors/arrays as (x[i], y[i]) pairs,
    an IterableDataset or a DataLoader factory as a stream source (shoal.data.streams).

    Of a pair, floating tensors become float32 as the module's params are, and uint8 inputs (pixels)
    float32 as fit always made them; other integer tensors keep their dtype (token ids stay int64).
    Numpy arrays are wrapped without a copy where torch can; a Dataset is used as it is.
    """
    if isinstance(data, tuple) and len(data) == 2 and not isinstance(data, torch.utils.data.Dataset):
        x, y = (torch.as_tensor(v) for v in data)
        if (x.is_floating_point() and x.dtype != torch.float32) or x.dtype == torch.uint8:
            x = x.float()
        if y.is_floating_point() and y.dtype != torch.float32:
            y = y.float()
        data = TensorPairs(x, y)
    elif isinstance(data, torch.utils.data.IterableDataset):
        data = IterableSource(data, f"shoal.fit: {what}")
    elif isinstance(data, torch.utils.data.DataLoader):
        raise FitError(f"shoal.fit: {what}: give a DataLoader factory, `lambda batch_sampler: DataLoader(dataset, "
                       "batch_sampler=batch_sampler, ...)`, not a DataLoader (shoal decides each worker's rows)")
    elif callable(data) and not isinstance(data, torch.utils.data.Dataset):
        data = LoaderSource(data, f"shoal.fit: {what}")
    try:
        check_dataset(data, f"shoal.fit: {what}")
    except ShoalError as err:
        raise FitError(str(err)) from None
    return data


AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def autocast_dtype(autocast) -> Optional[torch.dtype]:
    """fit's autocast= as a torch dtype (None: full fp32)."""
    if autocast is None or autocast in ("fp32", "float32"):
        return None
    if autocast is torch.bfloat16 or autocast in AUTOCAST_DTYPES:
        return torch.bfloat16
    raise FitError(f"shoal.fit: autocast must be 'bf16' (or None for fp32), got {autocast!r}")


def _eval_batches(data: Optional[torch.utils.data.Dataset], batch: int) -> tuple[int, int]:
    """(batch size, steps) that read every sample of an evaluation set once (0 steps without one).

    The batch is the largest divisor of the set's size up to `batch` (when at least a quarter of it), so each
    evaluation reads every sample exactly once and the next starts again at the first; otherwise the last
    batch wraps round to the first samples (counted twice) and the next evaluation starts where it ended.
    """
    if data is None:
        return batch, 0
    batch = min(batch, len(data))
    divisor = next(d for d in range(batch, 0, -1) if len(data) % d == 0)
    if 4 * divisor >= batch:
        batch = divisor
    return batch, math.ceil(len(data) / batch)
