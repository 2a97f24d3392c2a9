"""Fault injection for tests and benchmarks: every SHOAL_INJECT_* / SHOAL_SLOW_WORKER variable is read here.

The launcher hands `from_environment()` to each process's assembly (RunSpec.faults), which gives its
hooks to the trainers, the workers and the Downpour server (shoal.runtime.interfaces.FaultInjection);
nothing below the launcher reads these variables. An injected exit is the launcher's: it ends the
process here, as a crash would.

  SHOAL_INJECT_EXIT="RANK:STEP,..."     process RANK exits (code 3) when it reaches training step STEP;
                                        a Downpour server process exits when its version reaches STEP
  SHOAL_INJECT_EXIT_AFTER="RANK:STEP,..."  process RANK exits (code 3) right after training step STEP (its last step:
                                        after the step's commit, before the job's end)
  SHOAL_INJECT_STALL="RANK:STEP,..."    process RANK's training hangs at step STEP (its heartbeat goes on: caught by
                                        cluster.comm_timeout_s)
  SHOAL_INJECT_GROUP_ERROR="GROUP:STEP,..." in-memory worker group GROUP raises at step STEP
  SHOAL_SLOW_WORKER="[G.]K:COST,..."    worker K of each group (or of group G only; a G.K item wins over a K item)
                                        computes slower, as a slower device would. COST is PER_SAMPLE[+FIXED]:
                                        PER_SAMPLE more seconds per sample of its share plus FIXED per step, or
                                        xFACTOR: each step takes FACTOR times its measured compute (x2: half speed,
                                        whatever the machine's load)

Each RANK:STEP variable (GROUP:STEP too) takes several comma-separated pairs ("0:12,1:12": processes 0 and 1 at the
same step; "1:5,1:30": process 1, then its restart); each process reads the pairs naming its rank. A process restarted
into a running job (shoal.launcher.rejoin) takes up where its predecessor stopped: it never fires at the step it starts
at, so a fault its predecessor met is not met again (a pair past that step fires in it); a restarted Downpour server
fires none (it heals to the chief's mirror, which may be behind the version its predecessor died at). A whole job
restarted from a checkpoint (shoal.launcher.job_restarts) meets its faults again.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional

from shoal.runtime.interfaces import FaultInjection, TrainerHook


def _pairs(variable: str) -> list[tuple[int, int]]:
    """The RANK:STEP (or GROUP:STEP) pairs of `variable`, comma-separated."""
    pairs = []
    for item in filter(None, (part.strip() for part in os.environ.get(variable, "").split(","))):
        first, colon, second = item.partition(":")
        if not colon:
            raise ValueError(f"{variable}: RANK:STEP pairs, comma-separated, got {item!r}")
        pairs.append((int(first), int(second)))
    return pairs


def _steps(variable: str, rank: int) -> list[int]:
    """The steps `variable` names for `rank`, in order."""
    return sorted(step for who, step in _pairs(variable) if who == rank)


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


def server_exit_versions(rank: int) -> list[int]:
    """The versions at which the Downpour server of process `rank` "dies", if asked."""
    return _steps("SHOAL_INJECT_EXIT", rank)


def _die() -> None:
    """End now, as a crash would: no cleanup, exit code 3."""
    os._exit(3)


class ProcessFault(TrainerHook):
    """Process `rank` exits or hangs at a step, as SHOAL_INJECT_EXIT / SHOAL_INJECT_STALL ask. `restarted`: a process
    restarted in a dead one's place, whose first step is where its predecessor stopped: no fault fires at it."""

    def __init__(self, step: int, action: str, restarted: bool = False):
        self.step, self.action, self.restarted = step, action, restarted
        self._first: Optional[int] = None  # the first step this process trains

    def _fires(self, step: int) -> bool:
        if self._first is None:
            self._first = step
        return step == self.step and not (self.restarted and step == self._first)

    def before_step(self, step: int) -> None:
        if not self._fires(step) or self.action == "exit_after":
            return
        if self.action == "exit":
            _die()
        time.sleep(10**6)

    def after_step(self, step: int) -> None:
        if self.action == "exit_after" and self._fires(step):
            _die()


class GroupFault(TrainerHook):
    """In-memory worker group `group` raises at a step, as SHOAL_INJECT_GROUP_ERROR asks (the others go on)."""

    def __init__(self, step: int):
        self.step = step

    def before_step(self, step: int) -> None:
        if step == self.step:
            raise RuntimeError(f"injected failure (SHOAL_INJECT_GROUP_ERROR) at step {step}")


def process_faults(rank: int, restarted: bool = False) -> list[ProcessFault]:
    return [ProcessFault(step, action, restarted)
            for variable, action in (("SHOAL_INJECT_EXIT", "exit"), ("SHOAL_INJECT_STALL", "stall"),
                                     ("SHOAL_INJECT_EXIT_AFTER", "exit_after"))
            for step in _steps(variable, rank)]


class InjectedFaults(FaultInjection):
    """The faults this process's environment asks for, as hooks for the assembly (`restarted`: this process was
    restarted into the running job)."""

    def __init__(self, restarted: bool = False):
        self.restarted = restarted

    def process_hooks(self, rank: int) -> list[TrainerHook]:
        return list(process_faults(rank, self.restarted))

    def group_hooks(self, group: int) -> list[TrainerHook]:
        return [GroupFault(step) for step in _steps("SHOAL_INJECT_GROUP_ERROR", group)]

    def compute_delay(self, worker: int, group: int) -> Optional[Slowdown]:
        return slowdown(worker, group) or None

    def server_update_hook(self, rank: int):
        versions = server_exit_versions(rank)
        if not versions or self.restarted:  # (a restarted server heals to the mirror's version: maybe below its fault's)
            return None
        return lambda reached: _die() if reached in versions else None


def from_environment(restarted: bool = False) -> FaultInjection:
    """What SHOAL_INJECT_* / SHOAL_SLOW_WORKER ask of this process (read when the hooks are asked for); `restarted`: a
    process restarted into the running job (shoal.launcher.rejoin), which does not meet its predecessor's fault again."""
    return InjectedFaults(restarted)
