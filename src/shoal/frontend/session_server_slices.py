"""Server slices in a user's loop (AllReduce, cluster.nservers_per_group > 1, no restarts): each process updates its
slices of the params alone, as ZeRO-1 does.

run.optimizer(opt) gives this process an update of its slices (`update_slices`: an optimizer of the user's optimizer's
class and groups over them, which alone holds their state; runtime/session_slices.SlicedUpdate); opt.step()'s pre-hook
runs it and all-gathers every process's values (`slices_step`), leaving `.grad` None, so the user's optimizer updates
nothing here. A checkpoint holds every slice's state (`slices_state`), kept by param name (`named_params`). Each
function takes the `Session` (frontend/session.py) it acts for.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from shoal.frontend import session_state, session_worker
from shoal.frontend.session_start import SessionError
from shoal.runtime import session_slices


def update_slices(run, optimizer: torch.optim.Optimizer, index: int) -> None:
    """Server slices: this process updates its slices of the optimizer's params with an optimizer of its class and
    groups over them, which alone holds their state; opt.step()'s pre-hook runs it and all-gathers the values,
    leaving `.grad` None, so the user's optimizer updates nothing here (runtime/session_slices.py)."""
    if run.module is None:
        raise SessionError(f"run.optimizer: give the module to run.model(...) first ({run.plan.label}'s server slices "
                           "cut its params over the processes)")
    trained = [(n, p) for n, p in run.module.named_parameters() if p.requires_grad]
    saved = None
    if run.resumed is not None:  # the slices it saved, or (a checkpoint of whole params' state) each param as one
        saved = session_slices.saved_slices(run.resumed) or session_slices.sliced_from_whole(
            session_state.saved_optimizer_state(run._mine, index), index, named_params(optimizer, run.module))
    sliced = session_slices.SlicedUpdate(run.plan, run.rank, optimizer, index, trained, saved)
    run._slices.append(sliced)
    if run._workers:  # several workers: their opt.step()s meet, and the process updates once (threads.slices_step)
        return

    def update(optimizer, args, kwargs) -> None:
        slices_step(run, index)
        session_worker.drop_grads(optimizer)

    optimizer.register_step_pre_hook(update)


def slices_step(run, index: int) -> None:
    """Server slices: optimizer `index`'s update of this process's slices and the all-gather of every process's."""
    started = time.perf_counter()
    part = run._slices[index].step(run.step, run.exchange.present)
    others = run.plan.nprocs - 1  # (the replicated exchange's counts of an all-gather: each part to every other)
    run.exchange.sent_bytes += part * others
    run.exchange.job_bytes_sent += part * run.plan.nprocs * others
    run.exchange_seconds += time.perf_counter() - started


def named_params(optimizer: torch.optim.Optimizer, module: Optional[torch.nn.Module]) -> list[tuple[str, torch.Tensor]]:
    """The optimizer's params with the module's names, in its groups' order (a state_dict's positions)."""
    if module is None:
        raise SessionError("run.optimizer: give the module to run.model(...) first (the checkpoint's optimizer state is "
                           "kept by param name)")
    name_of = {id(p): n for n, p in module.named_parameters()}
    named = [(name_of.get(id(p)), p) for group in optimizer.param_groups for p in group["params"]]
    if any(name is None for name, _ in named):
        raise SessionError("run.optimizer: the optimizer holds a tensor that is not a param of run.model's module, "
                           "whose state the checkpoint's slices cannot name")
    return named


def slices_state(run) -> dict[str, torch.Tensor]:
    """Every slice this process updates: its optimizer state, as a checkpoint holds it."""
    return {key: value for sliced in run._slices for key, value in sliced.state_tensors().items()}
