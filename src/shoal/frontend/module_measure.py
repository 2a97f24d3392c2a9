"""A shoal.fit module's costs per sample, measured once for `shoal plan --estimate` (planning/module_costs.py).

One real sample of the training set, collated as the feed collates it, goes forward and backward
through a copy of the module (the user's module and its gradients are left alone) under
torch.utils.flop_counter.FlopCounterMode, which counts the matrix products, convolutions and
attention of each pass (a multiply-add as 2; elementwise ops are not counted: the cost model's
bytes floor covers them). autograd's saved-tensor hooks see every tensor kept for backward: their
storages, once each and without the params, are the activation memory of one sample. Then the
copy's forward and backward are timed on batches of 1 and 16 samples (the sample repeated), with
1 thread and with every core: what FLOPs miss on a small module (Python and dispatch per op,
attention, norms) is in those times, and the cost model reads the step from them.
"""
from __future__ import annotations

import copy
import os
import time

import torch
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import FlopCounterMode

from shoal.config import job_pb2
from shoal.data.in_place import first_batch, to_device
from shoal.frontend.fit_metrics import FitError
from shoal.planning.module_costs import ModuleCosts

BASIS = "counted by torch.utils.flop_counter on one sample's forward and backward (matrix products, convolutions, attention)"


def measure_module(model: torch.nn.Module, loss_of, datasets: dict) -> ModuleCosts:
    """`loss_of(module, batch)` is the fit job's loss on a batch through `module` (either loss form)."""
    module = copy.deepcopy(model).train()
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    batch = to_device(first_batch(datasets[job_pb2.kTrain]), device)  # an IterableDataset's or a loader's too
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved: dict[int, int] = {}  # storage -> bytes, each storage once (q, k and v are views of one tensor)

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    try:
        with FlopCounterMode(display=False) as forward, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loss_of(module, batch)
        with FlopCounterMode(display=False) as backward:
            loss.backward()
    except FitError:
        raise
    except Exception as err:  # noqa: BLE001 (a user's module: one line, not a traceback)
        raise FitError(f"shoal plan: counting the module's costs on one training sample failed: {type(err).__name__}: {err}".splitlines()[0]) from None
    elements = [(p.numel(), p.requires_grad) for p in model.parameters()]
    return ModuleCosts(fwd_flops=forward.get_total_flops(), bwd_flops=backward.get_total_flops(),
                       activation_bytes=sum(saved.values()), param_elements=sum(n for n, _ in elements),
                       trained_elements=sum(n for n, trained in elements if trained), basis=BASIS,
                       timed=time_module(module, loss_of, batch))


TIMED_ROWS = (1, 16)  # two batch sizes: a fixed cost per call (Python, dispatch) and a cost per row


def time_module(module: torch.nn.Module, loss_of, batch, rows: tuple[int, ...] = TIMED_ROWS) -> tuple:
    """Forward and backward of `module` timed on `rows`-sample batches (the sample repeated), with 1 thread and with
    every core this process may use: ((threads, ((rows, fwd s, bwd s), ...)), ...), each the fastest of 3 runs. On a
    GPU, nothing (the FLOPs at the device's rate stand)."""
    if any(p.is_cuda for p in module.parameters()):
        return ()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    before = torch.get_num_threads()
    timed = []
    try:
        for threads in sorted({1, cores}):
            torch.set_num_threads(threads)
            timed.append((threads, tuple((r, *_fastest(module, loss_of, _repeated(batch, r))) for r in rows)))
    finally:
        torch.set_num_threads(before)
    return tuple(timed)


def _repeated(batch, rows: int):
    """The one-sample batch as `rows` samples (tensors whose first dimension is the sample's)."""
    return tree_map(lambda t: t.repeat(rows, *[1] * (t.dim() - 1)) if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == 1
                    else t, batch)


def _fastest(module: torch.nn.Module, loss_of, batch, reps: int = 3) -> tuple[float, float]:
    best_f = best_b = float("inf")
    for _ in range(reps + 1):  # the first warms up allocators and autograd
        module.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss = loss_of(module, batch)
        middle = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
        best_f, best_b = min(best_f, middle - start), min(best_b, end - middle)
    module.zero_grad(set_to_none=True)
    return best_f, best_b
