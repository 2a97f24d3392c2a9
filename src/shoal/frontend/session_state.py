"""A session's state: what a checkpoint and a handover hold of a user's loop, and how it is built and loaded back.

A checkpoint (run.checkpoint(), `--resume`) holds the module's values, each optimizer's state_dict split into its
tensors (safetensors slots state/optimizer.<index>/<slot>) and the rest as JSON, the schedulers' state_dicts (JSON
only), torch's random generators, the display window and the exchange's state; every process writes its part
(`own_part` picks this rank's back out). A handover (a process the launcher restarted, --max-restarts) is the same
loop state in memory, in one order on both sides: the module's tensors and torch's RNG state, the optimizers' state
tensors by key (every param of their groups present, `complete_state`), then the optimizers' param groups and the
schedulers' state as JSON in a fixed-size tensor. Nothing here runs the loop: frontend/session.py and its
session_checkpoint, session_healing and session_threads call these.
"""
from __future__ import annotations

import dataclasses
import gc
import inspect
import json
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from shoal.frontend.session_start import SessionError
from shoal.neuralnet import checkpoint as ckpt_io
from shoal.report.metrics import MetricsLog, MetricWindow
from shoal.runtime import session_exchange

OPTIMIZER_STATE = "optimizer"  # checkpoint slots: state/optimizer.<index>/<slot>
HANDOVER_TEXT_BYTES = 1 << 20  # a restarted process's handover: the optimizers' and schedulers' state as JSON, padded


# -- a checkpoint ------------------------------------------------------------------------------------------
def own_part(ckpt: ckpt_io.Checkpoint, path: Path, group: int, rank: int, own_residual: bool, apart: bool,
             say: Callable[[str], None]) -> ckpt_io.Checkpoint:
    """This rank's part of the checkpoint: the chief's file for the process that wrote it (rank 0, or the one that took
    a dead chief's place: its `writer`), and for every replica of a synchronous group (they are equal; compressed,
    with the process's own residual from its part); a Local SGD group's own part, or the chief's file where its
    group was missing when it was written."""
    name = ckpt_io.part_name(ckpt.step, group, rank)
    writer = int(ckpt.trainer.get("writer", 0))
    if rank != writer and own_residual:  # the chief's file, with this process's residual from its part
        if name not in ckpt.parts:
            say(f"{path}: no part of process {rank} (it was missing from the steps): its error feedback starts at zero")
            return ckpt
        chiefs = {k: v for k, v in ckpt.exchange.items() if not k.startswith("own/residual/")}
        return dataclasses.replace(ckpt, exchange=chiefs | ckpt.parts[name].exchange, parts={})
    if rank == writer or not apart:
        return ckpt
    if name not in ckpt.parts:
        # (missing from Local SGD's meetings; an asynchronous group dead then, or a restarted one that ended elsewhere)
        say(f"{path}: no part of worker group {group} (it wrote none at step {ckpt.step}): it starts from the state of "
            f"the group whose process wrote the file (process {writer})")
        return ckpt
    return ckpt.parts[name]


def checkpoint_state(done: int, module, optimizers: list, schedulers: list, device: torch.device, window: MetricWindow,
                     metrics: Optional[MetricsLog], exchange, update_lock=None, whole: bool = False) -> ckpt_io.Checkpoint:
    """The loop's state after step `done - 1`'s update, as a checkpoint (the module's values copied under
    `update_lock`, Distributed Hogwild's, while no peer's delta is being added; the exchange's state, Local SGD's
    anchor and outer state say, taken after them). `whole`: a tensor-parallel module's and optimizers' sliced tensors
    gathered whole, under the module's own names (every process of the group calls it: comm/tensor_parallel.py)."""
    if whole:
        from shoal.comm import tensor_parallel
    with update_lock or nullcontext():
        if whole:
            params = tensor_parallel.full_state(module)
        else:
            params = {k: v.clone() if update_lock is not None else v for k, v in module.state_dict().items()
                      if isinstance(v, torch.Tensor)} if module else {}
    described_optimizers, updater_state = [], {}
    for index, optimizer in enumerate(optimizers):
        state = tensor_parallel.full_optimizer_state(optimizer.state_dict()) if whole else optimizer.state_dict()
        described, tensors = split_tensors(state, f"optimizer {index}")
        described_optimizers.append(described)
        for key, value in tensors.items():
            updater_state.setdefault(f"{OPTIMIZER_STATE}.{index}", {})[key] = value
    scheduler_states = [json_only(s.state_dict(), "a scheduler") for s in schedulers]
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and device.type == "cuda":
        rng |= {f"cuda/{i}": state for i, state in enumerate(torch.cuda.get_rng_state_all())}
    elapsed = metrics.elapsed() if metrics is not None else 0.0
    exchange_state = session_exchange.exchange_state(exchange) if exchange is not None else {}
    trainer = {"next_step": done, "optimizers": described_optimizers, "schedulers": scheduler_states,
               "window": window.state(), "elapsed": elapsed, "session": True}
    return ckpt_io.Checkpoint(step=done, params=params, updater_state=updater_state, rng=rng, trainer=trainer,
                              exchange=exchange_state)


def load_module(module: torch.nn.Module, saved: dict) -> None:
    """The checkpoint's values into the module, every key present with its shape."""
    state = module.state_dict()
    missing = [k for k in state if k not in saved]
    if missing:
        raise SessionError(f"--resume: the checkpoint has no value for {missing[0]!r} of the module (another model?)")
    for key, value in state.items():
        if tuple(saved[key].shape) != tuple(value.shape):
            raise SessionError(f"--resume: {key!r} has shape {tuple(saved[key].shape)} in the checkpoint and "
                               f"{tuple(value.shape)} in the module")
    with torch.no_grad():
        for key, value in state.items():
            value.copy_(saved[key].to(value.device))


def saved_optimizer_state(mine: ckpt_io.Checkpoint, index: int) -> dict:
    """Optimizer `index`'s state_dict from this rank's part of the checkpoint."""
    described = mine.trainer.get("optimizers", [])
    if index >= len(described):
        raise SessionError(f"--resume: the checkpoint holds {len(described)} optimizer(s), this loop has more")
    return join_tensors(described[index], mine.updater_state.get(f"{OPTIMIZER_STATE}.{index}", {}))


def restore_resumed(mine: ckpt_io.Checkpoint, optimizers: list, schedulers: list, sliced: bool = False,
                    saved_state: Optional[Callable[[int], dict]] = None) -> None:
    """On a resume, at the loop's start: the schedulers' state, the optimizers' learning rates they set (a new
    scheduler set its first), and the random generators. `sliced`: a tensor-parallel module's optimizers, whose
    whole saved tensors are re-sliced as their params are placed; `saved_state(index)`: optimizer `index`'s state_dict
    as the session gives it (server slices: Session._saved_optimizer_state), else the checkpoint's."""
    saved = mine.trainer.get("schedulers", [])
    if len(saved) != len(schedulers):
        raise SessionError(f"--resume: the checkpoint holds {len(saved)} scheduler(s), this loop has {len(schedulers)}")
    for scheduler, state in zip(schedulers, saved):
        scheduler.load_state_dict(state)
    for index, optimizer in enumerate(optimizers):
        state = saved_state(index) if saved_state is not None else saved_optimizer_state(mine, index)
        if sliced:
            from shoal.comm import tensor_parallel

            state = tensor_parallel.sliced_optimizer_state(optimizer, state)
        optimizer.load_state_dict(state)
    rng = mine.rng
    if "torch" in rng:
        torch.set_rng_state(rng["torch"])
    cuda = [rng[f"cuda/{i}"] for i in range(torch.cuda.device_count()) if f"cuda/{i}" in rng]
    if cuda:
        torch.cuda.set_rng_state_all(cuda)


def schedulers_of(optimizers: list) -> list:
    """The LR schedulers stepping these optimizers: a scheduler holds its optimizer, and nothing but the user's loop
    holds the scheduler, so they are found among the optimizers' referrers (the object itself, or its __dict__ where
    Python keeps one apart)."""
    def is_scheduler(obj) -> bool:  # type(): a lazy module's __class__ would import it
        return issubclass(type(obj), torch.optim.lr_scheduler.LRScheduler) and any(obj.optimizer is o for o in optimizers)

    found = []
    for holder in gc.get_referrers(*optimizers) if optimizers else ():
        owners = gc.get_referrers(holder) if type(holder) is dict else [holder]
        found += [obj for obj in owners if is_scheduler(obj) and getattr(obj, "__dict__", None) is (holder if type(holder) is dict
                                                                                                    else obj.__dict__)]
    return list({id(s): s for s in found}.values())


# -- a handover --------------------------------------------------------------------------------------------
def rng_states(device: torch.device) -> list[torch.Tensor]:
    """torch's global RNG state: the CPU generator's, and this device's CUDA generator's where the module is on one
    (the same kinds on every process of a plan: both sides of a handover list the same tensors)."""
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def set_rng_states(states: list[torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)


def loop_state(module: torch.nn.Module, optimizers: list, schedulers: list,
               device: torch.device) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]], dict]:
    """The module's values and buffers (live), torch's RNG state (copies), each optimizer's state tensors by key
    (live), and the rest as JSON. An optimizer's state is keyed by param index, every param of its groups present
    in order (`complete_state`), so that the chief's and a restarted process's keys match whichever params the
    chief's optimizer has stepped; "absent" names the params the chief's has no state for."""
    values = [t for t in module.state_dict().values() if isinstance(t, torch.Tensor)] + rng_states(device)
    described, tensors, absent = [], [], []
    for index, optimizer in enumerate(optimizers):
        state, missing = complete_state(optimizer)
        text, found = split_tensors(state, f"optimizer {index}")
        described.append(text)
        tensors.append(found)
        absent.append(missing)
    text = {"optimizers": described, "absent": absent,
            "schedulers": [json_only(s.state_dict(), "a scheduler") for s in schedulers]}
    return values, tensors, text


def handover(module: torch.nn.Module, optimizers: list, schedulers: list, device: torch.device) -> list[torch.Tensor]:
    """What a restarted process takes, in one order on both sides: the module's tensors, the optimizers' state
    tensors (by key), then the optimizers' param groups and the schedulers' state as JSON in a fixed-size tensor."""
    values, tensors, text = loop_state(module, optimizers, schedulers, device)
    encoded = json.dumps(text).encode()
    if len(encoded) > HANDOVER_TEXT_BYTES:
        raise SessionError(f"a restarted process's handover: the optimizers' and schedulers' state is {len(encoded)} bytes "
                           f"of JSON, more than {HANDOVER_TEXT_BYTES}")
    padded = torch.full((HANDOVER_TEXT_BYTES,), ord(" "), dtype=torch.uint8)
    padded[:len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    return values + [found[k] for found in tensors for k in sorted(found)] + [padded]


def handover_receivers(module: torch.nn.Module, optimizers: list, schedulers: list,
                       device: torch.device) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]], list[torch.Tensor],
                                                      torch.Tensor]:
    """A restarted process's side of `handover`: every tensor the chief's state is received into (the module's own,
    the optimizers' state, made here first where torch has not made it yet), the optimizers' state tensors by key,
    the RNG state's copies, and the text tensor."""
    for optimizer in optimizers:  # torch's optimizers make their state at the first step: make it, to fill it
        if not optimizer.state:
            make_state(optimizer)
    values, tensors, _ = loop_state(module, optimizers, schedulers, device)
    rng = values[len(values) - len(rng_states(device)):]  # (the copies the chief's RNG state is received into)
    text = torch.zeros(HANDOVER_TEXT_BYTES, dtype=torch.uint8)
    taken = values + [found[k] for found in tensors for k in sorted(found)] + [text]
    return taken, tensors, rng, text


def take_handover(text: torch.Tensor, tensors: list[dict[str, torch.Tensor]], rng: list[torch.Tensor], optimizers: list,
                  schedulers: list, device: torch.device) -> None:
    """The chief's state, received into `handover_receivers`' tensors, loaded into these optimizers and schedulers
    and torch's random generators."""
    given = json.loads(bytes(text.numpy()).decode())
    if len(given["schedulers"]) != len(schedulers):
        raise SessionError(f"a restarted process: the chief's loop has {len(given['schedulers'])} scheduler(s), this one "
                           f"{len(schedulers)}")
    for optimizer, described, found, absent in zip(optimizers, given["optimizers"], tensors, given["absent"]):
        optimizer.load_state_dict(join_tensors(described, found))
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for index in absent:  # no state on the chief (no gradient yet): none here either, as a fresh optimizer's
            optimizer.state.pop(params[index], None)
    set_rng_states(rng, device)  # the chief's stream: dropout masks from here on are the chief's, as after a resume
    for scheduler, state in zip(schedulers, given["schedulers"]):
        scheduler.load_state_dict(state)


def make_state(optimizer: torch.optim.Optimizer) -> None:
    """One step of `optimizer` on zero gradients: its state tensors exist, shaped as the chief's (their values, and the
    params it moved, are then overwritten by the chief's)."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for p, grad in zip(params, grads):
        p.grad = grad


def complete_state(optimizer: torch.optim.Optimizer) -> tuple[dict, list[int]]:
    """`optimizer.state_dict()` with its state keyed by param index in order and every param of its groups present
    (a param torch made no state for yet, because it never had a gradient, gets the state a zero-gradient step makes on
    a scratch copy of it: same keys and shapes as on a process that made all its state; the values are never used),
    and the indices of those params."""
    state = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    missing = [i for i in range(len(params)) if i not in state["state"]]
    made: dict[int, dict] = {}
    if missing:
        at = {id(p): i for i, p in enumerate(params)}
        groups, copies = [], []
        for group in optimizer.param_groups:
            mine = [p for p in group["params"] if at[id(p)] in missing]
            if mine:
                clones = [torch.zeros_like(p).requires_grad_(p.requires_grad) for p in mine]
                copies += [(at[id(p)], c) for p, c in zip(mine, clones)]
                groups.append({**{k: v for k, v in group.items() if k not in ("params", "param_names")}, "params": clones})
        scratch = type(optimizer)(groups, **_accepted_defaults(optimizer))
        make_state(scratch)
        made = {index: scratch.state[clone] for index, clone in copies if clone in scratch.state}
    state["state"] = {i: state["state"][i] if i in state["state"] else made[i]
                      for i in range(len(params)) if i in state["state"] or i in made}
    return state, missing


def _accepted_defaults(optimizer: torch.optim.Optimizer) -> dict:
    accepted = set(inspect.signature(type(optimizer).__init__).parameters) - {"self", "params"}
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}


# -- state_dicts as tensors and JSON -------------------------------------------------------------------------
def split_tensors(state: Any, what: str, prefix: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """A state_dict as JSON with every tensor replaced by {"tensor": key}, and the tensors by key (safetensors)."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(value, path):
        if isinstance(value, torch.Tensor):
            tensors[path] = value
            return {"tensor": path}
        if isinstance(value, dict):
            return {"dict": [[walk(k, f"{path}.k{i}"), walk(v, f"{path}.{i}")] for i, (k, v) in enumerate(value.items())]}
        if isinstance(value, (list, tuple)):
            return {"tuple" if isinstance(value, tuple) else "list": [walk(v, f"{path}.{i}") for i, v in enumerate(value)]}
        if value is None or isinstance(value, (bool, int, float, str)):
            return {"value": value}
        raise SessionError(f"run.checkpoint: {what} holds a {type(value).__name__}, which a checkpoint does not store "
                           "(tensors, numbers, strings, lists and dicts only)")

    return walk(state, prefix or "s"), tensors


def join_tensors(described: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """`split_tensors` undone: the state_dict its JSON and tensors describe."""
    def walk(node):
        (kind, value), = node.items()
        if kind == "tensor":
            return tensors[value]
        if kind == "dict":
            return {walk(k): walk(v) for k, v in value}
        if kind in ("list", "tuple"):
            items = [walk(v) for v in value]
            return tuple(items) if kind == "tuple" else items
        return value

    return walk(described)


def json_only(state: dict, what: str) -> dict:
    """A scheduler's state_dict as it is (JSON): one holding a tensor or a function is refused in one line."""
    try:
        json.dumps(state)
    except (TypeError, ValueError):
        raise SessionError(f"run.checkpoint: {what}'s state_dict holds values a checkpoint does not store (JSON only)") from None
    return state
