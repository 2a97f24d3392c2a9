"""Errors in job files: always one line, pointing at the file and position or field."""
from __future__ import annotations

from typing import Optional


class JobError(ValueError):
    """A job that cannot run, located as `file:line:col: message` or `file: field.path: message`."""

    def __init__(self, source: str, message: str, line: Optional[int] = None, col: Optional[int] = None, field_path: Optional[str] = None):
        self.source = source
        self.message = message
        self.line = line
        self.col = col
        self.field_path = field_path
        super().__init__(str(self))

    def __str__(self) -> str:
        where = self.source
        if self.line is not None:
            where += f":{self.line}" + (f":{self.col}" if self.col is not None else "")
        elif self.field_path:
            where += f": {self.field_path}"
        return f"{where}: {self.message}"


class JobShapeError(ValueError):
    """Raised by shape checking (the net builder) with the field path of the offending layer."""

    def __init__(self, field_path: str, message: str):
        super().__init__(f"{field_path}: {message}")
        self.field_path = field_path
        self.message = message
