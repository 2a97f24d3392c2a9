"""`shoal ARGS` run in the test's own process: what a shell would see (exit status, stdout, stderr), without starting
an interpreter and importing torch again (a fraction of a second instead of several).

For the many tests that only check how the CLI refuses or reports something. Each test file keeps at least one
case through a real `python -m shoal` process, which is what proves there is no traceback at the interpreter's
level; a call that does not return within `timeout` fails the test instead of hanging the suite.
"""
from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
from pathlib import Path
from typing import Mapping, Optional

from shoal.frontend.cli import main


class CliTimedOut(AssertionError):
    pass


@contextlib.contextmanager
def _deadline(seconds: float):
    def expired(signum, frame):
        raise CliTimedOut(f"the command did not return within {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def _environment(env: Optional[Mapping[str, str]]):
    if env is None:
        yield
        return
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def run_cli(*args, cwd: Optional[Path] = None, env: Optional[Mapping[str, str]] = None,
            timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `shoal ARGS` here, in `cwd` with `env`; the result as subprocess.run(capture_output=True, text=True) gives it."""
    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    try:
        with _environment(env), _deadline(timeout), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            if cwd is not None:
                os.chdir(cwd)
            try:
                code = main(argv)
            except SystemExit as exit_:  # argparse's usage errors
                code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 2)
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(["shoal", *argv], code, out.getvalue(), err.getvalue())


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """The one line a refused command prints (exit status 2, no traceback): what every bad-input test checks."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]
