"""Sandblaster: AllReduce's exchange with the servers in processes of their own (cluster.server_worker_separate).

In a user's own loop (shoal.session: the plan's job has no net) the servers run the user's optimizer, built from its
recipe (runtime/session_exchange.py), which the sliced exchange's owners cannot: there the group runs Downpour's
request/response with its one group (runtime/exchanges/downpour*.py). Every step the group's processes sum their
gradients at its stub (process 0), the stub pushes the sum to every server with the optimizer's hyper-parameters,
each server updates its slices and answers with their values, and the stub hands them to the group: synchronous, so
N workers train as one worker on the same rows. Under cluster.max_restarts the chief mirrors the servers' state, so a
dead server process is restarted and heals from it (`servers_heal`, as Downpour's), and (`loop_served_replicas`) the
worker processes, one worker or a few threads each, run as a job file's below, in the loop's order
(runtime/exchanges/sandblaster_loop.py: a restarted one's worker 0 takes the chief's handover, as AllReduce's in a
user's loop, and its other workers copy it).

A job file under cluster.max_restarts (`served_replicas`) runs the same servers, which heal from the chief's mirror when
one dies, and its worker processes as replicas that go on without a dead one and take a restarted one back at the next
step (runtime/exchanges/sandblaster.py); the chief's death too: the lowest living worker process decides the steps in
its place, becomes the servers' stub and keeps their mirror (`make_stub`), in a job file and in a user's loop."""
from __future__ import annotations

from shoal.comm import channels
from shoal.comm.quorum import Quorum
from shoal.neuralnet.updaters import make_updater
from shoal.planning.exchange_choice import loop_served_replicas, served_replicas
from shoal.planning.placement import ServerId
from shoal.planning.process_groups import worker_groups
from shoal.planning.strategy import Framework
from shoal.runtime import rejoined
from shoal.runtime.exchanges.compression import codec_factory
from shoal.runtime.interfaces import summary_annotator
from shoal.runtime.exchanges.downpour_stub import DownpourExchange
from shoal.runtime.exchanges.replicated import DOOR
from shoal.runtime.exchanges.sandblaster import SandblasterExchange
from shoal.runtime.exchanges.sandblaster_loop import LoopSandblasterExchange
from shoal.strategies.allreduce import AllReduce
from shoal.strategies.downpour import Downpour, resumed_version


class Sandblaster(AllReduce):
    framework = Framework.SANDBLASTER
    separate_servers = True

    def notes(self, plan) -> list[str]:
        if served_replicas(plan):
            workers = [p.rank for p in plan.placement.processes if p.workers]
            return [f"cluster.max_restarts {plan.max_restarts}: the {len(workers)} worker process(es) meet twice a step (the "
                    f"mean gradient, then the servers' values); a dead or stalled worker process is left out (the mean "
                    f"over the rows that came) and, restarted, rejoins at the next step; when it is process "
                    f"{workers[0]}, the chief, the lowest living worker process takes its place and becomes the "
                    f"servers' stub; a dead server process is restarted and heals from the stub's mirror of its state"]
        if not plan.own_loop:
            return super().notes(plan)
        if loop_served_replicas(plan):
            workers = ("a dead or stalled worker process is left out (the mean over the rows that came) and, restarted, "
                       "takes the loop state of the lowest living one and rejoins at the next step; when it is process 0, "
                       "the chief, the lowest living worker process takes its place and becomes the servers' stub")
            restarts = (f"; cluster.max_restarts {plan.max_restarts}: a dead server process is restarted and heals from the "
                        f"stub's mirror of its state; {workers}")
        else:
            restarts = (f"; cluster.max_restarts {plan.max_restarts}: a dead server process is restarted and heals from "
                        "process 0's mirror of its state, a dead worker process restarts the whole job from its newest "
                        "checkpoint" if self.servers_heal(plan) else "")
        return [f"your own loop: the group's processes sum their gradients at process 0, which pushes them to the "
                f"{plan.nservers} server process(es); they run your optimizer and answer with the new values{restarts}"]

    def compressed_in(self, plan):
        # a user's loop: the stub's push of the group's gradient (the servers answer with values, never encoded); a job
        # file's under restarts: the chief's push of the worker processes' mean, which their quorum sums in float32
        if served_replicas(plan):
            return "process 0's pushes to the servers (the worker processes' mean is summed in float32)"
        return "the group's pushes to the servers" if plan.own_loop else super().compressed_in(plan)

    def process_groups(self, placement, devices, nnodes: int, partition) -> tuple:
        # a user's loop's plan has no slices yet (its module comes after planning): the group's processes, over which
        # they sum at the stub and take its values (a job file's: the sliced exchange's owners' groups)
        return super().process_groups(placement, devices, nnodes, partition) or worker_groups(placement)

    def goes_on_without_a_process(self, plan) -> bool:
        return served_replicas(plan) or loop_served_replicas(plan)

    def servers_heal(self, plan) -> bool:
        """Under cluster.max_restarts the servers (Downpour's) heal from the chief's mirror: a job file's (`served_replicas`)
        and a user's loop's (whose worker processes also go on without a dead one: `loop_served_replicas`)."""
        return served_replicas(plan) or (plan.own_loop and plan.max_restarts > 0 and not plan.in_one_process)

    def attach_exchanges(self, run) -> None:
        plan = run.plan
        if served_replicas(plan):
            self._attach_served(run)
            return
        if not plan.own_loop:
            super().attach_exchanges(run)
            return
        if loop_served_replicas(plan) and not plan.process(run.rank).servers:  # the worker processes as replicas
            self._attach_served(run, LoopSandblasterExchange)
            return
        # Downpour's servers and stub over the plan of one group, with this strategy's answers
        Downpour.attach_exchanges(self, run)

    def _attach_served(self, run, exchange=SandblasterExchange) -> None:
        """cluster.max_restarts in a job file: a server process serves as Downpour's; a worker process meets the others
        through the quorum of the worker processes, and the chief's also pushes to the servers (see the module's text).
        `exchange`: a user's loop's is LoopSandblasterExchange (the same meetings in its loop's order)."""
        plan, rank, trainer = run.plan, run.rank, run.trainers[0]
        if plan.process(rank).servers:
            Downpour.attach_exchanges(self, run)  # (its servers heal: servers_heal)
            return
        workers = [p.rank for p in plan.placement.processes if p.workers]
        # the chief's death makes the lowest living worker process the decider, and group 0's stub (`make_stub`)
        quorum = Quorum(rank, workers, {r: r for r in workers}, channels.Door(DOOR), timeout_s=plan.comm_timeout_s,
                        admits=True, replaceable=True, form_first=not run.rejoining)  # (a restarted process knocks instead)
        servers = {ServerId(0, i): plan.placement.process_of(ServerId(0, i)) for i in range(plan.nservers_per_group)}

        def make_stub() -> DownpourExchange:
            codecs = codec_factory(plan.compression.kind, plan.compression.topk_fraction)  # (the pushes, as Downpour's)
            return DownpourExchange(trainer.store, make_updater(plan.updater), plan.placement, rank, 0, [rank], None,
                                    servers, plan.global_batch, timeout_s=plan.comm_timeout_s, codecs=codecs,
                                    servers_heal=True, resends=True)  # (synchronous: a push lost with its server goes to the healed one)

        stub = make_stub() if rank == workers[0] and not run.rejoining else None
        log = lambda line: trainer.log(line)  # noqa: E731 (the trainer's log once it runs: above a progress bar)
        trainer.attach_exchange(exchange(trainer.store, make_updater(plan.updater), quorum, rank, plan.global_batch, stub,
                                         log=log, annotate=summary_annotator(trainer), make_stub=make_stub),
                                may_take_over=True)

    def restore_server(self, run, resumed) -> None:
        if served_replicas(run.plan):  # (the version a resumed Downpour server starts at: the step, one group)
            Downpour.restore_server(self, run, resumed)

    def after_values(self, run, spec) -> None:
        if served_replicas(run.plan):
            exchange = run.chief.exchange
            if spec.rejoin is not None:  # from the chief's values and the servers', at the next step
                rejoined.complete(run, spec)
            elif exchange.stub is not None and spec.resume_from is not None:  # (the servers restored themselves)
                exchange.resume_at(run.chief.start_step, resumed_version(run.chief.start_step, run.plan))
            elif exchange.stub is not None:  # the servers start from the chief's values (job.checkpoint_path's too)
                exchange.stub.start_loop(run.chief.start_step)
            return
        if not run.plan.own_loop:
            super().after_values(run, spec)
            return
        Downpour.after_values(self, run, spec)  # (resumed: the servers' version is the step, one group)

    def complete_rejoin(self, run, incarnation: int) -> tuple[int, int, dict]:
        return run.chief.exchange.rejoin(incarnation)


STRATEGY = Sandblaster()
