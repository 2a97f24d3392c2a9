"""A user's module cut on its features over the group's processes (SINGA's `partition_dim: 1` in a user's loop, issue 39,
point 1): which Linears torch's tensor parallelism can cut, and `run.model`'s cut (comm/tensor_parallel.py does it).

Pure: reads the module's structure only. A pair is Megatron's: a Linear cut column-wise (each process a slice of its
output features), then only element-wise modules, then a Linear cut row-wise (its input features sliced the same way,
its outputs summed over the group). Only an `nn.Sequential` shows that order; elsewhere (a module's own forward, such
as an attention that splits its output by the global width) the user names the pairs in torch's form."""
from __future__ import annotations

from typing import Dict

import torch
import torch.nn as nn

from shoal.errors import ShoalError

ELEMENTWISE = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Mish, nn.Dropout, nn.Identity)


class NothingToCut(ShoalError, ValueError):
    pass


def linear_pairs(module: nn.Module) -> Dict[str, str]:
    """{qualified Linear name: "colwise" | "rowwise"} for every Linear → element-wise → Linear run in the module's
    `nn.Sequential`s, the widths matching; refused in one line naming the module where there is none."""
    cuts: Dict[str, str] = {}
    for prefix, seq in module.named_modules():
        if not isinstance(seq, nn.Sequential):
            continue
        children = list(seq.named_children())
        i = 0
        while i < len(children):
            name, first = children[i]
            j = i + 1
            while j < len(children) and isinstance(children[j][1], ELEMENTWISE):
                j += 1
            if isinstance(first, nn.Linear) and j < len(children) and isinstance(children[j][1], nn.Linear) \
                    and children[j][1].in_features == first.out_features:
                base = f"{prefix}." if prefix else ""
                cuts[base + name], cuts[base + children[j][0]] = "colwise", "rowwise"
                i = j + 1
            else:
                i += 1
    if not cuts:
        raise NothingToCut(f"run.model: {type(module).__name__} has no Linear → element-wise → Linear pair in an "
                           "nn.Sequential to cut (neuralnet.partition_dim 1): name the pairs in torch's form, or use "
                           "partition_dim 0 (the batch)")
    return cuts


STYLES = ("colwise", "rowwise")


def checked_cuts(module: nn.Module, cuts) -> Dict[str, str]:
    """The user's `cuts=` (torch's plan: a Linear's qualified name -> "colwise" or "rowwise"), refused in one line
    naming the entry that is not a Linear of `module` or not a style torch cuts it with."""
    if not isinstance(cuts, dict) or not cuts:
        raise NothingToCut(f"run.model: cuts= is a dict of Linear names to 'colwise' or 'rowwise', got {cuts!r}")
    modules = dict(module.named_modules())
    for name, style in cuts.items():
        if not isinstance(modules.get(name), nn.Linear):
            what = "no submodule" if name not in modules else f"a {type(modules[name]).__name__}"
            raise NothingToCut(f"run.model: cuts={{{name!r}: ...}}: {type(module).__name__} has {what} of that name, not an "
                               "nn.Linear (torch's tensor parallelism cuts Linears)")
        if style not in STYLES:
            raise NothingToCut(f"run.model: cuts={{{name!r}: {style!r}}}: the style is 'colwise' (its output features "
                               "cut) or 'rowwise' (its input features cut, its output summed over the group)")
    return dict(cuts)


def cut(module: nn.Module, plan, device: torch.device, cuts: Dict[str, str] | None = None) -> Dict[str, str]:
    """`run.model`'s module, every process of the plan's one group calling it: each Linear of `cuts` (default: of every
    pair `linear_pairs` finds) cut over the group's processes, every other param a replicated DTensor that its module
    sees as a plain tensor. Returns the cuts."""
    from shoal.comm import tensor_parallel  # (torch.distributed.tensor: imported by the layouts that cut a module)

    cuts = cuts or linear_pairs(module)
    tensor_parallel.parallelize(module, range(plan.nprocs), cuts, device.type)
    return cuts
