"""A job as plain data (parsed YAML/JSON, or a Python dict) -> JobProto.

json_format.ParseDict does the conversion. First the data is checked against
the schema, so that every mistake is reported with its field path (and its
YAML position): unknown fields, enum names, values of the wrong kind. The
check also mirrors text format where YAML users expect it: a scalar given for
a repeated field is a one-element list, and `1e-3` (a string to YAML 1.1) is a
number where the field wants one.
"""

from __future__ import annotations

import math
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from shoal.config import job_pb2
from shoal.config.errors import no_such_field, no_such_value
from shoal.config.positions import SourceMap, field_named

_FLOATS = (FieldDescriptor.CPPTYPE_FLOAT, FieldDescriptor.CPPTYPE_DOUBLE)
_INTS = {  # cpp type -> the range it holds
    FieldDescriptor.CPPTYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.CPPTYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.CPPTYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.CPPTYPE_UINT64: (0, 2**64 - 1),
}


def parse_dict(data: Any, sources: SourceMap) -> job_pb2.JobProto:
    """The JobProto `data` describes; JobError (with field path) for anything the schema does not allow."""
    job = job_pb2.JobProto()
    clean = _message(data if data is not None else {}, job.DESCRIPTOR, "", sources)
    try:
        json_format.ParseDict(clean, job)
    except json_format.ParseError as err:  # e.g. an integer out of int32 range
        raise sources.error("", str(err).splitlines()[0]) from None
    return job


def _message(data: Any, desc: Descriptor, path: str, sources: SourceMap) -> dict:
    if not isinstance(data, dict):
        raise sources.error(path, f"expected a mapping of {desc.name} fields, got {_kind(data)}")
    clean = {}
    for name, value in data.items():
        at = f"{path}.{name}" if path else str(name)
        fd = field_named(desc, name) if isinstance(name, str) else None
        if fd is None and str(name).startswith("["):
            raise sources.error(at, f"{desc.name} has no extension {name}: no loaded plugin declares it for {desc.name}")
        if fd is None:
            raise sources.error(at, no_such_field(desc.name, str(name), desc.fields_by_name))
        if fd.is_repeated:
            items = value if isinstance(value, list) else [value]
            clean[name] = [_value(fd, item, f"{at}[{i}]", sources) for i, item in enumerate(items)]
        elif isinstance(value, list):
            raise sources.error(at, f"{name} is not repeated: give one value, not a list")
        else:
            clean[name] = _value(fd, value, at, sources)
    return clean


def _value(fd: FieldDescriptor, value: Any, at: str, sources: SourceMap) -> Any:
    if fd.message_type is not None:
        return _message({} if value is None else value, fd.message_type, at, sources)
    if fd.type == FieldDescriptor.TYPE_ENUM:
        values = fd.enum_type.values_by_name
        if (isinstance(value, str) and value in values) or (_is_int(value) and value in fd.enum_type.values_by_number):
            return value
        raise sources.error(at, no_such_value(fd.enum_type.name, str(value), values))
    if fd.type == FieldDescriptor.TYPE_BOOL and isinstance(value, bool):
        return value
    if fd.cpp_type == FieldDescriptor.CPPTYPE_STRING and isinstance(value, str):
        return value
    if fd.cpp_type in _INTS:
        number = _number(value)
        if number is not None and float(number).is_integer():
            low, high = _INTS[fd.cpp_type]
            if not low <= int(number) <= high:
                raise sources.error(at, f"{fd.name} takes an integer in [{low}, {high}], not {int(number)}")
            return int(number)
    if fd.cpp_type in _FLOATS:
        number = _number(value)
        if number is not None:
            if not math.isfinite(number):  # YAML's .nan / .inf
                raise sources.error(at, f"{fd.name} must be a finite number, got {number}")
            return float(number)
    wanted = {FieldDescriptor.CPPTYPE_BOOL: "true or false", FieldDescriptor.CPPTYPE_STRING: "a string"}
    expected = wanted.get(fd.cpp_type, "an integer" if fd.cpp_type in _INTS else "a number")
    raise sources.error(at, f"{fd.name} takes {expected}, not {_kind(value)} {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any):
    """`value` as int or float, accepting numeric strings; None if it is not a number."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            try:
                return float(value)
            except ValueError:
                return None
    return None


def _kind(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", type(None): "nothing"}.get(
        type(value), type(value).__name__
    )
