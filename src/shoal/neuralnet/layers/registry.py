"""Layer types registered by SINGA enum name, plus user layers by user_type."""
from __future__ import annotations

from typing import Callable, Optional, TypeVar

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
        if not (isinstance(cls, type) and issubclass(cls, Layer)):
            raise TypeError(f"register_layer({user_type!r}): {cls!r} is not a subclass of shoal's Layer")
        _USER[user_type] = cls
        return cls

    return wrap


def register_layer(user_type: str, cls: Optional[L] = None):
    """A user layer class for `user_type: "Foo"` (SINGA's RegisterLayer): `register_layer("Foo", Foo)`,
    or `@register_layer("Foo")` on the class. A later registration of the same name replaces it."""
    if not user_type or not isinstance(user_type, str):
        raise ValueError(f"register_layer: user_type must be a non-empty string, got {user_type!r}")
    return register_user_layer(user_type) if cls is None else register_user_layer(user_type)(cls)


def layer_class(conf: job_pb2.LayerProto) -> type[Layer]:
    """The class for a layer conf; KeyError with a readable message if none."""
    if conf.type == job_pb2.kUserLayer:
        if conf.user_type not in _USER:
            known = f" (registered: {', '.join(sorted(_USER))})" if _USER else ""
            raise KeyError(
                f"no user layer registered as {conf.user_type!r}{known}; load the plugin that registers it"
                " (the job's plugin field, or shoal run --plugin)"
            )
        return _USER[conf.user_type]
    if conf.type not in _BUILTIN:
        raise KeyError(f"layer type {job_pb2.LayerType.Name(conf.type)} is not supported")
    return _BUILTIN[conf.type]


def user_batch_size(conf: job_pb2.LayerProto) -> Optional[int]:
    """Rows per batch of a user input layer that reads its own data (its class's `batch_size(conf)`), else None."""
    batch_size = getattr(_USER.get(conf.user_type), "batch_size", None)
    return batch_size(conf) if batch_size is not None else None


def registered_user_types() -> list[str]:
    return sorted(_USER)


def registered_types() -> list[str]:
    return sorted(job_pb2.LayerType.Name(t) for t in _BUILTIN)
