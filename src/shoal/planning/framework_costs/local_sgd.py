"""Local SGD's (DiLoCo's, SparseLoCo's) cost model: over processes a meeting every cluster.local_steps steps (every
step of a warm-up first) is one all-reduce of the pseudo-gradient (top-k, SparseLoCo: an all-gather), averaged over
the run's steps (runtime/exchanges/periodic.py, sparse_outer.py; strategies/local_sgd.py builds the exchange). Pure."""
from __future__ import annotations

from shoal.planning import sparse_chunks
from shoal.planning.framework_costs.base import FrameworkCosts, Messages, Phases, encoded_parts


class LocalSGDCosts(FrameworkCosts):
    """A meeting's bytes and calls, averaged over the run's steps (meetings_per_step)."""

    def traffic(self, model, move) -> None:
        # a meeting is one ring all-reduce of the pseudo-gradient: each group's process sends its neighbour
        # 2·(G−1)/G of the params; averaged over the run's steps (every step of a warm-up, then every local_steps)
        # (compressed: casts all-reduce in their precision; top-k all-gathers, sending its k entries G−1 times)
        plan = model.plan
        if plan.in_one_process:
            return
        ranks = [p.rank for p in plan.placement.processes]
        gathers = plan.compression.topk or plan.meetings.sparse
        ring = (len(ranks) - 1) if gathers else 2 * (len(ranks) - 1) / len(ranks)
        message = model.encoded(model.elements)
        if plan.meetings.sparse:  # SparseLoCo's buffer (its warm-up meetings are dense: not modelled)
            sizes = [s for n, s in model.sizes.items() if n in model.trainable]
            message = sparse_chunks.message_bytes(plan.meetings.sparse_outer_step, sizes)
        for i, r in enumerate(ranks):
            move(r, ranks[(i + 1) % len(ranks)], ring * message * meetings_per_step(plan))

    def messages(self, model) -> list[Messages]:
        """A meeting over processes (runtime/exchanges/periodic.py: ProcessMeeting.sum → _reduce_encoded):
        one all-reduce of the pseudo-gradient over every group's process (top-k: an all-gather per encoded part),
        averaged over the run's steps. Update here when that changes."""
        plan = model.plan
        if plan.in_one_process:
            return []
        topk = plan.compression.topk
        calls = encoded_parts(plan.compression) if topk else 1
        what = f"{calls} all-gather(s)" if topk else "one all-gather" if plan.meetings.sparse else "one all-reduce"
        return [Messages(f"a meeting: {what} of the pseudo-gradient, every {plan.meetings.local_steps} steps", calls * meetings_per_step(plan),
                         "collective", tuple(p.rank for p in plan.placement.processes))]

    def phases(self, model, compute: float, links: dict) -> Phases:
        plan = model.plan
        update = model.update_s(model.elements, plan.threads_per_worker, model.workers_on_host(0))
        exchange = None
        if not plan.in_one_process:  # a meeting's bytes, averaged over the steps between meetings
            per_meeting = 1 / max(meetings_per_step(plan), 1e-12)
            exchange = model.exchange_s({r: {q: [v[0] * per_meeting, v[1] * per_meeting] for q, v in peers.items()}
                                         for r, peers in links.items()}) / per_meeting
        return Phases(update=update, exchange=exchange,
                      staleness="none within a round; groups drift apart for local_steps steps between meetings")


def meetings_per_step(plan) -> float:
    """Meetings of the groups per step, over the run (every step of the warm-up, then every local_steps)."""
    return plan.meetings.per_step(plan.job.train_steps)
