"""Loading jobs: SINGA text format, YAML/JSON, Python dicts; then `--set` overrides and validation."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import yaml
from google.protobuf import text_format

from shoal.config import job_pb2
from shoal.config.dicts import parse_dict
from shoal.config.errors import JobError, no_such_field, no_such_value
from shoal.config.overrides import apply_overrides
from shoal.config.positions import SourceMap, text_positions, yaml_positions
from shoal.config.validate import ShapeCheck, validate

__all__ = ["apply_overrides", "job_from_dict", "job_from_text", "job_from_yaml", "load_job"]

YAML_SUFFIXES = (".yaml", ".yml", ".json")


def load_job(path: str | Path, overrides: Iterable[str] = (), shape_check: ShapeCheck | None = None) -> job_pb2.JobProto:
    """Parse, override and validate a job file: `.yaml/.yml/.json` as YAML, anything else as text format."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise JobError(str(path), "no such job file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise JobError(str(path), f"cannot read: {err}") from None
    parse = job_from_yaml if path.suffix.lower() in YAML_SUFFIXES else job_from_text
    return parse(text, str(path), shape_check, overrides, job_dir=path.resolve().parent)


def job_from_text(
    text: str,
    source: str = "job.conf",
    shape_check: ShapeCheck | None = None,
    overrides: Iterable[str] = (),
    job_dir: Path | None = None,
) -> job_pb2.JobProto:
    """A job from SINGA's protobuf text format (job.conf)."""
    job = job_pb2.JobProto()
    try:
        text_format.Parse(text, job, descriptor_pool=None)
    except text_format.ParseError as err:
        line, col = err.GetLine(), err.GetColumn()
        raise JobError(source, _tidy(str(err), text, line), line, col) from None
    return _finish(job, SourceMap(source, text_positions(text)), shape_check, overrides, job_dir)


def job_from_yaml(
    text: str,
    source: str = "job.yaml",
    shape_check: ShapeCheck | None = None,
    overrides: Iterable[str] = (),
    job_dir: Path | None = None,
) -> job_pb2.JobProto:
    """A job from YAML (or JSON) with the job.proto field names, e.g. `type: kInnerProduct`."""
    try:
        document = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise JobError(source, problem, mark.line + 1 if mark else None, mark.column + 1 if mark else None) from None
    sources = SourceMap(source, yaml_positions(document) if document is not None else {}, show_path=True)
    _reject_duplicate_keys(document, source)
    return _finish(parse_dict(data, sources), sources, shape_check, overrides, job_dir)


def job_from_dict(
    data: dict,
    source: str = "<python>",
    shape_check: ShapeCheck | None = None,
    overrides: Iterable[str] = (),
    job_dir: Path | None = None,
) -> job_pb2.JobProto:
    """A job from a Python dict shaped like the YAML form."""
    sources = SourceMap(source, show_path=True)
    return _finish(parse_dict(data, sources), sources, shape_check, overrides, job_dir)


def _finish(
    job: job_pb2.JobProto, sources: SourceMap, shape_check: ShapeCheck | None, overrides: Iterable[str], job_dir: Path | None
) -> job_pb2.JobProto:
    if job_dir is not None:
        job.job_dir = str(job_dir)
    for path, override in apply_overrides(job, overrides).items():
        sources.override(path, override)
    validate(job, sources, shape_check)
    return job


def _reject_duplicate_keys(node: yaml.Node | None, source: str) -> None:
    """YAML keeps the last of two equal keys; text-format users write `srclayers:` twice and mean both."""
    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _reject_duplicate_keys(item, source)
    if not isinstance(node, yaml.MappingNode):
        return
    seen = set()
    for key, value in node.value:
        if key.value in seen:
            mark = key.start_mark
            raise JobError(
                source,
                f"'{key.value}' is given twice; a repeated field takes a list: {key.value}: [a, b]",
                mark.line + 1,
                mark.column + 1,
            )
        seen.add(key.value)
        _reject_duplicate_keys(value, source)


def _tidy(message: str, text: str, line: int) -> str:
    """protobuf's ParseError text without its position and echoed line, in shoal's words."""
    message = re.sub(r"^\d+:\d+ : ", "", message)
    lines = text.split("\n")
    if 0 < line <= len(lines):
        echoed = repr(lines[line - 1]) + ": "
        message = message.removeprefix(echoed)
    m = re.match(r'Message type "shoal\.(\w+)" has no field named "(\w+)"', message)
    if m:
        message_type = job_pb2.DESCRIPTOR.message_types_by_name.get(m[1])
        return no_such_field(m[1], m[2], message_type.fields_by_name if message_type else ())
    m = re.match(r'Enum type "shoal\.([\w.]+)" has no value named (\w+)', message)
    if m:
        enum = _enum(m[1])
        return no_such_value(m[1].rpartition(".")[2], m[2], enum.values_by_name if enum else ())
    m = re.match(r'Message type "shoal\.(\w+)" should not have multiple "(\w+)" fields', message)
    if m:
        return f"{m[2]} is given twice, but {m[1]}.{m[2]} is not a repeated field"
    return message.rstrip(".")


def _enum(full_name: str):
    """The enum descriptor named `X` (top level) or `Message.X` (nested) in job.proto."""
    outer, _, inner = full_name.rpartition(".")
    if not outer:
        return job_pb2.DESCRIPTOR.enum_types_by_name.get(inner)
    message = job_pb2.DESCRIPTOR.message_types_by_name.get(outer)
    return message.enum_types_by_name.get(inner) if message else None
