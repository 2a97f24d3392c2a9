"""What an opaque torch module costs per sample, as `shoal plan --estimate` counts it. Pure.

A shoal.fit job's module is one layer whose inside the planner cannot see: no inner products or
convolutions to cost one by one. Its costs are measured once instead (frontend/module_measure.py:
torch.utils.flop_counter.FlopCounterMode over forward and backward of one real sample, and the bytes
autograd saves for backward) and handed to the cost model as this plain record; everything here is
arithmetic on it. Time: the counted FLOPs at the calibrated GEMM rate, never less than the bytes the
module streams (its params read forward; read again and their gradients written backward; the saved
activations written and read back) take at the worker's memory bandwidth.
"""
from __future__ import annotations

from dataclasses import dataclass

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
    # forward and backward timed on real batches (frontend/module_measure.py): threads -> ((rows, fwd s, bwd s), ...);
    # what FLOPs miss on a small module (Python and dispatch per op, attention, norms) is in these
    timed: tuple = ()

    def seconds(self, rows: int, threads: int) -> "tuple[float, float] | None":
        """(forward s, backward s) on `rows` samples at `threads`, on the line through the timed points (a fixed cost
        per call plus a cost per row), or None when nothing was timed at that thread count."""
        points = dict(self.timed).get(threads)
        if not points:
            return None
        if len(points) == 1:
            r, f, b = points[0]
            return f * rows / r, b * rows / r
        (r0, f0, b0), (r1, f1, b1) = points[0], points[-1]
        line = lambda t0, t1: max(0.0, t0 + (t1 - t0) * (rows - r0) / (r1 - r0))  # noqa: E731
        return line(f0, f1), line(b0, b1)

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
            f"{optimizer} keeps {slots} slot(s) per trained element" + "".join(
                f"; timed forward + backward at {t} thread(s): {1e3 * (points[0][1] + points[0][2]):.1f} ms for {points[0][0]} sample(s), "
                f"{1e3 * (points[-1][1] + points[-1][2]):.1f} ms for {points[-1][0]}" for t, points in costs.timed))


def module_costs_of(parts) -> "ModuleCosts | None":
    """The measured costs of the opaque module a partitioned net computes (planning.partition.PartitionPlan), if any."""
    return next((c for c in (n.layer.measured_costs() for n in parts.nodes) if c is not None), None)


def _bytes(n: float) -> str:
    return f"{n / 1e6:.3g} MB" if n >= 1e6 else f"{n / 1e3:.3g} kB"
