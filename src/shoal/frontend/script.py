"""`shoal run script.py`: a user program run in the cluster the command line sets (SINGA's `singa-run.sh -exec`).

The script runs as `python script.py ARGS` would: `__name__ == "__main__"`, its folder first on
sys.path, sys.argv = [script, ARGS...]. While it runs, every job it trains or tests, whether
through shoal.frontend.keras (`fit`, `evaluate`), shoal.train / shoal.evaluate or shoal.fit, gets the
command line's settings on top of the script's own values:

- `--set FIELD=VALUE` overrides (e.g. cluster.nworkers_per_group=2, train_steps=100),
- `--workspace DIR`: the job's workspace (as `--set cluster.workspace=DIR`, and it wins over a
  workspace the script passes to shoal.train),
- `--resume`: each job continues from its workspace's newest checkpoint.

`shoal plan script.py` runs the script the same way up to its first training call (shoal.fit,
shoal.train, a Keras-like model's fit): that call's job is planned (and estimated) instead of
trained, and the script stops there.

Layouts of several processes start them with torch.multiprocessing's spawn, which imports the
script in each child: as for any such program, the script's work must sit under
`if __name__ == "__main__":`.
"""
from __future__ import annotations

import runpy
import sys
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional

from shoal.config import job_pb2
from shoal.config.overrides import apply_overrides
from shoal.errors import ShoalError, first_line

if TYPE_CHECKING:
    from shoal.planning.plan import JobPlan


class ScriptError(ShoalError, ValueError):
    """The script is missing or failed: one line naming the file and line."""


class PlanReached(BaseException):
    """`shoal plan script.py`: the script's first training call was planned instead of run; the script stops here
    (a BaseException, so that a script's own `except Exception` does not go on without the job it asked for)."""


@dataclass(frozen=True)
class ScriptSettings:
    overrides: tuple[str, ...] = ()
    workspace: Optional[Path] = None
    resume: bool = False
    # `shoal plan script.py`: what to do with the first job (and the JobPlan that runs it, where that is not the job's
    # own: shoal.fit's loop on the session)
    plan: Optional[Callable[[job_pb2.JobProto, Optional[JobPlan]], None]] = None

    @classmethod
    def from_command_line(cls, overrides: list[str], workspace: Optional[Path], resume: bool) -> ScriptSettings:
        # the workspace also goes in the job, so a model's evaluate() finds the checkpoints fit() wrote
        workspace_set = [f"cluster.workspace={workspace}"] if workspace is not None else []
        return cls(tuple(overrides) + tuple(workspace_set), workspace, resume)


_ACTIVE: Optional[ScriptSettings] = None
_RUNNING: Optional[tuple[Path, tuple[str, ...]]] = None  # the script `shoal run` runs and its arguments
_AT_END: list[Callable[[bool], None]] = []  # what runs when the running script ends (shoal.session's end of the run)


def settings() -> Optional[ScriptSettings]:
    """The command line's settings while `shoal run script.py` (or `shoal plan script.py`) runs a script, else None."""
    return _ACTIVE


def running_path() -> Optional[Path]:
    """The script `shoal run` is running (None outside it): shoal.session starts it again in each rank."""
    return _RUNNING[0] if _RUNNING else None


def running_argv() -> tuple[str, ...]:
    return _RUNNING[1] if _RUNNING else ()


def at_script_end(fn: Callable[[bool], None]) -> None:
    """Call `fn(failed)` when the script `shoal run` is running ends, however it ends (nothing outside a script); failed:
    it raised (its own sys.exit is not a failure here: the status is the script's)."""
    if _RUNNING is not None:
        _AT_END.append(fn)


def overrides() -> tuple[str, ...]:
    return _ACTIVE.overrides if _ACTIVE else ()


def applied(job: job_pb2.JobProto) -> job_pb2.JobProto:
    """The job with the command line's overrides applied (a copy), or the job itself outside `shoal run script.py`."""
    if not overrides():
        return job
    out = job_pb2.JobProto()
    out.CopyFrom(job)
    apply_overrides(out, overrides())
    return out


def workspace(given: Optional[Path]) -> Optional[Path]:
    """--workspace wins over the workspace the script passes."""
    return _ACTIVE.workspace if _ACTIVE and _ACTIVE.workspace is not None else given


def plan_instead(job: job_pb2.JobProto, runs: Optional[JobPlan] = None) -> None:
    """Under `shoal plan script.py`: plan `job` (the script's first training call) and stop the script; else nothing.
    `runs`: the plan that runs it where that is not `job`'s own (shoal.fit's loop on the session: `job` is its module's,
    which --estimate counts the FLOPs and bytes of)."""
    if _ACTIVE is not None and _ACTIVE.plan is not None:
        _ACTIVE.plan(job, runs)
        raise PlanReached


def resume(given: bool) -> bool:
    return given or bool(_ACTIVE and _ACTIVE.resume)


@contextmanager
def _running(path: Path, argv: list[str], settings: ScriptSettings) -> Iterator[None]:
    global _ACTIVE, _RUNNING
    saved = (_ACTIVE, _RUNNING, sys.argv, list(sys.path))
    _ACTIVE, _RUNNING, sys.argv = settings, (path, tuple(argv)), [str(path)] + list(argv)
    sys.path.insert(0, str(path.resolve().parent))
    ending, failed = len(_AT_END), True
    try:
        yield
        failed = False
    finally:
        ended, _AT_END[ending:] = _AT_END[ending:], []
        try:
            for fn in reversed(ended):  # the last registered first
                fn(failed)
        finally:
            _ACTIVE, _RUNNING, sys.argv, sys.path[:] = saved


def run_script(path: Path, argv: list[str], settings: ScriptSettings, expected: tuple[type[BaseException], ...] = ()) -> int:
    """Run the script; its exit status. `expected` errors (shoal's one-line errors) pass through;
    any other failure becomes a ScriptError naming the script's line where it happened."""
    if not path.is_file():
        raise ScriptError(f"{path}: no such script")
    with _running(path, argv, settings):
        try:
            runpy.run_path(str(path), run_name="__main__")
        except SystemExit as done:
            return _exit_status(done.code)
        except PlanReached:
            return 0
        except SyntaxError as err:
            raise ScriptError(f"{err.filename}:{err.lineno}: SyntaxError: {err.msg}") from None
        except expected:
            raise
        except Exception as err:  # noqa: BLE001 (a user program's failure, reported in one line)
            said = first_line(str(err))
            raise ScriptError(f"{_where(err, path)}: {type(err).__name__}" + (f": {said}" if said else "")) from None
    return 0


def _exit_status(code) -> int:
    """sys.exit's argument as a status, as Python's own exit does (a message is printed, status 1)."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def _where(err: BaseException, path: Path) -> str:
    """file:line of the script's innermost frame in the traceback (the script itself if none)."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if Path(f.filename).resolve() == path.resolve()]
    return f"{path}:{frames[-1].lineno}" if frames else str(path)
