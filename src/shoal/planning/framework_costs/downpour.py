"""Downpour's cost model over processes: one group's step pushes its gradient to each server and pulls the values
(runtime/exchanges/downpour.py's request/response over gloo's point-to-point), the servers update one group's
push at a time, and a group spread over several processes reduces to its stub first (strategies/downpour.py
builds the exchanges). Pure."""
from __future__ import annotations

from shoal.planning.costs import FLOAT
from shoal.planning.framework_costs.base import FrameworkCosts, Messages, Phases, encoded_parts
from shoal.planning.placement import ServerId


def push_pull_messages(plan, stub: int) -> list[Messages]:
    """Per server, the stub's push and pull (runtime/exchanges/downpour_stub.py: _push_pull, _await_answer): a header,
    the gradient (an encoded part each) and the flags sent, the values and a reply received. Update here when that
    protocol changes."""
    sends = 2 + encoded_parts(plan.compression)
    return [Messages(f"push and pull with the server in process {server}: {sends} sends (header, gradient, flags) + "
                     "2 receives (values, reply)", sends + 2, "message", (stub, server))
            for server in (plan.placement.process_of(ServerId(0, sid)) for sid in range(plan.nservers_per_group))]


class DownpourCosts(FrameworkCosts):
    """Bytes and messages of group 0's step (the groups' are alike); the servers' updates and link cap the groups."""

    def traffic(self, model, move) -> None:
        plan = model.plan
        slices = model.trainable_slices()
        for g in range(plan.nworker_groups):
            ranks = plan.ranks_of_group(g)
            stub = ranks[0]
            for r in ranks[1:]:  # the group's processes sum into its stub and get the params back
                move(r, stub, FLOAT * model.elements + 4 * len(model.trainable))
                move(stub, r, FLOAT * model.elements)
            if g:
                continue  # bytes of one group's step: group 0's
            for sid in range(plan.nservers_per_group):
                server = ServerId(0, sid)
                rank = plan.placement.process_of(server)
                mine = [s for s in slices if plan.placement.server_of_slice(s.index, 0) == server]
                size = sum(s.size for s in mine)
                move(stub, rank, model.encoded(size) + len(mine) + 24)  # gradient, flags, header
                move(rank, stub, FLOAT * size + 16)  # values, version and staleness

    def messages(self, model) -> list[Messages]:
        """One group's step (runtime/exchanges/downpour_stub.py: DownpourExchange.step, _push_pull, _await_answer): inside a
        group of several processes two reduces to its stub and a broadcast of the params back; per server, the stub
        sends a header, the gradient (an encoded part each) and the flags, and receives the values and a reply.
        Update here when that protocol changes."""
        plan = model.plan
        ranks = plan.ranks_of_group(0)
        terms = [Messages("inside the group: 2 reduces to its stub + 1 broadcast of the params", 3, "collective", tuple(ranks))] \
            if len(ranks) > 1 else []
        return terms + push_pull_messages(plan, ranks[0])

    def phases(self, model, compute: float, links: dict) -> Phases:
        plan = model.plan
        server_rank = plan.placement.process_of(ServerId(0, 0))
        servers = max(1, plan.nservers_per_group)
        server_threads = max(1, model.cores // max(1, model.workers_on_host(model.where[server_rank]) + 1))
        update = model.update_s(model.elements / servers, server_threads)
        per_request = sum(v[0] for v in links[server_rank].values())  # bytes one group's step sends the server
        remote = any(model.where[p.rank] != model.where[server_rank] for p in plan.placement.processes)
        batch = plan.global_batch
        # a request occupies the server's link for its bytes and its messages' fixed costs (served one after another)
        request_s = per_request / (model.link_bw if remote else model.calib.link_gbps * 1e9) + sum(
            f["seconds"] for f in model.fixed_costs() if f["kind"] == "message")
        # the protocol's copies on the host (runtime/exchanges/downpour_*.py), counted from its code in elements moved (read +
        # written): the stub weighs the gradient (2), lays it into a zeroed flat buffer (3), gathers each server's part (2),
        # and scatters the pulled values from a zeroed buffer into the params (3); a server receives into a zeroed buffer (1)
        # and gathers the fresh values it sends back (2). Update here when that protocol changes.
        stub_host = model.where[plan.ranks_of_group(0)[0]]
        stub_copies = model.copy_s(FLOAT * 10 * model.elements, model.workers_on_host(stub_host))
        server_copies = model.copy_s(FLOAT * 3 * model.elements / servers, model.workers_on_host(model.where[server_rank]))
        bounds = {"the server's link": batch / max(request_s, 1e-12),
                  "the server's updates": batch / max(update + server_copies, 1e-12)}
        terms = ({"kind": "copies", "seconds": stub_copies + server_copies,
                  "what": f"the push's and pull's buffers on the host: {10 * model.elements:,} elements moved by the group's stub, "
                          f"{3 * model.elements // servers:,} by each server, at the copy bandwidth"},)
        # the stub pushes, the server updates, then the values come back: one after the other, unless the answer
        # arrives while the group computes its next step (overlap_push)
        stub = plan.ranks_of_group(0)[0]
        exchange = None if plan.asynchrony.overlap_push else model.request_s(links, stub)
        return Phases(update=update + stub_copies + server_copies, bounds=bounds, exchange=exchange, terms=terms,
                      staleness=f"≈ {plan.nworker_groups - 1} update(s) by other groups between a group's pull and push")
