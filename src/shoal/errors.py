"""The one base of every error shoal reports to a user.

The CLI catches ShoalError and prints `str(err)`: one line, starting with where
the problem is (a file and position, or a field) when that is known. Errors
that are control flow inside the runtime (a group aborted because another
failed) are not ShoalErrors: they never reach a user as such.
"""
from __future__ import annotations


class ShoalError(Exception):
    """An error a user can act on; `str()` is one line.

    `source` names the file (or `<python>`), `line`/`col` a position in it and
    `field_path` the job field (e.g. `cluster.nworkers_per_group`), each when known.
    """

    source: str | None = None
    line: int | None = None
    col: int | None = None
    field_path: str | None = None


def warn(line: str) -> None:
    """A warning: one line on stderr (stdout carries the run's own lines, which scripts parse)."""
    import sys

    # one write of the line and its newline: processes share the terminal, and print's two writes (unbuffered under
    # PYTHONUNBUFFERED) let another process's line land between them
    sys.stderr.write((line if line.startswith("WARNING") else f"WARNING: {line}") + "\n")
    sys.stderr.flush()


def first_line(text: str) -> str:
    """The first line of an error's text that says something (a message may begin with a newline); '' if none does."""
    return next((line.strip() for line in text.splitlines() if line.strip()), "")
