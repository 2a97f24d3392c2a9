"""Loading jobs: SINGA text format, YAML/JSON, Python dicts; then `--set` overrides and validation."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import yaml
from google.protobuf import descriptor_pool, text_format

from shoal.config import job_pb2
from shoal.config.dicts import parse_dict
from shoal.config.errors import JobError, did_you_mean, no_such_field, no_such_value
from shoal.config.inference import infer_vocab_sizes
from shoal.config.limits import check_text_nesting, load_yaml, read_job_text
from shoal.config.overrides import apply_overrides
from shoal.config.plugins import PluginError, extensions_of, load_job_plugins, load_plugins, loaded_plugins
from shoal.config.positions import SourceMap, text_positions, yaml_positions
from shoal.config.validate import ShapeCheck, validate

__all__ = ["apply_overrides", "cluster_of", "job_from_dict", "job_from_text", "job_from_yaml", "load_job"]

YAML_SUFFIXES = (".yaml", ".yml", ".json")


def load_job(path: str | Path, overrides: Iterable[str] = (), shape_check: ShapeCheck | None = None,
             plugins: Iterable[str | Path] = ()) -> job_pb2.JobProto:
    """Parse, override and validate a job file: `.yaml/.yml/.json` as YAML, anything else as text format.

    plugins: the ones the user gives (`--plugin`), loaded after the .proto plugins the job names
    (a user's .py imports the `_pb2` module of the job's .proto) and before its .py ones are checked.
    """
    path = Path(path)
    try:
        text = read_job_text(path)
    except FileNotFoundError:
        raise JobError(str(path), "no such job file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise JobError(str(path), f"cannot read: {err}") from None
    parse = job_from_yaml if path.suffix.lower() in YAML_SUFFIXES else job_from_text
    return parse(text, str(path), shape_check, overrides, job_dir=path.resolve().parent, plugins=plugins)


def cluster_of(path: str | Path, overrides: Iterable[str] = ()) -> job_pb2.ClusterProto | None:
    """A job file's cluster section with the `--set` overrides, read alone: no plugins loaded (their fields are
    skipped), nothing validated; None where that read fails (load_job names the problem). For what must be known
    before the job is loaded: how many processes `shoal run` will start."""
    path = Path(path)
    try:
        text = read_job_text(path)
        if path.suffix.lower() in YAML_SUFFIXES:
            data = load_yaml(text)[1]
            job = parse_dict({"cluster": data["cluster"]} if isinstance(data, dict) and "cluster" in data else {},
                             SourceMap(str(path)))
        else:
            check_text_nesting(text, str(path))  # protobuf's parser recurses per level
            job = job_pb2.JobProto()
            text_format.Parse(text, job, allow_unknown_extension=True, allow_unknown_field=True)
        apply_overrides(job, [o for o in overrides if o.startswith("cluster.")])
    except (OSError, UnicodeDecodeError, yaml.YAMLError, text_format.ParseError, JobError, ValueError, TypeError):
        return None
    return job.cluster


def job_from_text(
    text: str,
    source: str = "job.conf",
    shape_check: ShapeCheck | None = None,
    overrides: Iterable[str] = (),
    job_dir: Path | None = None,
    plugins: Iterable[str | Path] = (),
) -> job_pb2.JobProto:
    """A job from SINGA's protobuf text format (job.conf)."""
    check_text_nesting(text, source)  # protobuf's parser recurses per level
    _load_named_plugins(_plugins_named_in_text(text), source, lambda: text_positions(text), job_dir, plugins)
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
    plugins: Iterable[str | Path] = (),
) -> job_pb2.JobProto:
    """A job from YAML (or JSON) with the job.proto field names, e.g. `type: kInnerProduct`."""
    try:
        document, data = load_yaml(text)  # safe, with nesting and alias expansion bounded
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise JobError(source, problem, mark.line + 1 if mark else None, mark.column + 1 if mark else None) from None
    _reject_duplicate_keys(document, source)
    positions = lambda: yaml_positions(document) if document is not None else {}  # noqa: E731 (again once plugins add extensions)
    _load_named_plugins(_plugins_named_in_data(data), source, positions, job_dir, plugins, show_path=True)
    sources = SourceMap(source, positions(), show_path=True)
    return _finish(parse_dict(data, sources), sources, shape_check, overrides, job_dir)


def job_from_dict(
    data: dict,
    source: str = "<python>",
    shape_check: ShapeCheck | None = None,
    overrides: Iterable[str] = (),
    job_dir: Path | None = None,
    plugins: Iterable[str | Path] = (),
) -> job_pb2.JobProto:
    """A job from a Python dict shaped like the YAML form."""
    _load_named_plugins(_plugins_named_in_data(data), source, dict, job_dir, plugins, show_path=True)
    sources = SourceMap(source, show_path=True)
    return _finish(parse_dict(data, sources), sources, shape_check, overrides, job_dir)


def _finish(
    job: job_pb2.JobProto, sources: SourceMap, shape_check: ShapeCheck | None, overrides: Iterable[str], job_dir: Path | None
) -> job_pb2.JobProto:
    if job_dir is not None:
        job.job_dir = str(job_dir)
    for path, override in apply_overrides(job, overrides).items():
        sources.override(path, override)
    base_dirs = [job_dir] if job_dir is not None else []
    resolved = []
    for i, name in enumerate(job.plugin):  # (again: `--set plugin=...` may add one)
        try:
            resolved += load_job_plugins([name], base_dirs)
        except PluginError as err:
            raise sources.error(f"plugin[{i}]", f'plugin "{name}": {err.message}') if err.source == name else err from None
    # every plugin of this process, resolved: the processes it spawns load the same ones
    job.plugin[:] = list(dict.fromkeys(resolved + loaded_plugins()))
    infer_vocab_sizes(job, sources, base_dirs, required=shape_check is not None)
    validate(job, sources, shape_check)
    return job


def _plugins_named_in_text(text: str) -> list[str]:
    """The `plugin` fields of a job.conf, read before the plugins' extensions are known."""
    if "plugin" not in text:
        return []
    probe = job_pb2.JobProto()
    try:
        text_format.Parse(text, probe, allow_unknown_extension=True)
    except text_format.ParseError:
        return []  # the real parse reports it, with its position
    return list(probe.plugin)


def _plugins_named_in_data(data) -> list[str]:
    names = data.get("plugin", []) if isinstance(data, dict) else []
    names = names if isinstance(names, list) else [names]
    return [name for name in names if isinstance(name, str)]  # parse_dict reports anything else


def _load_named_plugins(names: list[str], source: str, positions, job_dir: Path | None, given: Iterable[str | Path] = (),
                        show_path: bool | None = None) -> None:
    """Load the plugins a job names before parsing it; a missing file or a refused .py is an error at its `plugin` field.

    Its .proto plugins first, then the ones the user gives (`given`: code may run), then its .py ones, which
    must be among those given.
    """
    is_module = [name.endswith(".py") for name in names]
    _load_job_plugins_at([(i, n) for i, n in enumerate(names) if not is_module[i]], source, positions, job_dir, show_path)
    load_plugins(given)
    _load_job_plugins_at([(i, n) for i, n in enumerate(names) if is_module[i]], source, positions, job_dir, show_path)


def _load_job_plugins_at(named: list[tuple[int, str]], source: str, positions, job_dir: Path | None, show_path: bool | None) -> None:
    for i, name in named:
        try:
            load_job_plugins([name], [job_dir] if job_dir is not None else [])
        except PluginError as err:
            if err.source != name:  # the plugin's own error: its file and position
                raise
            raise SourceMap(source, positions(), show_path=show_path).error(f"plugin[{i}]", f'plugin "{name}": {err.message}') from None


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
    pool = descriptor_pool.Default()
    m = re.match(r'Message type "([\w.]+)" has no field named "(\w+)"', message)
    if m:
        desc = _find(pool.FindMessageTypeByName, m[1])
        return no_such_field(_short(m[1]), m[2], desc.fields_by_name if desc else ())
    m = re.match(r'Enum type "([\w.]+)" has no value named (\w+)', message)
    if m:
        enum = _find(pool.FindEnumTypeByName, m[1])
        return no_such_value(_short(m[1]), m[2], enum.values_by_name if enum else ())
    m = re.match(r'Message type "([\w.]+)" should not have multiple "([\w.\[\]]+)" fields', message)
    if m:
        return f"{m[2]} is given twice, but {_short(m[1])}.{m[2]} is not a repeated field"
    m = re.match(r'Extension "([\w.]+)" not registered', message)
    if m:
        known = {name for desc in _EXTENDABLE for name in extensions_of(desc)}
        hint = f"; loaded: {', '.join(f'[{k}]' for k in sorted(known))}" if known else ""
        return (
            f"no loaded plugin declares the extension [{m[1]}]{did_you_mean(m[1], known)}"
            f' (load the .proto that does: --plugin layers.proto, or plugin: "layers.proto" in the job){hint}'
        )
    m = re.match(r'Message type "([\w.]+)" does not have extensions', message)
    if m:
        return f"{_short(m[1])} has no extension range: only {', '.join(d.name for d in _EXTENDABLE)} can be extended"
    return message.rstrip(".")


# the messages of job.proto that declare extension ranges (SINGA's)
_EXTENDABLE = [desc for desc in job_pb2.DESCRIPTOR.message_types_by_name.values() if desc.extension_ranges]


def _find(lookup, full_name: str):
    try:
        return lookup(full_name)
    except KeyError:
        return None


def _short(full_name: str) -> str:
    """`singa.LayerProto` -> `LayerProto`, `singa.PoolingProto.PoolMethod` -> `PoolMethod`: the names users write."""
    return full_name.removeprefix(job_pb2.DESCRIPTOR.package + ".").rpartition(".")[2]
