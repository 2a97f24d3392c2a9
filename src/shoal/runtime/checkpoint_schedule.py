"""Interval checkpoints: a job that sets no checkpoint_freq still checkpoints about every plan.checkpoint_interval_s.

A checkpoint is collective: the chief writes step<N>-worker0 and every other trainer (a group's thread, another
process) writes its part at the same step N (Trainer.save_checkpoint), and where the groups are synchronous the
sliced exchange even gathers the updater state with a collective. Each process's clock would pick a different
step, so the chief alone decides, from its own clock, and tells the others a step S:

- when checkpoint_interval_s has passed since its last checkpoint (or its first step), the chief picks
  S = its step + a lead (`checkpoint_step`), and past every trainer of its own process whose part is required
  (threads: it knows where each stands);
- threads of one process read S from this object (one per process, handed to every trainer by the assembly);
- another process reads the chief's decisions from the job's store (`comm.published`, signed values): the n-th
  interval checkpoint's step under `checkpoint_interval/<n>`, one store request (is the next one there?) every
  `read_every_s` seconds, and at least every half `reads_every` steps, as many as its own fastest step had made
  in that time when it last read (at most MOST_STEPS_BETWEEN_READS): steps turning faster make it read sooner;
- the lead: twice the steps the chief's fastest step makes in `read_every_s` (at most twice
  MOST_STEPS_BETWEEN_READS), plus plan.round_steps, how far a trainer may run ahead of the chief between two
  meetings (1; Local SGD: local_steps), plus 2. A trainer whose part is required is no further ahead of the chief
  than that (a collective every step, or a meeting every round), so it reads S before it reaches S; an
  asynchronous group behind the chief writes its part when it gets to S. One further ahead than the lead
  (Downpour, Hogwild) has passed S: its part, optional there, is missing, and a resume starts that group from the
  chief's values (checkpoint_parts).

Nothing here changes what is trained: it reads clocks and the store, never an RNG or a value.
"""
from __future__ import annotations

import math
import threading
import time
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    from shoal.planning.plan import JobPlan

MOST_STEPS_BETWEEN_READS = 256  # another process reads the schedule at least this often, however fast its steps
KEY = "checkpoint_interval/{}"  # the step of the n-th interval checkpoint, published by the chief


def read_every_s(interval_s: float) -> float:
    """How often another process reads the chief's schedule: an eighth of the interval, at most every second
    (one store request each time)."""
    return min(1.0, interval_s / 8)


def reads_every(fastest_step_s: Optional[float], read_s: float, most: int = MOST_STEPS_BETWEEN_READS) -> int:
    """The steps a trainer makes between two reads of the schedule, at the pace of its fastest step so far."""
    return most if not fastest_step_s else max(1, min(most, math.ceil(read_s / fastest_step_s)))


def lead_steps(fastest_step_s: Optional[float], read_s: float, round_steps: int) -> int:
    """Steps from the chief's decision to the checkpoint, so that every other trainer (at most `round_steps` ahead of
    the chief, reading the schedule every `reads_every` steps) knows the step before it gets there."""
    return 2 * reads_every(fastest_step_s, read_s) + round_steps + 2


def checkpoint_step(step: int, *, alone: bool, fastest_step_s: Optional[float], read_s: float, round_steps: int,
                    required_reached: int = -1) -> int:
    """The step of the interval checkpoint the chief decides at the start of `step`: this very step when it is the
    job's only trainer; else `lead_steps` ahead, and past `required_reached` (the furthest step a trainer of its
    own process whose part is required has started)."""
    lead = 0 if alone else lead_steps(fastest_step_s, read_s, round_steps)
    return max(step + lead, required_reached + 1)


class CheckpointSchedule:
    """The steps of a process's interval checkpoints, shared by its trainers (threads): the chief's process
    decides them, another process reads them from the job's store."""

    def __init__(self, interval_s: float, train_steps: int, *, deciding: bool, alone: bool, round_steps: int = 1,
                 required_groups: frozenset[int] = frozenset(), publish: Optional[Callable[[str, str], None]] = None,
                 published: Optional[Callable[[str], Optional[str]]] = None, clock: Callable[[], float] = time.monotonic):
        """`deciding`: the chief's process; `alone`: the chief is the job's only trainer; `required_groups`: the groups
        of this process whose part a checkpoint needs; `publish`/`published`: the job's store (other processes)."""
        self.interval_s, self.train_steps = interval_s, train_steps
        self.deciding, self.alone, self.round_steps = deciding, alone, round_steps
        self.required_groups = required_groups
        self.read_s = read_every_s(interval_s)
        self._publish, self._published, self._clock = publish, published, clock
        self._lock = threading.Lock()
        self._steps: set[int] = set()  # the checkpoint steps decided (the chief's process) or read (another)
        self._reached: dict[int, int] = {}  # group -> the step it last asked about
        self._step_started: dict[int, tuple[int, float]] = {}  # group -> (step, when it started)
        self.fastest_step_s: Optional[float] = None  # of any trainer of this process, so far
        self._next_key = 0  # n of the next interval checkpoint: decided by the chief, looked for by another process
        self._pending: Optional[int] = None  # the chief's decided step, not yet written
        self._since: Optional[float] = None  # the chief's last checkpoint (or first step)
        self._over = False  # the next one would come at or after train_steps: the final checkpoint is the last
        self._read_at: Optional[tuple[int, float]] = None  # (step, time) of this process's last read of the store
        self._read_steps = MOST_STEPS_BETWEEN_READS  # the most steps until the next read, as its pace was at the last

    def due(self, group: int, step: int, chief: bool = False) -> bool:
        """Called by every trainer at the start of each step it trains: whether it writes its checkpoint (its part,
        for a trainer other than the chief) at `step`."""
        with self._lock:
            now = self._clock()
            self._measure(group, step, now)
            if chief and self.deciding:
                self._decide(step, now)
            elif not self.deciding:
                self._read(step, now)
            return step in self._steps

    def take_over(self) -> None:
        """This process took a dead chief's place (report/succession.py): it decides from now on, after every decision
        the chief published (its steps stand); the interval counts from now."""
        with self._lock:
            if self._published is not None:
                self._read_at = None
                self._read(0, self._clock())
            self.deciding, self._published = True, None
            self._since = self._clock()
            ahead = [s for s in self._steps if s > max(self._reached.values(), default=-1)]
            self._pending = min(ahead, default=None)

    def written(self, step: int) -> None:
        """The chief wrote the checkpoint of `step`: the interval counts from now."""
        with self._lock:
            self._since, self._pending = self._clock(), None

    def _measure(self, group: int, step: int, now: float) -> None:
        last = self._step_started.get(group)
        if last is not None and step == last[0] + 1 and now > last[1]:
            took = now - last[1]
            self.fastest_step_s = took if self.fastest_step_s is None else min(self.fastest_step_s, took)
        self._step_started[group] = (step, now)
        self._reached[group] = step

    # -- the chief's process ------------------------------------------------------------------
    def _decide(self, step: int, now: float) -> None:
        if self._since is None:
            self._since = now
        if self._pending is not None and self._pending < step:  # passed unwritten: never so in Trainer.run
            self._pending, self._since = None, now
        if self._over or self._pending is not None or now - self._since < self.interval_s:
            return
        required = max((s for g, s in self._reached.items() if g in self.required_groups), default=-1)
        at = checkpoint_step(step, alone=self.alone, fastest_step_s=self.fastest_step_s, read_s=self.read_s,
                             round_steps=self.round_steps, required_reached=required)
        if at >= self.train_steps:  # the final checkpoint comes first
            self._over = True
            return
        self._pending = at
        self._steps.add(at)
        if self._publish is not None:
            self._publish(KEY.format(self._next_key), str(at))
        self._next_key += 1

    # -- another process -------------------------------------------------------------------------
    def _read(self, step: int, now: float) -> None:
        if self._published is None:
            return
        if self._read_at is not None:
            last_step, last_time = self._read_at
            if now - last_time < self.read_s and step - last_step < self._read_steps:
                return
        # half what the time allows: its own steps may be somewhat faster than the chief's fastest
        self._read_at, self._read_steps = (step, now), max(1, reads_every(self.fastest_step_s, self.read_s) // 2)
        while True:  # every decision since the last read (a process that joins late reads them all once)
            text = self._published(KEY.format(self._next_key))
            if text is None:
                return
            self._next_key += 1
            if text.strip().isdigit():  # a job without a secret: whatever else another local user wrote is skipped
                self._steps.add(int(text))


def checkpoint_parts(plan: "JobPlan", writer: tuple[int, int] = (0, 0)) -> dict[tuple[int, int], bool]:
    """(group, rank) of every trainer but the chief (`writer`: the chief's, or a successor's that took a dead chief's
    place), each writing its own part of every checkpoint, and whether a checkpoint without it is incomplete: it is
    where the groups are synchronous or meet (Local SGD); an asynchronous group may have died before writing its part,
    and then starts from the chief's values on resume. Downpour's server processes run no trainer: the chief asks the
    servers for their state, as Sandblaster's chief asks its servers under cluster.max_restarts (they are Downpour's then:
    `servers_heal`)."""
    parts = {}
    for rank in range(plan.nprocs):
        hosted = plan.process(rank)
        if hosted.servers and not hosted.workers and not (plan.strategy.servers_hold_trainers and not plan.strategy.servers_heal(plan)):
            continue
        for group in sorted({w.group for w in hosted.workers}) or [0]:
            if (group, rank) != writer:  # (a group of replicas that goes on without a process: each part optional)
                parts[(group, rank)] = (plan.strategy.synchronous or plan.strategy.meets) and not plan.strategy.goes_on_without_a_process(plan)
    return parts


def for_process(plan: "JobPlan", rank: int, parts: dict[tuple[int, int], bool], publish: Callable[[str, str], None],
                published: Callable[[str], Optional[str]], deciding: bool) -> Optional[CheckpointSchedule]:
    """The schedule process `rank`'s trainers share, or None when the plan has no interval (checkpoint_freq set,
    or checkpoint_interval_s 0). `parts`: checkpoint_parts(plan); `publish`/`published`: the job's store's;
    `deciding`: the chief's process (process 0, unless it was restarted into the job: a successor decides then)."""
    if not plan.checkpoint_interval_s > 0:
        return None
    other_processes = any(r != 0 for _, r in parts)
    return CheckpointSchedule(
        plan.checkpoint_interval_s, plan.job.train_steps, deciding=deciding, alone=not parts,
        round_steps=plan.round_steps,
        required_groups=frozenset(g for (g, r), required in parts.items() if r == rank and required),
        publish=publish if other_processes else None,  # (a successor publishes too: take_over)
        published=None if deciding else published,
    )
