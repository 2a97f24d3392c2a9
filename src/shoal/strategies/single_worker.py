"""One worker in one process: gradients straight to one in-memory Server."""
from __future__ import annotations

from shoal.neuralnet.updaters import make_updater
from shoal.planning.strategy import Framework, Layout, Strategy
from shoal.runtime.exchanges.local import LocalExchange
from shoal.runtime.exchanges.server import Server


class SingleWorker(Strategy):
    framework = Framework.SINGLE_WORKER
    synchronous = True

    def recognises(self, layout: Layout) -> bool:
        c = layout.cluster
        return c.nworker_groups == 1 and c.nworkers_per_group == 1 and layout.nprocs == 1

    def attach_exchanges(self, run) -> None:
        trainer = run.trainers[0]
        trainer.attach_exchange(LocalExchange(Server(trainer.store, make_updater(run.plan.updater))))


STRATEGY = SingleWorker()
