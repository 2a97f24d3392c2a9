"""A process held up for less than the stall timeout judges nobody stalled when it runs again.

Its peers count its silence from its last beat, so they may drop it (they saw it silent past the timeout); but
its own watch must not count the time it did not run as the store's or a peer's silence. Before the fix, a stop
just under the timeout, added to the time since its last beat, read as "the job's store stopped answering" and
failed the job (found by a shortened tests/test_stalls.py test under load).

The watch's two threads are held up at their waits, as a stopped process's are: the watch thread for 0.5 s (under
the 0.6 s timeout, so not a wake from a stop past it), the beat thread 0.8 s longer (a process starved of CPU after
SIGCONT, its store requests later still: past the timeout, so only a watch that counts the store's silence from an
unanswered request, and a peer's up to the last read, passes; the earlier fix, which discounted the watch thread's
own hold-up, fails it (3 of 3) and, with the beat 0.3 s late, under load now and then).
"""
from __future__ import annotations

import datetime
import threading
import time

import torch.distributed as dist

from shoal.comm.heartbeat import Watch

TIMEOUT_S = 0.6


class HeldUp(threading.Event):
    """A watch's stop event whose waits can be held up, per thread, until a moment: a stopped process."""

    def __init__(self):
        super().__init__()
        self.until: dict[str, float] = {}  # the thread's target's name (_beat, _watch) -> until when

    def wait(self, timeout=None):
        stopped = super().wait(timeout)
        pause = self.until.get(threading.current_thread()._target.__name__, 0.0) - time.monotonic()
        if pause > 0 and not stopped:
            time.sleep(pause)
        return stopped


def test_a_watch_held_up_under_the_timeout_judges_neither_the_store_nor_its_peers():
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
    stalls, peers_stalls = [], []
    host = Watch(store, rank=0, world=2, on_stall=peers_stalls.append, timeout_s=TIMEOUT_S).start()  # beats on, hosts the store
    watched = Watch(store, rank=1, world=2, on_stall=stalls.append, timeout_s=TIMEOUT_S, store_host=0)
    held = watched._stop = HeldUp()
    watched.start()
    try:
        time.sleep(2 * TIMEOUT_S)  # beating, both seen
        assert stalls == []
        now = time.monotonic()
        held.until = {"_watch": now + 0.5, "_beat": now + 1.3}
        time.sleep(1.3 + 2 * TIMEOUT_S)  # held up, then runs again for a few timeouts
        assert 1 in [s.rank for s in peers_stalls]  # its peer saw it silent past the timeout: really held up
        assert stalls == [], [(s.rank, s.store, round(s.silent_s, 2)) for s in stalls]
    finally:
        watched.stop()
        host.stop()
