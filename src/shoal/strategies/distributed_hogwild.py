"""Distributed Hogwild: asynchronous groups over processes, each with a server group of its own in its process;
the replicas sync their master slices every cluster.sync_freq steps (runtime/exchanges/hogwild.py). A dead group's
process may be restarted (cluster.max_restarts, launcher/rejoin.py): it rejoins from the other groups' live values
and joins at its peers' step, skipping the steps since its last sync, which every group re-trains a share of beyond
train_steps (runtime/exchanges/hogwild_recovery.py's steps_to_train)."""
from __future__ import annotations

from shoal.comm import channels
from shoal.comm.succession import successor_of
from shoal.neuralnet.updaters import make_updater
from shoal.planning.strategy import Framework, Layout, Strategy, UnsupportedClusterError
from shoal.runtime import rejoined
from shoal.runtime.exchanges.compression import codec_factory
from shoal.runtime.exchanges.hogwild import DOOR
from shoal.runtime.exchanges.hogwild_group import HogwildExchange
from shoal.runtime.exchanges.server import Server
from shoal.report.terminal import write_line


class DistributedHogwild(Strategy):
    framework = Framework.DISTRIBUTED_HOGWILD
    params_on_host = True  # request/response over gloo's point-to-point
    compressed = "syncs (deltas to the masters, and their answers)"
    compensates_async_momentum = True
    outlives_a_dead_group = True  # masters answer each group on a thread: a dead group's syncs end, the others train on
    rejoins = True  # a dead group's process may be restarted (--max-restarts): it knocks at the live groups' doors
    rejoin_door = DOOR
    rejoins_from = "from the other groups' live values"
    retrains_skipped_steps = True  # (hogwild_recovery.steps_to_train: each group's share, past train_steps)
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

    # -- runtime ------------------------------------------------------------------------------------
    def chief_succeeded_by_a_group(self, plan) -> bool:
        """Groups of one process each (every process is a whole group: `refuse`), in a job file or a user's loop, under
        cluster.max_restarts: group 0's process holds nothing the others need but its duties as chief, which the lowest
        living one takes."""
        return plan.max_restarts > 0

    def attach_exchanges(self, run) -> None:
        plan, t = run.plan, run.trainers[0]
        door = channels.Door(DOOR) if plan.max_restarts > 0 else None  # restarted groups knock there
        successor = successor_of(plan, run.rank, DOOR) if self.chief_succeeded_by_a_group(plan) and not run.rejoining else None
        t.attach_exchange(HogwildExchange(t.store, Server(t.store, make_updater(plan.updater)), plan.placement, run.rank, t.group,
                                          plan.sync_freq, plan.nserver_groups, log=write_line,
                                          codecs=codec_factory(plan.compression.kind, plan.compression.topk_fraction),
                                          door=door, rejoining=run.rejoining, timeout_s=plan.comm_timeout_s,
                                          successor=successor),
                          may_take_over=successor is not None)

    def after_values(self, run, spec) -> None:
        if spec.rejoin is not None:  # a restarted process: from the live groups' values, at their step
            rejoined.complete(run, spec)

    def complete_rejoin(self, run, incarnation: int) -> tuple[int, int, dict]:
        exchange = run.chief.exchange
        step, took = exchange.rejoin(incarnation, end_step=run.plan.job.train_steps)
        return step, 0, {"took": took} | ({"skipped_steps": list(exchange.skipped)} if exchange.skipped else {})


STRATEGY = DistributedHogwild()
