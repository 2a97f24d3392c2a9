"""Which exchange a synchronous group over processes runs (AllReduce, Sandblaster). Pure: the plan alone decides;
the strategy (strategies/allreduce.py) builds that exchange and the cost model (planning/framework_costs/allreduce.py)
prices it."""
from __future__ import annotations


def replicated(plan) -> bool:
    """Whether this AllReduce plan runs the ReplicatedExchange (pure: the plan alone decides): restarts allowed
    (cluster.max_restarts > 0) or a user's own loop (its optimizer updates every replica), the group over processes
    each computing whole replicas (not partitioned, every process hosting workers); cluster.compression or not (the
    replicated exchange all-gathers the encodings). A job file without restarts keeps SINGA's sliced exchange."""
    return ((plan.max_restarts > 0 or plan.own_loop) and not plan.in_one_process and not plan.partitioned
            and all(p.workers for p in plan.placement.processes))
