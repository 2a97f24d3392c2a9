"""Downpour over processes: asynchronous worker groups push gradients to one server group (in processes of its
own) and pull fresh values (runtime/exchanges/downpour.py). The servers hold the live params, so a dead group's
process can be restarted into the running job and rejoin from them (launcher/rejoin.py); a server process runs no
trainer and restores its slices itself."""
from __future__ import annotations

from typing import Optional

from shoal.comm import regroup
from shoal.comm.succession import successor_of
from shoal.neuralnet.updaters import make_updater
from shoal.planning.placement import ServerId
from shoal.planning.process_groups import worker_group_name, worker_groups
from shoal.planning.strategy import Framework, Layout, Strategy, UnsupportedClusterError
from shoal.runtime import rejoined
from shoal.runtime.exchanges.compression import codec_factory
from shoal.runtime.exchanges.downpour_server import DownpourServer
from shoal.runtime.exchanges.downpour import DOOR
from shoal.runtime.exchanges.downpour_stub import DownpourExchange
from shoal.report.terminal import write_line


class Downpour(Strategy):
    framework = Framework.DOWNPOUR
    params_on_host = True  # request/response over gloo's point-to-point
    bounds_update_lag = True
    compressed = "pushes"
    compensates_async_momentum = True
    overlaps_push = True
    rejoins = True
    regroups = True  # a group over several processes comes back whole: its stub pulls, then reduces and broadcasts afresh
    servers_hold_trainers = False
    outlives_a_dead_group = True  # the servers serve each group on a thread of its own: a dead one ends only its thread

    def recognises(self, layout: Layout) -> bool:
        return layout.asynchronous_groups and layout.nprocs > 1 and layout.cluster.nserver_groups <= 1

    def refuse(self, layout: Layout) -> None:
        c, nprocs = layout.cluster, layout.nprocs
        if not c.server_worker_separate:
            raise UnsupportedClusterError(
                f"cluster: asynchronous groups over {nprocs} processes with servers in the workers' processes are not supported yet: "
                "asynchronous groups over processes run as Downpour (nserver_groups: 1, server_worker_separate: true) "
                f"or in one process (nworkers_per_procs: {c.nworker_groups * c.nworkers_per_group}); see `shoal plan`"
            )
        if any(len({w.group for w in p.workers}) > 1 for p in layout.placement.processes):
            raise UnsupportedClusterError("cluster: a process hosting workers of several groups is not supported over processes yet")

    def process_groups(self, placement, devices, nnodes: int, partition) -> tuple:
        # the processes of each worker group spread over several; a rejoined process makes none (it has no world): the
        # launcher restarts all of a group's processes, which form their group afresh (`groups_formed_afresh`)
        return worker_groups(placement)

    def groups_formed_afresh(self, plan, rank: int, incarnation: int) -> dict:
        """A restarted process of a group over several processes: the group of its processes, formed afresh by the
        group's new incarnations on the job's store (shoal.comm.regroup); none for a group of one process."""
        group = plan.process(rank).workers[0].group if plan.process(rank).workers else None
        name = worker_group_name(group) if group is not None else None
        spec = next((s for s in plan.process_groups if s.name == name), None)
        if spec is None:
            return {}
        return {name: regroup.form_afresh(name, tuple(spec.ranks), rank, incarnation, timeout_s=plan.comm_timeout_s)}

    # -- runtime ------------------------------------------------------------------------------------
    def attach_exchanges(self, run) -> None:
        """A Downpour process is a server or a group's worker(s). A group over several processes reduces to its stub
        and broadcasts back over the plan's group of its processes (`process_groups`)."""
        plan, rank, trainer = run.plan, run.rank, run.trainers[0]
        bounds = plan.asynchrony
        updater = make_updater(plan.updater)
        group_ranks = {g: plan.ranks_of_group(g) for g in range(plan.nworker_groups)}
        hosted = plan.process(rank)
        codecs = codec_factory(plan.compression.kind, plan.compression.topk_fraction)  # cluster.compression of the pushes
        replaceable = self.chief_succeeded_by_a_group(plan)
        if hosted.servers:
            run.server = DownpourServer(trainer.store, updater, plan.placement, hosted.servers[0],
                                        {g: ranks[0] for g, ranks in group_ranks.items()}, log=write_line,
                                        max_staleness=bounds.max_staleness, warmup_steps=bounds.warmup_steps,
                                        after_update=run.faults.server_update_hook(rank), max_update_lag=bounds.max_update_lag,
                                        overlap_push=bounds.overlap_push, codecs=codecs, chief_replaceable=replaceable)
            run.server.rank, run.server.workspace = rank, str(trainer.workspace)  # where a heal's record goes
            return
        servers = {ServerId(0, i): plan.placement.process_of(ServerId(0, i)) for i in range(plan.nservers_per_group)}
        group = hosted.workers[0].group
        # (only a group's stub may take the chief's place: it holds the channels to the servers)
        stub = rank == group_ranks[group][0]
        successor = successor_of(plan, rank, DOOR) if replaceable and stub and not run.rejoining else None
        trainer.attach_exchange(DownpourExchange(trainer.store, updater, plan.placement, rank, group,
                                                 group_ranks[group], run.process_groups.get(worker_group_name(group)), servers, plan.global_batch,
                                                 timeout_s=plan.comm_timeout_s, warmup_steps=bounds.warmup_steps,
                                                 overlap_push=bounds.overlap_push, codecs=codecs,
                                                 servers_heal=self.servers_heal(plan), rejoining=run.rejoining,
                                                 successor=successor, resends=self.synchronous),  # (Sandblaster's loop)
                                may_take_over=successor is not None)

    def chief_succeeded_by_a_group(self, plan) -> bool:
        """Under cluster.max_restarts, groups of one process each, in a job file or a user's loop, or groups over several
        processes in a job file (`shoal run`'s launcher restarts all of group 0's: launcher/rejoin.py `_restart_group`):
        group 0's stub holds nothing the servers do not but the mirror, which the successor, the lowest living group's
        stub, rebuilds (the servers, restarted, heal from it; a loop's chief published the servers' description and
        schedule at its start)."""
        return plan.max_restarts > 0 and (
            not plan.own_loop or all(len(plan.ranks_of_group(g)) == 1 for g in range(plan.nworker_groups)))

    def servers_heal(self, plan) -> bool:
        """Under cluster.max_restarts a dead server process is restarted into the running job and heals from the
        chief's mirror (runtime/exchanges/downpour_mirror.py), on one host (`shoal run`'s launcher restarts it)."""
        return plan.max_restarts > 0

    def loads_checkpoint_path(self, trainer) -> bool:
        return trainer.group == 0  # the other groups take their first values from the servers

    def restore_server(self, run, resumed) -> None:
        run.server.restore(resumed.params, resumed.updater_state, resumed.step, resumed_version(resumed.step, run.plan))

    def after_values(self, run, spec) -> None:
        chief, exchange = run.chief, run.chief.exchange
        if spec.resume_from is not None:
            exchange.resume_at(chief.start_step, resumed_version(chief.start_step, run.plan))
        if chief.group != 0:  # groups join where group 0's warm-up ends, and finish at train_steps like it
            chief.start_at(max(chief.start_step, run.plan.asynchrony.warmup_steps))
            exchange.start_at(chief.start_step)
        if spec.rejoin is not None:  # from the servers' live values, at the step the group had reached
            rejoined.complete(run, spec)

    def complete_rejoin(self, run, incarnation: int) -> tuple[int, int, dict]:
        exchange = run.chief.exchange
        step, version = exchange.rejoin(incarnation)
        return step, version, exchange.digests

    def staleness_histogram(self, run) -> Optional[dict]:
        """The servers' count of every group's updates, and how many each was to apply in this run (its steps from
        where it started: group 0 at the run's first step, the others after the warm-up): summary.json's missed_updates."""
        exchange = run.chief.exchange if run.chief is not None else None
        if not isinstance(exchange, DownpourExchange) or exchange.lag_histogram is None:  # a server process has none
            return None
        if exchange.healed_without_counts is not None:  # the counts start at that heal: no group's shortfall is known
            return {**exchange.lag_histogram, "counted_from_version": exchange.healed_without_counts}
        first, steps, warmup = run.chief.start_step, run.plan.job.train_steps, run.plan.asynchrony.warmup_steps
        for group, counts in exchange.lag_histogram["groups"].items():
            counts["expected"] = max(0, steps - (first if group == "0" else max(first, warmup)))
        return exchange.lag_histogram


def resumed_version(step: int, plan) -> int:
    """The server version a Downpour run resumes at: every group had done about `step` updates."""
    return step * plan.nworker_groups


STRATEGY = Downpour()
