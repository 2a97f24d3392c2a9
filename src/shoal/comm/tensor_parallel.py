"""Torch's tensor parallelism for a user's module (SINGA's `partition_dim: 1`, Megatron's column/row pairs): the only
code that builds a DeviceMesh or calls `parallelize_module` (issue 39, point 1; frontend/session_partition.py chooses
the cuts and runs the loop's side).

Every process of the group holds a slice of each cut Linear's features and computes on the group's whole batch. A
Linear packing an attention's q, k and v ("qkv") is cut as three: each process holds its heads' rows of each, side by
side (torch's `_StridedShard`: gathered, the rows are the user's, in order), so its output is its heads' q, k and v. The
params the plan does not cut become Replicate DTensors that their module sees through a `to_local` parametrization:
torch's `clip_grad_norm_` then sees DTensors only (it refuses a mix of DTensor and plain params) and returns the global
norm, as one process's loop would. Their gradients are equal on every process without a collective of ours: the
backward of a column-wise Linear's Replicate input all-reduces the input's gradient (Megatron's f). A tied param
(a GPT's `lm_head.weight is wte.weight`) stays one param.

Checkpoints hold whole tensors under the user's names (`full_state`, `full_optimizer_state`: collectives every process
of the mesh joins, each tensor copied: a gathered Replicate tensor can alias the live one); a resume loads the module's
into it before it is cut, and re-slices the optimizers' as each param is placed (`sliced_optimizer_state`).
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Sequence

import torch
import torch.nn as nn
import torch.nn.utils.parametrize as parametrize
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

try:
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # (an older torch: a packed q/k/v is refused, session_partition.cut)
    _StridedShard = None
PACKS = _StridedShard is not None


class PackedColwise(ColwiseParallel):
    """ColwiseParallel of a Linear whose output packs `parts` equal blocks (an attention's q, k and v): each process
    holds its slice of every block, so its local output is its slices side by side, which it computes with as is."""

    def __init__(self, parts: int = 3):
        super().__init__()
        self.parts = parts

    def _partition_linear_fn(self, name, module, device_mesh):
        for name, param in module.named_parameters():
            placed = distribute_tensor(param, device_mesh, [_StridedShard(0, split_factor=self.parts)],
                                       src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(placed, requires_grad=param.requires_grad))

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        return outputs.to_local() if use_local_output else outputs  # (no redistribution: the blocks stay apart)


STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "qkv": PackedColwise}


class _Local(nn.Module):
    """A replicated param as its module computes with it: the process's plain copy (gradients flow back as Replicate)."""

    def forward(self, value: torch.Tensor) -> torch.Tensor:
        return value.to_local() if isinstance(value, DTensor) else value


def parallelize(module: nn.Module, ranks: Sequence[int], cuts: Mapping[str, str], device_type: str = "cpu") -> DeviceMesh:
    """Cut `module` in place over `ranks` (this process among them; every one of them calls this): `cuts` maps a
    Linear's qualified name to "colwise" or "rowwise" (torch's own plan, by name), or "qkv" (packed q, k and v, each
    cut column-wise). Returns the mesh."""
    mesh = DeviceMesh(device_type, list(ranks))
    parallelize_module(module, mesh, {name: STYLES[style]() for name, style in cuts.items()})
    replicated: Dict[int, nn.Parameter] = {}  # by the plain param's id: a tied param stays one param
    for owner in list(module.modules()):
        for name, param in list(owner.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                continue
            if id(param) not in replicated:
                replicated[id(param)] = nn.Parameter(DTensor.from_local(param.data, mesh, [Replicate()], run_check=False),
                                                     requires_grad=param.requires_grad)
            setattr(owner, name, replicated[id(param)])
            parametrize.register_parametrization(owner, name, _Local(), unsafe=True)
    return mesh


def plain_name(name: str) -> str:
    """A param's name as the user's module had it (`a.parametrizations.weight.original` → `a.weight`)."""
    return name.replace("parametrizations.", "").replace(".original", "")


def whole(value: Any) -> Any:
    """`value` whole, copied (a DTensor gathered over its mesh: every process of it calls this in the same order)."""
    if isinstance(value, DTensor):
        return value.full_tensor().detach().clone()
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def full_state(module: nn.Module) -> Dict[str, torch.Tensor]:
    """The module's state, every tensor whole, under the user's names."""
    return {plain_name(name): whole(value) for name, value in module.state_dict().items()}


def full_optimizer_state(state_dict: dict) -> dict:
    """A torch optimizer's state_dict with every DTensor of its state whole (AdamW's moments are sliced as their
    params are)."""
    return {**state_dict, "state": {index: {slot: whole(value) if isinstance(value, DTensor) else value for slot, value in slots.items()}
                                    for index, slots in state_dict["state"].items()}}


def sliced_optimizer_state(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """`state_dict` (whole tensors, a checkpoint's) with each tensor the shape of its param re-sliced as that param is
    placed, for `optimizer.load_state_dict`."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for index, slots in state_dict["state"].items():
        param = params[int(index)]
        state[index] = {slot: distribute_tensor(value.to(param.device), param.device_mesh, param.placements)
                        if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(param.shape)
                        else value for slot, value in slots.items()}
    return {**state_dict, "state": state}
