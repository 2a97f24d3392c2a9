"""Server slices in a user's loop: AllReduce over processes with `cluster.nservers_per_group` K > 1 (SINGA's server
slices, co-located with the workers), without restarts: each process owns the slices of the params that the plan's
servers in it own and holds the user's optimizer's state for those alone (ZeRO-1's shape, as the job path's sliced
exchange, runtime/exchanges/sliced.py: there an owner's updater state lives with its slice too).

The group's mean gradient is in every `.grad` when backward ends (the replicated exchange's all-reduce,
session_exchange.GradientMean), so a clip_grad_norm_ in the loop sees the group's global norm, as under DDP; a
reduce-scatter would leave each process only its slices' gradients and the loop's clip would clip a part. `opt.step()`'s
pre-hook then updates this process's slices with an optimizer of the user's optimizer's class, defaults and param
groups built over views of them (in this process: no recipe travels, so a user's own element-wise class works too),
its groups' hyper-parameters the user's optimizer's as the user's scheduler left them, set before each update; one
all-gather over the whole job then puts every owner's new values (its slices laid end to end, padded to the longest)
into every replica, and `.grad` is left None, so the user's optimizer, which runs next, updates nothing and makes no
state. The slices are the plan's (`planning/plan.sliced_for` cuts the module's trained params as a net's: the same cut
in every process); a slice's owner is the process hosting its server. The result is one worker's to float rounding, as
the replicated update's (an element-wise optimizer: each element's update reads only that element).

A checkpoint holds every slice's state: the chief's file its own slices', each other process's part its own (required:
a resume needs every slice), under `slices/<optimizer>/<param>/<start>:<stop>/<slot>` in the exchange tensors; a
resume assembles each param's state from whatever slices the checkpoint holds and takes its own slices of it, so a
checkpoint resumes onto another slice count too (as the job path's, whose checkpoints hold each param's whole state),
and a loop without server slices takes each param's whole state from them (`whole_state`), as a sliced loop takes its
slices out of a checkpoint of whole params' state (`sliced_from_whole`).

A process that dies takes its slices' state with it: the group cannot go on without it (the replicated exchange's
quorum would); the step after which one is missing stops every process in one line. With `cluster.max_restarts` the
layout keeps the replicated update (every replica the whole state; a restarted process heals from the chief), as the
job path's AllReduce runs the replicated exchange there; with `cluster.compression` too (the job path's compressed
sliced exchange gives every process the state of every param it trains).
"""
from __future__ import annotations

from typing import Optional

import torch

from shoal.comm import collectives
from shoal.errors import ShoalError
from shoal.neuralnet.torch_optimizer import is_elementwise
from shoal.planning.exchange_choice import shards_optimizer_state  # noqa: F401 (the plan's word: fit and the session ask it here)
from shoal.planning.plan import JobPlan, sliced_for

KEY = "slices"  # the exchange tensors' prefix: slices/<optimizer index>/<param>/<start>:<stop>/<slot>
NOT_HYPER = ("params", "param_names")  # a param group's keys that are not its hyper-parameters


class SlicesError(ShoalError, ValueError):
    """Server slices in a user's loop cannot go on or start as asked: one line naming why."""


def saved_slices(ckpt) -> dict[str, torch.Tensor]:
    """Every slice's state a checkpoint holds: the file's own and its parts' (a resume loads it with its parts)."""
    found = {k: v for k, v in ckpt.exchange.items() if k.startswith(KEY + "/")}
    for part in ckpt.parts.values():
        found |= {k: v for k, v in part.exchange.items() if k.startswith(KEY + "/")}
    return found


class SlicedUpdate:
    """One user optimizer's update over this process's slices, and the all-gather of every owner's values."""

    def __init__(self, plan: JobPlan, rank: int, optimizer: torch.optim.Optimizer, index: int,
                 trained: list[tuple[str, torch.nn.Parameter]], saved: Optional[dict[str, torch.Tensor]]):
        """`trained`: the module's trained (name, param) pairs in order (the cut is over all of them, so every
        optimizer's slices are the plan's); `saved`: a resumed checkpoint's slice tensors (saved_slices), None for a
        fresh start."""
        self.plan, self.rank, self.optimizer, self.index = plan, rank, optimizer, index
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        placement = sliced_for(plan, {name: p.numel() for name, p in trained}).placement
        param_of = dict(trained)
        if held - {id(p) for p in param_of.values()}:
            raise SlicesError("run.optimizer: the optimizer holds a tensor that is not a trained param of run.model's "
                              f"module, which server slices (cluster.nservers_per_group {plan.nservers_per_group}) cannot cut")
        # (slice, owner, param) of every slice of this optimizer's params, in the plan's order: every process alike
        self.pieces = [(s, placement.process_of(placement.server_of_slice(s.index, 0)), param_of[s.param])
                       for s in placement.slices if id(param_of[s.param]) in held]
        for s, _, param in self.pieces:
            if not param.is_contiguous():
                raise SlicesError(f"run.optimizer: {s.param} is not contiguous in memory: server slices "
                                  f"(cluster.nservers_per_group {plan.nservers_per_group}) update views of its flat value")
        cut = sorted({s.param for s, _, param in self.pieces if s.size != param.numel()})
        if cut and not is_elementwise(optimizer):
            raise SlicesError(f"run.optimizer: {type(optimizer).__name__} is not known to be element-wise, and server "
                              f"slices (cluster.nservers_per_group {plan.nservers_per_group}) cut {cut[0]} over processes: "
                              "use one of torch's element-wise optimizers (SGD, Adam, AdamW...), or no server slices")
        self.sizes = {}
        for s, owner, _ in self.pieces:
            self.sizes[owner] = self.sizes.get(owner, 0) + s.size
        self.longest = max(self.sizes.values(), default=0)
        self.mine = [(s, param.detach().view(-1)[s.start : s.stop], param) for s, owner, param in self.pieces if owner == rank]
        self.local: Optional[torch.optim.Optimizer] = None  # over this process's slices (None: it owns none of them)
        if self.mine:
            self.local = self._made()
        if saved:
            self._load(saved)
        self.group = collectives.whole_job(plan.process_groups)

    def _made(self) -> torch.optim.Optimizer:
        """The user's optimizer's class over this process's slices: its param groups in order (a group with none of
        them empty), each group's hyper-parameters, its constructor's defaults."""
        import inspect

        view_of = {id(param): view for _, view, param in self.mine}
        groups = [{**{k: v for k, v in group.items() if k not in NOT_HYPER},
                   "params": [view_of[id(p)] for p in group["params"] if id(p) in view_of]}
                  for group in self.optimizer.param_groups]
        cls = type(self.optimizer)
        accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
        try:
            return cls(groups, **{k: v for k, v in self.optimizer.defaults.items() if k in accepted})
        except (TypeError, ValueError) as err:
            raise SlicesError(f"run.optimizer: {cls.__name__} cannot be made again over this process's server slices "
                              f"({str(err).splitlines()[0] if str(err) else type(err).__name__})") from None

    # -- a step ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, step: int, present) -> int:
        """Step `step`'s update of this process's slices from the group's mean in `.grad`, then every owner's values
        into every replica; `present`: the processes whose gradients the step's mean holds (all, or it stops).
        Returns the bytes this process's part of the all-gather holds (each other process receives them)."""
        missing = sorted(set(range(self.plan.nprocs)) - set(present))
        if missing:
            raise SlicesError(f"process {missing[0]} left the group at step {step}: under server slices "
                              f"(cluster.nservers_per_group {self.plan.nservers_per_group}) it alone held its slices' "
                              "optimizer state, so the group cannot go on without it; resume from the newest checkpoint "
                              "(--resume)")
        if self.local is not None:
            stepped = False
            for s, view, param in self.mine:
                grad = param.grad
                view.grad = None if grad is None else grad.reshape(-1)[s.start : s.stop]
                stepped = stepped or grad is not None
            if stepped:
                for local, group in zip(self.local.param_groups, self.optimizer.param_groups):  # (as its scheduler set them)
                    local.update({k: v for k, v in group.items() if k not in NOT_HYPER})
                self.local.step()
            for _, view, _ in self.mine:
                view.grad = None
        if not self.longest:
            return 0
        self._gather()
        return self.longest * self.pieces[0][2].element_size()

    def _gather(self) -> None:
        """Every owner's slices laid end to end (padded to the longest), all-gathered, copied into the replicas."""
        device = self.pieces[0][2].device
        flat = torch.zeros(self.longest, dtype=self.pieces[0][2].dtype, device=device)
        at = 0
        for s, view, _ in self.mine:
            flat[at : at + s.size] = view
            at += s.size
        gathered = self.group.all_gather(flat)
        offsets = dict.fromkeys(self.sizes, 0)
        for s, owner, param in self.pieces:
            at = offsets[owner]
            if owner != self.rank:
                param.detach().view(-1)[s.start : s.stop].copy_(gathered[self.group.index(owner)][at : at + s.size])
            offsets[owner] = at + s.size

    # -- memory and checkpoints -----------------------------------------------------------------------------
    def state_elements(self) -> int:
        """The elements of optimizer state this process holds for this optimizer (its slices' alone)."""
        if self.local is None:
            return 0
        return sum(v.numel() for state in self.local.state.values() for v in state.values() if isinstance(v, torch.Tensor))

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """This process's slices' state, as a checkpoint's exchange tensors (clones: the next step moves them)."""
        found = {}
        for s, view, _ in self.mine:
            for slot, value in (self.local.state.get(view, {}) if self.local is not None else {}).items():
                if isinstance(value, torch.Tensor):
                    found[f"{KEY}/{self.index}/{s.param}/{s.start}:{s.stop}/{slot}"] = value.detach().clone()
        return found

    def _load(self, saved: dict[str, torch.Tensor]) -> None:
        """This process's slices' state, cut from each param's state as the checkpoint's slices (any count) hold it."""
        pieces = _by_param(saved, self.index)
        for s, view, param in self.mine:
            whole = _assembled(pieces.get(s.param, {}), param.numel(), self.index, s.param, (s.start, s.stop))
            if whole:  # (none saved: no gradient yet when it was written, so none here either)
                self.local.state[view] = {slot: (value if value.dim() == 0 else value[s.start : s.stop]).clone().to(view.device)
                                          for slot, value in whole.items()}


def _by_param(saved: dict[str, torch.Tensor], index: int) -> dict[str, dict[str, list[tuple[int, int, torch.Tensor]]]]:
    """Optimizer `index`'s saved slices by param and slot: (start, stop, tensor) each."""
    pieces: dict[str, dict[str, list[tuple[int, int, torch.Tensor]]]] = {}
    prefix = f"{KEY}/{index}/"
    for key, value in saved.items():
        if key.startswith(prefix):
            name_range, _, slot = key[len(prefix):].rpartition("/")
            name, _, span = name_range.rpartition("/")
            start, _, stop = span.partition(":")
            pieces.setdefault(name, {}).setdefault(slot, []).append((int(start), int(stop), value))
    return pieces


def _assembled(slots: dict[str, list[tuple[int, int, torch.Tensor]]], numel: int, index: int, name: str,
               needed: tuple[int, int]) -> dict[str, torch.Tensor]:
    """A param's state from its saved slices: each element-wise slot flat and whole (the elements `needed` covered),
    each per-param slot (Adam's step, 0-d: every slice holds it alike) as it is."""
    state = {}
    for slot, held in slots.items():
        if held[0][2].dim() == 0:
            state[slot] = held[0][2]
            continue
        whole = torch.zeros(numel, dtype=held[0][2].dtype)
        covered = torch.zeros(numel, dtype=torch.bool)
        for start, stop, value in held:
            whole[start:stop] = value.reshape(-1)
            covered[start:stop] = True
        if not bool(covered[needed[0] : needed[1]].all()):
            raise SlicesError(f"--resume: the checkpoint's optimizer {index} state {slot!r} of {name} does not cover "
                              f"elements {needed[0]}:{needed[1]} (a part missing?)")
        state[slot] = whole
    return state


def whole_state(saved: dict[str, torch.Tensor], index: int, named: list[tuple[str, torch.Tensor]]) -> dict:
    """A sliced checkpoint's optimizer `index` state for a loop without server slices: torch's state_dict "state" (by
    the optimizer's param positions, `named` in its groups' order), each param's slots assembled from every slice."""
    pieces = _by_param(saved, index)
    found = {}
    for position, (name, param) in enumerate(named):
        whole = _assembled(pieces.get(name, {}), param.numel(), index, name, (0, param.numel()))
        if whole:
            found[position] = {slot: value.clone() if value.dim() == 0 else value.reshape(param.shape).clone()
                               for slot, value in whole.items()}
    return found


def sliced_from_whole(state: dict, index: int, named: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The other way: a whole-params checkpoint's optimizer `index` state_dict as slice tensors, each param one slice
    over all its elements (SlicedUpdate cuts its own slices out of them)."""
    found = {}
    for position, slots in state.get("state", {}).items():
        name, param = named[int(position)]
        for slot, value in slots.items():
            if isinstance(value, torch.Tensor):
                found[f"{KEY}/{index}/{name}/0:{param.numel()}/{slot}"] = value if value.dim() == 0 else value.reshape(-1)
    return found
