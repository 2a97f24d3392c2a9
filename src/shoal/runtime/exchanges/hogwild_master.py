"""Distributed Hogwild: a group as master of its slices, answering the other groups' syncs (SINGA's delta rule, step 2:
the master adds the requester's Δ to its replica and answers with its fresh value; compressed, with the encoded change
since what that requester holds). One thread per peer group, so a group that dies or stalls only ends its own thread.
The protocol: runtime/exchanges/hogwild.py.

A mixin of HogwildExchange (runtime/exchanges/hogwild_group.py), whose constructor sets the state it reads: the store,
its lock, the slices this group masters (`served`), the links to its peers, `known` and the answers' codecs
(compressed), and the peers' steps and bytes it records.
"""
from __future__ import annotations

import threading

import torch

from shoal.errors import warn
from shoal.comm import dist as comm
from shoal.comm import heartbeat
from shoal.runtime.exchanges.compression import wire_bytes
from shoal.runtime.exchanges.hogwild import (KINDS, STOP, SYNC_ENCODED, TAG_SYNC_DELTA, TAG_SYNC_DELTA_2,
                                            TAG_SYNC_HEADER, TAG_SYNC_VALUE, TAG_SYNC_VALUE_2)
from shoal.runtime.exchanges.requests import gather, post


class HogwildMaster:
    """The answering side of a group's syncs (the requesting side: HogwildExchange)."""

    def _answer(self, group: int, rank: int) -> None:
        """Start the thread that answers `group`'s process `rank` over its link."""
        key = len(self._peer_bytes)
        self._peer_bytes[key] = 0
        self._served_links[group] = self.links[rank]
        self._threads[group] = threading.Thread(target=self._serve, args=(group, rank, self.links[rank], key),
                                                name=f"shoal-sync-group{group}", daemon=True)
        self._threads[group].start()

    def _serve(self, group: int, rank: int, link, key: int) -> None:
        """Answer `group`'s syncs. The next request's receives are posted before this answer is sent, as the
        requester posts its answer's before it asks (requests.Posted says why: else the two groups' syncs alternate
        instead of crossing). `key`: this thread's entry of _peer_bytes."""
        segments, size = self.served
        header = torch.zeros(1, dtype=torch.int64, device="cpu")
        codec = self.answer_codecs[group] if self.codecs is not None else None
        received = codec.buffers(size) if codec is not None else [torch.zeros(size, device="cpu")]

        def post_next():  # a group that masters nothing is never asked, only told to stop
            return post(link, [(header, TAG_SYNC_HEADER)] + [(part, tag) for part, tag in zip(received, (TAG_SYNC_DELTA, TAG_SYNC_DELTA_2)) if size])

        try:
            receives = post_next()
            while True:
                receives.wait()
                kind, steps = int(header[0]) % KINDS, int(header[0]) // KINDS
                if kind == STOP:  # its Δ is zeros, sent so that no receive is left pending; its header, the peer's bytes
                    self._peer_bytes[key] = steps
                    self._stopped_links.add(id(link))
                    return
                delta = codec.decode(received, size) if codec is not None else received[0]
                if heartbeat.is_stalled(rank):  # it woke after being dropped: its delta is stale, never added
                    self.log(f"server group {self.group} refused a sync of worker group {group}, dropped after it stalled")
                    return
                with self.lock:
                    for s in segments:
                        self.store.values[s.param].view(-1)[s.start : s.stop].add_(delta[s.offset : s.offset + s.size])
                    fresh = gather(self.store, segments)
                self.peer_steps[group] = steps
                encoded = kind == SYNC_ENCODED
                receives = post_next()  # Δ is added: its buffers take the next request
                if encoded:  # the change since what the requester holds
                    parts = codec.encode(fresh - self.known[group])
                    self.known[group] += codec.decode(parts, size)
                    for part, tag in zip(parts, (TAG_SYNC_VALUE, TAG_SYNC_VALUE_2)):
                        link.send(part, tag)
                    self._peer_bytes[key] += 8 + wire_bytes(received + parts)  # as the requester counts it
                    continue
                link.send(fresh, TAG_SYNC_VALUE)
                self._peer_bytes[key] += 8 + wire_bytes(received + [fresh])
        except RuntimeError as err:
            if not heartbeat.is_stalled(rank):  # a stalled group was dropped already (the chief warned)
                warn(f"WARNING: server group {self.group} drops worker group {group} (process {rank}): {comm.describe_error(err)}")
