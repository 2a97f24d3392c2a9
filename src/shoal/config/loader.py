"""Loading jobs: SINGA text format, YAML/JSON, Python dicts, and `--set` overrides."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Optional, Union

import yaml
from google.protobuf import descriptor, json_format, text_format

from shoal.config import job_pb2
from shoal.config.errors import JobError
from shoal.config.positions import index_positions
from shoal.config.validate import validate

ShapeCheck = Optional[Callable[[job_pb2.JobProto], None]]
_SEGMENT = re.compile(r"^(\w+)(?:\[(\d+|name=[^\]]+)\])?$")


def _tidy_protobuf_message(message: str) -> str:
    # 'Message type "shoal.JobProto" has no field named "x".' -> 'JobProto has no field "x"'
    message = re.sub(r'^\d+:\d+ : ', "", message)
    message = re.sub(r'Message type "shoal\.(\w+)" has no field named "(\w+)"\.?', r'\1 has no field "\2"', message)
    message = re.sub(r'Enum type "shoal\.(\w+)" has no value named (\w+)\.?', r'\2 is not a \1', message)
    return message.rstrip(".")


def job_from_text(text: str, source: str = "job.conf", shape_check: ShapeCheck = None, overrides: list[str] = ()) -> job_pb2.JobProto:
    job = job_pb2.JobProto()
    try:
        text_format.Parse(text, job)
    except text_format.ParseError as err:
        raise JobError(source, _tidy_protobuf_message(str(err)), err.GetLine(), err.GetColumn()) from None
    apply_overrides(job, overrides)
    validate(job, index_positions(text), source=source, shape_check=shape_check)
    return job


def _listify_repeated(value, desc: descriptor.Descriptor):
    """Accept a scalar where a repeated field is expected, as text format does."""
    if not isinstance(value, dict):
        return value
    out = {}
    for key, item in value.items():
        field = desc.fields_by_name.get(key) or desc.fields_by_camelcase_name.get(key)
        if field is None:
            out[key] = item
            continue
        repeated = field.is_repeated
        if repeated and not isinstance(item, list):
            item = [item]
        if field.message_type is not None:
            item = [_listify_repeated(i, field.message_type) for i in item] if repeated else _listify_repeated(item, field.message_type)
        out[key] = item
    return out


def job_from_dict(data: dict, source: str = "<python>", shape_check: ShapeCheck = None, overrides: list[str] = ()) -> job_pb2.JobProto:
    if not isinstance(data, dict):
        raise JobError(source, f"a job is a mapping of fields, not {type(data).__name__}")
    job = job_pb2.JobProto()
    try:
        json_format.ParseDict(_listify_repeated(data, job_pb2.JobProto.DESCRIPTOR), job)
    except json_format.ParseError as err:
        raise JobError(source, _tidy_protobuf_message(str(err).splitlines()[0])) from None
    apply_overrides(job, overrides)
    validate(job, None, source=source, shape_check=shape_check)
    return job


def load_job(path: Union[str, Path], overrides: list[str] = (), shape_check: ShapeCheck = None) -> job_pb2.JobProto:
    """Parse and validate a job file; JobError (one line, positioned) on any problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise JobError(str(path), "no such job file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise JobError(str(path), f"cannot read: {err}") from None
    overrides = [f"job_dir={path.resolve().parent}", *overrides]
    if path.suffix.lower() in (".yaml", ".yml", ".json"):
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise JobError(str(path), problem, mark.line + 1 if mark else None, mark.column + 1 if mark else None) from None
        return job_from_dict(data or {}, source=str(path), shape_check=shape_check, overrides=list(overrides))
    return job_from_text(text, source=str(path), shape_check=shape_check, overrides=list(overrides))


# -- overrides ------------------------------------------------------------------
def _parse_scalar(field: descriptor.FieldDescriptor, text: str, where: str):
    t = field.type
    FD = descriptor.FieldDescriptor
    try:
        if t == FD.TYPE_ENUM:
            enum = field.enum_type
            return enum.values_by_name[text].number if text in enum.values_by_name else enum.values_by_number[int(text)].number
        if t == FD.TYPE_BOOL:
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return text.lower() in ("true", "1")
        if t in (FD.TYPE_FLOAT, FD.TYPE_DOUBLE):
            return float(text)
        if t in (FD.TYPE_STRING,):
            return text
        if t == FD.TYPE_BYTES:
            return text.encode()
        return int(text)
    except (KeyError, ValueError):
        raise JobError("--set", f"{where}: {text!r} is not a valid value for {field.name}") from None


def _top_level_equals(text: str) -> int:
    """Index of the first '=' outside [...] (selectors like layer[name=fc1] contain one)."""
    depth = 0
    for i, ch in enumerate(text):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "=" and depth == 0:
            return i
    return -1


def apply_overrides(job: job_pb2.JobProto, overrides: list[str]) -> None:
    """Apply `path.to.field=value` overrides in order (before validation)."""
    for override in overrides:
        split_at = _top_level_equals(override)
        if split_at < 0:
            raise JobError("--set", f"{override}: expected FIELD=VALUE")
        path, value = override[:split_at], override[split_at + 1 :]
        where = f"--set {override}"
        msg = job
        segments = path.strip().split(".")
        for i, segment in enumerate(segments):
            m = _SEGMENT.match(segment)
            if not m:
                raise JobError(where, f"cannot read field path segment {segment!r}")
            name, selector = m.group(1), m.group(2)
            field = msg.DESCRIPTOR.fields_by_name.get(name)
            if field is None:
                raise JobError(where, f"{msg.DESCRIPTOR.name} has no field {name!r}")
            repeated = field.is_repeated
            last = i == len(segments) - 1
            if field.message_type is not None:
                if last:
                    raise JobError(where, f"{name} is a message; set one of its fields")
                if repeated:
                    items = getattr(msg, name)
                    if selector is None:
                        raise JobError(where, f"{name} is repeated: say which, e.g. {name}[0] or {name}[name=...]")
                    if selector.startswith("name="):
                        wanted = selector[5:]
                        matches = [it for it in items if getattr(it, "name", None) == wanted]
                        if not matches:
                            raise JobError(where, f"no {name} named {wanted!r}")
                        msg = matches[0]
                    else:
                        index = int(selector)
                        if index >= len(items):
                            raise JobError(where, f"{name}[{index}] does not exist ({len(items)} given)")
                        msg = items[index]
                else:
                    msg = getattr(msg, name)
                continue
            if not last:
                raise JobError(where, f"{name} is not a message")
            if repeated:
                target = getattr(msg, name)
                values = [_parse_scalar(field, v.strip(), where) for v in value.split(",") if v.strip()]
                if selector is not None and not selector.startswith("name="):
                    index = int(selector)
                    if index >= len(target):
                        raise JobError(where, f"{name}[{index}] does not exist ({len(target)} given)")
                    target[index] = values[0]
                else:
                    del target[:]
                    target.extend(values)
            else:
                setattr(msg, name, _parse_scalar(field, value.strip(), where))
