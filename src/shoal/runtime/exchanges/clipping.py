"""Clipping by the global norm (torch's clip_grad_norm_), a whole-model transform run by the exchange.

One scale for the whole gradient, min(max_norm / (‖g‖ + 1e-6), 1), applied before any shard updates: in one
process over the whole summed gradient (exactly torch's computation: the norm of the per-tensor norms, in the
module's param order); over owners of slices, each owner's sum of squares, one scalar exchanged among the
owners, one scale (every owner sums in rank order, so all apply the same); compressed (cluster.compression),
the norm is that of the owners' dense sums before they are encoded, and each owner scales its sums before
encoding them, so every process applies the decoding of a clipped sum (top-k's residual carries what was
not sent, clipped when it was added); an asynchronous group (Hogwild, Downpour, a Distributed Hogwild
group) clips its own push or update, which it holds whole. The bound comes with the torch optimizer
(shoal.fit's clip_grad_norm=).
"""
from __future__ import annotations

from typing import Optional

import torch

EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


def max_norm_of(updater) -> Optional[float]:
    """The bound the job clips to, or None (SINGA's updaters clip per element with clip_low/clip_high instead)."""
    return float(updater.clip_grad_norm) if updater.clip_grad_norm else None


def scale_for(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    return torch.clamp(max_norm / (total_norm + EPS), max=1.0)


def clip_(grads: list[Optional[torch.Tensor]], max_norm: Optional[float]) -> None:
    """Scale `grads` in place as torch.nn.utils.clip_grad_norm_ scales the .grad of params holding them."""
    present = [g for g in grads if g is not None]
    if max_norm is None or not present:
        return
    total = torch.nn.utils.get_total_norm(present, 2.0)
    torch._foreach_mul_(present, scale_for(total, max_norm).to(present[0].device))


def sum_of_squares(grads: list[torch.Tensor], device: Optional[torch.device] = None) -> torch.Tensor:
    """One owner's part of the squared global norm (float64: the owners' parts are summed once more), on `device`
    (default: the gradients')."""
    total = torch.zeros((), dtype=torch.float64, device=device or (grads[0].device if grads else "cpu"))
    for g in grads:  # the norm accumulated in float64 without a float64 copy of the gradient (2.5x faster)
        total += torch.linalg.vector_norm(g, dtype=torch.float64).square().to(total.device)
    return total
