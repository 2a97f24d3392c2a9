"""Layer types registered by SINGA enum name, plus user layers by user_type."""
from __future__ import annotations

from typing import Callable, TypeVar

from shoal.config import job_pb2

from shoal.neuralnet.layers.base import Layer

_BUILTIN: dict[int, type[Layer]] = {}
_USER: dict[str, type[Layer]] = {}

L = TypeVar("L", bound=type[Layer])


def register(*type_names: str) -> Callable[[L], L]:
    """Register a class for one or more SINGA LayerType names (aliases share a class)."""

    def wrap(cls: L) -> L:
        for name in type_names:
            _BUILTIN[job_pb2.LayerType.Value(name)] = cls
        return cls

    return wrap


def register_user_layer(user_type: str) -> Callable[[L], L]:
    """Decorator for kUserLayer classes: `layer { type: kUserLayer user_type: "Foo" }`."""

    def wrap(cls: L) -> L:
        _USER[user_type] = cls
        return cls

    return wrap


def layer_class(conf: job_pb2.LayerProto) -> type[Layer]:
    """The class for a layer conf; KeyError with a readable message if none."""
    if conf.type == job_pb2.kUserLayer:
        if conf.user_type not in _USER:
            raise KeyError(f"no user layer registered as {conf.user_type!r}")
        return _USER[conf.user_type]
    if conf.type not in _BUILTIN:
        raise KeyError(f"layer type {job_pb2.LayerType.Name(conf.type)} is not supported")
    return _BUILTIN[conf.type]


def registered_types() -> list[str]:
    return sorted(job_pb2.LayerType.Name(t) for t in _BUILTIN)
