"""AllReduce: one synchronous group; each process's servers own slices of the params. In one process it is
in-memory Sandblaster (gradients summed in memory, one Server); over processes gradients stream out of
backward in buckets to the rank owning each slice, and the new values come back (SlicedExchange)."""
from __future__ import annotations

from shoal.config import job_pb2
from shoal.neuralnet.updaters import make_updater
from shoal.planning.buckets import plan_buckets
from shoal.planning.costs import FLOAT
from shoal.planning.process_groups import sliced_groups
from shoal.planning.strategy import Framework, Layout, Phases, Strategy
from shoal.runtime.exchanges.compression import codec_factory
from shoal.runtime.exchanges.local import LocalExchange
from shoal.runtime.exchanges.server import Server
from shoal.runtime.exchanges.sliced import SlicedExchange


class AllReduce(Strategy):
    framework = Framework.ALLREDUCE
    synchronous = True
    compressed = "gradients (to the servers of their slices, and their sum back)"
    separate_servers = False  # Sandblaster: servers in processes of their own

    def recognises(self, layout: Layout) -> bool:
        c = layout.cluster
        single = c.nworkers_per_group == 1 and layout.nprocs == 1
        return c.nworker_groups == 1 and not single and bool(c.server_worker_separate) == self.separate_servers

    def label(self, plan) -> str:
        return "in-memory Sandblaster" if plan.in_one_process else self.framework.value

    def process_groups(self, placement, devices, nnodes: int) -> tuple:
        return sliced_groups(placement, devices, nnodes)

    # -- cost model ---------------------------------------------------------------------------------
    def traffic(self, model, move) -> None:
        plan = model.plan
        if plan.in_one_process:
            return
        slices = model.trainable_slices()
        owner = {s.index: plan.placement.process_of(plan.placement.server_of_slice(s.index, 0)) for s in slices}
        worker_ranks = [p.rank for p in plan.placement.processes if p.workers]
        # per bucket, each worker process's gradients gathered at the owner (compressed: their encoding) and its new
        # values (compressed: the encoded sum) broadcast back. Whether anyone had a gradient: dense, a float per
        # param of the owner riding in its last bucket; compressed, a byte per param reduced to it and broadcast back
        dense = plan.cluster.compression == job_pb2.kNone
        flagged: dict[int, set[str]] = {}
        buckets = plan_buckets(slices, owner, plan.bucket_elements)
        last = {b.owner: b.index for b in buckets}
        for b in buckets:
            flagged.setdefault(b.owner, set()).update(b.params)
            for r in worker_ranks:
                if r != b.owner:
                    flags = len(flagged[b.owner]) if dense and last[b.owner] == b.index else 0
                    move(r, b.owner, FLOAT * (b.numel + flags) if dense else model.encoded(b.numel))
                    move(b.owner, r, FLOAT * b.numel if dense else model.encoded(b.numel))  # broadcast back
        if dense:
            return
        for o, params in flagged.items():
            for r in worker_ranks:
                if r != o:
                    move(r, o, len(params))
                    move(o, r, len(params))

    def phases(self, model, compute: float, links: dict) -> Phases:
        plan, threads = model.plan, model.plan.threads_per_worker
        if plan.in_one_process:
            p = plan.cluster.nworkers_per_group
            owned = plan.partition.updated_where_computed()
            local = sum(model.view_numel(v) for v in owned)
            reduce = 3 * FLOAT * (p - 1) * max(0, model.elements - local) / model.calib.bandwidth(threads * p)
            update = model.update_s(model.elements - local, threads * p) + model.update_s(local // max(1, p), threads, p)
            return Phases(reduce=reduce, update=update)
        owned_by: dict[int, int] = {}
        for s in plan.placement.slices:
            if s.param in model.trainable:
                r = plan.placement.process_of(plan.placement.server_of_slice(s.index, 0))
                owned_by[r] = owned_by.get(r, 0) + s.size
        per_proc = len(plan.placement.processes[0].workers) or 1
        reduce = 3 * FLOAT * (per_proc - 1) * model.elements / model.calib.bandwidth(threads * per_proc)
        on_host0 = model.workers_on_host(0)
        update = max(model.update_s(n, threads, on_host0) for n in owned_by.values()) if owned_by else 0.0
        return Phases(reduce=reduce, update=update)

    # -- runtime ------------------------------------------------------------------------------------
    def attach_exchanges(self, run) -> None:
        plan, trainer = run.plan, run.trainers[0]
        updater = make_updater(plan.updater)
        if plan.in_one_process:
            trainer.attach_exchange(LocalExchange(Server(trainer.store, updater)))
            return
        # cluster.compression over processes: a fresh codec per sender (top-k keeps its residual)
        codecs = codec_factory(plan.cluster.compression, plan.cluster.topk_fraction)
        trainer.attach_exchange(SlicedExchange(trainer.store, updater, plan.placement, run.rank, plan.global_batch,
                                               trainer.workers, bucket_cap=plan.bucket_elements, codecs=codecs,
                                               groups=run.process_groups))


STRATEGY = AllReduce()
