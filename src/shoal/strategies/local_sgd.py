"""Local SGD and DiLoCo: groups train on their own copies and meet every cluster.local_steps steps (every step
of a warm-up first); at a meeting the outer updater (DiLoCo: with momentum) moves the anchor by the groups' mean
change (runtime/exchanges/periodic.py). In one process the groups are threads meeting in memory; over
processes each process holds one whole group and a meeting is one all-reduce over the groups that came
(shoal.comm.quorum). A dead or stalled group is left out of the meetings and the others go on; with
cluster.max_restarts the launcher restarts its process, which joins at the next meeting from a live group's state
(launcher/rejoin.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from shoal.comm import channels
from shoal.comm.quorum import Quorum
from shoal.config import job_pb2
from shoal.neuralnet.updaters import make_updater
from shoal.planning.process_groups import whole_group
from shoal.planning.strategy import Framework, Layout, Strategy, UnsupportedClusterError
from shoal.runtime.exchanges.compression import codec_factory
from shoal.runtime.interfaces import summary_annotator
from shoal.runtime.exchanges.groups import GroupBoard
from shoal.runtime import rejoined
from shoal.runtime.exchanges.periodic import DOOR, InMemoryMeeting, PeriodicExchange, ProcessMeeting
from shoal.strategies.in_memory_hogwild import start_on_board


class LocalSGD(Strategy):
    framework = Framework.LOCAL_SGD
    compressed = "pseudo-gradients at each meeting"
    meets = True
    # a meeting goes on without a group that died or stalled (the mean over the groups that came): in memory the group
    # leaves the meeting, over processes the chief decides each meeting's quorum (shoal.comm.quorum)
    outlives_a_dead_group = True
    rejoins = True  # a dead group's process may be restarted (--max-restarts): it joins at the next meeting

    def process_groups(self, placement, devices, nnodes: int, partition) -> tuple:
        return (whole_group("meeting", range(len(placement.processes)), devices, nnodes),)

    def recognises(self, layout: Layout) -> bool:
        return layout.cluster.nworker_groups > 1 and layout.cluster.local_steps > 0

    def refuse(self, layout: Layout) -> None:
        c, nprocs = layout.cluster, layout.nprocs
        if any(len({w.group for w in p.workers}) != 1 or len(p.workers) != c.nworkers_per_group for p in layout.placement.processes if nprocs > 1) \
                or (nprocs > 1 and c.server_worker_separate):
            raise UnsupportedClusterError(
                f"cluster.local_steps: over processes, each process holds one whole worker group (nworkers_per_procs: "
                f"{c.nworkers_per_group}, server_worker_separate: false), or all groups share one process")
        if c.max_staleness >= 0 or c.warmup_steps > 0 or c.max_update_lag >= 0:
            raise UnsupportedClusterError("cluster: max_staleness, max_update_lag and warmup_steps do not apply to local_steps (groups "
                                          "meet in lockstep; local_warmup_steps is Local SGD's warm-up)")
        if c.local_warmup_steps < 0:
            raise UnsupportedClusterError(f"cluster.local_warmup_steps: must be >= 0, got {c.local_warmup_steps}")
        if c.HasField("sparse_outer_step"):
            refuse_sparse_outer_step(c)

    def label(self, plan) -> str:
        if plan.meetings.sparse:
            return "SparseLoCo"
        return "DiLoCo" if plan.outer_updater is not None and plan.outer_updater.momentum > 0 else self.framework.value

    def notes(self, plan) -> list[str]:
        """When the groups meet, and what that costs against a synchronous exchange every step."""
        m, steps = plan.meetings, max(1, plan.job.train_steps)
        warmup = f"after each of the first {m.warmup_steps} steps (synchronous warm-up), then " if m.warmup_steps else ""
        meetings = m.count(steps)
        notes = [f"groups meet {warmup}every {m.local_steps} steps: {meetings} meeting(s) in {steps} steps, "
                 f"{steps / max(1, meetings):.1f}x fewer exchanges than a synchronous job's"]
        o = m.sparse_outer_step
        if o is not None:
            notes.append(f"SparseLoCo outer step (cluster.sparse_outer_step): each group sends the {o.topk_per_chunk} largest of every "
                         f"{o.chunk_size} entries of its error-feedback accumulator (decay {o.error_decay:g}) in {o.value_bits}-bit values; "
                         f"the groups' mean, times {o.outer_lr:g}, is the outer step (no outer updater)")
        return notes

    def round_steps(self, cluster) -> tuple[int, str]:
        return (cluster.local_steps, f"{cluster.local_steps} local steps (a meeting)") if cluster.local_steps > 1 else (1, "step")

    # -- runtime ------------------------------------------------------------------------------------
    def attach_exchanges(self, run) -> None:
        plan, meetings = run.plan, run.plan.meetings
        groups = plan.nworker_groups
        replaceable = False  # (in one process a group's thread never dies alone)
        if plan.in_one_process:
            meeting = InMemoryMeeting(groups, plan.comm_timeout_s)
            run.board = MeetingBoard(groups, -1, 0, meeting=meeting)
        else:
            codecs = codec_factory(plan.compression.kind, plan.compression.topk_fraction)
            ranks = [p.rank for p in plan.placement.processes]
            group_of = {r: plan.process(r).workers[0].group for r in ranks}
            first = None if run.rejoining else run.process_groups["meeting"]  # a restarted process knocks instead
            # groups of one process each: group 0's process may die like any other; the lowest living one decides the
            # meetings, as under AllReduce, and its loop (a user's session, or its trainer) takes over the chief's duties
            replaceable = all(len(plan.ranks_of_group(g)) == 1 for g in range(groups))
            quorum = Quorum(run.rank, ranks, group_of, channels.Door(DOOR), first=first, timeout_s=plan.comm_timeout_s,
                            admits=plan.max_restarts > 0, replaceable=replaceable)
            meeting = ProcessMeeting(groups, codecs() if codecs else None, quorum, group_of, first)
        for t in run.trainers:
            steps_done = None if run.board is None else (lambda steps, g=t.group: run.board.note_steps(g, steps))
            t.attach_exchange(PeriodicExchange(t.store, make_updater(plan.updater), make_updater(plan.outer_updater), meetings.local_steps,
                                               meeting, t.group, plan.global_batch, meetings.warmup_steps,
                                               meetings.sparse_outer_step,
                                               on_step_done=steps_done, annotate=summary_annotator(t)),
                             may_take_over=replaceable)

    def after_values(self, run, spec) -> None:
        chief = run.chief
        for trainer in run.trainers:  # every group starts from the chief's values; a resumed round from its anchor
            trainer.exchange.start_from(chief.store, resumed=spec.resume_from is not None, step=chief.start_step)
        if run.board is not None:
            start_on_board(run)
        if spec.rejoin is not None:  # a restarted process: from a live group's state, at the next meeting
            rejoined.complete(run, spec)

    def complete_rejoin(self, run, incarnation: int) -> tuple[int, int, dict]:
        return run.chief.exchange.rejoin(incarnation)


@dataclass
class MeetingBoard(GroupBoard):
    """In-memory Local SGD's board: a group that stops (its thread failed, or it finished) leaves the meetings, so that
    nobody waits for it; aborted (the chief failed, or the job ends early), it ends the meetings too."""

    meeting: Optional[InMemoryMeeting] = None

    def stop(self, group: int) -> None:
        super().stop(group)
        if self.meeting is not None:
            self.meeting.leave(group)

    def note_steps(self, group: int, steps: int) -> None:
        """`group` has done `steps` steps (the warning that names a group that died says where)."""
        with self._cond:
            self.steps[group] = steps

    def abort(self) -> None:
        super().abort()
        if self.meeting is not None:
            self.meeting.abandon()


def refuse_sparse_outer_step(c) -> None:
    """cluster.sparse_outer_step's own fields, and what it replaces (the outer updater, compression)."""
    o = c.sparse_outer_step
    if c.HasField("outer_updater"):
        raise UnsupportedClusterError("cluster.sparse_outer_step: replaces the outer updater (its error feedback plays the outer "
                                      "momentum's part): give cluster.outer_updater / outer_optimizer= or sparse_outer_step, not both")
    if c.compression != job_pb2.kNone:
        raise UnsupportedClusterError("cluster.sparse_outer_step: encodes the pseudo-gradients itself: leave cluster.compression unset")
    if not 1 <= o.chunk_size <= 65536:
        raise UnsupportedClusterError(f"cluster.sparse_outer_step.chunk_size: must be in [1, 65536] (16-bit positions), got {o.chunk_size}")
    if not 1 <= o.topk_per_chunk <= o.chunk_size:
        raise UnsupportedClusterError(f"cluster.sparse_outer_step.topk_per_chunk: must be in [1, chunk_size = {o.chunk_size}], got {o.topk_per_chunk}")
    if o.value_bits not in (2, 16):
        raise UnsupportedClusterError(f"cluster.sparse_outer_step.value_bits: 2 (sign and magnitude bit) or 16 (bfloat16), got {o.value_bits}")
    if not 0 <= o.error_decay <= 1:
        raise UnsupportedClusterError(f"cluster.sparse_outer_step.error_decay: must be in [0, 1], got {o.error_decay:g}")
    if not o.outer_lr > 0:
        raise UnsupportedClusterError(f"cluster.sparse_outer_step.outer_lr: must be > 0, got {o.outer_lr:g}")


STRATEGY = LocalSGD()
