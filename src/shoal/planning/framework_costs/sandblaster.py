"""Sandblaster's cost model: AllReduce's (the sliced exchange, servers in processes of their own) except where a job file
allows restarts (planning/exchange_choice.py's `served_replicas`): then the worker processes all-reduce the mean
gradient, the chief pushes it to each server and takes its values, and the worker processes all-reduce those (the
chief's values, the others' zeros: runtime/exchanges/sandblaster.py). Pure."""
from __future__ import annotations

from shoal.planning.costs import FLOAT
from shoal.planning.exchange_choice import served_replicas
from shoal.planning.framework_costs.allreduce import AllReduceCosts, replicated_flat_elements
from shoal.planning.framework_costs.base import Messages, Phases
from shoal.planning.framework_costs.downpour import push_pull_messages
from shoal.planning.placement import ServerId


def _worker_ranks(plan) -> list[int]:
    return [p.rank for p in plan.placement.processes if p.workers]


class SandblasterCosts(AllReduceCosts):
    """Served (restarts allowed): two ring all-reduces over the worker processes and the chief's push and pull."""

    def traffic(self, model, move) -> None:
        plan = model.plan
        if not served_replicas(plan):
            super().traffic(model, move)
            return
        ranks = _worker_ranks(plan)
        ring = 2 * (len(ranks) - 1) / len(ranks) * FLOAT
        for i, r in enumerate(ranks):  # the mean gradient's all-reduce, then the values'
            move(r, ranks[(i + 1) % len(ranks)], ring * (replicated_flat_elements(model) + model.elements))
        slices = model.trainable_slices()
        for sid in range(plan.nservers_per_group):  # the chief's push and the server's answer (as Downpour's group of one)
            server = ServerId(0, sid)
            mine = [s for s in slices if plan.placement.server_of_slice(s.index, 0) == server]
            size = sum(s.size for s in mine)
            rank = plan.placement.process_of(server)
            move(ranks[0], rank, model.encoded(size) + len(mine) + 24)  # gradient, flags, header
            move(rank, ranks[0], FLOAT * size + 16)  # values, version and staleness

    def messages(self, model) -> list[Messages]:
        """runtime/exchanges/sandblaster.py's step: two meetings of the worker processes' quorum (each one all-reduce and
        the chief's word through the job's store) and, per server, the chief's push and pull (downpour_stub.py's
        _push_pull). Update here when that changes."""
        plan = model.plan
        if not served_replicas(plan):
            return super().messages(model)
        ranks = tuple(_worker_ranks(plan))
        terms = [Messages("the worker processes' all-reduces: the mean gradient (with its rows and has-gradient flags), then "
                          "the servers' values", 2, "collective", ranks),
                 Messages("the chief's word on each: each process's report and the outcome, through the job's store", 4,
                          "message", (ranks[0], ranks[-1]))]
        return terms + push_pull_messages(plan, ranks[0])

    def phases(self, model, compute: float, links: dict) -> Phases:
        plan = model.plan
        if not served_replicas(plan):
            return super().phases(model, compute, links)
        threads = plan.threads_per_worker
        per_proc = len(plan.placement.processes[0].workers) or 1
        reduce = 3 * FLOAT * (per_proc - 1) * model.elements / model.calib.bandwidth(threads * per_proc)
        servers = max(1, plan.nservers_per_group)
        # the servers update their slices at once; the step waits for the slowest, and for the bytes above in turn
        return Phases(reduce=reduce, update=model.update_s(model.elements / servers, threads), exchange=model.exchange_s(links))
