"""Bounds on what a job file can make the parsers do: size, nesting, alias expansion.

A hostile or broken file must fail in one line, quickly: a YAML "billion
laughs" (aliases of aliases, each level multiplying the document) would make
every walk over the parsed data take hours, and deep nesting makes recursive
parsers (PyYAML's composer, protobuf's text format) die with a RecursionError.
Real jobs are a few kilobytes, a few levels deep, with a handful of aliases.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import yaml

from shoal.config.errors import JobError

MAX_JOB_BYTES = 16 * 2**20
MAX_NESTING = 64  # SINGA's deepest job nests 5 levels
MAX_NODES = 200_000  # values in the document once every alias is expanded

# text format tokens that matter for nesting: strings (skipped whole), comments, brackets
_TEXT_TOKEN = re.compile(r"""\#[^\n]*|"(?:[^"\\\n]|\\.)*"?|'(?:[^'\\\n]|\\.)*'?|[{}<>\[\]\n]""")
_OPENING, _CLOSING = "{<[", "}>]"


def read_job_text(path: Path) -> str:
    """A job file's text; a device (`/dev/zero`), a named pipe or a file over MAX_JOB_BYTES is refused.

    An anonymous pipe is read (`shoal run <(generate-job)`), up to the same bound:
    its writer is the user's own command, where a named pipe may never get one.
    """
    real = Path(os.path.realpath(path))  # a pipe of `<(...)` resolves to `pipe:[N]`, which does not exist
    if real.exists() and not real.is_file():
        raise JobError(str(path), "is not a regular file (a device, named pipe, socket or folder): a job is a file")
    with open(path, "rb") as f:
        data = f.read(MAX_JOB_BYTES + 1)
    if len(data) > MAX_JOB_BYTES:
        raise JobError(str(path), f"is over {MAX_JOB_BYTES // 2**20} MB: not a job file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        col = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        raise JobError(str(path), f"byte 0x{data[err.start]:02x} is not UTF-8 text: not a job file", line, col) from None


def check_text_nesting(text: str, source: str) -> None:
    """Refuse text format nested deeper than MAX_NESTING (`{`, `<`, `[`), at the bracket that goes too deep."""
    if text.count("{") + text.count("<") + text.count("[") <= MAX_NESTING:
        return  # cannot be too deep: the common case costs one pass of str.count
    depth, line, line_start = 0, 1, 0
    for m in _TEXT_TOKEN.finditer(text):
        token = m.group()
        if token == "\n":
            line, line_start = line + 1, m.end()
        elif token in _OPENING:
            depth += 1
            if depth > MAX_NESTING:
                raise JobError(source, f"nested deeper than {MAX_NESTING} levels", line, m.start() - line_start + 1)
        elif token in _CLOSING:
            depth = max(depth - 1, 0)


class _BoundedSafeLoader(yaml.SafeLoader):
    """PyYAML's safe loader (no Python tags) that counts nesting and the nodes aliases expand to."""

    def compose_document(self):
        self._depth, self._expanded = 0, 0
        self._sizes: dict[int, int] = {}  # id(node) -> values in it once expanded (absent: still being composed)
        return super().compose_document()

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            node = super().compose_node(parent, index)
            size = self._sizes.get(id(node))
            if size is None:
                raise yaml.composer.ComposerError(None, None, f"alias *{event.anchor} refers to a value that contains it", event.start_mark)
            self._count(size, event.start_mark, f"alias *{event.anchor}")
            return node
        self._depth += 1
        if self._depth > MAX_NESTING:
            raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_NESTING} levels", event.start_mark)
        node = super().compose_node(parent, index)
        self._depth -= 1
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [child for pair in node.value for child in pair]
        else:
            children = []
        self._sizes[id(node)] = 1 + sum(self._sizes[id(child)] for child in children)
        self._count(1, event.start_mark, "the document")
        return node

    def _count(self, size: int, mark, what: str) -> None:
        self._expanded += size
        if self._expanded > MAX_NODES:
            raise yaml.composer.ComposerError(
                None, None, f"{what} expands the document past {MAX_NODES} values (aliases of aliases?)", mark
            )


def load_yaml(text: str) -> tuple[yaml.Node | None, object]:
    """(the composed document, its data) through the bounded safe loader; yaml.YAMLError for anything refused."""
    loader = _BoundedSafeLoader(text)
    try:
        document = loader.get_single_node()
        data = loader.construct_document(document) if document is not None else None
    finally:
        loader.dispose()
    return document, data
