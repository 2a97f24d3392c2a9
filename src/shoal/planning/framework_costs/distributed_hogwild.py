"""Distributed Hogwild's cost model: every cluster.sync_freq steps a group syncs with the other groups' masters (Δ
out, fresh values back) and serves its own slices to them, over the same link (runtime/exchanges/hogwild.py;
strategies/distributed_hogwild.py builds the exchange). Pure."""
from __future__ import annotations

from shoal.planning.costs import FLOAT
from shoal.planning.framework_costs.base import FrameworkCosts, Messages, Phases, encoded_parts
from shoal.planning.placement import ServerId


class DistributedHogwildCosts(FrameworkCosts):
    """Group 0's syncs, averaged over the sync_freq steps between them."""

    def traffic(self, model, move) -> None:
        """One group's step (as Downpour's): group 0's syncs with the masters of the slices it does not own."""
        self._syncs(model, move, serving=False)

    def _syncs(self, model, move, serving: bool) -> None:
        plan = model.plan
        freq, slices = max(1, plan.sync_freq), model.trainable_slices()
        rank_of = {g: plan.placement.process_of(ServerId(g, 0)) for g in range(plan.nserver_groups)}
        for master in range(1, plan.nserver_groups):  # group 0 syncs with every other group's masters
            size = sum(s.size for s in slices if plan.placement.master_group_of_slice(s.index) == master)
            move(rank_of[0], rank_of[master], (model.encoded(size) + 8) / freq)  # Δ
            move(rank_of[master], rank_of[0], model.encoded(size) / freq)  # fresh values (compressed: their change)
        if not serving:
            return
        # ... and serves its own slices to each of them, as often, over the same link
        own = sum(s.size for s in slices if plan.placement.master_group_of_slice(s.index) == 0)
        for g in range(1, plan.nserver_groups):
            move(rank_of[g], rank_of[0], (model.encoded(own) + 8) / freq)
            move(rank_of[0], rank_of[g], model.encoded(own) / freq)

    def messages(self, model) -> list[Messages]:
        """Group 0's syncs (runtime/exchanges/hogwild_group.py: HogwildExchange's requests): every sync_freq steps, per other
        group's master, a header and Δ (an encoded part each) sent, the fresh values (as many parts) received. Its own
        server answers the other groups on a thread of its own, alongside. Update here when that protocol changes."""
        plan = model.plan
        parts, freq = encoded_parts(plan.compression), max(1, plan.sync_freq)
        mine = plan.placement.process_of(ServerId(0, 0))
        return [Messages(f"a sync with group {g}'s master: {1 + parts} sends (header, Δ) + {parts} receive(s), every "
                         f"{freq} steps", (1 + 2 * parts) / freq, "message",
                         (mine, plan.placement.process_of(ServerId(g, 0)))) for g in range(1, plan.nserver_groups)]

    def phases(self, model, compute: float, links: dict) -> Phases:
        # group 0's link also carries the other groups' syncs with the slices it masters
        busy: dict[int, dict[int, list[int]]] = {rank: {} for rank in links}

        def move(src: int, dst: int, nbytes: float) -> None:
            busy[src].setdefault(dst, [0, 0])[0] += int(nbytes)
            busy[dst].setdefault(src, [0, 0])[1] += int(nbytes)

        self._syncs(model, move, serving=True)
        update = model.update_s(model.elements, model.plan.threads_per_worker, model.workers_on_host(0))
        # the syncs' copies on the host (runtime/exchanges/hogwild_group.py asks, hogwild_master.py answers), counted
        # from their code in elements moved (read + written), every sync_freq steps: asking, Δ = gather − last sync
        # (2 + 3), a zeroed answer (1), scattered (2); serving the other groups, Δ added into the slices it masters (3)
        # and those gathered to answer (2). Update here when that protocol changes.
        plan, slices = model.plan, model.trainable_slices()
        mastered = sum(s.size for s in slices if plan.placement.master_group_of_slice(s.index) == 0)
        asked = model.elements - mastered
        moved = (8 * asked + 5 * mastered * (plan.nserver_groups - 1)) / max(1, plan.sync_freq)
        copies = model.copy_s(FLOAT * moved, model.workers_on_host(0))
        terms = ({"kind": "copies", "seconds": copies,
                  "what": f"the syncs' buffers on the host: {moved:,.0f} elements moved per step (asking and serving), at the copy bandwidth"},)
        return Phases(update=update + copies, exchange=model.exchange_s(busy), terms=terms,
                      staleness=f"replicas drift for up to sync_freq = {max(1, plan.sync_freq)} local updates between syncs")
