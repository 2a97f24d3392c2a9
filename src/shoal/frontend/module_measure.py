"""A shoal.fit module's costs per sample, measured once for `shoal plan --estimate` (planning/module_costs.py).

One real sample of the training set, collated as the feed collates it, goes forward and backward
through a copy of the module (the user's module and its gradients are left alone) under
torch.utils.flop_counter.FlopCounterMode, which counts the matrix products, convolutions and
attention of each pass (a multiply-add as 2; elementwise ops are not counted: the cost model's
bytes floor covers them). autograd's saved-tensor hooks see every tensor kept for backward: their
storages, once each and without the params, are the activation memory of one sample. The copy
also gets a probe (one forward and backward on `rows` samples, the sample repeated) with which the
calibration times it at the plan's thread count on batches of 1 and 16 samples (cached under a
digest of the module, its sample and its loss): what FLOPs miss on a small module (Python and
dispatch per op, attention, norms) is in those times, and the cost model reads the step from them.
"""
from __future__ import annotations

import copy
import hashlib

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
                       digest=digest_of(model, loss_of, batch), probe=probe_of(module, loss_of, batch))


def digest_of(model: torch.nn.Module, loss_of, batch) -> str:
    """What names the module's timings in the calibration cache: its structure, params, sample and loss."""
    shapes = tree_map(lambda t: (tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else t, batch)
    params = [(n, tuple(p.shape), p.requires_grad) for n, p in model.named_parameters()]
    loss = getattr(loss_of, "__qualname__", type(loss_of).__name__)
    return hashlib.sha1(repr((repr(model), params, shapes, loss)).encode()).hexdigest()[:12]


def probe_of(module: torch.nn.Module, loss_of, batch):
    """One forward and backward of the copy `module` on `rows` samples (the sample repeated), for the calibration."""
    batches: dict[int, object] = {}

    def probe(rows: int) -> None:
        if rows not in batches:
            batches[rows] = tree_map(lambda t: t.repeat(rows, *[1] * (t.dim() - 1))
                                     if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == 1 else t, batch)
        module.zero_grad(set_to_none=True)
        loss_of(module, batches[rows]).backward()

    return None if any(p.is_cuda for p in module.parameters()) else probe
