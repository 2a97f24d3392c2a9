"""Distributed Hogwild over processes: each group updates its own replica, replicas meet every sync_freq.

Each process hosts a whole worker group and its whole server group (SINGA's
Caffe-style layout, nserver_groups = nworker_groups, co-located). Updates are
local: the group's server applies them to the group's own replica at once.
Every `sync_freq` local updates the group synchronises the slices it does not
master with their master group (slice i's master is group i mod
nserver_groups, shoal.planning.placement), with SINGA's delta rule:
  1. the requester sends Δ = cur − last_sync,
  2. the master adds Δ to its replica and answers with its fresh value,
  3. the requester sets cur = master + (cur − value at sending) and last_sync = master.
The request is made between two local updates, so "cur − value at sending" is 0
here and the requester takes the master's value; an answer that takes longer than
SYNC_PATIENCE_S (hogwild_group.py: 1 s, where a sync takes milliseconds; not the first
with that master, which waits for its loop to start) is waited for on its own thread
while the group trains on, and applied by that rule when it
comes (no new sync goes to that master meanwhile), so a slow or stopped master
holds nobody up for more than that.

Masters answer on a thread per peer group, so a group that dies only ends its
thread; its requests end with a warning and the group trains on alone. A group
whose process stops answering (no heartbeat for cluster.stall_timeout_s,
shoal.comm.heartbeat) is dropped the same way: a sync waiting for it gives up
(its receive is left pending on a thread of its own), and if it wakes later its
deltas are never added.

A group whose process dies may be restarted (shoal run --max-restarts N, launcher/rejoin.py): the new
process is in no process group of the job, so it knocks at each live group's door (`DOOR`,
shoal.comm.channels.Door) and the two talk over a channel of their own from then on. Each group it
reaches sends it the live values of the slices it masters, its own copy of the restarted group's
slices as of its last sync with them, when that sync was, the restarted group's step at it (the
header of every sync carries the requester's step; where it has not synced since the run began, the step the run
began at: a resumed run's, never step 0 again) and its own step now. The restarted group takes the live values and
its own slices from the latest of those syncs, and joins at its peers' step (the slowest live group's, never before
its last sync), skipping the steps from its last sync to there, as a step without a process skips that process's rows
under AllReduce: the data shards are a function of the step, so its rows of those steps are not trained then. It says
the steps it skipped in the job's store (shoal.comm.channels.Door.say_skipped), and every group, once it reaches
train_steps, trains its share of all the steps skipped so far (an even split by group index, hogwild_recovery.reshare)
beyond train_steps, on its shard's next rows, then waits while a peer still trains, counting again (a restart the
launcher announced is let in and its skip awaited first; a group in its finish keeps its door open until every peer
said STOP): the job applies as many updates as unfaulted, and its wall time grows by about
K / groups steps for K skipped, not K. What it had done since its last sync, and the updater state of its server, are
lost. The groups it reached then sync with it again, both ways. A restarted process knocks
at the groups that started with the job and at restarted ones of a lower group number (never both
ways, so two restarted groups make one channel); a group that is not running then is not synced with.

Every group starts from the same values (the job's seed, its checkpoint_path or the checkpoint a
run resumes from), taken as last_sync when the group begins its first step; its masters start
serving then too. Compressed (cluster.compression), the requester sends its encoded Δ (top-k:
what it did not send stays in its residual and goes with the next Δ) and the master answers with
the encoded change of its slices since what this requester holds (`known`, which the master
tracks from those common start values: the part of the change it did not send is still in the
next difference, so the answer needs no residual). The requester's copy of a master's slices is
then `known`, which trails the master's by what was not sent yet.

Where each part is: this module holds the protocol (its kinds, tags, door and how a peer is reached, shared by every
part); runtime/exchanges/hogwild_group.py a group's own steps, its syncs and its finish (HogwildExchange),
hogwild_master.py the group as master of its slices (answering the other groups' syncs), hogwild_recovery.py how a
group recovers (letting a restarted group in, rejoining as one, and the checkpoint's state of a group);
runtime/exchanges/requests.py the request/response mechanics they share with Downpour.
"""
from __future__ import annotations

import torch

from shoal.planning.placement import Placement
from shoal.comm import dist as comm
from shoal.comm.channels import HOGWILD_DOOR

SYNC, STOP, SYNC_ENCODED = 1, 2, 3
KINDS = 4  # a sync's header is one int64: its kind + KINDS * the requester's steps (where a restarted group's skipped steps begin)
TAG_SYNC_HEADER, TAG_SYNC_DELTA, TAG_SYNC_VALUE, TAG_SYNC_DELTA_2, TAG_SYNC_VALUE_2 = 21, 22, 23, 24, 25
TAG_JOIN_INFO, TAG_JOIN_LIVE, TAG_JOIN_YOURS = 26, 27, 28  # what a live group sends a restarted one that knocked
DOOR = HOGWILD_DOOR  # the store's door at which a restarted group's process knocks (shoal.comm.channels.Door)
ADMIT_POLL_S = 0.1  # how often a group looks for a restarted group's knock


class WorldLink:
    """Messages with a peer that started with the job, over the job's world process group."""

    def __init__(self, rank: int):
        self.rank = rank

    def send(self, tensor: torch.Tensor, tag: int) -> None:
        comm.send(tensor, self.rank, tag)

    def irecv(self, tensor: torch.Tensor, tag: int):
        return comm.irecv(tensor, self.rank, tag)


def mastered_by(placement: Placement, trainable: set[str], group: int) -> list:
    """The slices whose master copy lives in server group `group`."""
    return [s for s in placement.slices if s.param in trainable and placement.master_group_of_slice(s.index) == group]
