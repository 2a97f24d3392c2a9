"""Params: named tensors with SINGA's init methods, scales and sharing.

A ParamStore holds the master value of every *owner* param of a job. Params
declared with `share_from` are aliases of their owner. Nets never own values:
each net (one per worker and phase) takes leaf views of the store's tensors,
so all nets of a process share value memory while keeping their own
gradients, as SINGA's `ShareParamsFrom` does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from shoal.config import job_pb2
from shoal.errors import ShoalError
from shoal.neuralnet.memory import FLOAT_BYTES, available_bytes, describe_bytes

Shape = tuple[int, ...]
ParamInit = Callable[[job_pb2.ParamGenProto, Shape, torch.Generator], torch.Tensor]
_USER_INITS: dict[str, ParamInit] = {}


def register_param_init(user_type: str) -> Callable[[ParamInit], ParamInit]:
    """Register a kUserInit generator: fn(conf, shape, generator) -> tensor."""

    def wrap(fn: ParamInit) -> ParamInit:
        _USER_INITS[user_type] = fn
        return fn

    return wrap


def _fan(shape: Shape) -> tuple[int, int]:
    """(rows, cols) of the param seen as SINGA's 2-D blob (conv filters flattened)."""
    rows = shape[0]
    cols = math.prod(shape[1:]) if len(shape) > 1 else 1
    return rows, cols


def init_value(conf: Optional[job_pb2.ParamGenProto], shape: Shape, generator: torch.Generator) -> torch.Tensor:
    """A fresh float32 tensor filled as SINGA's ParamGenerator for `conf.type`.

    kConstant: value. kGaussian: N(mean, std)·value. kUniform: U(low, high)·value.
    kGaussianSqrtFanIn: Gaussian / sqrt(cols). kUniformSqrtFanIn: Uniform / sqrt(cols/3).
    kUniformSqrtFanInOut: Uniform / sqrt(rows + cols). The fan-in variants divide only
    multi-dimensional params, as SINGA's (which only divides 2-D blobs).
    A param without `init` is filled with `value` (default 1), SINGA's base generator.
    """
    conf = conf if conf is not None else job_pb2.ParamGenProto(type=job_pb2.kConstant)
    kind = conf.type
    if kind == job_pb2.kUserInit:
        if conf.user_type in _USER_INITS:
            return _USER_INITS[conf.user_type](conf, shape, generator).to(torch.float32)
        if conf.HasField("user_type"):
            raise ValueError(f"init.user_type {conf.user_type!r} is not registered")
        kind = job_pb2.kConstant  # no init given: SINGA's base generator fills `value`
    out = torch.empty(shape, dtype=torch.float32)
    if kind == job_pb2.kConstant:
        return out.fill_(conf.value)
    if kind in (job_pb2.kGaussian, job_pb2.kGaussianSqrtFanIn):
        out.normal_(conf.mean, conf.std, generator=generator)
    elif kind in (job_pb2.kUniform, job_pb2.kUniformSqrtFanIn, job_pb2.kUniformSqrtFanInOut):
        out.uniform_(conf.low, conf.high, generator=generator)
    else:
        raise ValueError(f"init.type {job_pb2.InitMethod.Name(kind)} is not supported")
    if conf.value != 1:
        out.mul_(conf.value)
    if len(shape) >= 2:
        rows, cols = _fan(shape)
        if kind == job_pb2.kGaussianSqrtFanIn:
            out.div_(math.sqrt(cols))
        elif kind == job_pb2.kUniformSqrtFanIn:
            out.div_(math.sqrt(cols / 3))
        elif kind == job_pb2.kUniformSqrtFanInOut:
            out.div_(math.sqrt(rows + cols))
    return out


class ParamMismatch(ShoalError, ValueError):
    """Values (a checkpoint's) that do not fit the job's params: one line naming the param and both shapes."""


@dataclass
class ParamInfo:
    """What the runtime needs to know about one owner param."""

    name: str
    shape: Shape
    conf: job_pb2.ParamProto
    # params whose value is a running statistic (batch norm), not trained by gradient
    trainable: bool = True

    @property
    def lr_scale(self) -> float:
        return self.conf.lr_scale

    @property
    def wd_scale(self) -> float:
        return self.conf.wd_scale

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class ParamStore:
    """Master values of a job's params, in declaration order, plus aliases."""

    def __init__(self, allocate: bool = True) -> None:
        # allocate=False: shapes only (meta tensors), for validating a job without memory
        self.allocate = allocate
        self.info: dict[str, ParamInfo] = {}
        self.values: dict[str, torch.Tensor] = {}
        self._owner: dict[str, str] = {}
        self._bytes = 0  # of the owner params declared so far
        self._room: Optional[int] = None  # memory available when the first param was declared

    @classmethod
    def viewing(cls, named: list[tuple[str, torch.Tensor]]) -> "ParamStore":
        """A store whose values are the given tensors themselves (no copy): an exchange that updates its store's values
        in place updates them (shoal.session: the user's module's params)."""
        store = cls()
        for name, tensor in named:
            store.info[name] = ParamInfo(name, tuple(tensor.shape), job_pb2.ParamProto(name=name))
            store.values[name] = tensor.detach()  # shares the parameter's memory; autograd never sees the exchange's writes
        return store

    def owner(self, name: str) -> str:
        return self._owner.get(name, name)

    def declare(self, conf: job_pb2.ParamProto, shape: Shape, generator: torch.Generator, trainable: bool = True) -> str:
        """Create the param (or alias it to its owner); return the owner's name."""
        name = conf.name
        if conf.share_from:
            owner = self.owner(conf.share_from)
            if owner not in self.info:
                raise KeyError(f"param {name!r}: share_from {conf.share_from!r} names no param")
            if self.info[owner].shape != tuple(shape):
                raise ValueError(
                    f"param {name!r} has shape {tuple(shape)} but share_from {conf.share_from!r} "
                    f"has shape {self.info[owner].shape}"
                )
            self._owner[name] = owner
            return owner
        if name in self.info:
            if self.info[name].shape != tuple(shape):
                raise ValueError(f"param {name!r} is declared twice with shapes {self.info[name].shape} and {tuple(shape)}")
            return name
        self._check_size(name, tuple(shape))
        self.info[name] = ParamInfo(name, tuple(shape), conf, trainable)
        if self.allocate:
            self.values[name] = init_value(conf.init if conf.HasField("init") else None, tuple(shape), generator)
        else:
            self.values[name] = torch.empty(tuple(shape), device="meta")
        return name

    def _check_size(self, name: str, shape: Shape) -> None:
        """Refuse a param with a size <= 0, or one that memory cannot hold, before any tensor exists (even a meta one)."""
        if any(size <= 0 for size in shape):
            raise ValueError(f"param {name!r} would have shape {shape}: every size must be > 0")
        if self._room is None:
            self._room = available_bytes() or 0
        nbytes = math.prod(shape) * FLOAT_BYTES
        self._bytes += nbytes
        if self._room and self._bytes > self._room:
            earlier = f" (with the params declared before it, {describe_bytes(self._bytes)})" if self._bytes > nbytes else ""
            raise ValueError(
                f"param {name!r} of shape {shape} needs {describe_bytes(nbytes)}{earlier}, "
                f"more than the {describe_bytes(self._room)} of memory available"
            )

    def names(self) -> list[str]:
        return list(self.info)

    def trainable_names(self) -> list[str]:
        return [n for n, i in self.info.items() if i.trainable]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.values)

    def load(self, tensors: dict[str, torch.Tensor], strict: bool = False, source: Optional[str] = None) -> list[str]:
        """Copy values in by name; return the names loaded. ParamMismatch (one line) when a shape differs,
        or, `strict`, when a param of the job has no value in `tensors`; nothing is copied then.
        `source` (the checkpoint file) starts the message when given."""
        where = f"{source}: " if source else ""
        shared = [name for name in self.values if name in tensors]  # in the net's order: its first param is named first
        for name in shared:
            if tuple(tensors[name].shape) != self.info[name].shape:
                raise ParamMismatch(
                    f"{where}param {name!r} has shape {tuple(tensors[name].shape)} in the checkpoint and {self.info[name].shape} in this job's net"
                    " (a checkpoint of another net?)"
                )
        if strict and len(shared) != len(self.values):
            missing = [name for name in self.values if name not in tensors]
            raise ParamMismatch(
                f"{where}the checkpoint has no value for param{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing[:5]))}"
                f"{f' and {len(missing) - 5} more' if len(missing) > 5 else ''} of this job's net (a checkpoint of another net?)"
            )
        for name in shared:
            self.values[name].copy_(tensors[name])
        return shared

    def copy(self) -> "ParamStore":
        """A store with the same params and its own copy of their values."""
        return self.copy_to(self.device)

    @property
    def device(self) -> torch.device:
        """Where the values live (one device per store)."""
        return next(iter(self.values.values())).device if self.values else torch.device("cpu")

    def copy_to(self, device: torch.device) -> "ParamStore":
        """A replica of this store on `device` (same params, its own values there)."""
        other = ParamStore(self.allocate)
        other.info, other._owner = dict(self.info), dict(self._owner)
        other.values = {name: value.detach().to(device, copy=True) for name, value in self.values.items()}
        return other

    def move_to(self, device: torch.device) -> None:
        """Keep this store's values on `device` (before any net binds leaves to them)."""
        self.values = {name: value.to(device) for name, value in self.values.items()}
