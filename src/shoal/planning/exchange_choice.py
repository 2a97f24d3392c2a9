"""Which exchange a synchronous group over processes runs (AllReduce, Sandblaster), and how often a partitioned one
mirrors its owners' state. Pure: the plan alone decides;
the strategy (strategies/allreduce.py) builds that exchange and the cost model (planning/framework_costs/allreduce.py)
prices it."""
from __future__ import annotations

import math

from shoal.neuralnet.updaters import make_updater


def replicated(plan) -> bool:
    """Whether this AllReduce plan runs the ReplicatedExchange (pure: the plan alone decides): restarts allowed
    (cluster.max_restarts > 0) or a user's own loop (its optimizer updates every replica), the group over processes
    each computing whole replicas (not partitioned, every process hosting workers); cluster.compression or not (the
    replicated exchange all-gathers the encodings). A job file without restarts keeps SINGA's sliced exchange."""
    return ((plan.max_restarts > 0 or plan.own_loop) and not plan.in_one_process and not plan.partitioned
            and not plan.tensor_parallel and all(p.workers for p in plan.placement.processes))


def served_replicas(plan) -> bool:
    """Whether this Sandblaster plan (servers in processes of their own) runs its worker processes as replicas that go on
    without a dead one and its servers as Downpour's, which heal from the chief's mirror (runtime/exchanges/sandblaster.py;
    pure: the plan alone decides): a job file's, restarts allowed (cluster.max_restarts > 0), over processes, each worker
    process computing whole replicas (not partitioned) and no process hosting both workers and servers. Without restarts
    a job file keeps SINGA's sliced exchange; a user's loop runs Downpour's stub and servers (strategies/sandblaster.py)."""
    return (plan.max_restarts > 0 and not plan.own_loop and not plan.in_one_process and not plan.partitioned
            and not plan.tensor_parallel and all(bool(p.workers) != bool(p.servers) for p in plan.placement.processes))


def loop_served_replicas(plan) -> bool:
    """Whether this Sandblaster plan in a user's own loop runs its worker processes as replicas that go on without a dead
    one (runtime/exchanges/sandblaster_loop.py; pure: the plan alone decides): `served_replicas`' conditions, in a user's
    loop, each worker process one worker or a few threads (a restarted process's worker 0 takes the handover, which
    its other workers copy). Its servers run the user's optimizer from its recipe and heal from the chief's mirror, as
    without it."""
    return (plan.max_restarts > 0 and plan.own_loop and not plan.in_one_process and not plan.partitioned
            and not plan.tensor_parallel and plan.strategy.separate_servers
            and all(bool(p.workers) != bool(p.servers) for p in plan.placement.processes))


def shards_optimizer_state(plan) -> bool:
    """Whether a user's loop under this AllReduce plan shards its optimizer's state over the group's processes (pure):
    server slices (nservers_per_group > 1, in the workers' processes; one worker or a few threads each), without
    restarts or compression, the module whole in each process (runtime/session_slices.py: each process its slices'
    state, as the sliced exchange's owners). The replicated exchange then sums the gradients; the group cannot go on
    without a process."""
    return (replicated(plan) and plan.own_loop and plan.max_restarts == 0 and plan.nservers_per_group > 1
            and plan.strategy.synchronous and not plan.strategy.meets and plan.nworker_groups == 1
            and not plan.server_worker_separate and plan.compression.dense
            and all(p.workers and p.servers for p in plan.placement.processes))


# A partitioned group's mirror (issue 38, point 1): the cost model lets it add at most this share to the bytes a step
# moves (each trained element's gradient to its owner and its value back: 2 x the params' bytes)
MIRROR_SHARE = 0.25


def mirror_elements(plan) -> int:
    """Elements a partitioned group's mirror holds: every param's value and the updater's state of it (what the
    owners alone hold between two steps), each float32 (runtime/exchanges/sliced_mirror.py writes it)."""
    sizes: dict[str, int] = {}
    for s in plan.placement.slices:
        sizes[s.param] = sizes.get(s.param, 0) + s.size
    try:
        updater = make_updater(plan.updater)
        state = sum(math.prod(shape) for name, size in sizes.items() for shape in updater.state_shapes(name, (size,)).values())
    except Exception:  # noqa: BLE001 (a user updater this process cannot build: planned as one slot, momentum's)
        state = sum(sizes.values())
    return sum(sizes.values()) + state


def mirror_every(plan) -> int:
    """Every how many steps a partitioned group over processes under cluster.max_restarts writes its mirror (0: it
    writes none): the smallest K whose mirror bytes, spread over K steps, add at most MIRROR_SHARE to the 2 x params
    bytes a step moves: plain SGD every 2 steps, momentum every 4, Adam every 6. Pure: the plan alone decides. Only
    where the sliced exchange runs in every process of a group that cannot go on without one (a partitioned group:
    each process computes its own layers); a dead process then restarts the whole job from the newest mirror, so the
    steps redone are at most K."""
    if not (plan.max_restarts > 0 and plan.partitioned and not plan.in_one_process and not replicated(plan)
            and all(p.workers for p in plan.placement.processes)):
        return 0
    params = sum(s.size for s in plan.placement.slices)
    if params <= 0:
        return 0
    return max(1, math.ceil(mirror_elements(plan) / (MIRROR_SHARE * 2 * params)))
