"""The state a restarted process takes at its admission is broadcast over a group made for it (comm/quorum.py,
MeetingGroup.formed, MeetingGroup.broadcast), and a joiner killed before it came to the group or took the state must
hold the donor up only until its death is known:
gloo's own timeout (the job's comm timeout, 45 s) is as long as the servers the donor pushes to wait for it, so waiting
it out turned a worker's death into a whole-job restart (Sandblaster's chaos run, 2026-11-29)."""
from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

from shoal.comm import dist as comm
from shoal.comm.quorum import MeetingGroup, PeerLost
from test_chief_death import job_store  # noqa: F401 (a fixture)


def two_member_group() -> list[MeetingGroup]:
    """Ranks 0 and 1 of one gloo group in this process (each made in a thread: gloo's constructor waits for the other)."""
    store = dist.HashStore()
    groups: list = [None, None]

    def make(rank: int) -> None:
        groups[rank] = MeetingGroup(0, (0, 1), rank, backend=dist.ProcessGroupGloo(
            store, rank, 2, datetime.timedelta(seconds=8)))

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return groups


def test_a_handover_to_a_joiner_that_never_takes_it_is_given_up_once_its_death_is_known():
    donor, joiner = two_member_group()
    known_dead_at = time.monotonic() + 0.5  # the launcher's word on the joiner, half a second in
    started = time.monotonic()
    with pytest.raises(PeerLost, match="process 1 ended"):
        donor.broadcast(torch.ones(4), 0, lambda: "process 1 ended" if time.monotonic() >= known_dead_at else None)
    assert time.monotonic() - started < 4  # (gloo's own timeout here: 8 s)
    joiner.broadcast(torch.zeros(4), 0, lambda: None)  # the given-up collective ends: the groups' teardown need not wait it out


def test_a_handover_both_members_take_arrives_whole():
    donor, joiner = two_member_group()
    got = torch.zeros(4)
    taking = threading.Thread(target=joiner.broadcast, args=(got, 0, lambda: None))
    taking.start()
    donor.broadcast(torch.arange(4.0), 0, lambda: None)
    taking.join()
    assert torch.equal(got, torch.arange(4.0))


def test_a_group_a_joiner_never_comes_to_is_given_up_once_its_death_is_known(job_store, monkeypatch):  # noqa: F811
    raw, _secret = job_store
    monkeypatch.setattr(comm, "_store", raw)
    known_dead_at = time.monotonic() + 0.5
    started = time.monotonic()
    with pytest.raises(PeerLost, match="process 1 ended"):
        MeetingGroup.formed(7, (0, 1), 0, 8.0, lambda: "process 1 ended" if time.monotonic() >= known_dead_at else None)
    assert time.monotonic() - started < 4  # (gloo's rendezvous alone waits 8 s here)


def test_a_group_both_members_come_to_is_made(job_store, monkeypatch):  # noqa: F811
    raw, _secret = job_store
    monkeypatch.setattr(comm, "_store", raw)
    groups: list = [None, None]
    threads = [threading.Thread(target=lambda r=r: groups.__setitem__(r, MeetingGroup.formed(8, (0, 1), r, 8.0)))
               for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = torch.zeros(3)
    taking = threading.Thread(target=groups[1].broadcast, args=(got, 0, lambda: None))
    taking.start()
    groups[0].broadcast(torch.arange(3.0), 0, lambda: None)
    taking.join()
    assert torch.equal(got, torch.arange(3.0))
