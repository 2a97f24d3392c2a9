"""Checkpoints: safetensors files written atomically, never pickle.

Layout: WORKSPACE/checkpoint/step<N>-worker<W>.safetensors (SINGA's names plus
an extension). One file holds
  param/<name>            param values
  state/<name>/<slot>     updater slots (momentum history, Adam moments, ...)
  rng/<name>              RNG states as uint8 tensors
  exchange/<key>          what the group's exchange alone holds (compression residuals, a
                          Local SGD group's anchor, Distributed Hogwild's last syncs, ...)
and string metadata (the safetensors header's `__metadata__`): the checkpoint format, the step, a
JSON blob with the trainer's position (data cursors, `random_skip` draws, open metric windows,
elapsed time), the parts it is written with, and `sha256`: a SHA-256 over every other metadata
field (canonical JSON: sorted keys, the digest itself left out) and every tensor's name, dtype,
shape and bytes. It is checked on load: a checkpoint whose header or data was damaged or edited is
refused with one line naming it, never trained on. (A checksum, not a signature: whoever can write
the workspace can also write a matching digest; docs/security.md.)

Format 1 (shoal before this one) digested the tensors alone: its header cannot be checked, so
such a checkpoint is never resumed; its params (checked) still initialise a job
(`checkpoint_path`, --test), with a warning. A checkpoint without a digest, or of a format this
shoal does not know, is refused.

A job of several worker groups or processes writes one more file per other
trainer (a group of threads, or a process): step<N>-group<G>-rank<R>.safetensors,
the same format, holding that trainer's own state (its params where they are its
own, its updater state, RNG, data position and exchange state). The chief's file
lists them (metadata `parts`: name -> required); a resume loads the chief's file with
its parts (`load(path, parts=True)`) and checks them too, each as the chief's file is (the
chief's digest covers the list, each part's its own header and tensors), so a checkpoint missing
a required part, or with a damaged or edited one, is refused as a whole and --resume falls back
to an older one, with a warning. Readers of the params alone (--test, checkpoint_path,
shoal.fit) read the chief's file only: over several hosts without a shared workspace, the other
hosts' parts are in their own workspaces.
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
from safetensors.torch import load_file
from safetensors.torch import save as to_safetensors_bytes

from shoal.errors import ShoalError, warn
from shoal.report.writes import own_folders, replace_file, write_error

FORMAT_VERSION = "2"  # 2: the digest covers the metadata and the tensors; 1: the tensors only
OLD_FORMAT = "1"
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


DIGEST_FIELD = "sha256"


def _tensor_bytes(value: torch.Tensor) -> bytes:
    return value.reshape(-1).view(torch.uint8).numpy().tobytes() if value.numel() else b""


def _update_framed(h, data: bytes) -> None:
    """`data` preceded by its length: no two sequences of fields hash the same bytes."""
    h.update(len(data).to_bytes(8, "little"))
    h.update(data)


def canonical_metadata(metadata: dict[str, str]) -> bytes:
    """The metadata the digest covers: every field but the digest, as JSON with sorted keys and no spaces."""
    kept = {k: v for k, v in metadata.items() if k != DIGEST_FIELD}
    return json.dumps(kept, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def digest(metadata: dict[str, str], tensors: dict[str, torch.Tensor]) -> str:
    """Format 2: SHA-256 over the canonical metadata, then each tensor's name, dtype and shape and its bytes,
    in name order, every field framed by its length."""
    h = hashlib.sha256(b"shoal checkpoint, format 2\n")
    _update_framed(h, canonical_metadata(metadata))
    for name in sorted(tensors):
        value = tensors[name].detach().cpu().contiguous()
        _update_framed(h, json.dumps([name, str(value.dtype), list(value.shape)]).encode())
        _update_framed(h, _tensor_bytes(value))
    return h.hexdigest()


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """Format 1's digest (an older shoal's checkpoints): the tensors' names, dtypes, shapes and bytes alone."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        value = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{value.dtype}|{tuple(value.shape)}|".encode())
        h.update(_tensor_bytes(value))
    return h.hexdigest()


def remove_stale_temporaries(workspace: Path) -> list[Path]:
    """Half-written checkpoints (`*.tmp`) a killed run left behind; removed, and returned."""
    folder = checkpoint_dir(workspace)
    stale = sorted(folder.glob("*.safetensors.tmp")) if folder.is_dir() else []
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


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
    metadata = {"format": FORMAT_VERSION, "step": str(ckpt.step), "trainer": json.dumps(ckpt.trainer)}
    if ckpt.part_names:
        metadata["parts"] = json.dumps(ckpt.part_names)
    metadata[DIGEST_FIELD] = digest(metadata, tensors)  # last: it covers every other field
    try:  # the file's bytes, written below through no link (safetensors' save_file opens its path, following one)
        data = to_safetensors_bytes(tensors, metadata=metadata)
    except SafetensorError as err:
        raise write_error(path, err) from None
    own_folders(path.parent)
    # a temp file beside it, fsync'd, renamed within the folder's descriptor, the folder fsync'd; a refused write
    # (disk full, quota, read-only) removes the temp, and the previous checkpoint stays as it was
    replace_file(path, data, temp_name=path.name + ".tmp", durable=True)
    return path


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
    """Read and check a checkpoint; `parts`: the whole state, for a resume: also the other trainers' parts its
    metadata lists (checked too), and never a checkpoint whose header its digest does not cover (format 1)."""
    ckpt, listed = _read(Path(path), resume=parts)
    if parts:
        ckpt.parts = _load_parts(Path(path), ckpt.step, listed)
    return ckpt


def _read(path: Path, resume: bool) -> tuple[Checkpoint, object]:
    """One file, checked: its checkpoint (without parts) and the parts its metadata lists."""
    if path.exists() and not path.is_file():  # a named pipe would block, a device never end
        raise CheckpointError(f"{path}: not a regular file")
    try:
        tensors = load_file(str(path))
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_len), object_pairs_hook=_no_repeated_keys)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such checkpoint") from None
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"{path}: not a readable safetensors checkpoint ({str(err).splitlines()[0]})") from None
    metadata = header.get("__metadata__") or {}  # safetensors has checked it maps strings to strings
    _check_digest(path, metadata, tensors, resume)
    try:
        ckpt = Checkpoint(step=int(metadata.get("step", 0)), params={}, trainer=json.loads(metadata.get("trainer", "{}")))
        listed = json.loads(metadata.get("parts", "{}"))
    except ValueError as err:
        raise CheckpointError(f"{path}: not a readable safetensors checkpoint (metadata: {err})") from None
    if not isinstance(ckpt.trainer, dict):
        raise CheckpointError(f"{path}: not a readable safetensors checkpoint (metadata: trainer is not a mapping)")
    named = _NAME.match(path.name) or _PART_NAME.match(path.name)
    if named is not None and int(named.group(1)) != ckpt.step:  # list_checkpoints orders by the name's step
        raise CheckpointError(f"{path}: its header says step {ckpt.step}, its name step {named.group(1)}: "
                              "renamed or edited, not used")
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
    return ckpt, listed


def _no_repeated_keys(pairs: list[tuple[str, object]]) -> dict:
    """A header naming a field twice (safetensors may take one, Python's json takes the last) is not one shoal wrote."""
    found: dict = {}
    for key, value in pairs:
        if key in found:
            raise ValueError(f"its header names {key!r} twice")
        found[key] = value
    return found


_WARNED_UNCHECKED_HEADERS: set[str] = set()  # format-1 files warned about in this process (one line each)


def _check_digest(path: Path, metadata: dict[str, str], tensors: dict[str, torch.Tensor], resume: bool) -> None:
    """The digest written with the checkpoint against its metadata and tensors as read; refused in one line."""
    written, fmt = metadata.get(DIGEST_FIELD), metadata.get("format")
    if written is None:
        raise CheckpointError(f"{path}: carries no checksum (metadata {DIGEST_FIELD!r}): not a checkpoint this shoal "
                              "can check, not used")
    if fmt == FORMAT_VERSION:
        if digest(metadata, tensors) != written:
            raise CheckpointError(f"{path}: damaged checkpoint: its header (step, data positions, parts) or its "
                                  "tensors do not match the checksum written with them")
        return
    if fmt != OLD_FORMAT:
        named = f"checkpoint format {fmt!r}" if fmt is not None else "no checkpoint format"
        raise CheckpointError(f"{path}: {named}: this shoal reads format {FORMAT_VERSION}, and {OLD_FORMAT} for params only")
    if tensors_digest(tensors) != written:
        raise CheckpointError(f"{path}: damaged checkpoint: its tensors do not match the checksum written with them")
    if resume:
        raise CheckpointError(f"{path}: written by an older shoal (checkpoint format {OLD_FORMAT}, whose checksum "
                              "leaves out the step, data positions and parts): not resumed; its params still "
                              "initialise a run through checkpoint_path")
    if str(path) not in _WARNED_UNCHECKED_HEADERS:
        _WARNED_UNCHECKED_HEADERS.add(str(path))
        warn(f"{path}: written by an older shoal (checkpoint format {OLD_FORMAT}): its params are checked, "
             "its step and positions are not")


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
        found[name], _ = _read(part, resume=True)  # checked as the chief's file is: format 2 only
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
