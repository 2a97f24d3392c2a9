"""`shoal plan --recommend`: settings derived from the prediction, each with its one-line reason. Pure.

Today the timeouts of a job over processes (docs/planning.md, "Recommended timeouts"): how long a
collective waits for a peer and how long a silent heartbeat is tolerated, as a fixed multiple of
the predicted time between two meetings of the processes, never under a floor; the rendezvous's,
which the step does not bound.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from shoal.planning.estimate import Estimate
from shoal.planning.plan import JobPlan

# the defaults live where they are read (shoal.comm.dist, shoal.comm.heartbeat, shoal.runtime.launch);
# tests/test_recommend.py checks these copies against them (planning may not import comm or runtime)
COMM_DEFAULT_S, STALL_DEFAULT_S, JOIN_DEFAULT_S = 45.0, 10.0, 600.0
# a collective waits for its slowest peer's step: 20 of them leave room for skew, a test or a checkpoint
# between steps on one rank; below the default (validated under load 10 on 2 cores) it never goes
COMM_STEPS, COMM_FLOOR_S = 20, COMM_DEFAULT_S
# heartbeats come from their own thread about once a second whatever the step; a few steps of silence
# (a process paused by swapping, a long collection) is not yet a stall, nor is less than the floor
STALL_STEPS, STALL_FLOOR_S = 3, STALL_DEFAULT_S


@dataclass(frozen=True)
class Recommendation:
    setting: str  # the environment variable `shoal run` reads
    value: float  # seconds
    default: float
    reason: str


def interval(plan: JobPlan) -> tuple[int, str]:
    """Steps between two meetings of the processes, and what such a meeting is called."""
    return plan.strategy.round_steps(plan.job.cluster)


def timeouts(plan: JobPlan, e: Estimate) -> list[Recommendation]:
    """The stall, collective and rendezvous timeouts for `plan`, whose prediction is `e` (none for one process)."""
    if plan.nprocs == 1:
        return []
    steps, what = interval(plan)
    between = steps * e.step_s
    span = f"the predicted {what} ({_seconds(between)})"
    comm = max(COMM_FLOOR_S, _whole_seconds(COMM_STEPS * between))
    stall = max(STALL_FLOOR_S, _whole_seconds(STALL_STEPS * between))
    return [
        Recommendation("SHOAL_COMM_TIMEOUT", comm, COMM_DEFAULT_S,
                       f"a collective waits for its slowest peer: {COMM_STEPS} × {span} = {_seconds(COMM_STEPS * between)}"
                       + (f", under the {COMM_FLOOR_S:g} s floor" if comm == COMM_FLOOR_S else "")),
        Recommendation("SHOAL_STALL_TIMEOUT", stall, STALL_DEFAULT_S,
                       f"heartbeats beat once a second whatever the step; {STALL_STEPS} × {span} = "
                       f"{_seconds(STALL_STEPS * between)} of silence is a stall" + (f", under the {STALL_FLOOR_S:g} s floor" if stall == STALL_FLOOR_S else "")),
        Recommendation("SHOAL_JOIN_TIMEOUT", JOIN_DEFAULT_S, JOIN_DEFAULT_S,
                       "the nodes meet before the first step, so the step does not bound it: the slowest host's start does (torchrun's default)"),
    ]


def _whole_seconds(s: float) -> int:
    """Up to the next second (from the tenth: 60.002 s is 60, not 61)."""
    return math.ceil(round(s, 1))


def _seconds(s: float) -> str:
    return f"{s:.3g} s" if s >= 0.1 else f"{s * 1000:.3g} ms"
