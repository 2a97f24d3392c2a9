"""Server: owns param values (or slices of them) and applies the updater.

The updater's state lives with the values it updates, as a plain dict of
tensors per param, so a server can own any slice of a param and its state.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable, Optional

import torch

from shoal.neuralnet.params import ParamStore
from shoal.neuralnet.updaters import ParamUpdate, Updater

if TYPE_CHECKING:
    from shoal.planning.partition import ParamView


class Server:
    """Applies SINGA updates to the params it owns, one version bump per update."""

    def __init__(self, store: ParamStore, updater: Updater, names: Optional[list[str]] = None):
        self.store = store
        self.updater = updater
        self.names = list(names if names is not None else store.trainable_names())
        self.state: dict[str, dict[str, torch.Tensor]] = {
            n: updater.init_shard_state(store.values[n], (n, 0, store.values[n].numel())) for n in self.names}
        self.version: dict[str, int] = {n: 0 for n in self.names}
        self.updates = 0  # updates applied (SINGA's slice version when all slices update together)
        self._count = threading.Lock()  # only the counter is locked: values are updated lock-free (Hogwild)
        # a user's loop (carry_hyper): each push's hyper-parameters, set on the updater before that push's update
        self.set_hyper: Optional[Callable[[torch.Tensor], None]] = None
        self._hyper = threading.Lock()  # a push's hyper-parameters and its update are one: no other group's lr in between

    def carry_hyper(self, set_hyper: Callable[[torch.Tensor], None]) -> None:
        """A user's loop (shoal.session): every push carries its group's hyper-parameters (a float64 vector, as
        DownpourServer's pushes over processes do), which `set_hyper` puts on the updater before the push's update."""
        self.set_hyper = set_hyper

    def update(self, step: int, grads: dict[str, Optional[torch.Tensor]], grad_scale: float = 1.0,
               group_step: Optional[tuple[int, int]] = None, hyper: Optional[torch.Tensor] = None) -> None:
        """Apply one update per owned param that has a gradient (running stats have none), all in one
        multi-tensor update; `group_step`: the (group, its own step) of an asynchronous group's push (Updater.update_many);
        `hyper`: the push's hyper-parameters (a user's loop's, carry_hyper), set before its update."""
        if hyper is not None and self.set_hyper is not None:
            with self._hyper:
                self.set_hyper(hyper)
                self._update(step, grads, grad_scale, group_step)
        else:
            self._update(step, grads, grad_scale, group_step)

    def _update(self, step: int, grads: dict[str, Optional[torch.Tensor]], grad_scale: float,
                group_step: Optional[tuple[int, int]]) -> None:
        updated = [name for name in self.names if grads.get(name) is not None]
        values, info = self.store.values, self.store.info
        self.updater.update_many(
            step,
            [ParamUpdate(values[n], grads[n], self.state[n], info[n].lr_scale, info[n].wd_scale) for n in updated],
            grad_scale,
            group_step,
        )
        for name in updated:
            self.version[name] += 1
        with self._count:
            self.updates += 1

    def update_view(self, step: int, view: "ParamView", grad: torch.Tensor) -> None:
        """Update one view of a param in place (a slice, or the whole), with the same slice of its
        updater state: what a worker computing that view alone does with its own gradient."""
        if view.name not in self.state:
            return  # not trained by gradient
        value, state = self.store.values[view.name], self.state[view.name]
        if view.axis >= 0:
            value = value.narrow(view.axis, view.start, view.size)
            state = {slot: s.narrow(view.axis, view.start, view.size) for slot, s in state.items()}
        info = self.store.info[view.name]
        self.updater.update(step, value, grad.to(value.device), state, info.lr_scale, info.wd_scale)

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        return self.state

    def load_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        for name, slots in state.items():
            if name not in self.state:
                continue
            for slot, value in slots.items():
                if slot in self.state[name]:
                    self.state[name][slot].copy_(value)
