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
its older ones (a restart also the two newest of the start it resumed from); a checkpoint the job asked for
(checkpoint_freq, and an interval checkpoint this start wrote at a mirror's step) is never removed.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from shoal.config.phases import fires
from shoal.neuralnet import checkpoint as ckpt_io
from shoal.runtime.interfaces import TrainerHook

KEPT = 2  # mirrors each process keeps: the newest may be incomplete (a process died writing its part)


class SlicedMirror(TrainerHook):
    """Writes the trainer's checkpoint (the chief's file, or its process's part) before every `every`-th step."""

    def __init__(self, trainer, every: int):
        self.trainer, self.every = trainer, every
        self.written: Optional[list[int]] = None  # the mirrors' steps this start wrote, oldest first (read at the first step)
        self.started = time.time()

    def _file(self, step: int) -> Path:
        t = self.trainer
        return ckpt_io.checkpoint_file(t.workspace, step) if t.chief else ckpt_io.part_file(t.workspace, step, t.group, t.rank)

    def _mirror_step(self, step: int) -> bool:
        job = self.trainer.plan.job
        return step > 0 and step % self.every == 0 and not fires(job.checkpoint_freq, job.checkpoint_after, step)

    def before_step(self, step: int) -> None:
        t = self.trainer
        if self.written is None:  # a restart resumed from a mirror: it and the one before are the earlier start's
            self.written = [s for s in (t.start_step - self.every, t.start_step) if t.resumed and self._mirror_step(s)]
        if step <= t.start_step or not self._mirror_step(step):
            return  # nothing trained since the start or the resume, or the job's own checkpoint of this step was written
        # every process decides alike from the step alone (the write is collective); what is on disk only decides what
        # it may remove: an interval checkpoint of this step, written by this start just now, is the job's own
        path = self._file(step)
        own = path.exists() and path.stat().st_mtime >= self.started
        t.save_checkpoint(step)
        if not own:
            self.written.append(step)
        # every process wrote its part of the mirrors before this one (this one's collective needed them all here)
        for old in self.written[:-KEPT]:
            self._file(old).unlink(missing_ok=True)
        del self.written[:-KEPT]
