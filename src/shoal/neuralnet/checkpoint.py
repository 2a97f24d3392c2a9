"""Checkpoints: safetensors files written atomically, never pickle.

Layout: WORKSPACE/checkpoint/step<N>-worker<W>.safetensors (SINGA's names plus
an extension). One file holds
  param/<name>            param values
  state/<name>/<slot>     updater slots (momentum history, Adam moments, ...)
  rng/<name>              RNG states as uint8 tensors
  exchange/<key>          what the group's exchange alone holds (compression residuals, a
                          Local SGD group's anchor, Distributed Hogwild's last syncs, ...)
and string metadata: the step, a JSON blob with the trainer's position
(data cursors, open metric windows, elapsed time) and a SHA-256 of every
tensor's bytes, checked on load: a checkpoint whose data was damaged is
refused with one line naming it, never trained on.

A job of several worker groups or processes writes one more file per other
trainer (a group of threads, or a process): step<N>-group<G>-rank<R>.safetensors,
the same format, holding that trainer's own state (its params where they are its
own, its updater state, RNG, data position and exchange state). The chief's file
lists them (metadata `parts`: name -> required); a resume loads the chief's file with
its parts (`load(path, parts=True)`) and checks them too, so a checkpoint missing a
required part, or with a damaged one, is refused as a whole and --resume falls back to
an older one. Readers of the params alone (--test, checkpoint_path, shoal.fit) read the
chief's file only: over several hosts without a shared workspace, the other hosts'
parts are in their own workspaces.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from shoal.errors import ShoalError
from shoal.report.writes import write_error

FORMAT_VERSION = "1"
_NAME = re.compile(r"^step(\d+)-worker(\d+)\.safetensors$")
_PART_NAME = re.compile(r"^step(\d+)-group(\d+)-rank(\d+)\.safetensors$")


class CheckpointError(ShoalError, ValueError):
    """A checkpoint is missing, unreadable or does not fit the job (one line)."""


@dataclass
class Checkpoint:
    step: int
    params: dict[str, torch.Tensor]
    updater_state: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    rng: dict[str, torch.Tensor] = field(default_factory=dict)
    trainer: dict = field(default_factory=dict)
    exchange: dict[str, torch.Tensor] = field(default_factory=dict)
    parts: dict[str, "Checkpoint"] = field(default_factory=dict)  # file name -> another trainer's part (on load)
    part_names: dict[str, bool] = field(default_factory=dict)  # on save: the parts other trainers write -> required


def checkpoint_dir(workspace: Path) -> Path:
    return Path(workspace) / "checkpoint"


def checkpoint_file(workspace: Path, step: int, worker: int = 0) -> Path:
    return checkpoint_dir(workspace) / f"step{step}-worker{worker}.safetensors"


def part_file(workspace: Path, step: int, group: int, rank: int) -> Path:
    """The file another trainer (worker group `group` in process `rank`) writes its own state to."""
    return checkpoint_dir(workspace) / part_name(step, group, rank)


def part_name(step: int, group: int, rank: int) -> str:
    return f"step{step}-group{group}-rank{rank}.safetensors"


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the tensors' names, dtypes, shapes and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        value = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{value.dtype}|{tuple(value.shape)}|".encode())
        h.update(value.reshape(-1).view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    return h.hexdigest()


def remove_stale_temporaries(workspace: Path) -> list[Path]:
    """Half-written checkpoints (`*.tmp`) a killed run left behind; removed, and returned."""
    folder = checkpoint_dir(workspace)
    stale = sorted(folder.glob("*.safetensors.tmp")) if folder.is_dir() else []
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def _fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (the new directory entry survives a power loss)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(path: Path, ckpt: Checkpoint) -> Path:
    """Write atomically: a temp file in the same folder, fsync, rename, fsync the folder.

    A write the machine refuses (ENOSPC, EDQUOT, EROFS, EACCES) raises WorkspaceWriteError naming `path`,
    after removing the partial temp file; the checkpoints already written are untouched.
    """
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {f"param/{k}": v.detach().contiguous() for k, v in ckpt.params.items()}
    for name, slots in ckpt.updater_state.items():
        for slot, value in slots.items():
            tensors[f"state/{name}/{slot}"] = value.detach().contiguous()
    tensors.update({f"rng/{k}": v.contiguous() for k, v in ckpt.rng.items()})
    tensors.update({f"exchange/{k}": v.detach().contiguous() for k, v in ckpt.exchange.items()})
    # a copy: asynchronous groups may go on updating the live params (Hogwild) while they are written, and the
    # checksum must be of the bytes the file holds
    tensors = {k: v.to("cpu", copy=True) for k, v in tensors.items()}
    metadata = {"format": FORMAT_VERSION, "step": str(ckpt.step), "trainer": json.dumps(ckpt.trainer), "sha256": digest(tensors)}
    if ckpt.part_names:
        metadata["parts"] = json.dumps(ckpt.part_names)
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp), metadata=metadata)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except (OSError, SafetensorError) as err:  # disk full, quota, read-only: the previous checkpoint stays as it was
        _remove_partial(tmp)
        raise write_error(path, err) from None
    return path


def _remove_partial(tmp: Path) -> None:
    """A temp checkpoint that could not be finished: removed, which also gives back the space it took."""
    try:
        tmp.unlink(missing_ok=True)
    except OSError:  # a read-only folder never got it
        pass


def values_and_state(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """A trainer's own params (`value/<name>`) and updater state (`state/<name>/<slot>`) from the tensors it saved."""
    values = {key[len("value/"):]: v for key, v in tensors.items() if key.startswith("value/")}
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("state/"):
            name, _, slot = key[len("state/"):].rpartition("/")
            state.setdefault(name, {})[slot] = value
    return values, state


def load(path: Path, parts: bool = False) -> Checkpoint:
    """Read and check a checkpoint; `parts`: also the other trainers' parts its metadata lists."""
    path = Path(path)
    if path.exists() and not path.is_file():  # a named pipe would block, a device never end
        raise CheckpointError(f"{path}: not a regular file")
    try:
        tensors = load_file(str(path))
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            metadata = json.loads(f.read(header_len)).get("__metadata__", {})
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such checkpoint") from None
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"{path}: not a readable safetensors checkpoint ({str(err).splitlines()[0]})") from None
    expected = metadata.get("sha256")
    if expected is not None and digest(tensors) != expected:
        raise CheckpointError(f"{path}: damaged checkpoint: its tensors do not match the checksum written with them")
    try:
        ckpt = Checkpoint(step=int(metadata.get("step", 0)), params={}, trainer=json.loads(metadata.get("trainer", "{}")))
        listed = json.loads(metadata.get("parts", "{}"))
    except ValueError as err:
        raise CheckpointError(f"{path}: not a readable safetensors checkpoint (metadata: {err})") from None
    for key, value in tensors.items():
        kind, _, rest = key.partition("/")
        if kind == "param":
            ckpt.params[rest] = value
        elif kind == "state":
            name, _, slot = rest.rpartition("/")
            ckpt.updater_state.setdefault(name, {})[slot] = value
        elif kind == "rng":
            ckpt.rng[rest] = value
        elif kind == "exchange":
            ckpt.exchange[rest] = value
    if parts:
        ckpt.parts = _load_parts(path, ckpt.step, listed)
    return ckpt


def _load_parts(path: Path, step: int, listed) -> dict[str, Checkpoint]:
    """The parts the chief's file lists, each checked; a required one missing makes the checkpoint incomplete."""
    if not isinstance(listed, dict):
        raise CheckpointError(f"{path}: not a readable safetensors checkpoint (metadata: parts is not a mapping)")
    found = {}
    for name, required in listed.items():
        m = _PART_NAME.match(str(name))
        if m is None or int(m.group(1)) != step:  # only files of this step, in this folder
            raise CheckpointError(f"{path}: metadata names {name!r}, not a part of step {step}")
        part = path.parent / name
        if not part.exists():
            if required:
                raise CheckpointError(f"{path}: incomplete checkpoint: its part {name} is missing (another process writes "
                                      "it; over several hosts, resume from a workspace every host shares)")
            continue
        found[name] = load(part, parts=False)
    return found


def list_checkpoints(workspace: Path) -> list[tuple[int, Path]]:
    """(step, path) of every worker-0 checkpoint (the chief's file) in the workspace, oldest first."""
    folder = checkpoint_dir(workspace)
    if not folder.is_dir():
        return []
    found = []
    for p in folder.iterdir():
        m = _NAME.match(p.name)
        if m and int(m.group(2)) == 0:
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest(workspace: Path) -> Optional[Path]:
    found = list_checkpoints(workspace)
    return found[-1][1] if found else None


def resolve_path(spec: str, base_dirs: list[Path]) -> Path:
    """Find the file a `checkpoint_path` entry names.

    Accepts a file, SINGA's extension-less `.../step6000-worker0`, or a
    workspace / checkpoint folder (its newest checkpoint).
    """
    tried = []
    for base in base_dirs:
        p = Path(spec) if os.path.isabs(spec) else Path(base) / spec
        for candidate in (p, p.with_name(p.name + ".safetensors")):
            tried.append(candidate)
            if candidate.is_file():
                return candidate
        if p.is_dir():
            newest = latest(p.parent) if p.name == "checkpoint" else latest(p)
            if newest is not None:
                return newest
        if os.path.isabs(spec):
            break
    raise CheckpointError(f"checkpoint_path {spec!r}: no checkpoint found (tried {', '.join(str(t) for t in tried)})")
