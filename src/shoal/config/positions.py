"""Where each field of a job was written, so that any error can point at it.

protobuf reports positions only for syntax errors; validation needs them for
semantic ones too ("srclayers names no layer"). Positions are keyed by field
path as a user writes it: repeated fields carry an index, singular ones do not
(`neuralnet.layer[3].srclayers[1]`, `cluster.nworkers_per_group`); a plugin's
extension field is its bracketed name (`neuralnet.layer[0].[data_conf].path`).
A scalar's position is its value's; a message's is its name's.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import yaml
from google.protobuf import descriptor_pool
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from shoal.config import job_pb2
from shoal.config.errors import JobError

Position = tuple[int, int]  # 1-based line, column

# text format tokens, one line at a time (strings never span lines); comments dropped
_TOKEN = re.compile(r"""\s+|\#.*|"(?:[^"\\\n]|\\.)*"?|'(?:[^'\\\n]|\\.)*'?|[\w.+-]+|.""")


def enclosing(path: str) -> Iterator[str]:
    """`a.b[3].c` -> `a.b[3].c`, `a.b[3]`, `a.b`, `a`: the path, then every field around it."""
    while path:
        yield path
        path = path[: path.rindex("[")] if path.endswith("]") else path.rpartition(".")[0]


@dataclass
class SourceMap:
    """A job's origin: file name, field positions, and the fields `--set` overrides replaced."""

    source: str = "<python>"
    positions: dict[str, Position] = field(default_factory=dict)
    show_path: bool | None = None  # see JobError
    overridden: dict[str, str] = field(default_factory=dict)  # field path -> the override's text

    def override(self, path: str, text: str) -> None:
        """`path` now holds what `--set text` gave it: the file's positions inside it no longer apply."""
        stale = [p for p in self.positions if p == path or p.startswith((path + ".", path + "["))]
        for p in stale:
            del self.positions[p]
        self.overridden[path] = text

    def error(self, path: str, message: str) -> JobError:
        """A JobError at the nearest written place of `path` (itself, else the field around it)."""
        for candidate in enclosing(path):
            if candidate in self.overridden:
                return JobError(f"--set {self.overridden[candidate]}", message, field_path=path, show_path=False)
            if candidate in self.positions:
                line, col = self.positions[candidate]
                return JobError(self.source, message, line, col, field_path=path, show_path=self.show_path)
        return JobError(self.source, message, field_path=path)


def field_named(desc: Descriptor | None, name: str) -> FieldDescriptor | None:
    """`desc`'s field `name`, or the extension `[full.name]` a loaded plugin declares for it."""
    if desc is None:
        return None
    if not (name.startswith("[") and name.endswith("]")):
        return desc.fields_by_name.get(name)
    try:
        ext = descriptor_pool.Default().FindExtensionByName(name[1:-1])
    except KeyError:
        return None
    return ext if ext.containing_type is desc or ext.containing_type.full_name == desc.full_name else None


# -- text format -------------------------------------------------------------------
def text_positions(text: str) -> dict[str, Position]:
    """Positions of every field in a text-format job that protobuf has already parsed."""
    tokens = [
        (m.group(), (number, m.start() + 1))
        for number, line in enumerate(text.split("\n"), 1)  # lines as protobuf counts them
        for m in _TOKEN.finditer(line)
        if not m.group().isspace() and not m.group().startswith("#")
    ]
    indexer = _TextIndexer(tokens)
    indexer.message(job_pb2.JobProto.DESCRIPTOR, "", closing=None)
    return indexer.positions


class _TextIndexer:
    """Recursive descent over the tokens of valid text format, recording positions by field path."""

    def __init__(self, tokens: list[tuple[str, Position]]):
        self.tokens, self.i = tokens, 0
        self.positions: dict[str, Position] = {}

    def peek(self) -> str | None:
        return self.tokens[self.i][0] if self.i < len(self.tokens) else None

    def take(self) -> tuple[str, Position]:
        """The next token; past the end an empty one, so a surprise ends the walk instead of raising."""
        self.i += 1
        return self.tokens[self.i - 1] if self.i <= len(self.tokens) else ("", (0, 0))

    def message(self, desc: Descriptor | None, prefix: str, closing: str | None) -> None:
        counts: dict[str, int] = {}
        while self.peek() not in (None, closing):
            name, name_at = self.take()
            if name in (";", ","):
                continue
            if name == "[":  # an extension: [data_conf] { ... }
                parts = []
                while self.peek() not in (None, "]"):
                    parts.append(self.take()[0])
                self.take()
                name = "[" + "".join(parts) + "]"
            fd = field_named(desc, name)
            self.positions.setdefault(prefix + name, name_at)
            if self.peek() == ":":
                self.take()
            if self.peek() == "[":  # list syntax: name: [v1, v2] or name: [{...}, {...}]
                self.take()
                while self.peek() not in (None, "]"):
                    if self.peek() == ",":
                        self.take()
                    else:
                        self.value(fd, self._path(fd, prefix, name, counts), self.tokens[self.i][1])
                self.take()
            else:
                self.value(fd, self._path(fd, prefix, name, counts), name_at)
        if closing is not None and self.peek() == closing:
            self.take()

    def value(self, fd, path: str, name_at: Position) -> None:
        token, at = self.take()
        if token in ("{", "<"):
            self.positions[path] = name_at
            self.message(fd.message_type if fd else None, path + ".", "}" if token == "{" else ">")
            return
        self.positions[path] = at
        while (self.peek() or "x")[0] in "\"'":  # adjacent string literals concatenate
            self.take()

    @staticmethod
    def _path(fd, prefix: str, name: str, counts: dict[str, int]) -> str:
        if fd is None or not fd.is_repeated:
            return prefix + name
        counts[name] = counts.get(name, 0) + 1
        return f"{prefix}{name}[{counts[name] - 1}]"


# -- YAML --------------------------------------------------------------------------
def yaml_positions(document: yaml.Node) -> dict[str, Position]:
    """Positions of every field in a composed YAML document (a scalar given for a repeated field is its [0])."""
    positions: dict[str, Position] = {}
    _index_mapping(document, job_pb2.JobProto.DESCRIPTOR, "", positions)
    return positions


def _index_mapping(node: yaml.Node, desc: Descriptor | None, prefix: str, positions: dict[str, Position]) -> None:
    if not isinstance(node, yaml.MappingNode):
        return
    for key, value in node.value:
        name = str(key.value)
        fd = field_named(desc, name)
        sub = fd.message_type if fd else None
        positions.setdefault(prefix + name, _mark(key))
        if fd is not None and fd.is_repeated and isinstance(value, yaml.SequenceNode):
            for i, item in enumerate(value.value):
                positions[f"{prefix}{name}[{i}]"] = _mark(item)
                _index_mapping(item, sub, f"{prefix}{name}[{i}].", positions)
            continue
        path = f"{prefix}{name}[0]" if fd is not None and fd.is_repeated else prefix + name
        # a message's key, and the key of a field the schema lacks; otherwise the value
        positions[path] = _mark(key if fd is None or isinstance(value, yaml.MappingNode) else value)
        _index_mapping(value, sub, path + ".", positions)


def _mark(node: yaml.Node) -> Position:
    return node.start_mark.line + 1, node.start_mark.column + 1
