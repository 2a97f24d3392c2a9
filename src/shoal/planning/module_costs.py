"""What an opaque torch module costs per sample, as `shoal plan --estimate` counts it. Pure.

A shoal.fit job's module is one layer whose inside the planner cannot see: no inner products or
convolutions to cost one by one. Its costs are measured once instead (frontend/module_measure.py:
torch.utils.flop_counter.FlopCounterMode over forward and backward of one real sample, and the bytes
autograd saves for backward) and handed to the cost model as this plain record; everything here is
arithmetic on it. Time: the counted FLOPs at the calibrated GEMM rate, never less than the bytes the
module streams (its params read forward; read again and their gradients written backward; the saved
activations written and read back) take at the worker's memory bandwidth; where the calibration timed
the module's forward and backward on real batches (`probe`), those times instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

FLOAT = 4  # bytes of a float32 (the params' dtype in shoal)


@dataclass(frozen=True)
class ModuleCosts:
    """One sample's forward and backward through the module, as measured."""

    fwd_flops: int  # counted by FlopCounterMode (a multiply-add is 2)
    bwd_flops: int
    activation_bytes: int  # what autograd saves for backward (params excluded)
    param_elements: int  # every param of the module
    trained_elements: int  # those with requires_grad
    basis: str  # how it was counted, for the printed estimate
    # the module's forward and backward are timed by the calibration on real batches, as kernels named by this
    # digest of the module, its sample and its loss (planning/costs.py: module_kernels); `probe(rows)` runs one
    # forward and backward on `rows` samples (None: nothing to time, the counted FLOPs stand)
    digest: str = ""
    probe: Optional[Callable[[int], None]] = field(default=None, compare=False, repr=False)

    def flops(self, rows: int) -> tuple[int, int]:
        """(forward, backward) FLOPs on `rows` samples: linear in the rows (one sample counted)."""
        return rows * self.fwd_flops, rows * self.bwd_flops

    def stream_bytes(self, rows: int) -> tuple[int, int]:
        """(forward, backward) bytes through memory: the floor on the module's time at the memory bandwidth."""
        params = FLOAT * self.param_elements
        acts = rows * self.activation_bytes
        return params + acts, params + FLOAT * self.trained_elements + acts

    def memory_bytes(self, rows: int) -> int:
        """Activations held between forward and backward on `rows` samples (the module's own gradients flowing
        back are of the same size at most once: counted as one more copy)."""
        return 2 * rows * self.activation_bytes


def describe_basis(costs: ModuleCosts, slots: int, optimizer: str) -> str:
    """The one line that says what the estimate of a module rests on."""
    return (f"module costs {costs.basis}: {costs.fwd_flops / 1e6:.3g} MFLOP forward and {costs.bwd_flops / 1e6:.3g} MFLOP "
            f"backward per sample, {_bytes(costs.activation_bytes)} of activations saved per sample; "
            f"{costs.param_elements:,} param elements ({_bytes(FLOAT * costs.param_elements)} float32); "
            f"{optimizer} keeps {slots} slot(s) per trained element")


def module_costs_of(parts) -> "ModuleCosts | None":
    """The measured costs of the opaque module a partitioned net computes (planning.partition.PartitionPlan), if any."""
    return next((c for c in (n.layer.measured_costs() for n in parts.nodes) if c is not None), None)


def _bytes(n: float) -> str:
    return f"{n / 1e6:.3g} MB" if n >= 1e6 else f"{n / 1e3:.3g} kB"
