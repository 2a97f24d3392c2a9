"""Distributed Hogwild: asynchronous groups over processes, each with a server group of its own in its process;
the replicas sync their master slices every cluster.sync_freq steps (runtime/exchanges/hogwild.py). A dead group's
process may be restarted (cluster.max_restarts, launcher/rejoin.py): it rejoins from the other groups' live values
and goes on from the step of its last sync."""
from __future__ import annotations

from shoal.comm import channels
from shoal.neuralnet.updaters import make_updater
from shoal.planning.costs import FLOAT
from shoal.planning.placement import ServerId
from shoal.planning.strategy import Framework, Layout, Messages, Phases, Strategy, UnsupportedClusterError
from shoal.runtime import rejoined
from shoal.runtime.exchanges.compression import codec_factory
from shoal.runtime.exchanges.hogwild import DOOR, HogwildExchange
from shoal.runtime.exchanges.server import Server
from shoal.strategies.allreduce import encoded_parts


class DistributedHogwild(Strategy):
    framework = Framework.DISTRIBUTED_HOGWILD
    params_on_host = True  # request/response over gloo's point-to-point
    compressed = "syncs (deltas to the masters, and their answers)"
    compensates_async_momentum = True
    outlives_a_dead_group = True  # masters answer each group on a thread: a dead group's syncs end, the others train on
    rejoins = True  # a dead group's process may be restarted (--max-restarts): it knocks at the live groups' doors
    rejoin_door = DOOR
    rejoins_from = "from the other groups' live values"
    syncs_with_peers = True  # (a user's loop: its optimizer is the local update, the sync runs after it)

    def recognises(self, layout: Layout) -> bool:
        return layout.asynchronous_groups and layout.nprocs > 1 and layout.cluster.nserver_groups > 1

    def refuse(self, layout: Layout) -> None:
        c = layout.cluster
        for p in layout.placement.processes:  # every process holds one whole worker group and its whole server group
            if len({m.group for m in p.workers + p.servers}) != 1 or len(p.workers) != c.nworkers_per_group or len(p.servers) != c.nservers_per_group:
                raise UnsupportedClusterError(
                    "cluster: with several server groups over processes, each process must hold one whole worker group and "
                    f"its server group (Distributed Hogwild: nworkers_per_procs: {c.nworkers_per_group}, "
                    f"nservers_per_procs: {c.nservers_per_group}, nserver_groups = nworker_groups, server_worker_separate: false)"
                )
        if c.max_staleness >= 0 or c.warmup_steps > 0 or c.max_update_lag >= 0:
            raise UnsupportedClusterError("cluster: max_staleness, max_update_lag and warmup_steps apply to Downpour and in-memory "
                                          "Hogwild, not to Distributed Hogwild")

    def round_steps(self, cluster) -> tuple[int, str]:
        return (cluster.sync_freq, f"{cluster.sync_freq} steps (a sync)") if cluster.sync_freq > 1 else (1, "step")

    # -- cost model ---------------------------------------------------------------------------------
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
        """Group 0's syncs (runtime/exchanges/hogwild.py: HogwildExchange's requests): every sync_freq steps, per other
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
        # the syncs' copies on the host (runtime/exchanges/hogwild.py), counted from its code in elements moved (read +
        # written), every sync_freq steps: asking, Δ = gather − last sync (2 + 3), a zeroed answer (1), scattered (2);
        # serving the other groups, Δ added into the slices it masters (3) and those gathered to answer (2). Update here
        # when that protocol changes.
        plan, slices = model.plan, model.trainable_slices()
        mastered = sum(s.size for s in slices if plan.placement.master_group_of_slice(s.index) == 0)
        asked = model.elements - mastered
        moved = (8 * asked + 5 * mastered * (plan.nserver_groups - 1)) / max(1, plan.sync_freq)
        copies = model.copy_s(FLOAT * moved, model.workers_on_host(0))
        terms = ({"kind": "copies", "seconds": copies,
                  "what": f"the syncs' buffers on the host: {moved:,.0f} elements moved per step (asking and serving), at the copy bandwidth"},)
        return Phases(update=update + copies, exchange=model.exchange_s(busy), terms=terms,
                      staleness=f"replicas drift for up to sync_freq = {max(1, plan.sync_freq)} local updates between syncs")

    # -- runtime ------------------------------------------------------------------------------------
    def attach_exchanges(self, run) -> None:
        plan, t = run.plan, run.trainers[0]
        door = channels.Door(DOOR) if plan.max_restarts > 0 else None  # restarted groups knock there
        t.attach_exchange(HogwildExchange(t.store, Server(t.store, make_updater(plan.updater)), plan.placement, run.rank, t.group,
                                          plan.sync_freq, plan.nserver_groups, log=print,
                                          codecs=codec_factory(plan.compression.kind, plan.compression.topk_fraction),
                                          door=door, rejoining=run.rejoining, timeout_s=plan.comm_timeout_s))

    def after_values(self, run, spec) -> None:
        if spec.rejoin is not None:  # a restarted process: from the live groups' values, at the step of its last sync
            rejoined.complete(run, spec)

    def complete_rejoin(self, run, incarnation: int) -> tuple[int, int, dict]:
        step, took = run.chief.exchange.rejoin(incarnation)
        return step, 0, {"took": took}


STRATEGY = DistributedHogwild()
