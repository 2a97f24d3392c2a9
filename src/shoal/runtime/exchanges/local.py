"""LocalExchange: a whole synchronous group and its server in this process (single worker, in-memory Sandblaster).

The gradients of the workers are summed in memory (weighted by batch share, in
Caffe's tree order across devices) and one Server updates whole params.
"""
from __future__ import annotations

from typing import Optional

import torch

from shoal.neuralnet.algorithms import Grads
from shoal.report.metrics import MetricWindow
from shoal.runtime.exchanges.clipping import clip_, max_norm_of
from shoal.runtime.exchanges.server import Server
from shoal.runtime.replicas import tree_reduce


def aggregate(parts: list[tuple[Grads, int]], total: Optional[int] = None, target: Optional[torch.device] = None) -> Grads:
    """Σ (share_i / total) · g_i over the workers' gradients (total defaults to Σ shares), on `target`.

    Each worker's loss is a mean over its share, so this is the gradient of the
    mean over the whole batch, whatever the shares (Caffe con Troll's 200 + 56).
    The workers' gradients combine in Caffe's tree order, device to device.
    """
    if len(parts) == 1 and total is None:
        grads = parts[0][0]
        return grads if target is None else {n: None if g is None else g.to(target) for n, g in grads.items()}
    return tree_reduce(parts, total or sum(share for _, share in parts), target)


def clipped(grads: Grads, server: Server) -> Grads:
    """The whole gradient clipped by its global norm where the job says so (in the server's param order)."""
    clip_([grads.get(name) for name in server.names], max_norm_of(server.updater))
    return grads


class LocalExchange:
    chief = True
    job_bytes_sent: Optional[int] = None  # nothing crosses a wire: no bytes counted
    absent_groups: frozenset[int] = frozenset()  # every group stays in the job (only Local SGD's meetings leave one out)

    def __init__(self, server: Server):
        self.server = server

    def begin(self, step: int) -> None:
        """Nothing to prepare: the workers' gradients are summed after they all finished."""

    def step(self, step: int, parts: list[tuple[Grads, int]]) -> None:
        self.server.update(step, clipped(aggregate(parts, target=self.server.store.device), self.server))

    def view_updater(self):
        """How a worker updates a param view it computed alone: the server's updater on the view, at this step."""
        return self.server.update_view

    def metrics(self, window: MetricWindow) -> dict[str, float]:
        return window.averages()

    def updater_state(self) -> dict[str, dict[str, torch.Tensor]]:
        return self.server.state_dict()

    def load_updater_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        self.server.load_state(state)

    def finish(self) -> None:
        """Every update was applied in its step."""
