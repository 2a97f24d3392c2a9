"""Downpour over processes: worker groups push gradients to one server group and pull fresh params.

Each worker group is synchronous inside (its processes sum their gradients
into the group's stub, its lowest rank, and receive the new params from it);
groups are asynchronous to each other. Per step a stub sends every server the
gradient of the slices it owns (SINGA's lcm slicing, shoal.planning.placement) with the
version of the params the group computed on; the server applies the updater
to its slices at once (the LR step is the slice version, as SINGA's), bumps
the version and answers with the new values, the new version and the
staleness of that update (updates other groups made in between).

Stubs and servers talk over channels of their own (shoal.comm.channels: a
two-process gloo group per server, group and incarnation, built through the
job's store), not over the job's world process group, so that a process can
take a dead one's place. A server serves each group on a thread with blocking
receives from that group's stub. A group whose process dies only ends that
thread (the server warns and goes on); the server then waits for a new process
of the group (shoal.launcher.rejoin: restarted by the launcher or by hand),
which pulls the live values, the version and the steps its group has done,
and trains the steps left. A push in flight when a process died is lost whole
(a server applies a push once it received all of it). The chief's last
request waits until every group has stopped or is gone with no new process
announced, so the final test and checkpoint see the model every group
trained; then the servers close. A group other than 0 whose stub stops
answering (no heartbeat for cluster.stall_timeout_s, shoal.comm.heartbeat) is
dropped the same way, though its thread stays blocked in its receive; if the
group wakes later, its pushes are refused (answered with version -1, never
applied) and it leaves.

A server's death, under cluster.max_restarts (Strategy.servers_heal): the
launcher announces the server's next restart at the door (server<S>/restart)
and starts a new process in its place (shoal.launcher.rejoin); every stub that
finds its channel to the server closed waits for that word (SERVER_ANNOUNCEMENT_S;
without it, ServerLost as before) and knocks at the new process's keys. A stub does not rely on the channel's
close alone: under load gloo now and then leaves a call on a dead server's link (a push's send, a wait for its
answer) blocked for the whole comm timeout (45 s), so every call on a server's channel, and the knock, is given up
on the launcher's signed word that the process it reaches died (requests.Guarded; the word of the restart that
channel was opened at, not the newest one). The
mirror is the chief's: a stub already holds its newest answer's values of every
slice, so the chief keeps only what a worker lacks, each server's updater state
and counters (version, each group's steps and updates, bytes), asked for with
MIRROR every `mirror_interval` of its steps (the cost model's choice). The chief
heals the new server with HEAL: its newest values and their version, and that
mirror; the server answers nobody before. Every other stub then pulls the healed
values (PULL) and goes on. Lost: the updates the dead server applied after the
version of the chief's newest answer (other groups' pushes during the chief's
current step), every push in flight (dropped, never sent again: the values it
was computed on are gone), and the updater state's progress since the last
refresh (at most `mirror_interval` of the chief's steps old).

Where each part is: this module holds the protocol (its kinds, tags, door and errors, shared by both sides);
runtime/exchanges/downpour_server.py the server (DownpourServer), downpour_stub.py a worker group's side
(DownpourExchange), downpour_mirror.py the chief's mirror and the messages that heal a server (HEAL) or start it
from a user's loop's values (FIRST); runtime/exchanges/requests.py the request/response mechanics they share with
Distributed Hogwild.
"""
from __future__ import annotations

import math

from shoal.comm.channels import DOWNPOUR_DOOR
from shoal.neuralnet.params import ParamStore
from shoal.neuralnet.updaters import Updater
from shoal.runtime.exchanges.requests import Segment

PUSH, STOP, STATE, FINAL, PULL, MIRROR, HEAL, FIRST = 1, 2, 3, 4, 5, 6, 7, 8
REFUSED = -1  # the version a server answers a dropped group with
DOOR = DOWNPOUR_DOOR  # the channels' keys in the job's store (shoal.comm.channels)
ANNOUNCEMENT_S = 2.0  # how long a server waits for the launcher to say whether a dead group is restarted
TAG_HEADER, TAG_GRAD, TAG_VALUES, TAG_REPLY, TAG_STATE, TAG_HAS_GRAD, TAG_LAGS, TAG_BYTES = 11, 12, 13, 14, 15, 16, 17, 18
TAG_MIRROR = 19  # a mirror's counters (MIRROR's answer, HEAL's request)
TAG_HYPER = 20  # a push's hyper-parameters (a user's loop: its optimizer's lr, betas... as its scheduler left them)
SERVER_ANNOUNCEMENT_S = 10.0  # how long a stub that lost its server waits for the launcher to say it restarts it


def server_key(server_id: int, restart: int):
    """A server's keys at the door: its first process's are its id, as before; a restart's are its own."""
    return server_id if restart == 0 else f"{server_id}r{restart}"


def state_layout(updater: Updater, store: ParamStore, segments: list[Segment]) -> list[tuple[Segment, str, int]]:
    """A server's updater state in one flat message: each segment's slots in name order, with their sizes (an
    element-wise slot the segment's, a per-param slot such as torch's Adam step whole)."""
    layout = []
    for seg in segments:
        info = store.info[seg.param]
        for slot, shape in sorted(updater.state_shapes(seg.param, tuple(info.shape)).items()):
            numel = math.prod(shape)
            layout.append((seg, slot, seg.size if numel == info.numel else numel))
    return layout


