"""Sandblaster: AllReduce's exchange with the servers in processes of their own (cluster.server_worker_separate).

In a user's own loop (shoal.session: the plan's job has no net) the servers run the user's optimizer, built from its
recipe (runtime/session_exchange.py), which the sliced exchange's owners cannot: there the group runs Downpour's
request/response with its one group (runtime/exchanges/downpour*.py). Every step the group's processes sum their
gradients at its stub (process 0), the stub pushes the sum to every server with the optimizer's hyper-parameters,
each server updates its slices and answers with their values, and the stub hands them to the group: synchronous, so
N workers train as one worker on the same rows. The servers keep no mirror: a dead process restarts the whole job
from its newest checkpoint (launcher/job_restarts.py)."""
from __future__ import annotations

from shoal.planning.process_groups import worker_groups
from shoal.planning.strategy import Framework
from shoal.strategies.allreduce import AllReduce
from shoal.strategies.downpour import Downpour


class Sandblaster(AllReduce):
    framework = Framework.SANDBLASTER
    separate_servers = True

    def notes(self, plan) -> list[str]:
        if not plan.own_loop:
            return super().notes(plan)
        restarts = (f"; cluster.max_restarts {plan.max_restarts}: a dead process restarts the whole job from its newest "
                    "checkpoint" if plan.max_restarts > 0 else "")
        return [f"your own loop: the group's processes sum their gradients at process 0, which pushes them to the "
                f"{plan.nservers} server process(es); they run your optimizer and answer with the new values{restarts}"]

    def compressed_in(self, plan):
        # a user's loop: the stub's push of the group's gradient (the servers answer with values, never encoded)
        return "the group's pushes to the servers" if plan.own_loop else super().compressed_in(plan)

    def process_groups(self, placement, devices, nnodes: int, partition) -> tuple:
        # a user's loop's plan has no slices yet (its module comes after planning): the group's processes, over which
        # they sum at the stub and take its values (a job file's: the sliced exchange's owners' groups)
        return super().process_groups(placement, devices, nnodes, partition) or worker_groups(placement)

    def attach_exchanges(self, run) -> None:
        if not run.plan.own_loop:
            super().attach_exchanges(run)
            return
        # Downpour's servers and stub over the plan of one group, with this strategy's answers: servers_heal is False
        Downpour.attach_exchanges(self, run)

    def after_values(self, run, spec) -> None:
        if not run.plan.own_loop:
            super().after_values(run, spec)
            return
        Downpour.after_values(self, run, spec)  # (resumed: the servers' version is the step, one group)


STRATEGY = Sandblaster()
