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
  SHOAL_SLOW_UNTIL="PATH"               SHOAL_SLOW_WORKER's slowdowns hold until the file PATH exists (a test that
                                        needs the job to outlast something creates it then: no fixed pace to outlast
                                        a loaded machine, no waiting out the pace on an idle one)

Each variable takes several comma-separated pairs ("0:12,1:12": processes 0 and 1 at the same step; "0:4,1:9": groups
0 and 1). A rank's pairs are its processes', one each, in the order written: the process the job started meets the
rank's first pair, the process restarted in its place (shoal.launcher.rejoin, incarnation K) the rank's K+1-th, at the
first step it trains at or past it (a restart joins at a step it cannot choose: "1:12,1:13" ends process 1 at step 12
and its restart right after it rejoined, before its first step), a restarted Downpour server at the first version it
reaches at or past it. So a restart never meets its predecessor's fault again. A whole job restarted from a checkpoint
(shoal.launcher.job_restarts) starts its processes afresh: they meet the first pairs again.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
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


def _own_step(variable: str, rank: int, incarnation: int = 0) -> Optional[int]:
    """The step of `variable`'s pair that process `rank`'s incarnation `incarnation` meets: the rank's pairs in the order
    written, one per process (None: none left for it)."""
    steps = [step for who, step in _pairs(variable) if who == rank]
    return steps[incarnation] if incarnation < len(steps) else None


@dataclass(frozen=True)
class Slowdown:
    """What a slowed worker adds to each step: seconds per sample and per step, or a factor on its compute time; until
    the file `until` exists, where one is named (SHOAL_SLOW_UNTIL: one stat a step)."""

    per_sample: float = 0.0
    per_step: float = 0.0
    factor: float = 1.0
    until: Optional[str] = None

    def extra_seconds(self, compute_seconds: float, samples: int) -> float:
        if self.until is not None and os.path.exists(self.until):
            return 0.0
        return self.per_step + self.per_sample * samples + (self.factor - 1.0) * compute_seconds

    def __bool__(self) -> bool:
        return (self.per_sample, self.per_step, self.factor) != (0.0, 0.0, 1.0)


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
    return replace(this_group or every_group, until=os.environ.get("SHOAL_SLOW_UNTIL") or None)


def server_exit_version(rank: int, incarnation: int = 0) -> Optional[int]:
    """The version at which the Downpour server of process `rank` (its incarnation `incarnation`) "dies", if asked."""
    return _own_step("SHOAL_INJECT_EXIT", rank, incarnation)


def _die() -> None:
    """End now, as a crash would: no cleanup, exit code 3."""
    os._exit(3)


class ProcessFault(TrainerHook):
    """Process `rank` exits or hangs at a step, as SHOAL_INJECT_EXIT / SHOAL_INJECT_STALL ask. `restarted`: a process
    restarted in a dead one's place, which starts at a step it cannot choose: its fault fires at the first step it
    trains at or past `step`."""

    def __init__(self, step: int, action: str, restarted: bool = False):
        self.step, self.action, self.restarted = step, action, restarted

    def _fires(self, step: int) -> bool:
        return step >= self.step if self.restarted else step == self.step

    def before_step(self, step: int) -> None:
        if self.action == "exit_after" or not self._fires(step):
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


def process_faults(rank: int, incarnation: int = 0) -> list[ProcessFault]:
    faults = []
    for variable, action in (("SHOAL_INJECT_EXIT", "exit"), ("SHOAL_INJECT_STALL", "stall"),
                             ("SHOAL_INJECT_EXIT_AFTER", "exit_after")):
        step = _own_step(variable, rank, incarnation)
        if step is not None:
            faults.append(ProcessFault(step, action, restarted=incarnation > 0))
    return faults


class InjectedFaults(FaultInjection):
    """The faults this process's environment asks for, as hooks for the assembly (`incarnation`: this process's, 0 for
    one the job started, K for the K-th restart of its rank)."""

    def __init__(self, incarnation: int = 0):
        self.incarnation = incarnation

    def process_hooks(self, rank: int) -> list[TrainerHook]:
        return list(process_faults(rank, self.incarnation))

    def group_hooks(self, group: int) -> list[TrainerHook]:
        step = _own_step("SHOAL_INJECT_GROUP_ERROR", group)
        return [GroupFault(step)] if step is not None else []

    def compute_delay(self, worker: int, group: int) -> Optional[Slowdown]:
        return slowdown(worker, group) or None

    def server_update_hook(self, rank: int):
        version = server_exit_version(rank, self.incarnation)
        if version is None:
            return None
        if self.incarnation > 0:  # (healed from the mirror, maybe past it already)
            return lambda reached: _die() if reached >= version else None
        return lambda reached: _die() if reached == version else None


def from_environment(incarnation: int = 0) -> FaultInjection:
    """What SHOAL_INJECT_* / SHOAL_SLOW_WORKER ask of this process (read when the hooks are asked for); `incarnation`: a
    process restarted into the running job (shoal.launcher.rejoin) meets its own pairs, not its predecessor's."""
    return InjectedFaults(incarnation)
