"""In-memory Hogwild: asynchronous groups as threads of one process, computing on one shared copy of the params
and updating it lock-free through one Server (cluster.share_memory). Groups take turns on a GroupBoard, which
bounds staleness (max_staleness, warmup_steps, max_update_lag)."""
from __future__ import annotations

from typing import Optional

from shoal.neuralnet.updaters import make_updater
from shoal.planning.strategy import Framework, Layout, Strategy, UnsupportedClusterError
from shoal.runtime.exchanges.groups import GroupBoard, GroupExchange
from shoal.runtime.exchanges.server import Server


class InMemoryGroups(Strategy):
    """Asynchronous groups as threads of one process around one Server; `share_memory` says whose values they read."""

    framework = Framework.IN_MEMORY_HOGWILD
    compensates_async_momentum = True
    bounds_update_lag = True
    share_memory = True
    outlives_a_dead_group = True  # the board never waits for a group that stopped (runtime/exchanges/groups.py)

    def recognises(self, layout: Layout) -> bool:
        return layout.asynchronous_groups and layout.nprocs == 1 and bool(layout.cluster.share_memory) == self.share_memory

    def refuse(self, layout: Layout) -> None:
        if layout.cluster.nserver_groups > 1:
            raise UnsupportedClusterError(
                "cluster: asynchronous groups in one process need nserver_groups: 1 (in-memory Hogwild or Downpour); "
                "Distributed Hogwild runs one group per process"
            )

    # -- runtime ------------------------------------------------------------------------------------
    def shares_one_store(self) -> bool:
        return self.share_memory

    def attach_exchanges(self, run) -> None:
        plan, chief = run.plan, run.trainers[0]
        bounds = plan.asynchrony
        # Hogwild: every group computes on the server's values; Downpour: each on its own copy
        server = Server(chief.store if self.share_memory else chief.store.copy(), make_updater(plan.updater))
        run.board = GroupBoard(plan.nworker_groups, bounds.max_staleness, bounds.warmup_steps, bounds.max_update_lag)
        for t in run.trainers:
            t.attach_exchange(GroupExchange(server, run.board, t.group, None if self.share_memory else t.store))

    def after_values(self, run, spec) -> None:
        for trainer in run.trainers:
            trainer.exchange.start_from(run.chief.store)
        start_on_board(run)

    def staleness_histogram(self, run) -> Optional[dict]:
        """The board's count of every group's updates, and how many each was to apply in this run (its steps from where
        it started): summary.json's missed_updates."""
        histogram = run.board.histogram()
        for trainer in run.trainers:
            counts = histogram["groups"].setdefault(str(trainer.group), {"updates": 0, "mean": 0.0, "max": 0, "updates_per_lag": {}})
            counts["expected"] = max(0, run.plan.job.train_steps - trainer.start_step)
        return histogram


def start_on_board(run) -> None:
    """Groups of one process start where the board lets them (a resumed group at its own step)."""
    run.board.start_at([t.start_step for t in run.trainers])
    for trainer in run.trainers:
        trainer.start_at(run.board.first_step(trainer.group))


STRATEGY = InMemoryGroups()
