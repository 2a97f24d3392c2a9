"""Errors in job files: always one line, naming the file and where in it."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from shoal.errors import ShoalError


class JobError(ShoalError):
    """A job that cannot run.

    `str()` is one line: `job.conf:12:5: message` when the position is known,
    else `job.yaml: neuralnet.layer[3].srclayers[0]: message`. `show_path`
    prints the field path next to a known position too (YAML puts several
    fields on one line); by default the path is shown only without a line.
    """

    def __init__(
        self,
        source: str,
        message: str,
        line: int | None = None,
        col: int | None = None,
        field_path: str | None = None,
        show_path: bool | None = None,
    ):
        message = " ".join(str(message).split("\n"))
        super().__init__(source, message, line, col, field_path, show_path)  # args make it picklable
        self.source, self.message = source, message
        self.line, self.col, self.field_path = line, col, field_path
        self.show_path = line is None if show_path is None else show_path

    def __str__(self) -> str:
        where = self.source
        if self.line is not None:
            where += f":{self.line}" + (f":{self.col}" if self.col is not None else "")
        if self.field_path and self.show_path:
            where += f": {self.field_path}"
        return f"{where}: {self.message}"


class JobShapeError(Exception):
    """Raised by a shape check (the net builder) with the field path of the layer that does not fit."""

    def __init__(self, field_path: str, message: str):
        super().__init__(field_path, message)
        self.field_path, self.message = field_path, message

    def __str__(self) -> str:
        return f"{self.field_path}: {self.message}"


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' (did you mean 'x'?)' when a choice is close to `word`, else ''."""
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def no_such_field(message_name: str, field: str, choices: Iterable[str]) -> str:
    return f"{message_name} has no field '{field}'" + did_you_mean(field, choices)


def no_such_value(enum_name: str, value: str, choices: Iterable[str]) -> str:
    return f"{enum_name} has no value '{value}'" + did_you_mean(value, choices)
