"""Who takes a dead chief's place among asynchronous groups of one process each (Downpour, Distributed Hogwild, issue 38).

No quorum decides their steps, so nobody has to decide *at* a step who succeeds: each process that started with the
job asks, at its step boundaries (at most every CHECK_EVERY_S) and before its finish, whether the chief's process is
gone (the launcher's word on its group at the groups' door: a restart announced or given up on, or its heartbeat
silent past the stall timeout) and so is every other worker process ranked below it: then it is the lowest living
one and takes the chief's duties (runtime/trainer.py `_take_over`; a user's loop's: frontend/session_healing.py
`take_over`). A process restarted into the job never does: it
rejoins as an ordinary group, the dead chief's too.

`chief_done`: the chief (or its successor) says it before its last word to the other groups (Distributed Hogwild's
STOP, Downpour's FINAL); the launcher then treats the chief's death as one the job cannot lose (a whole-job restart,
as before), since no group is left waiting to take its place. `speaker`: who speaks for the job now (0, or the
process that took the chief's place: it says so), so that the launcher knows whose death that is, and whether a
process that started with the job is left to take its place. `chief_started`: a user's loop's chief says it at its
first step; dead before, it held what the others start from, and its death restarts the whole job.
"""
from __future__ import annotations

import time
from typing import Optional

from shoal.comm import channels, heartbeat
from shoal.comm import dist as comm

KEY = "shoal/succession/chief_done"
SPEAKER_KEY = "shoal/succession/speaker"
STARTED_KEY = "shoal/succession/chief_started"
CHECK_EVERY_S = 0.2  # how often a would-be successor asks the store (two reads per lower process)


def say_chief_done() -> None:
    """This process speaks for the job and is about to say its last word to the other groups."""
    store = comm.signed_job_store()
    if store is not None:
        store.set(KEY, "1")


def say_chief_started() -> None:
    """A user's loop's chief, at its first step: the others need nothing more of it (before, Downpour's servers wait for
    its module's values, FIRST, and Distributed Hogwild's groups for its broadcast of them)."""
    store = comm.signed_job_store()
    if store is not None:
        store.set(STARTED_KEY, "1")


def chief_started(store) -> bool:
    """Whether a user's loop's chief reached its first step (`store`: as `chief_done`'s)."""
    return store.get(STARTED_KEY) == "1"


def chief_done(store) -> bool:
    """Whether the job's chief said its last word (`store`: a signed view of the job's store, the launcher's)."""
    return store.get(KEY) == "1"


def speaker(store) -> int:
    """The process that speaks for the job now: the chief's (0), or the last to take its place (`store`: as above)."""
    said = store.get(SPEAKER_KEY)
    return int(said) if said is not None and said.isdigit() else 0


class Successor:
    """Process `rank`'s view of the chief's succession; `lower`: every worker process ranked below it, rank -> group
    (the chief's, rank 0, first); `door`: the kind of door at which the launcher says a group's restarts."""

    def __init__(self, rank: int, lower: dict[int, int], door: str):
        self.rank, self.lower = rank, dict(lower)
        self._door: Optional[channels.Door] = None
        self._kind = door
        self._asked_at = 0.0

    def takes_over(self, now: bool = False) -> bool:
        """Whether this process is now the lowest living one (asked at most every CHECK_EVERY_S unless `now`)."""
        moment = time.monotonic()
        if not now and moment - self._asked_at < CHECK_EVERY_S:
            return False
        self._asked_at = moment
        try:
            if not (self.lower and all(self._gone(rank, group) for rank, group in self.lower.items())):
                return False
            store = comm.signed_job_store()
            if store is not None:  # (the launcher reads whose death is the chief's)
                store.set(SPEAKER_KEY, str(self.rank))
            return True
        except RuntimeError:  # the job's store is gone: the job is ending
            return False

    def _gone(self, rank: int, group: int) -> bool:
        """Whether `rank` cannot take the place: stalled, or its first process ended (a restarted one never does)."""
        if heartbeat.is_stalled(rank):
            return True
        if self._door is None:
            self._door = channels.Door(self._kind)
        return self._door.incarnation(group) > 0 or self._door.given_up(group) >= 0

    def chief_done(self) -> bool:
        store = comm.signed_job_store()
        try:
            return store is not None and chief_done(store)
        except RuntimeError:
            return False


def successor_of(plan, rank: int, door: str) -> Successor:
    """Process `rank`'s watch on the chief's succession under `plan` (a JobPlan): every group's first worker process
    (its stub, the one that may take the chief's place) ranked below it, with its group (Downpour's servers come after
    the groups' processes; a group over several processes is gone once the launcher restarted it whole)."""
    return Successor(rank, {r: plan.process(r).workers[0].group for r in range(rank) if plan.is_group_stub(r)}, door)
