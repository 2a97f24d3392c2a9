"""Values in the job's store that carry a MAC under the job's secret and a freshness counter.

Every user of a host can connect to the store, list its keys (torch's `list_keys`) and write any of them:
the secret-derived namespace only hides the keys from a process that cannot list them. So every value
that steers the job (heartbeats, progress, the published start and resume point, Downpour's handshake
words) is written as

    s1 <writer> <counter> <mac> <text>

- `writer`: 16 hex digits drawn once per process (a process restarted in a dead one's place, or forked,
  is a new writer); `counter`: that writer's count of the values it wrote, rising by one with each;
- `mac`: HMAC-SHA256, under a key derived from the job's secret, over the store's scope (torchrun's
  attempt), the key's name, the writer, the counter and the text: a value cannot be made without
  the secret, nor moved to another key or another attempt.

A reader takes a value only if its MAC holds and it is fresh: newer than every value of that writer this
process read at that key, or the very value it read last there (a value re-read unchanged). A value that
fails (bad MAC, an older value replayed, unparsable, over MAX_VALUE_BYTES) is ignored, never the peer's
word; it is counted (`failures`) and named once per key in this process's log. Over MAX_VALUE_BYTES
nothing is kept (the store's client has received it; it is dropped at once).

A job without a secret (the calibration's loopback pair; one process's threads) writes and reads plain
text, as before: it has nothing to authenticate with.

Counters made with the store's `add` and torch's own keys (the world's rendezvous, gloo's addresses)
cannot carry a MAC: `add` and `check`/`wait` pass through unchanged (docs/security.md lists them).
"""
from __future__ import annotations

import hashlib
import hmac
import itertools
import os
import secrets
import threading
from typing import Optional, Sequence

from shoal.errors import warn

FORMAT = "s1"
MAX_VALUE_BYTES = 16 * 1024  # every value shoal writes is a line of text (a path at most): anything longer is not ours
_MAC_HEX = 2 * hashlib.sha256().digest_size
_WRITER_HEX = 16


class SignedStore:
    """A view of a torch store whose values carry MACs under the job's secret (plain text without one).

    `scope`: where the keys live beyond the namespace (torchrun's attempt prefix: "" when there is none);
    `prefix`: what this view adds before every key (e.g. "shoal/downpour/"). Both are bound into every MAC."""

    def __init__(self, store, secret: Optional[bytes], scope: str = "", prefix: str = ""):
        self.raw = store  # the torch store: for gloo's channels, `add` counters and waits
        self.scope, self.prefix = scope, prefix
        self._key = None if secret is None else hmac.new(secret, b"shoal store values", hashlib.sha256).digest()

    @property
    def signed(self) -> bool:
        """Whether values carry MACs (the job has a secret)."""
        return self._key is not None

    def clone(self) -> "SignedStore":
        """The same view over a connection of its own (one per thread that blocks on the store)."""
        twin = SignedStore(self.raw.clone(), None, self.scope, self.prefix)
        twin._key = self._key
        return twin

    def under(self, prefix: str) -> "SignedStore":
        """The view of the keys under `prefix` (added after this view's own)."""
        view = SignedStore(self.raw, None, self.scope, self.prefix + prefix)
        view._key = self._key
        return view

    def set_timeout(self, timeout) -> None:
        self.raw.set_timeout(timeout)

    # -- values: signed when written, checked when read -----------------------------------------
    def set(self, key: str, text: str) -> None:
        name = self.prefix + key
        value = text if self._key is None else _envelope(self._key, self.scope, name, text)
        if len(value.encode()) > MAX_VALUE_BYTES:  # what shoal writes is bounded: a longer value is a bug of ours
            raise ValueError(f"a value of key {name} has {len(value.encode())} bytes; at most {MAX_VALUE_BYTES} are written")
        self.raw.set(name, value)

    def set_first(self, key: str, text: str) -> Optional[str]:
        """Write `text` at `key` unless a value is there already (one atomic request); the authentic text now there:
        `text` when this write was the first, the first writer's otherwise (None: that one failed authentication)."""
        name = self.prefix + key
        value = text if self._key is None else _envelope(self._key, self.scope, name, text)
        now = self.raw.compare_set(name, "", value)
        return text if now == value.encode() else self.verify(key, now)

    def get(self, key: str) -> Optional[str]:
        """The text at `key`; None when there is none, or when the value there failed authentication."""
        name = self.prefix + key
        if not self.raw.check([name]):
            return None
        return self.verify(key, self.raw.get(name))

    def multi_get(self, keys: Sequence[str]) -> list[Optional[str]]:
        """The texts at `keys` (every one present: one request); None for each that failed authentication."""
        return [self.verify(k, v) for k, v in zip(keys, self.raw.multi_get([self.prefix + k for k in keys]))]

    def verify(self, key: str, value: bytes) -> Optional[str]:
        """The text of `value`, read at `key`, if it is authentic and fresh; None (counted, named once) if not."""
        name = self.prefix + key
        if len(value) > MAX_VALUE_BYTES:
            return _failed(name, f"{len(value)} bytes, over the {MAX_VALUE_BYTES} any value of shoal's has")
        if self._key is None:
            return value.decode(errors="replace")
        try:
            form, writer, counter_text, mac, text = value.decode("ascii").split(" ", 4)
            counter = int(counter_text)
            if form != FORMAT or len(writer) != _WRITER_HEX or len(mac) != _MAC_HEX or counter < 0:
                raise ValueError
        except ValueError:  # UnicodeDecodeError is one
            return _failed(name, "not a signed value of shoal's")
        if not hmac.compare_digest(mac, _mac(self._key, self.scope, name, writer, counter, text)):
            return _failed(name, "its MAC does not match")
        if not _book.fresh((self._key, self.scope, name), writer, counter):
            return _failed(name, "an older value replayed")
        return text

    def delete(self, keys: Sequence[str]) -> None:
        """Remove `keys` from the store and forget their freshness here: for keys of a protocol's past rounds (a
        round's keys carry its number, so nobody reads them again: a value replayed there is never read)."""
        for key in keys:
            self.raw.delete_key(self.prefix + key)
        self.forget(keys)

    def forget(self, keys: Sequence[str]) -> None:
        """Drop this process's freshness record of `keys` (past rounds' keys it will not read again)."""
        _book.forget([(self._key, self.scope, self.prefix + k) for k in keys])

    # -- what cannot carry a MAC: passed through ----------------------------------------------
    def check(self, keys: Sequence[str]) -> bool:
        return self.raw.check([self.prefix + k for k in keys])

    def wait(self, keys: Sequence[str], timeout) -> None:
        self.raw.wait([self.prefix + k for k in keys], timeout)

    def add(self, key: str, amount: int) -> int:
        """The store's counter at `key` (unauthenticated: anyone may add to it; docs/security.md)."""
        return self.raw.add(self.prefix + key, amount)


# -- the envelope ---------------------------------------------------------------------------------
def _mac(key: bytes, scope: str, name: str, writer: str, counter: int, text: str) -> str:
    mac = hmac.new(key, b"shoal store value", hashlib.sha256)
    for part in (scope, name, writer, str(counter), text):
        data = part.encode()
        mac.update(len(data).to_bytes(4, "big") + data)
    return mac.hexdigest()


def _envelope(key: bytes, scope: str, name: str, text: str) -> str:
    writer, counter = _next_count()
    return f"{FORMAT} {writer} {counter} {_mac(key, scope, name, writer, counter, text)} {text}"


_count_lock = threading.Lock()
_writer: Optional[tuple[int, str, itertools.count]] = None  # (pid, writer id, counter): drawn again in a forked child


def _next_count() -> tuple[str, int]:
    global _writer
    with _count_lock:
        if _writer is None or _writer[0] != os.getpid():
            _writer = (os.getpid(), secrets.token_hex(_WRITER_HEX // 2), itertools.count())
        return _writer[1], next(_writer[2])


class _Freshness:
    """Per key, the newest counter of each writer this process read there, and the value it read last."""

    def __init__(self):
        self._lock = threading.Lock()
        self._newest: dict[tuple, dict[str, int]] = {}
        self._last: dict[tuple, tuple[str, int]] = {}

    def fresh(self, where: tuple, writer: str, counter: int) -> bool:
        with self._lock:
            if self._last.get(where) == (writer, counter):  # re-read unchanged
                return True
            newest = self._newest.setdefault(where, {})
            if counter <= newest.get(writer, -1):  # that writer wrote this, or something newer, before: a replay
                return False
            newest[writer], self._last[where] = counter, (writer, counter)
            return True

    def forget(self, places: Sequence[tuple]) -> None:
        with self._lock:
            for where in places:
                self._newest.pop(where, None)
                self._last.pop(where, None)


_book = _Freshness()
_failures: dict[str, int] = {}
_failures_lock = threading.Lock()


def _failed(name: str, why: str) -> None:
    with _failures_lock:
        first = name not in _failures
        _failures[name] = _failures.get(name, 0) + 1
    if first:
        warn(f"WARNING: a value of key {name} failed authentication: another local user may be writing to this job's "
             f"store ({why}; such values are ignored)")
    return None


def failures() -> dict[str, int]:
    """How many values of each key this process ignored because they failed authentication."""
    with _failures_lock:
        return dict(_failures)


def note_vanished(name: str) -> None:
    """A key shoal never deletes is gone: named once, as a value that failed."""
    _failed(name, "the key vanished")
