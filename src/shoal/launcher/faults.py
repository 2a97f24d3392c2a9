"""Fault injection for tests and benchmarks: every SHOAL_INJECT_* / SHOAL_SLOW_WORKER variable is read here.

The launcher hands `from_environment()` to each process's assembly (RunSpec.faults), which gives its
hooks to the trainers, the workers and the Downpour server (shoal.runtime.interfaces.FaultInjection);
nothing below the launcher reads these variables. An injected exit is the launcher's: it ends the
process here, as a crash would.

  SHOAL_INJECT_EXIT="RANK:STEP"         process RANK exits (code 3) when it reaches training step STEP;
                                        a Downpour server process exits when its version reaches STEP
  SHOAL_INJECT_EXIT_AFTER="RANK:STEP"   process RANK exits (code 3) right after training step STEP (its last step: after
                                        the step's commit, before the job's end)
  SHOAL_INJECT_STALL="RANK:STEP"        process RANK's training hangs at step STEP (its heartbeat goes on: caught by cluster.comm_timeout_s)
  SHOAL_INJECT_GROUP_ERROR="GROUP:STEP" in-memory worker group GROUP raises at step STEP
  SHOAL_SLOW_WORKER="[G.]K:COST,..."    worker K of each group (or of group G only; a G.K item wins over a K item)
                                        computes slower, as a slower device would. COST is PER_SAMPLE[+FIXED]:
                                        PER_SAMPLE more seconds per sample of its share plus FIXED per step, or
                                        xFACTOR: each step takes FACTOR times its measured compute (x2: half speed,
                                        whatever the machine's load)
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional

from shoal.runtime.interfaces import FaultInjection, TrainerHook


def _pair(variable: str) -> Optional[tuple[int, int]]:
    spec = os.environ.get(variable, "")
    if not spec:
        return None
    first, _, second = spec.partition(":")
    return int(first), int(second)


@dataclass(frozen=True)
class Slowdown:
    """What a slowed worker adds to each step: seconds per sample and per step, or a factor on its compute time."""

    per_sample: float = 0.0
    per_step: float = 0.0
    factor: float = 1.0

    def extra_seconds(self, compute_seconds: float, samples: int) -> float:
        return self.per_step + self.per_sample * samples + (self.factor - 1.0) * compute_seconds

    def __bool__(self) -> bool:
        return self != Slowdown()


def _cost(text: str) -> Slowdown:
    if text.startswith("x"):
        factor = float(text[1:])
        if factor < 1:
            raise ValueError(f"SHOAL_SLOW_WORKER: a factor slows down, so it is >= 1, got {text}")
        return Slowdown(factor=factor)
    per_sample, _, fixed = text.partition("+")
    return Slowdown(per_sample=float(per_sample), per_step=float(fixed or 0))


def slowdown(worker: int, group: int = 0) -> Slowdown:
    """What SHOAL_SLOW_WORKER adds to the compute of worker `worker` of group `group`."""
    every_group, this_group = Slowdown(), None
    for item in filter(None, os.environ.get("SHOAL_SLOW_WORKER", "").split(",")):
        who, _, cost = item.partition(":")
        in_group, dot, index = who.rpartition(".")
        if int(index) != worker or (dot and int(in_group) != group):
            continue
        if dot:
            this_group = _cost(cost)
        else:
            every_group = _cost(cost)
    return this_group or every_group


def server_exit_version(rank: int) -> Optional[int]:
    """The version at which the Downpour server of process `rank` "dies", if asked."""
    spec = _pair("SHOAL_INJECT_EXIT")
    return spec[1] if spec and spec[0] == rank else None


def _die() -> None:
    """End now, as a crash would: no cleanup, exit code 3."""
    os._exit(3)


class ProcessFault(TrainerHook):
    """Process `rank` exits or hangs at a step, as SHOAL_INJECT_EXIT / SHOAL_INJECT_STALL ask."""

    def __init__(self, step: int, action: str):
        self.step, self.action = step, action

    def before_step(self, step: int) -> None:
        if step != self.step or self.action == "exit_after":
            return
        if self.action == "exit":
            _die()
        time.sleep(10**6)

    def after_step(self, step: int) -> None:
        if step == self.step and self.action == "exit_after":
            _die()


class GroupFault(TrainerHook):
    """In-memory worker group `group` raises at a step, as SHOAL_INJECT_GROUP_ERROR asks (the others go on)."""

    def __init__(self, step: int):
        self.step = step

    def before_step(self, step: int) -> None:
        if step == self.step:
            raise RuntimeError(f"injected failure (SHOAL_INJECT_GROUP_ERROR) at step {step}")


def process_faults(rank: int) -> list[ProcessFault]:
    faults = []
    for variable, action in (("SHOAL_INJECT_EXIT", "exit"), ("SHOAL_INJECT_STALL", "stall"),
                             ("SHOAL_INJECT_EXIT_AFTER", "exit_after")):
        spec = _pair(variable)
        if spec and spec[0] == rank:
            faults.append(ProcessFault(spec[1], action))
    return faults


class InjectedFaults(FaultInjection):
    """The faults this process's environment asks for, as hooks for the assembly."""

    def process_hooks(self, rank: int) -> list[TrainerHook]:
        return list(process_faults(rank))

    def group_hooks(self, group: int) -> list[TrainerHook]:
        spec = _pair("SHOAL_INJECT_GROUP_ERROR")
        return [GroupFault(spec[1])] if spec and spec[0] == group else []

    def compute_delay(self, worker: int, group: int) -> Optional[Slowdown]:
        return slowdown(worker, group) or None

    def server_update_hook(self, rank: int):
        version = server_exit_version(rank)
        if version is None:
            return None
        return lambda reached: _die() if reached == version else None


def from_environment() -> FaultInjection:
    """What SHOAL_INJECT_* / SHOAL_SLOW_WORKER ask of this process (read when the hooks are asked for)."""
    return InjectedFaults()
