"""Downpour's mirror: the chief's copy of what a server holds that no worker does, and the messages that set a server.

A stub already holds its newest answer's values of every slice, so the chief mirrors only each server's updater
state and counters (MIRROR, every `mirror_interval` of its steps). A server restarted in a dead one's place is set
from that mirror and the chief's newest values (HEAL); in a user's loop every server starts from the chief's module's
values and, resumed, the checkpoint's updater state (FIRST). Both sides of each message are here, so its layout
reads once (runtime/exchanges/downpour.py: the protocol).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from shoal.runtime.exchanges.downpour import FIRST, HEAL, MIRROR, TAG_HEADER, TAG_MIRROR, TAG_STATE, TAG_VALUES
from shoal.runtime.exchanges.requests import words

# the chief refreshes its mirror of a server's updater state so that the mirror adds at most this share to the
# bytes the chief moves with that server (a gradient out and the values back per step): mirror_interval
MIRROR_SHARE = 0.25
COUNTERS_EVERY = 50  # an updater without state: the mirror holds counters only (steps, updates per group, bytes)


def mirror_interval(state_elements: int, shard_elements: int) -> int:
    """Every how many of its steps the chief refreshes its mirror of a server's updater state (the cost model's
    choice): the state's bytes spread over K steps are at most MIRROR_SHARE of the 2 x shard bytes a step moves with
    that server, so K = ceil(state / (MIRROR_SHARE x 2 x shard)): momentum every 2 steps, Adam every 4. The values
    need no refresh (the chief holds its newest answer's). Plain SGD (no state): every COUNTERS_EVERY steps, the
    counters only (a round trip per step would cost more than what it keeps)."""
    if state_elements <= 0 or shard_elements <= 0:
        return COUNTERS_EVERY
    return max(1, math.ceil(state_elements / (MIRROR_SHARE * 2 * shard_elements)))


def counters(version: int, bytes_moved: int, steps: list[int], applied: list[int], lag_counts: torch.Tensor) -> torch.Tensor:
    """What a mirror holds besides the updater state: [version, bytes moved, groups, each group's steps, each
    group's updates applied, the lag histogram's width, its counts (group-major)]."""
    return words(version, bytes_moved, len(steps), *steps, *applied, lag_counts.shape[1], *lag_counts.reshape(-1).tolist())


@dataclass
class Heal:
    """A HEAL as the server reads it: the chief's newest values and their `version`, and its mirror (the updater
    state of `mirrored_version`, -1: no mirror yet, and the counters)."""

    values: torch.Tensor
    state: torch.Tensor
    version: int
    mirrored_version: int
    bytes_moved: int
    steps: list[int]
    applied: list[int]
    lags: list[dict[int, int]]  # per group: updates applied per lag


# -- the chief's refresh of its mirror (MIRROR) ------------------------------------------------------------------
def ask_mirror(channel, step: int, state_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The chief: a server's updater state and counters now."""
    channel.send(words(MIRROR, step, 0), TAG_HEADER)
    state, length = torch.zeros(state_size, device="cpu"), torch.zeros(1, dtype=torch.int64, device="cpu")
    channel.recv(state, TAG_STATE)
    channel.recv(length, TAG_MIRROR)
    mirrored = torch.zeros(int(length), dtype=torch.int64, device="cpu")
    channel.recv(mirrored, TAG_MIRROR)
    return state, mirrored


def answer_mirror(channel, state: torch.Tensor, mirrored: torch.Tensor) -> None:
    """The server's answer to MIRROR."""
    channel.send(state, TAG_STATE)
    channel.send(words(mirrored.numel()), TAG_MIRROR)
    channel.send(mirrored, TAG_MIRROR)


# -- a restarted server set from the chief's mirror (HEAL) --------------------------------------------------------
def send_heal(channel, step: int, version: int, values: torch.Tensor, mirror: Optional[tuple[torch.Tensor, torch.Tensor]],
              state_size: int) -> None:
    """The chief: its newest values of the server's slices and their version, its mirror of the updater state and the
    counters (none yet: the server keeps the updater's first state)."""
    if mirror is None:
        state, mirrored = torch.zeros(state_size, device="cpu"), words(version, -1, 0, 0)
    else:
        state, mirrored = mirror[0], torch.cat([words(version), mirror[1]])
    channel.send(words(HEAL, step, version), TAG_HEADER)
    channel.send(values, TAG_VALUES)
    answer_mirror(channel, state, mirrored)


def receive_heal(channel, size: int, state_size: int) -> Heal:
    """The server, after HEAL's header: the rest of it."""
    values, state = torch.zeros(size, device="cpu"), torch.zeros(state_size, device="cpu")
    length = torch.zeros(1, dtype=torch.int64, device="cpu")
    channel.recv(values, TAG_VALUES)
    channel.recv(state, TAG_STATE)
    channel.recv(length, TAG_MIRROR)
    mirrored = torch.zeros(int(length), dtype=torch.int64, device="cpu")
    channel.recv(mirrored, TAG_MIRROR)
    c = mirrored.tolist()
    version, mirrored_version, bytes_moved, ngroups = c[0], c[1], c[2], c[3]
    steps, applied = c[4 : 4 + ngroups], c[4 + ngroups : 4 + 2 * ngroups]
    width = c[4 + 2 * ngroups] if len(c) > 4 + 2 * ngroups else 0
    flat = c[5 + 2 * ngroups :]
    lags = [{lag: flat[i * width + lag] for lag in range(width) if flat[i * width + lag]} for i in range(ngroups)]
    return Heal(values, state, version, mirrored_version, bytes_moved, steps, applied, lags)


# -- a user's loop: every server starts from the chief's values (FIRST) ------------------------------------------
def send_first(channel, step: int, version: int, values: torch.Tensor, state: torch.Tensor, resumed: bool) -> None:
    """The chief: its module's values of the server's slices and, `resumed`, the checkpoint's updater state."""
    channel.send(words(FIRST, step, version), TAG_HEADER)
    channel.send(values, TAG_VALUES)
    channel.send(words(1 if resumed else 0), TAG_STATE)
    channel.send(state, TAG_STATE)


def receive_first(channel, size: int, state_size: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The server, after FIRST's header: the values, and the updater state when the loop resumed (else None)."""
    values, state = torch.zeros(size, device="cpu"), torch.zeros(state_size, device="cpu")
    resumed = torch.zeros(1, dtype=torch.int64, device="cpu")
    channel.recv(values, TAG_VALUES)
    channel.recv(resumed, TAG_STATE)
    channel.recv(state, TAG_STATE)
    return values, state if int(resumed) else None
