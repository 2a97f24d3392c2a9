"""AllReduce's and Sandblaster's cost model: over processes the SlicedExchange's buckets (gradients gathered at the
rank owning each slice, values broadcast back) or, under cluster.max_restarts, the ReplicatedExchange's one
all-reduce (planning/exchange_choice.py decides which runs); in one process the workers' sum in memory and the
update (strategies/allreduce.py builds the exchanges). Pure."""
from __future__ import annotations

from shoal.config import job_pb2
from shoal.neuralnet.updaters import make_updater
from shoal.planning.buckets import plan_buckets
from shoal.planning.costs import FLOAT, learning_nodes, node_rows, numel
from shoal.planning.devices import tree_levels
from shoal.planning.exchange_choice import replicated
from shoal.planning.framework_costs.base import FrameworkCosts, Messages, Phases, encoded_parts
from shoal.planning.placement import WorkerId


def replicated_flat_elements(model) -> int:
    """Elements of the step's one all-reduce: every trained param, a has-gradient flag each, the rows."""
    return model.elements + len(model.trainable) + 1


def exchange_buckets(model) -> list:
    """The buckets SlicedExchange sends over processes (planning/buckets.py): the trainable slices by owner rank."""
    plan = model.plan
    slices = model.trainable_slices()
    owner = {s.index: plan.placement.process_of(plan.placement.server_of_slice(s.index, 0)) for s in slices}
    return plan_buckets(slices, owner, plan.bucket_elements)


def clips(plan) -> bool:
    """Whether the job clips by the global norm (its exchange then all-reduces one scalar a step:
    runtime/exchanges/clipping.py's max_norm_of is not None)."""
    try:
        return bool(make_updater(plan.updater).clip_grad_norm)
    except Exception:  # noqa: BLE001 (a user updater this process cannot build: planned as not clipping)
        return False


def cross_bridges(plan):
    """A partitioned group spanning processes: each bridge whose ends are in different processes, as (producer's rank,
    consumer's rank, blob bytes, whether its gradient comes back)."""
    parts = plan.partition
    if not plan.partitioned:
        return
    shares = list(plan.batch_shares[0]) if plan.batch_shares else [1]
    learns, by_name = learning_nodes(parts), {n.name: n for n in parts.nodes}
    for dst in parts.nodes:
        if dst.layer.conf.type != job_pb2.kBridgeDst:
            continue
        src = by_name[dst.peer]
        src_rank, dst_rank = (plan.placement.process_of(WorkerId(0, n.worker)) for n in (src, dst))
        if src_rank != dst_rank:
            yield src_rank, dst_rank, FLOAT * node_rows(dst, shares) * numel(dst.shape), learns[src.name]


def bridges_between_processes(plan, move) -> None:
    """Each bridge between processes broadcasts its blob to the consumer's process and (when params lie below it) the
    blob's gradient back (runtime/partitioned.py; as in memory, the labels riding along and the few header bytes are
    left out)."""
    for src_rank, dst_rank, nbytes, learns in cross_bridges(plan):
        move(src_rank, dst_rank, nbytes)
        if learns:
            move(dst_rank, src_rank, nbytes)


class AllReduceCosts(FrameworkCosts):
    """AllReduce's (and Sandblaster's: servers in processes of their own change no term)."""

    def served_elements(self, model, rank: int, served: int) -> int:
        """Replicated, every process updates the whole params."""
        return model.elements if model.plan.in_one_process or replicated(model.plan) else served

    def traffic(self, model, move) -> None:
        if replicated(model.plan):  # a ring all-reduce: each process sends its neighbour 2(P-1)/P of the flat sum;
            # compressed, a ring all-gather: each process sends its neighbour P-1 encodings (and their flags and rows)
            ranks = [p.rank for p in model.plan.placement.processes]
            if model.plan.compression.dense:
                sent = 2 * (len(ranks) - 1) / len(ranks) * FLOAT * replicated_flat_elements(model)
            else:
                sent = (len(ranks) - 1) * (model.encoded(model.elements) + FLOAT * (len(model.trainable) + 1))
            for i, r in enumerate(ranks):
                move(r, ranks[(i + 1) % len(ranks)], sent)
            return
        self._traffic(model, move, move)

    def _traffic(self, model, move, back) -> None:
        """`move` the gradients to their owners (and the bridges' blobs), `back` the values from them."""
        plan = model.plan
        if plan.in_one_process:
            return
        worker_ranks = [p.rank for p in plan.placement.processes if p.workers]
        # per bucket, each worker process's gradients gathered at the owner (compressed: their encoding) and its new
        # values (compressed: the encoded sum) broadcast back. Whether anyone had a gradient: dense, a float per
        # param of the owner riding in its last bucket; compressed, a byte per param reduced to it and broadcast back
        dense = plan.compression.dense
        flagged: dict[int, set[str]] = {}
        buckets = exchange_buckets(model)
        last = {b.owner: b.index for b in buckets}
        for b in buckets:
            flagged.setdefault(b.owner, set()).update(b.params)
            for r in worker_ranks:
                if r != b.owner:
                    flags = len(flagged[b.owner]) if dense and last[b.owner] == b.index else 0
                    move(r, b.owner, FLOAT * (b.numel + flags) if dense else model.encoded(b.numel))
                    back(b.owner, r, FLOAT * b.numel if dense else model.encoded(b.numel))  # broadcast back
        bridges_between_processes(plan, move)
        if dense:
            return
        for o, params in flagged.items():
            for r in worker_ranks:
                if r != o:
                    move(r, o, len(params))
                    back(o, r, len(params))

    def messages(self, model) -> list[Messages]:
        """SlicedExchange's collectives of a step (runtime/exchanges/sliced.py: _send_gradients, _flags_round, _finish,
        _finish_compressed, _clip_scale): per bucket a gather at its owner (between two processes one broadcast from
        the other) and a broadcast of its values (compressed: a gather and a broadcast per encoded part); dense, the
        has-gradient flags ride in each owner's last bucket, compressed, per owner a reduce of the flags and their
        broadcast; with clip_grad_norm one scalar all-reduce over every process. Update here when those change."""
        plan = model.plan
        if plan.in_one_process:
            return []
        if replicated(plan):  # runtime/exchanges/replicated.py: mean_gradients, through shoal.comm.quorum's meet
            ranks = tuple(p.rank for p in plan.placement.processes)
            what = "all-reduce of the gradients" if plan.compression.dense else "all-gather of the encoded gradients"
            return [Messages(f"replicated: one {what} (with their rows and has-gradient flags)", 1, "collective", ranks),
                    Messages("the chief's word on the step: each process's report and the outcome, through the job's store", 2,
                             "message", (0, ranks[-1]))]
        workers = {p.rank for p in plan.placement.processes if p.workers}
        parts = encoded_parts(plan.compression)
        dense = plan.compression.dense
        terms, owners = [], {}
        for b in exchange_buckets(model):
            owners.setdefault(b.owner, 0)
            owners[b.owner] += 1
        for o, buckets in sorted(owners.items()):
            ranks = tuple(sorted(workers | {o}))
            what = "gather + broadcast" if dense else f"{parts} gather(s) + {parts} broadcast(s)"
            terms.append(Messages(f"{what} per bucket of rank {o} ({buckets} bucket(s))", 2 * parts * buckets, "collective", ranks))
            if not dense:
                terms.append(Messages(f"flags of rank {o}'s params: a reduce + a broadcast", 2, "collective", ranks))
        # runtime/partitioned.py's RemoteChannel: a header, the blob and its labels (a layer's output carries its input's
        # labels on, so every blob downstream of the data does), and where a gradient comes back a header and the gradient
        for src_rank, dst_rank, _, learns in cross_bridges(plan):
            terms.append(Messages(f"bridge between processes {src_rank} and {dst_rank}: header, blob and labels broadcast"
                                  + (", header and gradient back" if learns else ""), 5 if learns else 3, "collective",
                                  (src_rank, dst_rank)))
        if clips(plan):
            terms.append(Messages("clip_grad_norm: the global norm's all-reduce", 1, "collective",
                                  tuple(p.rank for p in plan.placement.processes)))
        return terms

    def phases(self, model, compute: float, links: dict) -> Phases:
        plan, threads = model.plan, model.plan.threads_per_worker
        if plan.in_one_process:
            p = plan.nworkers_per_group
            owned = plan.partition.updated_where_computed()
            local = sum(model.view_numel(v) for v in owned)
            # the sum and the update run on the process's main thread after its workers' threads, at the process's
            # intra-op thread count (runtime/assemble.py sets threads_per_worker for the whole process), not threads × p
            # runtime/replicas.py tree_reduce: each add reads two and writes one (3 passes), and each node that takes
            # an add is first scaled by its worker's share in place (2 passes)
            scaled = len({into for level in tree_levels(p) for into, _ in level})
            reduce = (3 * (p - 1) + 2 * scaled) * FLOAT * max(0, model.elements - local) / model.calib.bandwidth(threads)
            update = model.update_s(model.elements - local, threads) + model.update_s(local // max(1, p), threads, p)
            return Phases(reduce=reduce, update=update)
        if replicated(plan):  # the process's workers summed in memory, then every process updates the whole params
            per_proc = len(plan.placement.processes[0].workers) or 1
            reduce = 3 * FLOAT * (per_proc - 1) * model.elements / model.calib.bandwidth(threads * per_proc)
            on_host0 = sum(1 for p in plan.placement.processes if model.where[p.rank] == model.where[0])
            return Phases(reduce=reduce, update=model.update_s(model.elements, threads, on_host0), exchange=model.exchange_s(links))
        owned_by: dict[int, int] = {}
        for s in plan.placement.slices:
            if s.param in model.trainable:
                r = plan.placement.process_of(plan.placement.server_of_slice(s.index, 0))
                owned_by[r] = owned_by.get(r, 0) + s.size
        per_proc = len(plan.placement.processes[0].workers) or 1
        reduce = 3 * FLOAT * (per_proc - 1) * model.elements / model.calib.bandwidth(threads * per_proc)
        on_host0 = model.workers_on_host(0)
        update = max(model.update_s(n, threads, on_host0) for n in owned_by.values()) if owned_by else 0.0
        # on loopback the cores copy, whichever the direction (the model's exchange_s); between hosts, the messages in turn
        exchange = max(model.loopback_s(links), self._between_hosts_s(model))
        return Phases(reduce=reduce, update=update, exchange=exchange)

    def _between_hosts_s(self, model) -> float:
        """The step's messages between hosts as they travel (runtime/exchanges/sliced.py): the gathers in bucket order as
        backward launches them, and each owner's broadcasts once every gradient of its buckets is in (_finish), so one
        owner's broadcasts go back while the next owner's gathers still arrive. A message occupies its host's way out
        and its peer's way in, one message after another on each, at the link's bandwidth, or the duplex bandwidth for
        the part of it that travels while the other way carries bytes too. Sandblaster with its workers on one host
        and its 2 servers on another takes 3 messages' time: not 2 (both ways at once) or 4 (gathers, then broadcasts)."""
        where, messages = model.where, []  # (from host, to host, bytes, owner rank, is a broadcast)
        self._traffic(model, lambda src, dst, n: messages.append((where[src], where[dst], n, dst, False)),
                      lambda src, dst, n: messages.append((where[src], where[dst], n, src, True)))
        messages = [m for m in messages if m[0] != m[1] and m[2] > 0]
        messages.sort(key=lambda m: m[4])  # the gathers first: each owner waits for all of its own
        alone = self._travel(messages, [1.0 / model.link_bw] * len(messages))
        seconds = []
        for (a, b, n, _, _), (start, end) in zip(messages, alone):
            crossing = sum(max(0.0, min(end, e) - max(start, s)) for (a2, b2, *_), (s, e) in zip(messages, alone) if (a2, b2) == (b, a))
            both = min(1.0, crossing / (end - start)) if end > start else 0.0
            seconds.append((1 - both) / model.link_bw + both / model.duplex_bw)
        return max((end for _, end in self._travel(messages, seconds)), default=0.0)

    @staticmethod
    def _travel(messages: list[tuple], seconds_per_byte: list[float]) -> list[tuple[float, float]]:
        """Each message's (start, end): after its host's way out and its peer's way in are free, a broadcast after
        its owner's last gathered gradient arrived."""
        free: dict[tuple, float] = {}  # (host, "out" | "in") -> when it is free
        gathered: dict[int, float] = {}  # owner rank -> when its last gradient arrived
        out = []
        for (a, b, n, owner, broadcast), rate in zip(messages, seconds_per_byte):
            start = max(gathered.get(owner, 0.0) if broadcast else 0.0, free.get((a, "out"), 0.0), free.get((b, "in"), 0.0))
            free[(a, "out")] = free[(b, "in")] = end = start + n * rate
            if not broadcast:
                gathered[owner] = max(gathered.get(owner, 0.0), end)
            out.append((start, end))
        return out
