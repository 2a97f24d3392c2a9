"""The cost model of asynchronous groups as threads of one process around one Server (runtime/exchanges/groups.py;
strategies/in_memory_hogwild.py and in_memory_downpour.py build the exchanges): nothing moves between processes;
the groups' updates share the host. Pure."""
from __future__ import annotations

from shoal.planning.costs import FLOAT
from shoal.planning.framework_costs.base import FrameworkCosts, Phases


class InMemoryHogwildCosts(FrameworkCosts):
    """Every group computes on the server's one copy and updates it lock-free."""

    def phases(self, model, compute: float, links: dict) -> Phases:
        ngroups, threads = model.plan.nworker_groups, model.plan.threads_per_worker
        update = model.update_s(model.elements, threads, ngroups)
        return Phases(update=update, staleness=f"≈ {(ngroups - 1) * compute / max(compute + update, 1e-12):.2f} updates by other "
                                               "groups between a group's read and write (lock-free)")


class InMemoryDownpourCosts(FrameworkCosts):
    """Each group computes on its own copy, pulling from and pushing to the one server."""

    def extra_param_bytes(self, model) -> int:
        return FLOAT * sum(model.sizes.values()) * model.plan.nworker_groups  # each group computes on its own copy

    def phases(self, model, compute: float, links: dict) -> Phases:
        plan, threads = model.plan, model.plan.threads_per_worker
        update = model.update_s(model.elements, threads) + 2 * FLOAT * model.elements / model.calib.bandwidth(threads)
        return Phases(update=update, bounds={"the shared server (updates one group at a time)": plan.global_batch / update},
                      staleness=f"≈ {plan.nworker_groups - 1} update(s) by other groups between a group's pull and push")
