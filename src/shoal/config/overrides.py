"""`--set path.to.field=value` overrides, applied to a parsed job before validation.

Paths use the job's field names; a repeated message is picked by index or by
name: `neuralnet.layer[2].innerproduct_conf.num_output=10`,
`neuralnet.layer[name=fc1].innerproduct_conf.num_output=10`. A repeated scalar
takes a comma-separated list (`gpu=0,1`) or one element (`gpu[1]=3`). A plugin's
extension is its bracketed name: `neuralnet.layer[name=data].[data_conf].max_window=5`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from google.protobuf import message as pb_message
from google.protobuf.descriptor import FieldDescriptor

from shoal.config.errors import JobError, no_such_field, no_such_value
from shoal.config.positions import field_named

_SEGMENT = re.compile(r"(\w+)(?:\[(\d+|name=[^\]]*)\])?$")
_TRUE, _FALSE = ("true", "t", "1"), ("false", "f", "0")


def apply_overrides(job: pb_message.Message, overrides: Iterable[str]) -> dict[str, str]:
    """Apply the overrides in order; returns {field path set: override text} so errors can name the override."""
    applied = {}
    for override in overrides:
        path, value = _split(override)
        applied[_apply(job, path, value, override)] = override
    return applied


def _split(override: str) -> tuple[str, str]:
    depth = 0
    for i, ch in enumerate(override):  # the first '=' outside [...]: selectors hold one
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "=" and depth == 0:
            return override[:i].strip(), override[i + 1 :].strip()
    raise JobError(f"--set {override}", "expected FIELD=VALUE, e.g. cluster.nworkers_per_group=2")


def _apply(msg: pb_message.Message, path: str, value: str, override: str) -> str:
    """Set `path` in `msg`; returns the path with name selectors resolved to indices."""

    def fail(message: str) -> JobError:
        return JobError(f"--set {override}", message)

    segments, resolved = re.split(r"\.(?![^\[]*\])", path), []  # dots inside [name=...] do not split
    for n, segment in enumerate(segments):
        if segment.startswith("[") and segment.endswith("]"):  # a plugin's extension: [data_conf]
            msg = _extension(msg, segment, value, n == len(segments) - 1, fail)
            resolved.append(segment)
            continue
        m = _SEGMENT.match(segment)
        if not m:
            raise fail(f"cannot read {segment!r}: expected name, name[index] or name[name=...]")
        name, selector = m.groups()
        fd = msg.DESCRIPTOR.fields_by_name.get(name)
        if fd is None:
            raise fail(no_such_field(msg.DESCRIPTOR.name, name, msg.DESCRIPTOR.fields_by_name))
        last = n == len(segments) - 1
        if fd.message_type is not None:
            if last:
                raise fail(f"{name} is a message: set one of its fields, e.g. {path}.{fd.message_type.fields[0].name}=...")
            if fd.is_repeated:
                index = _select(getattr(msg, name), name, selector, fail)
                msg = getattr(msg, name)[index]
                resolved.append(f"{name}[{index}]")
            else:
                msg = getattr(msg, name)
                resolved.append(name)
            continue
        if not last:
            raise fail(f"{name} is not a message, so it has no field {segments[n + 1]!r}")
        try:
            if fd.is_repeated and selector is None:
                values = [_parse(fd, item.strip(), fail) for item in value.split(",") if item.strip()]
                del getattr(msg, name)[:]
                getattr(msg, name).extend(values)
                resolved.append(name)
            elif fd.is_repeated:
                index = _select(getattr(msg, name), name, selector, fail)
                getattr(msg, name)[index] = _parse(fd, value, fail)
                resolved.append(f"{name}[{index}]")
            elif selector is not None:
                raise fail(f"{name} is not repeated: drop [{selector}]")
            else:
                setattr(msg, name, _parse(fd, value, fail))
                resolved.append(name)
        except (ValueError, TypeError) as err:  # protobuf's range checks, e.g. int32 overflow
            raise fail(f"{name}: {err}") from None
    return ".".join(resolved)


def _extension(msg: pb_message.Message, segment: str, value: str, last: bool, fail) -> pb_message.Message:
    """Step into the singular extension `segment` of `msg` (or set it, when it ends the path); the message to go on with."""
    fd = field_named(msg.DESCRIPTOR, segment)
    if fd is None:
        raise fail(f"{msg.DESCRIPTOR.name} has no extension {segment}: no loaded plugin declares it")
    if fd.is_repeated:
        raise fail(f"{segment} is repeated: --set takes singular extensions")
    if fd.message_type is not None:
        if last:
            raise fail(f"{segment} is a message: set one of its fields, e.g. {segment}.{fd.message_type.fields[0].name}=...")
        return msg.Extensions[fd]
    if not last:
        raise fail(f"{segment} is not a message, so it has no fields")
    msg.Extensions[fd] = _parse(fd, value, fail)
    return msg


def _select(items, name: str, selector, fail) -> int:
    if selector is None:
        raise fail(f"{name} is repeated: say which, e.g. {name}[0] or {name}[name=...]")
    if selector.startswith("name="):
        wanted = selector[len("name=") :]
        for index, item in enumerate(items):
            if getattr(item, "name", None) == wanted:
                return index
        raise fail(f'no {name} named "{wanted}"')
    index = int(selector)
    if index >= len(items):
        raise fail(f"{name}[{index}] does not exist: there are {len(items)}")
    return index


def _parse(fd: FieldDescriptor, text: str, fail):
    """`text` as a value of field `fd`: enum names (or numbers), true/false, numbers, strings."""
    try:
        if fd.type == FieldDescriptor.TYPE_ENUM:
            values = fd.enum_type.values_by_name
            if text in values:
                return values[text].number
            if text.lstrip("-").isdigit() and int(text) in fd.enum_type.values_by_number:
                return int(text)
            raise fail(no_such_value(fd.enum_type.name, text, values))
        if fd.type == FieldDescriptor.TYPE_BOOL:
            if text.lower() not in _TRUE + _FALSE:
                raise ValueError
            return text.lower() in _TRUE
        if fd.cpp_type in (FieldDescriptor.CPPTYPE_FLOAT, FieldDescriptor.CPPTYPE_DOUBLE):
            return float(text)
        if fd.cpp_type == FieldDescriptor.CPPTYPE_STRING:
            quoted = len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'"
            text = text[1:-1] if quoted else text
            return text.encode() if fd.type == FieldDescriptor.TYPE_BYTES else text
        return int(text)
    except ValueError:
        kind = {
            FieldDescriptor.TYPE_BOOL: "true or false",
            FieldDescriptor.TYPE_FLOAT: "a number",
            FieldDescriptor.TYPE_DOUBLE: "a number",
        }.get(fd.type, "an integer")
        raise fail(f"{fd.name} takes {kind}, not {text!r}") from None
