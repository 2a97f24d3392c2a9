"""A user's loop's checkpoint (run.checkpoint): what each process writes, and the chief's file that lists the parts.

A synchronous group's replicas are equal: the chief's file is the checkpoint, each other process adding what is its
own as its part (a compressed AllReduce's error-feedback residual, server slices' optimizer state); groups that train
apart (Local SGD / DiLoCo, Distributed Hogwild) each write their state as a part, which the chief's file lists (an
asynchronous group's optional); Local SGD's groups in one process write every group's part here
(session_threads.WorkerThreads.write_group_parts). At each step's end `when_due` writes it where checkpoint_freq or
checkpoint_interval_s says. What a state holds, and loading it back: session_state.py. Each function takes the
`Session` (frontend/session.py) it writes for.
"""
from __future__ import annotations

from pathlib import Path

from shoal.frontend import session_display, session_server_slices, session_state
from shoal.neuralnet import checkpoint as ckpt_io
from shoal.runtime import checkpoint_schedule, session_exchange


def write(run, done: int) -> Path:
    """The checkpoint after `done` steps (run.checkpoint): this process's part, and the chief's file that lists every
    part; returns the file's path."""
    path = ckpt_io.checkpoint_file(run.workspace, done)
    # a synchronous group's replicas are equal: the chief's file is the checkpoint (compressed, each other process
    # adds its residual as its part). Local SGD's groups each write their part, which the chief's file lists
    # (required, but for groups missing from the meetings): no barrier, so that a dead group never holds the others
    # up; a resume refuses a checkpoint with a required part missing
    if not run.chief and run.apart:
        ckpt_io.save(ckpt_io.part_file(run.workspace, done, run.group, run.rank), state(run, done))
    elif not run.chief and run.sliced:  # server slices: only its slices' optimizer state is this process's own
        ckpt_io.save(ckpt_io.part_file(run.workspace, done, run.group, run.rank),
                     ckpt_io.Checkpoint(step=done, params={}, trainer={"next_step": done, "session": True},
                                        exchange=session_server_slices.slices_state(run)))
    elif not run.chief and run.own_residual:  # the replicas are equal: only the residual is this process's own
        own = session_exchange.exchange_state(run.exchange) if run.exchange is not None else {}
        ckpt_io.save(ckpt_io.part_file(run.workspace, done, run.group, run.rank),
                     ckpt_io.Checkpoint(step=done, params={}, trainer={"next_step": done, "session": True},
                                        exchange={k: v for k, v in own.items() if k.startswith("own/residual/")}))
    whole = state(run, done) if run.plan.tensor_parallel else None  # (gathered: every process of the group joins)
    if run.chief:  # (process 0, or the process that took a dead chief's place: report/succession.py)
        ckpt = whole or state(run, done)
        if run.own_residual:  # required from the processes the last step's mean held (a dead one writes none)
            present = run.exchange.present if run.exchange is not None else range(run.plan.nprocs)
            ckpt.part_names = {ckpt_io.part_name(done, run.plan.process(r).workers[0].group, r): r in present
                               for r in range(run.plan.nprocs) if r != run.rank}  # (the chief: 0, or its successor)
        if run.sliced:  # every other process's slices, required: a resume needs every slice's state
            ckpt.exchange |= session_server_slices.slices_state(run)
            ckpt.part_names = {ckpt_io.part_name(done, run.plan.process(r).workers[0].group, r): True
                               for r in range(run.plan.nprocs) if r != run.rank}
        if run.apart:  # every group's part but the writer's own (here); an asynchronous group's optional, as a job
            # file's (a restarted one may end at another step, or die before writing it: a resume starts it from here)
            absent = run.exchange.absent_groups if run.exchange is not None else frozenset()
            parts = checkpoint_schedule.checkpoint_parts(run.plan, writer=(run.group, run.rank))
            ckpt.part_names = {ckpt_io.part_name(done, g, r): required and g not in absent
                               for (g, r), required in parts.items()}
        if run.meets_in_memory:  # every other group's state, its part (every group is at this step: a meeting of all)
            ckpt.part_names = run._threads.write_group_parts(done)
        ckpt.trainer["writer"] = run.rank  # whose state the file holds (a resume gives it to that process)
        ckpt_io.save(path, ckpt)
    return path


def when_due(run, step: int) -> None:
    """At the end of step `step`: the checkpoint when checkpoint_freq, or checkpoint_interval_s's step (the chief's pick,
    every process's part; in-memory groups' free-running interval), says it is due."""
    if run.checkpoints_after(step):
        path = run.checkpoint()
        if run._free_interval is not None:  # (no checkpoint_freq: the interval's step)
            run._free_interval.written()
            session_display.say_interval_checkpoint(run, path)
    elif (run._interval is not None and step + 1 < run.job.train_steps
          and run._interval.due(run.group, step + 1, run.chief)):
        path = run.checkpoint()
        run._interval.written(step + 1)
        session_display.say_interval_checkpoint(run, path)


def state(run, done: int) -> ckpt_io.Checkpoint:
    """This process's state after `done` steps (session_state.checkpoint_state), with its groups' measured batch
    shares."""
    ckpt = session_state.checkpoint_state(done, run.module, run.optimizers, run.schedulers, run.device, run.window,
                                          run.metrics, run.exchange, run._update_lock, whole=run.plan.tensor_parallel)
    if run._measured:  # each measuring group's split here: a resume goes on from it (as the job path's Trainer)
        ckpt.trainer["batch_shares"] = [group.shares for group in run._measured]
    return ckpt
