"""How a worker group's gradients become updated params.

LocalExchange: the whole group and its server live in this process: the
gradients of the workers are summed in memory (weighted by batch share) and
one Server updates whole params.

SlicedExchange: the group spans processes and params are sliced over servers
(SINGA's lcm slicing). Per slice: the workers' weighted gradients are summed
into the slice's server (a reduce to its rank), that server applies the
updater to the slice it owns, and sends the new values to every rank (a
broadcast). Over all slices this is reduce-scatter + slice update +
all-gather: the AllReduce framework when servers share the workers'
processes, Sandblaster when they have processes of their own.
"""
from __future__ import annotations

from typing import Optional

import torch

from shoal.algorithms import Grads
from shoal.cluster import ParamSlice, Placement
from shoal.comm import dist as comm
from shoal.metrics import MetricWindow
from shoal.params import ParamStore
from shoal.runtime.server import Server
from shoal.updaters import Updater


def aggregate(parts: list[tuple[Grads, int]], total: Optional[int] = None) -> Grads:
    """Σ (share_i / total) · g_i over the workers' gradients (total defaults to Σ shares).

    Each worker's loss is a mean over its share, so this is the gradient of the
    mean over the whole batch, whatever the shares (Caffe con Troll's 200 + 56).
    """
    if len(parts) == 1 and total is None:
        return parts[0][0]
    total = total or sum(share for _, share in parts)
    out: Grads = {}
    for name in parts[0][0]:
        grads = [(g[name], share) for g, share in parts if g[name] is not None]
        if not grads:
            out[name] = None
            continue
        # in place on the first worker's gradient: workers make fresh gradients every step
        acc = grads[0][0].mul_(grads[0][1] / total)
        for g, share in grads[1:]:
            acc.add_(g, alpha=share / total)
        out[name] = acc
    return out


class LocalExchange:
    chief = True

    def __init__(self, server: Server):
        self.server = server

    def step(self, step: int, parts: list[tuple[Grads, int]]) -> None:
        self.server.update(step, aggregate(parts))

    def metrics(self, window: MetricWindow) -> dict[str, float]:
        return window.averages()

    def updater_state(self) -> dict[str, dict[str, torch.Tensor]]:
        return self.server.state_dict()

    def load_updater_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        self.server.load_state(state)


class SlicedExchange:
    def __init__(self, store: ParamStore, updater: Updater, placement: Placement, rank: int, global_batch: int):
        self.store, self.updater, self.rank, self.global_batch = store, updater, rank, global_batch
        self.chief = rank == 0
        self.names = store.trainable_names()
        self.offsets: dict[str, int] = {}
        offset = 0
        for name in self.names:
            self.offsets[name] = offset
            offset += store.info[name].numel
        self.total = offset
        self.slices = [s for s in placement.slices if s.param in self.offsets]
        # every server group holds a full replica; one group here (synchronous), group 0
        self.owner = {s.index: placement.process_of(placement.server_of_slice(s.index, 0)) for s in self.slices}
        self.state = {self._key(s): updater.init_state(self._value(s)) for s in self.slices if self.owner[s.index] == rank}

    @staticmethod
    def _key(s: ParamSlice) -> tuple[str, int, int]:
        return (s.param, s.start, s.stop)

    def _value(self, s: ParamSlice) -> torch.Tensor:
        return self.store.values[s.param].view(-1)[s.start : s.stop]

    def step(self, step: int, parts: list[tuple[Grads, int]]) -> None:
        flat = torch.zeros(self.total)
        for grads, share in parts:  # this process's workers, weighted by share of the global batch
            for name in self.names:
                g = grads.get(name)
                if g is not None:
                    flat[self.offsets[name] : self.offsets[name] + g.numel()].add_(g.reshape(-1), alpha=share / self.global_batch)
        for s in self.slices:
            owner = self.owner[s.index]
            segment = flat[self.offsets[s.param] + s.start : self.offsets[s.param] + s.stop]
            comm.reduce_sum(segment, owner)
            value = self._value(s)
            if self.rank == owner:
                info = self.store.info[s.param]
                self.updater.update(step, value, segment, self.state[self._key(s)], info.lr_scale, info.wd_scale)
            comm.broadcast(value, owner)

    def metrics(self, window: MetricWindow) -> dict[str, float]:
        """Sample-weighted averages over every worker of the group (rank 0 decides the names)."""
        state = window.state()
        names = sorted(state["sums"]) if self.chief else []
        encoded = torch.tensor(list(",".join(names).encode()), dtype=torch.uint8)
        length = torch.tensor([len(encoded)])
        comm.broadcast(length, 0)
        if not self.chief:
            encoded = torch.zeros(int(length), dtype=torch.uint8)
        comm.broadcast(encoded, 0)
        names = [n for n in bytes(encoded.tolist()).decode().split(",") if n]
        values = torch.tensor([[state["sums"].get(n, 0.0), state["counts"].get(n, 0)] for n in names], dtype=torch.float64).reshape(-1, 2)
        comm.all_reduce_sum(values)
        return {n: float(s / c) for n, (s, c) in zip(names, values.tolist()) if c}

    def updater_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The whole updater state, assembled on every rank from the servers' slices (collective)."""
        slots = self.updater.init_state(torch.zeros(1)).keys()
        full = {name: {slot: torch.zeros(self.store.info[name].shape) for slot in slots} for name in self.names}
        for key, state in self.state.items():
            name, start, stop = key
            for slot, value in state.items():
                full[name][slot].view(-1)[start:stop] = value
        for name in self.names:
            for slot in slots:
                comm.all_reduce_sum(full[name][slot])
        return full

    def load_updater_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        for (name, start, stop), slots in self.state.items():
            for slot, value in slots.items():
                if name in state and slot in state[name]:
                    value.copy_(state[name][slot].reshape(-1)[start:stop])
