"""The job's terminal, as a process of shoal's launcher sees it: the standard output it was started with (its own stdout
is its log file, logs/rank<R>.log). A line about the whole job (a process rejoined, a server healed, a successor took
the chief's place) goes there as well as to the process's log.

`shoal.fit` with a `log=` of its own (a quiet one, a logger) has no terminal: it relays the chief's log file to its log=,
and its ranks call `mute()` so that no rank, restarted ones included, writes to the caller's stdout behind its back.
"""
from __future__ import annotations

import sys

_muted = False


def mute() -> None:
    """This process's job has no terminal (shoal.fit's ranks with the caller's own log=)."""
    global _muted
    _muted = True


def write_line(line: str, file=None) -> None:
    """`print(line)` in one write: ranks that share a terminal (torchrun's, srun's) write it unbuffered, where print's
    separate write of the newline let another rank's line land inside this one."""
    (file or sys.stdout).write(line + "\n")


def also_on_the_terminal(line: str) -> None:
    """Say `line` on the job's terminal too, when this process has one apart from its stdout."""
    if not _muted and sys.__stdout__ is not None and sys.stdout is not sys.__stdout__:
        write_line(line, sys.__stdout__)
        sys.__stdout__.flush()
