"""In-memory Downpour: asynchronous groups as threads of one process, each computing on its own copy of the params,
pulling from and pushing to one Server (cluster.share_memory: false)."""
from __future__ import annotations

from shoal.planning.costs import FLOAT
from shoal.planning.strategy import Framework, Phases
from shoal.strategies.in_memory_hogwild import InMemoryGroups


class InMemoryDownpour(InMemoryGroups):
    framework = Framework.IN_MEMORY_DOWNPOUR
    share_memory = False

    def extra_param_bytes(self, model) -> int:
        return FLOAT * sum(model.sizes.values()) * model.plan.nworker_groups  # each group computes on its own copy

    def phases(self, model, compute: float, links: dict) -> Phases:
        plan, threads = model.plan, model.plan.threads_per_worker
        update = model.update_s(model.elements, threads) + 2 * FLOAT * model.elements / model.calib.bandwidth(threads)
        return Phases(update=update, bounds={"the shared server (updates one group at a time)": plan.global_batch / update},
                      staleness=f"≈ {plan.nworker_groups - 1} update(s) by other groups between a group's pull and push")


STRATEGY = InMemoryDownpour()
