"""A rank's line reaches a shared terminal whole: torchrun's and srun's ranks write to one stdout, unbuffered, so a line
written as two writes (print's text, then its newline) can take another rank's line inside it. Every way a rank says
a line (its chief's log, another rank's, a line for the job's terminal too) writes it in one write."""
from __future__ import annotations

import io
import sys

import pytest

from shoal.launcher.ranks import chief_log
from shoal.report import terminal


class Writes(io.StringIO):
    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return super().write(text)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_ranks_line_is_one_write_on_its_stdout(monkeypatch, rank):
    stdout, log_file = Writes(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", stdout)
    chief_log(rank, log_file)("Process 1 rejoined at step 21 (restart 1)")
    assert stdout.calls == ["Process 1 rejoined at step 21 (restart 1)\n"]
    assert log_file.getvalue() == ("Process 1 rejoined at step 21 (restart 1)\n" if rank == 0 else "")


def test_a_line_for_the_jobs_terminal_too_is_one_write(monkeypatch):
    terminal_out, own_log = Writes(), io.StringIO()
    monkeypatch.setattr(sys, "__stdout__", terminal_out)
    monkeypatch.setattr(sys, "stdout", own_log)  # (a process of shoal's launcher: its stdout is its log file)
    terminal.also_on_the_terminal("Process 1 took the chief's place after step 13")
    assert terminal_out.calls == ["Process 1 took the chief's place after step 13\n"]
