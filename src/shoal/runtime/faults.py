"""Fault injection for tests and benchmarks: every SHOAL_INJECT_* / SHOAL_SLOW_WORKER variable is read here.

  SHOAL_INJECT_EXIT="RANK:STEP"         process RANK exits (code 3) when it reaches training step STEP;
                                        a Downpour server process exits when its version reaches STEP
  SHOAL_INJECT_STALL="RANK:STEP"        process RANK's training hangs at step STEP (its heartbeat goes on: caught by SHOAL_COMM_TIMEOUT)
  SHOAL_INJECT_GROUP_ERROR="GROUP:STEP" in-memory worker group GROUP raises at step STEP
  SHOAL_SLOW_WORKER="K:PER_SAMPLE[+FIXED],..."  worker K of each group spends PER_SAMPLE more seconds per
                                        sample of its share, plus FIXED per step (as a slower device would)
"""
from __future__ import annotations

import os
import time
from typing import Optional

from shoal.runtime.interfaces import TrainerHook


def _pair(variable: str) -> Optional[tuple[int, int]]:
    spec = os.environ.get(variable, "")
    if not spec:
        return None
    first, _, second = spec.partition(":")
    return int(first), int(second)


def slowdown(worker: int) -> tuple[float, float]:
    """(seconds per sample, seconds per step) added to worker `worker`'s compute."""
    for item in filter(None, os.environ.get("SHOAL_SLOW_WORKER", "").split(",")):
        index, _, cost = item.partition(":")
        per_sample, _, fixed = cost.partition("+")
        if int(index) == worker:
            return float(per_sample), float(fixed or 0)
    return 0.0, 0.0


def group_fails(group: int, step: int) -> bool:
    return _pair("SHOAL_INJECT_GROUP_ERROR") == (group, step)


def server_exit_version(rank: int) -> Optional[int]:
    """The version at which the Downpour server of process `rank` "dies", if asked."""
    spec = _pair("SHOAL_INJECT_EXIT")
    return spec[1] if spec and spec[0] == rank else None


class ProcessFault(TrainerHook):
    """Process `rank` exits or hangs at a step, as SHOAL_INJECT_EXIT / SHOAL_INJECT_STALL ask."""

    def __init__(self, step: int, action: str):
        self.step, self.action = step, action

    def before_step(self, step: int) -> None:
        if step != self.step:
            return
        if self.action == "exit":
            os._exit(3)
        time.sleep(10**6)


def process_faults(rank: int) -> list[ProcessFault]:
    faults = []
    for variable, action in (("SHOAL_INJECT_EXIT", "exit"), ("SHOAL_INJECT_STALL", "stall")):
        spec = _pair(variable)
        if spec and spec[0] == rank:
            faults.append(ProcessFault(spec[1], action))
    return faults
