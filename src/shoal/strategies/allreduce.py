"""AllReduce: one synchronous group; each process's servers own slices of the params. In one process it is
in-memory Sandblaster (gradients summed in memory, one Server); over processes gradients stream out of
backward in buckets to the rank owning each slice, and the new values come back (SlicedExchange).

With restarts allowed (cluster.max_restarts > 0, `shoal run --max-restarts N`) a group over processes that each hold a
whole replica (`replicated`) runs the ReplicatedExchange instead: every process all-reduces its workers' gradients
through the job's quorum (shoal.comm.quorum) and applies the updater to the whole params, so the group goes on without
a dead or stalled process (the chief's excepted), and a restarted process heals from the chief at the next step
(launcher/rejoin.py). A partitioned group (layers cut over processes) cannot go on without one: it keeps the
SlicedExchange and writes a mirror every K steps (runtime/exchanges/sliced_mirror.py), from which a dead process
restarts the whole job. Decided at planning time, from the plan alone (planning/exchange_choice.py); what either exchange
moves and costs is planning/framework_costs/allreduce.py's."""
from __future__ import annotations

from shoal.comm import channels
from shoal.comm.quorum import Quorum
from shoal.neuralnet.updaters import make_updater
from shoal.planning.exchange_choice import mirror_elements, mirror_every, replicated, shards_optimizer_state
from shoal.planning.process_groups import JOB_GROUP, bridge_groups, sliced_groups
from shoal.planning.strategy import Framework, Layout, Strategy
from shoal.runtime.exchanges.compression import codec_factory
from shoal.runtime.interfaces import summary_annotator
from shoal.runtime import rejoined
from shoal.runtime.exchanges.local import LocalExchange
from shoal.runtime.exchanges.replicated import DOOR, ReplicatedExchange
from shoal.runtime.exchanges.server import Server
from shoal.runtime.exchanges.sliced import SlicedExchange
from shoal.runtime.exchanges.sliced_mirror import SlicedMirror


class AllReduce(Strategy):
    framework = Framework.ALLREDUCE
    synchronous = True
    compressed = "gradients (to the servers of their slices, and their sum back)"

    def recognises(self, layout: Layout) -> bool:
        c = layout.cluster
        single = c.nworkers_per_group == 1 and layout.nprocs == 1
        return c.nworker_groups == 1 and not single and bool(c.server_worker_separate) == self.separate_servers

    def label(self, plan) -> str:
        if plan.tensor_parallel:
            return f"{self.framework.value}, tensor-parallel"
        return "in-memory Sandblaster" if plan.in_one_process else self.framework.value

    def notes(self, plan) -> list[str]:
        """Which exchange runs over processes under cluster.max_restarts, and what a dead process costs."""
        if plan.tensor_parallel:
            dead = ("a dead process restarts the whole job from its newest checkpoint" if plan.max_restarts > 0 else
                    "the group cannot go on without a process")
            return [f"tensor-parallel over {plan.nprocs} processes (neuralnet.partition_dim 1, your own loop): each process "
                    "holds a slice of the features of every Linear → element-wise → Linear pair of your module and "
                    f"computes on the whole batch; torch's DTensor collectives, no gradient exchange; {dead}"]
        if shards_optimizer_state(plan):
            return [f"server slices over {plan.nprocs} processes (your own loop, cluster.nservers_per_group "
                    f"{plan.nservers_per_group}): one all-reduce of the gradients a step, then each process updates its "
                    "slices with your optimizer and holds their state alone (ZeRO-1's shape), and one all-gather of the "
                    "values; the group cannot go on without a process"]
        if replicated(plan):
            why = f"cluster.max_restarts {plan.max_restarts}" if plan.max_restarts > 0 else "a loop on the session: yours, or shoal.fit's"
            how = ("one all-reduce of the gradients a step" if plan.compression.dense else
                   "one all-gather of each process's encoded gradients a step, decoded and summed in process order")
            healed = " and, restarted, heals from process 0 at the next step" if plan.max_restarts > 0 else ""
            return [f"replicated over {plan.nprocs} processes ({why}): each process updates the whole params from {how}; "
                    f"a dead or stalled process other than 0 is left out (the mean over the rows that came){healed}"]
        if mirror_every(plan):
            size = mirror_elements(plan) * 4
            size_text = f"{size / 1e6:.3g} MB" if size >= 1e6 else f"{size / 1e3:.3g} kB"
            return [f"cluster.max_restarts: a partitioned group cannot go on without a process: every {mirror_every(plan)} "
                    f"steps it writes a mirror of what each process alone holds (the params and the updater's state, "
                    f"{size_text}: a checkpoint), and a dead process restarts the whole job from the newest one, "
                    f"redoing at most {mirror_every(plan)} steps"]
        if plan.max_restarts > 0 and not plan.in_one_process:
            why = "a partitioned group" if plan.partitioned else "processes without workers"
            return [f"cluster.max_restarts: with {why}, the sliced exchange runs; it cannot go on without a process: "
                    "a dead one restarts the whole job from its newest checkpoint"]
        return []

    def compressed_in(self, plan) -> str:
        return "gradients (each process's, gathered by every process)" if replicated(plan) else self.compressed

    def goes_on_without_a_process(self, plan) -> bool:
        return replicated(plan) and not shards_optimizer_state(plan)  # (a process alone holds its slices' state)

    def process_groups(self, placement, devices, nnodes: int, partition) -> tuple:
        # a partitioned group spanning processes also moves activations and their gradients over bridge groups
        return sliced_groups(placement, devices, nnodes) + bridge_groups(partition, placement, devices, nnodes)

    # -- runtime ------------------------------------------------------------------------------------
    def attach_exchanges(self, run) -> None:
        plan, trainer = run.plan, run.trainers[0]
        updater = make_updater(plan.updater)
        if plan.in_one_process:
            trainer.attach_exchange(LocalExchange(Server(trainer.store, updater)))
            return
        # cluster.compression over processes: a fresh codec per sender (top-k keeps its residual)
        codecs = codec_factory(plan.compression.kind, plan.compression.topk_fraction)
        if replicated(plan):
            first = None if run.rejoining else run.process_groups[JOB_GROUP]  # a restarted process knocks instead
            quorum = Quorum(run.rank, range(plan.nprocs), {r: r for r in range(plan.nprocs)}, channels.Door(DOOR), first=first,
                            timeout_s=plan.comm_timeout_s, admits=True, replaceable=True)  # the chief's death
            # makes the lowest living process the decider; its loop (a user's session, or this trainer) takes over the
            # chief's duties (report/succession.py)
            log = lambda line: trainer.log(line)  # noqa: E731 (the trainer's log once it runs: above a progress bar)
            trainer.attach_exchange(ReplicatedExchange(trainer.store, updater, quorum, run.rank, plan.global_batch, first,
                                                       log=log, annotate=summary_annotator(trainer), codecs=codecs),
                                    may_take_over=True)
            return
        trainer.attach_exchange(SlicedExchange(trainer.store, updater, plan.placement, run.rank, plan.global_batch,
                                               trainer.workers, bucket_cap=plan.bucket_elements, codecs=codecs,
                                               groups=run.process_groups))
        if mirror_every(plan):  # a partitioned group: a dead process costs at most the steps since the mirror
            trainer.add_hook(SlicedMirror(trainer, mirror_every(plan)))

    def after_values(self, run, spec) -> None:
        exchange = run.trainers[0].exchange
        if isinstance(exchange, ReplicatedExchange):
            exchange.start_from()  # every replica from the chief's values
            if spec.rejoin is not None:  # a restarted process: from the chief's state, at the next step
                rejoined.complete(run, spec)

    def complete_rejoin(self, run, incarnation: int) -> tuple[int, int, dict]:
        return run.chief.exchange.rejoin(incarnation)


STRATEGY = AllReduce()
