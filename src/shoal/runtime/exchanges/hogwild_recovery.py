"""Distributed Hogwild: how a group recovers. A live group lets a restarted group's process in when it knocks at the
door (a channel of their own, the live values of the slices this group masters, this group's copy of the restarted
group's slices as of their last sync, that sync's step and time, and this group's step now); a restarted process
rejoins by knocking at the live groups, taking those and joining at their step (runtime/exchanges/hogwild.py tells the
whole of it). And a group's part of a checkpoint: what the chief's file does not hold of it.

A mixin of HogwildExchange (runtime/exchanges/hogwild_group.py), whose constructor sets the state it reads: the door,
the peers and the incarnation of each this process is linked with, the slices asked for and served, the values at the
last syncs and when they were, the peers' steps, the links and (compressed) `known` and the codecs.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from shoal.errors import warn
from shoal.neuralnet import checkpoint as ckpt_io
from shoal.comm import dist as comm
from shoal.comm import heartbeat
from shoal.runtime.exchanges.compression import codecs_state, load_codecs_state, wire_bytes
from shoal.runtime.exchanges.hogwild import ADMIT_POLL_S, TAG_JOIN_INFO, TAG_JOIN_LIVE, TAG_JOIN_YOURS
from shoal.runtime.exchanges.requests import gather, let_in, scatter


def reshare(skipped: int, group: int, ngroups: int) -> int:
    """Group `group`'s share of `skipped` steps over `ngroups` groups: an even split, the lower group numbers taking
    one more each where it does not divide (the same answer in every process; it never shrinks as `skipped` grows)."""
    return skipped // ngroups + (1 if group < skipped % ngroups else 0)


class HogwildRecovery:
    """A group's restarts (letting one in, rejoining as one), its share of the skipped steps, and its checkpoint state."""
    end_step = None  # the step this group trains to, once it reached train_steps (steps_to_train)
    alone = False  # restarted after every other group had finished: it trains no share (rejoin)
    train_steps = 0

    def _await_announced(self) -> None:
        """Wait (up to the comm timeout) for the groups whose restart the launcher announced to knock and be let in."""
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline and any(self._knocks_expected(g) for g in self.peers):
            time.sleep(ADMIT_POLL_S)

    def _knocks_expected(self, group: int) -> bool:
        """Whether a restarted process of `group` that this process has not let in yet will knock here."""
        newest = self.door.incarnation(group)
        return (newest > self.linked[group] and self.door.given_up(group) < newest
                and self._knocks_at(self.group, self.incarnation, group) and self.door.state(group, group) != "finished")

    def _knocks_at(self, group: int, incarnation: int, knocker: int) -> bool:
        """Whether a restarted process of `knocker` knocks at `group`'s process (at incarnation `incarnation` of it):
        at those that started with the job, and at restarted ones of a lower group number (one channel per pair)."""
        return incarnation == 0 or group < knocker

    def _admit(self) -> None:
        """Let in each restarted group's process that knocks (a thread of its own, until this group finished)."""
        while not self._closing:
            for group in self.peers:
                try:
                    incarnation = self.door.incarnation(group)
                    nonce = None
                    if incarnation > self.linked[group] and self.door.given_up(group) < incarnation:
                        nonce = self.door.hello(self.group, group, incarnation)
                except RuntimeError:  # the job's store is gone: the job is ending
                    return
                if nonce is None or self._closing:
                    continue
                try:
                    self._let_in(group, incarnation, nonce)
                except RuntimeError as err:  # it died again half-way: its next restart knocks anew
                    self.linked[group] = incarnation
                    warn(f"WARNING: worker group {self.group} could not let worker group {group} in: {comm.describe_error(err)}")
            time.sleep(ADMIT_POLL_S)

    def _let_in(self, group: int, incarnation: int, nonce: str) -> None:
        """Open the channel the knock of `group`'s incarnation `incarnation` asked for; send it the live values of
        this group's slices, this group's copy of its slices as of their last sync and that sync's step and time;
        then sync with it again both ways."""
        rank = self.peers[group]
        channel = let_in(self.door, self.door.accept(self.group, group, incarnation, nonce))
        if channel is None:
            self.log(f"server group {self.group} refused a process knocking as worker group {group}: it could not prove it "
                     "holds the job's secret")
            self.linked[group] = incarnation
            return
        asked = self.asked[rank][1]
        with self.lock:
            live = gather(self.store, self.served[0])
            theirs = self.last_sync[rank].clone() if asked else torch.zeros(0, device="cpu")
        synced_at = int(self.synced_at.get(rank, 0.0) * 1000)
        # its step at its last sync here, when that was, and this group's step now (the restarted group joins at its peers')
        info = [self.peer_steps.get(group, self.began_at), synced_at, max(self.steps_done, self.began_at)]
        channel.send(torch.tensor(info, dtype=torch.int64, device="cpu"), TAG_JOIN_INFO)
        if self.served[1]:
            channel.send(live, TAG_JOIN_LIVE)
        if asked:
            channel.send(theirs, TAG_JOIN_YOURS)
        heartbeat.revive(rank)  # the launcher said its predecessor was done: watch the new process
        with self.lock:
            self.links[rank] = channel
            self._late.pop(rank, None)  # a sync its dead predecessor never answered: given up
            if self.codecs is not None:
                self.known[group] = live.clone()  # what it holds of this group's slices now
            if asked:
                self.requests[rank] = self.asked[rank]
        self._answer(group, rank)
        self.linked[group] = incarnation  # (last: finish waits for this, then for the thread that answers it)
        self.log(f"worker group {self.group} syncs with worker group {group} again (its restart {incarnation})")

    def rejoin(self, incarnation: int, end_step: Optional[int] = None) -> tuple[int, str]:
        """This process was restarted in its group's dead one's place: knock at every live group, take the live values
        of the slices each masters and this group's own slices from the latest of their syncs with it; returns the step
        it joins at, its peers' (the slowest live group's, and never before its last sync: it ends no later than they do
        and skips the fewest rows), and what it took, in words. `skipped` holds the steps it skips, [first, joined):
        from its last sync (its updates since were lost with its process) to its peers' step, whose rows it never
        trains then, as a step without a process skips its rows under AllReduce; it says them in the job's store, and
        every group re-trains a share of them at its end (steps_to_train). `end_step` (the job's train_steps): the step
        of a group that finished, and the latest it joins at (a group past it trains its share of skipped steps; None:
        neither counts). Where every other group had finished, it trains nothing more (`alone`): the chief's values,
        the job's result, are final, and nobody answered to say what it skipped."""
        self.incarnation = incarnation
        steps, latest, own, linked, peers_at = [0], -1, None, [], []
        finished = [] if end_step is None else [end_step]  # a finished group is at the end: nothing is left to train
        for group, rank in self.peers.items():
            theirs, state = self.door.incarnation(group), self.door.state(group, group)
            if state == "finished":
                peers_at += finished
                continue
            if state != f"serving {theirs}" or self.door.given_up(group) >= theirs or not self._knocks_at(group, theirs, self.group):
                continue  # not running, or it knocks here itself (then it is let in by _admit)
            try:
                channel = self.door.knock(group, self.group, incarnation, self.timeout_s)
                if channel is None:  # it finished meanwhile
                    peers_at += finished
                    continue
                info = torch.zeros(3, dtype=torch.int64, device="cpu")
                live = torch.zeros(self.asked[rank][1], device="cpu")
                mine = torch.zeros(self.served[1], device="cpu")
                channel.recv(info, TAG_JOIN_INFO)
                if live.numel():
                    channel.recv(live, TAG_JOIN_LIVE)
                if mine.numel():
                    channel.recv(mine, TAG_JOIN_YOURS)
            except RuntimeError as err:
                warn(f"WARNING: worker group {self.group} could not reach worker group {group} to rejoin: {comm.describe_error(err)}; "
                     "it does not sync with it")
                continue
            self._count(wire_bytes([info, live, mine]))  # what rejoining took from this group
            with self.lock:
                scatter(self.store, live, self.asked[rank][0])
                self.links[rank] = channel
                if self.codecs is not None:
                    self.known[group] = mine.clone()  # what that group holds of this group's slices
            self.last_sync[rank] = live
            self.linked[group] = theirs
            linked.append(group)
            steps.append(int(info[0]))
            peers_at.append(int(info[2]))
            if int(info[1]) > latest:
                latest, own = int(info[1]), (group, mine)
        self.requests = {rank: self.asked[rank] for rank in self.links if self.asked[rank][1]}
        if own is not None and self.served[1]:
            with self.lock:
                scatter(self.store, own[1], self.served[0])
        # its last sync's step: the last whose work the live groups hold (an earlier restart of it joined at its step
        # with the live values, as a sync: killed before it synced again, it did not skip those steps twice)
        earlier = [said[1] for i in range(1, incarnation) if self.door is not None
                   and (said := self.door.skipped(self.group, i)) is not None]
        synced = max(steps + earlier[-1:]) if linked else max(steps)
        # a live group past train_steps trains its share of skipped steps: this group's own steps end at train_steps
        peers_at = [min(at, end_step) for at in peers_at] if end_step is not None else peers_at
        step = max(synced, min(peers_at, default=synced))  # (a live group behind its last sync: from that sync)
        # (where no group answered, the step of its last sync is not known here: nothing is said of what it skipped)
        self.skipped = (synced, step) if linked else None
        self.alone = not linked and bool(peers_at)  # every other group had finished: it re-trains no share either
        if self.door is not None and linked:  # every group re-trains its share of them at its end (steps_to_train)
            self.door.say_skipped(self.group, incarnation, synced, step)
            self.door.say_waiting(self.group, -1)  # (its dead predecessor's word does not stand: it trains)
        self.updates = self.server.updates = step  # the sync cadence and the LR schedule's step go on from there
        self.steps_done = step
        self._start()
        if not linked:
            took = "every other group had finished: nothing is left to train" if peers_at else \
                "no live group answered: it trains on alone from its start values"
        else:
            masters = " and ".join(", ".join(map(str, linked)).rsplit(", ", 1))
            took = (f"the live values of the slices worker group{'s' if len(linked) > 1 else ''} {masters} "
                    f"master{'' if len(linked) > 1 else 's'}")
        if own is not None and self.served[1]:
            took += f", and its own slices as worker group {own[0]} last synced them (its updates since that sync were lost)"
        if step > synced and linked:
            which = f"steps {synced} to {step - 1} ({step - synced} steps" if step - synced > 1 else f"step {synced} (1 step"
            took += (f"; it skipped {which}, to its peers' step: what it trained of them was lost with its process; every "
                     "group re-trains a share of that many steps beyond train_steps, on its shard's next rows)")
        return step, took

    # -- the steps restarted groups skipped, re-shared over every group at its end --------------------------------
    def steps_to_train(self, train_steps: int) -> int:
        """The step this group trains to: `train_steps` plus its share of the steps the restarted groups skipped so far
        (skipped_total: each restarted process said its own in the job's store when it rejoined), split by group index
        (reshare). Asked when the group reaches train_steps and again once it trained to the answer (a skip may land
        late: a restart the launcher announced is let in, and its skip awaited, first); with its share trained it
        waits, counting again, while a peer still trains, and ends once every peer has the same count's share trained
        (`g<G>/waiting`), finished or is gone."""
        if self.door is None or self.alone:
            return max(train_steps, self.steps_done)
        self.train_steps = train_steps
        while True:
            self._await_announced()
            self._await_skips_said()
            skipped = self.skipped_total()
            self.end_step = max(train_steps + reshare(skipped, self.group, self.ngroups), self.steps_done)
            if self.end_step > self.steps_done:
                self.door.say_waiting(self.group, -1)  # training its share: the others wait for it
                return self.end_step
            # its share is trained: it waits while a peer still trains, so that a skip said meanwhile (a peer killed
            # or stopped near the end, restarted) is re-shared with it too; done once every peer waits at the same
            # count, has finished or is gone (a group in its finish still lets a restarted one in: hogwild_group.finish)
            self.door.say_waiting(self.group, skipped)
            if all(self._peer_done(group, skipped) for group in self.peers):
                return self.end_step
            time.sleep(ADMIT_POLL_S)

    def _peer_done(self, group: int, skipped: int) -> bool:
        """Whether `group` trains no more of the skipped steps (as this group counts them: `skipped`)."""
        if self._knocks_expected(group):  # a restart announced: it is let in first, its skip then counted
            return False
        if self.door.resharing(group) is not None or self.door.waiting(group) == skipped:
            return True
        answering = self._threads.get(group)
        return answering is None or not answering.is_alive() or heartbeat.is_stalled(self.peers[group])

    def skipped_total(self) -> int:
        """The steps every restarted group's process skipped so far, over every group and restart (the job's store)."""
        return sum(self._skipped_by_group().values())

    def _skipped_by_group(self) -> dict[int, int]:
        """Per group, the steps its restarted processes said they skipped (the job's store)."""
        skipped = {}
        for group in range(self.ngroups):
            said = (self.door.skipped(group, incarnation) for incarnation in range(1, self.door.incarnation(group) + 1))
            skipped[group] = sum(max(0, stop - first) for first, stop in filter(None, said))
        return skipped

    def _await_skips_said(self) -> None:
        """Wait (up to the comm timeout) for each restarted group this process let in to say what it skipped (it does
        once it heard from every live group), unless it died again or the launcher gave it up."""
        deadline = time.monotonic() + self.timeout_s
        for group, incarnation in self.linked.items():
            while (incarnation > 0 and self.door.skipped(group, incarnation) is None and time.monotonic() < deadline
                   and self.door.incarnation(group) == incarnation and self.door.given_up(group) < incarnation
                   and not heartbeat.is_stalled(self.peers[group]) and self.door.state(group, group) != "finished"):
                time.sleep(ADMIT_POLL_S)

    def say_resharing(self) -> None:
        """Before this group's STOP: how many skipped steps it trained beyond train_steps and its last step (the
        chief gathers every group's for summary.json's reshared_steps)."""
        if self.door is not None and self.end_step is not None:
            self.door.say_resharing(self.group, max(0, self.steps_done - self.train_steps), self.steps_done)

    def resharing_notes(self, train_steps: int) -> dict:
        """The chief's, after every group said STOP: summary.json's `reshared_steps`, the steps the restarted groups
        skipped and how many each group re-trained beyond train_steps, and `steps_per_group`, the updates each group
        applied to the job's values (train_steps − its skipped steps + its re-trained ones)."""
        if self.door is None:
            return {}
        skipped = self._skipped_by_group()
        if not any(skipped.values()):
            return {}
        retrained = {g: (said[0] if (said := self.door.resharing(g)) is not None else 0) for g in range(self.ngroups)}
        retrained[self.group] = max(0, self.steps_done - train_steps)
        return {"reshared_steps": {"skipped": sum(skipped.values()), "retrained": sum(retrained.values()),
                                   "by_group": {str(g): n for g, n in retrained.items()}},
                "steps_per_group": {str(g): train_steps - skipped[g] + retrained[g] for g in range(self.ngroups)}}

    # -- a checkpoint of the group ------------------------------------------------------
    def own_state(self) -> dict[str, torch.Tensor]:
        """What the chief's file does not hold of this group: another group's replica and updater state; every
        group's values at its last syncs, what each requester holds of its slices (compressed), its residuals
        and update counts (the sync cadence and the step an LR schedule sees)."""
        self.settle_late()
        with self.lock:
            tensors = {f"last_sync/{r}": v for r, v in self.last_sync.items()}
            tensors |= {"count/updates": torch.tensor(self.updates, device="cpu"), "count/server_updates": torch.tensor(self.server.updates, device="cpu"),
                        "count/bytes_sent": torch.tensor(self.own_bytes, device="cpu")}
            if self.codecs is not None:
                tensors |= {f"known/{g}": v.clone() for g, v in self.known.items()}
                tensors |= codecs_state("delta", self.delta_codecs)
            if not self.chief:
                tensors |= {f"value/{n}": v.clone() for n, v in self.store.values.items()}
                for name, slots in self.server.state_dict().items():
                    tensors |= {f"state/{name}/{slot}": v.clone() for slot, v in slots.items()}
        return tensors

    def load_own_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.last_sync = {r: tensors[f"last_sync/{r}"].clone() for r in self.requests if f"last_sync/{r}" in tensors}
        if self.codecs is not None:
            self.known = {g: tensors[f"known/{g}"].clone() for g in self.peers if f"known/{g}" in tensors}
        self.updates = int(tensors.get("count/updates", 0))
        self.server.updates = int(tensors.get("count/server_updates", 0))
        self.own_bytes = int(tensors.get("count/bytes_sent", 0))  # a resumed run counts on
        if self.codecs is not None:
            load_codecs_state("delta", self.delta_codecs, tensors)
        values, state = ckpt_io.values_and_state(tensors)
        if values:
            self.store.load(values, strict=True)
            self.server.load_state(state)
