"""A partitioned group's mirror (issue 38, point 1): what each process of a group cut over processes alone holds
(its layers' params, the master slices it owns and their updater state, its workers' RNG), kept recoverable every
K steps, so that a dead process costs at most K steps.

Such a group cannot step without a process (its layers are there), so it does not go on: `shoal run --max-restarts N`
restarts the whole job (launcher/job_restarts.py) from the newest complete checkpoint. The mirror is that checkpoint,
written every K steps (`planning/exchange_choice.mirror_every`: the cost model's K): the chief's file and each other
process's part, as any checkpoint (the sliced exchange gathers the updater state over the group), so the restart is the
usual exact resume and the steps redone are those since the mirror. It lives in the workspace, not in the next
process's memory: whole-job restarts happen on one host (shoal run's launcher), where the workspace outlives any of
the job's processes, the launcher included, and no survivor has to outlive the death to hand a dead one's part over.
Each process keeps its two newest mirrors (the newer may be incomplete when a process dies writing it) and removes
its older ones. It removes only mirrors this start wrote (the start a restart resumed from leaves its last two: a
file this start did not write may be a checkpoint the job asked for), and a step whose checkpoint the job wrote
anyway (checkpoint_freq, or checkpoint_interval_s's, which the trainer writes before the hooks run) is not written
again and never removed.
"""
from __future__ import annotations

from pathlib import Path

from shoal.config.phases import fires
from shoal.neuralnet import checkpoint as ckpt_io
from shoal.runtime.interfaces import TrainerHook

KEPT = 2  # mirrors each process keeps: the newest may be incomplete (a process died writing its part)


class SlicedMirror(TrainerHook):
    """Writes the trainer's checkpoint (the chief's file, or its process's part) before every `every`-th step."""

    def __init__(self, trainer, every: int):
        self.trainer, self.every = trainer, every
        self.written: list[int] = []  # the mirrors' steps this start wrote, oldest first

    def _file(self, step: int) -> Path:
        t = self.trainer
        return ckpt_io.checkpoint_file(t.workspace, step) if t.chief else ckpt_io.part_file(t.workspace, step, t.group, t.rank)

    def _mirror_step(self, step: int) -> bool:
        job = self.trainer.plan.job
        return step > 0 and step % self.every == 0 and not fires(job.checkpoint_freq, job.checkpoint_after, step)

    def before_step(self, step: int) -> None:
        t = self.trainer
        if step <= t.start_step or not self._mirror_step(step) or step in t.interval_steps:
            return  # nothing trained since the start or the resume, or the job's own checkpoint of this step was written
        # every process decides alike from the step alone (the write is collective; the chief chose the interval
        # checkpoints, and every process wrote its part of them)
        t.save_checkpoint(step)
        self.written.append(step)
        # every process wrote its part of the mirrors before this one (this one's collective needed them all here)
        for old in self.written[:-KEPT]:
            self._file(old).unlink(missing_ok=True)
        del self.written[:-KEPT]
