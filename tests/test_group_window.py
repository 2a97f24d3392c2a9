"""The Train line of a synchronous group over processes is the group's (issue 39, point 2: fit's AllReduce on the
session): every other member that came to the step tells the decider its display window through the job's store
(`Quorum.tell`), the decider hears each or learns that it is gone (`Quorum.hear`), and adds them, weighted by their
rows. A dead member holds nobody up. The whole path runs in tests/test_session.py (records equal to one worker's) and
tests/test_fit_eval_lm.py (fit's AllReduce on the session)."""
from __future__ import annotations

import math
import time

from shoal.comm import channels, quorum
from shoal.report.metrics import MetricWindow
from shoal.runtime.exchanges.replicated import WINDOW, _window_state, _window_text
from shoal.comm.signed_store import SignedStore
from test_chief_death import job_store  # noqa: F401 (a fixture)


def window(**rows) -> MetricWindow:
    w = MetricWindow()
    for name, (value, count) in rows.items():
        w.report(name, value, count)
    return w


def test_the_decider_hears_every_member_that_came_and_not_one_that_is_gone(job_store):  # noqa: F811
    raw, secret = job_store
    door = lambda: channels.Door("step", raw, secret)  # noqa: E731
    members = {r: quorum.Quorum(r, [0, 1, 2], {0: 0, 1: 1, 2: 2}, door(), first=object(), timeout_s=30) for r in (0, 1)}
    members[1].tell(WINDOW, 9, _window_text(window(loss=(3.0, 2), accuracy=(0.5, 2)).state()))
    door().next_incarnation(2)  # process 2 died after the step (the launcher's word): it will never tell
    started = time.monotonic()
    heard = members[0].hear(WINDOW, 9, [0, 1, 2])
    assert time.monotonic() - started < 2  # not the 30 s a silent member is waited for
    assert set(heard) == {1, 2} and heard[2] is None
    mine = window(loss=(1.0, 6), accuracy=(1.0, 6))
    assert mine.averages_with([_window_state(heard[1])]) == {"loss": (6 * 1.0 + 2 * 3.0) / 8, "accuracy": (6 + 1.0) / 8}
    assert members[0].swept()
    assert not SignedStore(raw, secret).under(quorum.KEYS).get(f"{WINDOW}9/r1")  # read once, then removed


def test_a_window_travels_exactly_and_a_malformed_one_is_not_added():
    state = window(loss=(0.1 + 0.2, 3), diverged=(math.nan, 1)).state()
    back = _window_state(_window_text(state))
    assert back["sums"]["loss"] == state["sums"]["loss"] and back["counts"] == state["counts"]  # a float's repr round-trips
    assert math.isnan(back["sums"]["diverged"])  # a diverged member's NaN reaches the line
    for text in (None, "[]", '{"sums": {"loss": "1"}, "counts": {}}', '{"sums": {}, "counts": {"loss": -1}}', "{"):
        assert _window_state(text) is None
    assert window(loss=(2.0, 4)).averages_with([]) == {"loss": 2.0}  # nobody heard: the decider's own rows
