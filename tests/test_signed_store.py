"""Values of the job's store carry a MAC under the job's secret and a freshness counter (issue 37, point 2).

Any local user can list the store's keys and write them. A value that was tampered with, replayed, made with
another secret, moved to another key or attempt, unparsable or oversized is ignored, counted and named once per
key; a value re-read unchanged, or written by a process restarted in a dead writer's place, is taken.
"""
from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch.distributed as dist

from shoal.comm import auth, channels, heartbeat, signed_store
from shoal.comm import dist as comm
from shoal.comm.signed_store import MAX_VALUE_BYTES, SignedStore

NAMED = "failed authentication: another local user may be writing to this job's store"


@pytest.fixture
def fresh_book(monkeypatch):
    """Each test reads with a process's memory of its own: no key named or counted before."""
    monkeypatch.setattr(signed_store, "_book", signed_store._Freshness())
    monkeypatch.setattr(signed_store, "_failures", {})


def named(err: str, key: str) -> int:
    return err.count(f"WARNING: a value of key {key} {NAMED}")


def test_a_signed_value_is_read_back_and_re_read_unchanged(fresh_book, capfd):
    store, secret = dist.HashStore(), auth.new_secret()
    writer, reader = SignedStore(store, secret, "/shoal/attempt_0"), SignedStore(store, secret, "/shoal/attempt_0")
    writer.set("shoal/heartbeat/1", "3 7")
    assert store.get("shoal/heartbeat/1").decode().endswith(" 3 7")
    assert [reader.get("shoal/heartbeat/1") for _ in range(3)] == ["3 7"] * 3  # re-read unchanged: still the peer's word
    writer.set("shoal/heartbeat/1", "4 8")
    assert reader.multi_get(["shoal/heartbeat/1"]) == ["4 8"]
    assert reader.get("missing") is None
    assert signed_store.failures() == {} and NAMED not in capfd.readouterr().err


def test_a_tampered_value_is_ignored_counted_and_named_once(fresh_book, capfd):
    store, secret = dist.HashStore(), auth.new_secret()
    values = SignedStore(store, secret)
    values.set("shoal/calls/2", "40")
    genuine = store.get("shoal/calls/2").decode()
    for forged in (genuine[:-2] + "99", "7 7", "", b"\xff\x00",
                   genuine.replace("s1", "s2", 1), genuine.split(" ", 4)[4]):
        store.set("shoal/calls/2", forged)
        assert values.get("shoal/calls/2") is None, forged
    assert signed_store.failures() == {"shoal/calls/2": 6}
    err = capfd.readouterr().err
    assert named(err, "shoal/calls/2") == 1, err
    store.set("shoal/calls/2", genuine)  # the value it read last: taken again
    assert values.get("shoal/calls/2") == "40"


def test_an_older_value_replayed_is_refused_and_a_restarted_writer_is_not(fresh_book, capfd, monkeypatch):
    store, secret = dist.HashStore(), auth.new_secret()
    values = SignedStore(store, secret)
    values.set("shoal/heartbeat/1", "0 -1")
    old = store.get("shoal/heartbeat/1")
    assert values.get("shoal/heartbeat/1") == "0 -1"
    values.set("shoal/heartbeat/1", "1 5")
    assert values.get("shoal/heartbeat/1") == "1 5"
    store.set("shoal/heartbeat/1", old)
    assert values.get("shoal/heartbeat/1") is None
    err = capfd.readouterr().err
    assert named(err, "shoal/heartbeat/1") == 1 and "an older value replayed" in err, err
    # a process restarted in the dead writer's place counts afresh: its values are a new writer's
    monkeypatch.setattr(signed_store, "_writer", None)
    values.set("shoal/heartbeat/1", "0 5")
    assert values.get("shoal/heartbeat/1") == "0 5"
    store.set("shoal/heartbeat/1", old)  # the dead writer's values stay refused
    assert values.get("shoal/heartbeat/1") is None


def test_another_secret_another_key_or_another_attempt_is_refused(fresh_book, capfd):
    store, secret = dist.HashStore(), auth.new_secret()
    SignedStore(store, secret, "/shoal/attempt_0").set("shoal/heartbeat/1", "3 7")
    value = store.get("shoal/heartbeat/1")
    assert SignedStore(store, auth.new_secret(), "/shoal/attempt_0").get("shoal/heartbeat/1") is None  # the wrong key
    assert SignedStore(store, secret, "/shoal/attempt_1").get("shoal/heartbeat/1") is None  # another attempt's
    store.set("shoal/heartbeat/2", value)  # moved to another key
    assert SignedStore(store, secret, "/shoal/attempt_0").get("shoal/heartbeat/2") is None
    downpour = SignedStore(store, secret, "/shoal/attempt_0").under("shoal/downpour/")
    downpour.set("s0/g1/state", "serving 0")
    assert store.get("shoal/downpour/s0/g1/state").decode().endswith(" serving 0")
    store.set("shoal/downpour/s0/g2/state", store.get("shoal/downpour/s0/g1/state"))
    assert downpour.get("s0/g2/state") is None and downpour.get("s0/g1/state") == "serving 0"
    err = capfd.readouterr().err
    assert named(err, "shoal/heartbeat/1") == 1 and named(err, "shoal/heartbeat/2") == 1, err
    assert named(err, "shoal/downpour/s0/g2/state") == 1, err


def test_oversized_values_are_neither_read_nor_written(fresh_book, capfd):
    store, secret = dist.HashStore(), auth.new_secret()
    values = SignedStore(store, secret)
    store.set("shoal/published/start", b"x" * (MAX_VALUE_BYTES + 1))
    assert values.get("shoal/published/start") is None
    assert "over the 16384 any value of shoal's has" in capfd.readouterr().err
    with pytest.raises(ValueError, match="at most 16384 are written"):
        values.set("shoal/published/start", "y" * MAX_VALUE_BYTES)
    plain = SignedStore(store, None)  # without a secret the bound holds too
    assert plain.get("shoal/published/start") is None


def test_without_a_secret_values_are_plain_text(fresh_book):
    store = dist.HashStore()
    plain = SignedStore(store, None)
    plain.set("shoal/heartbeat/1", "3 7")
    assert store.get("shoal/heartbeat/1") == b"3 7" and plain.get("shoal/heartbeat/1") == "3 7"
    assert plain.add("g1/incarnation", 2) == 2 and plain.raw is store


STALL_S = 0.5  # the watch's stall timeout (beats every 0.125 s)


def test_a_forged_heartbeat_is_no_beat_and_no_blame(fresh_book, capfd):
    """A peer whose key another user rewrites ("7 7", an old beat replayed) is neither alive by it nor stalled by it;
    a peer whose authentic beats stop is stalled."""
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
    secret = auth.new_secret()
    peer = SignedStore(store, secret)
    peer.set("shoal/heartbeat/1", "0 3")
    replay = store.get("shoal/heartbeat/1")
    peer.set("shoal/heartbeat/1", "1 4")
    stalls = []
    watch = heartbeat.Watch(SignedStore(store, secret), rank=0, world=2, on_stall=stalls.append, timeout_s=STALL_S).start()
    stop = threading.Event()

    def forge():
        while not stop.is_set():
            store.set("shoal/heartbeat/1", "7 7")
            time.sleep(0.002)
            store.set("shoal/heartbeat/1", replay)
            time.sleep(0.002)

    try:
        deadline = time.monotonic() + 10
        while watch.last_step(1) != 4:  # it read the peer's beat
            assert time.monotonic() < deadline, "the watch never read the peer's beat"
            time.sleep(0.01)
        forger = threading.Thread(target=forge)
        forger.start()
        time.sleep(3 * STALL_S)  # three stall timeouts of nothing but forgeries
        stop.set()
        forger.join()
        assert stalls == [] and watch.last_step(1) == 4
        peer.set("shoal/heartbeat/1", "2 9")  # the peer's own word again, then silence
        deadline = time.monotonic() + 10
        while not stalls and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        watch.stop()
    assert [(s.rank, s.step) for s in stalls] == [(1, 9)]
    err = capfd.readouterr().err
    assert named(err, "shoal/heartbeat/1") == 1, err
    assert SignedStore(store, secret).get("shoal/heartbeat/0").startswith("done ")


def test_a_door_hears_no_word_without_the_secret(fresh_book, capfd):
    """Downpour's handshake words: a knock, an answer, a state or a `closed` written without the secret is unheard."""
    store, secret = dist.HashStore(), auth.new_secret()
    door, impostor = channels.Door("t", store, secret), channels.Door("t", store, auth.new_secret())
    impostor.close(0)
    impostor.set_state(0, 1, "finished")
    impostor.give_up(1, 5)
    store.set("shoal/t/s0/g1/i0/hello", "nonce")
    assert (door.closed(0), door.state(0, 1), door.given_up(1), door.hello(0, 1, 0)) == (False, None, -1, None)
    door.set_state(0, 1, "serving 0")
    door.give_up(1, 2)
    assert (door.state(0, 1), door.given_up(1)) == ("serving 0", 2)
    err = capfd.readouterr().err
    for key in ("s0/closed", "s0/g1/state", "g1/given_up", "s0/g1/i0/hello"):
        assert named(err, f"shoal/t/{key}") == 1, err


def test_published_words_and_progress_take_only_authentic_values(fresh_book, monkeypatch):
    """The start word and a failure's cause wait for an authentic value; a forged progress count names nobody."""
    store, secret = dist.HashStore(), auth.new_secret()
    monkeypatch.setattr(comm, "_signed", SignedStore(store, secret))
    store.set("shoal/published/start", '{"resume_from": "/elsewhere"}')
    threading.Timer(0.3, lambda: comm.publish("start", '{"resume_from": ""}')).start()
    assert comm.read_published("start", 5) == '{"resume_from": ""}'
    store.set("shoal/published/failure", "process 2 failed: forged")
    assert comm.published("failure", wait_s=0.2) is None
    with pytest.raises(dist.DistStoreError, match="no authentic value of shoal/published/process/1 within 0 s"):
        store.set("shoal/published/process/1", "{}")
        comm.read_published("process/1", 0.2)
    SignedStore(store, secret).set("shoal/calls/0", "12")
    store.set("shoal/calls/1", "0")  # would make process 1 look behind
    assert comm.progress(3) == {0: 12, 2: -1}


def test_a_quorum_keeps_only_its_last_meetings_keys(fresh_book, monkeypatch):
    """A step's quorum writes keys every step (the replicated exchange meets once a step): the chief deletes a
    meeting's keys KEPT_MEETINGS meetings later and forgets their freshness, so a long job's store and memory stay
    bounded."""
    from shoal.comm import quorum

    raw = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    monkeypatch.setattr(comm, "_signed", SignedStore(raw, auth.new_secret(), "/shoal/attempt_0"))
    chief = quorum.Quorum(0, [0], {0: 0}, door=None, first=object())
    meetings = quorum.KEPT_MEETINGS + 40
    for meeting in range(meetings):
        assert chief.meet(meeting, meeting, lambda attempt: meeting).result == meeting
    assert chief.swept()  # (the chief deletes them on a thread of its own)
    outcome = "shoal/quorum/m{}/a0/outcome"
    assert not raw.check([outcome.format(0)]) and not raw.check([outcome.format(meetings - quorum.KEPT_MEETINGS - 1)])
    assert all(raw.check([outcome.format(m)]) for m in range(meetings - quorum.KEPT_MEETINGS, meetings))
    assert raw.num_keys() <= quorum.KEPT_MEETINGS + 2  # (the store's own keys besides)
    assert len(signed_store._book._newest) <= quorum.KEPT_MEETINGS
