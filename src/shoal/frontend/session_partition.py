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


def cut(module: nn.Module, plan, device: torch.device) -> Dict[str, str]:
    """`run.model`'s module, every process of the plan's one group calling it: each Linear pair cut over the group's
    processes (every other param a replicated DTensor that its module sees as a plain tensor). Returns the cuts."""
    from shoal.comm import tensor_parallel  # (torch.distributed.tensor: imported by the layouts that cut a module)

    cuts = linear_pairs(module)
    tensor_parallel.parallelize(module, range(plan.nprocs), cuts, device.type)
    return cuts
