"""Where each field of a text-format job file sits (line, column).

protobuf's Python text_format reports positions only for syntax errors; the
validator needs them for semantic errors too ("srclayers names no layer").
This walks the file with protobuf's own tokenizer and records, for every
field occurrence, a key such as `neuralnet[0].layer[3].srclayers[1]`: every
segment carries its occurrence index, singular fields included.
"""
from __future__ import annotations

from google.protobuf import text_format

Position = tuple[int, int]  # 1-based line, column


def index_positions(text: str) -> dict[str, Position]:
    positions: dict[str, Position] = {}
    tok = text_format.Tokenizer(text.splitlines(keepends=True))
    path: list[str] = []
    counts: list[dict[str, int]] = [{}]
    try:
        while not tok.AtEnd():
            token = tok.token
            if token in ("}", ">"):
                if path:
                    path.pop()
                    counts.pop()
                tok.NextToken()
                continue
            if token in (";", ","):
                tok.NextToken()
                continue
            here = (tok._line + 1, tok._column + 1)
            name = token
            tok.NextToken()
            if tok.token == ":":
                tok.NextToken()
            if tok.token == "[":  # list syntax: name: [v1, v2]
                tok.NextToken()
                while not tok.AtEnd() and tok.token != "]":
                    if tok.token != ",":
                        index = counts[-1].get(name, 0)
                        counts[-1][name] = index + 1
                        positions[".".join(path + [f"{name}[{index}]"])] = (tok._line + 1, tok._column + 1)
                    tok.NextToken()
                tok.NextToken()
                continue
            index = counts[-1].get(name, 0)
            counts[-1][name] = index + 1
            segment = f"{name}[{index}]"
            positions[".".join(path + [segment])] = here
            if tok.token in ("{", "<"):
                path.append(segment)
                counts.append({})
            tok.NextToken()
    except text_format.ParseError:
        pass  # the real parse reports syntax errors with their own positions
    return positions


def lookup(positions: dict[str, Position] | None, key: str) -> Position | None:
    """Position of `key`, else of its nearest enclosing field that has one."""
    if not positions:
        return None
    parts = key.split(".")
    while parts:
        found = positions.get(".".join(parts))
        if found:
            return found
        parts.pop()
    return None
