"""A user's loop under --max-restarts: a restarted process's healing, and a living process taking a dead chief's place.

A process the launcher restarted rejoins the running loop at run.batches(): it knocks, and once admitted takes the
chief's state (`take_chiefs_state`: the module's values and buffers, the optimizers' and schedulers' state, torch's RNG;
Local SGD / DiLoCo: a live group's at a meeting), or a restarted Distributed Hogwild group the live values of its
peers (`take_live_values`); with several workers in the process worker 0 takes it and the others copy worker 0's
(`workers_take_chiefs_state`). The processes that stayed hand it over after the loop's body (`after_the_body`: `heal`,
`handover`).
When the chief dies, the process its exchange made the decider takes the chief's run log, evaluations and checkpoints
(`take_over`; report/succession.py). Each function takes the `Session` (frontend/session.py) it acts for.
"""
from __future__ import annotations

import time
import warnings

import torch

from shoal.frontend import session_state, session_worker
from shoal.report import succession
from shoal.runtime import rejoined
from shoal.runtime.endings import MeetingsOver
from shoal.runtime.interfaces import summary_annotator
from shoal.runtime.replicas import usable_device_names
from shoal.report.terminal import also_on_the_terminal


def heal(run, step: int) -> None:
    """After the loop's body of `step` (the update, the schedulers' step, whatever else it did): a process the
    launcher restarted and the chief admitted at this step takes the module's values and buffers, the optimizers'
    and schedulers' state from the chief, and trains on from the next step."""
    started = time.perf_counter()
    joined = run.exchange.heal(step, lambda: handover(run))
    if not run.chief and run.exchange.chief:  # the chief died: this process decides the steps now
        take_over(run, step)
    if joined and run.chief:
        who = ", ".join(f"Process {r}" for r in joined)
        run.say(f"{who} rejoined at step {step + 1}: it took the module's values and buffers, the optimizers' and "
                f"schedulers' state and torch's RNG state after step {step} from process {run.rank}")
    run.exchange_seconds += time.perf_counter() - started


def after_the_body(run, step: int) -> None:
    """After the loop's body of `step`: a restarted process admitted at this step takes its state (a synchronous
    group's from the chief, `heal`; Local SGD / DiLoCo's at this step's meeting), and a process whose exchange took a
    dead chief's place takes the chief's duties (`take_over`)."""
    if run.mean is not None and (not run.pushes or run._served_replicas) and run.exchange is not None \
            and run.plan.strategy.synchronous:
        heal(run, step)  # (in-memory workers have no exchange; Sandblaster's servers hold the optimizer's state)
    elif run.distributed and run.plan.strategy.meets:  # Local SGD / DiLoCo: a group admitted at this step's meeting
        run.exchange.heal(step)
        if not run.chief and run.exchange.chief:  # group 0's process died: this group speaks for the job now
            take_over(run, step)
    elif succeeds_the_chief(run):  # Downpour, Distributed Hogwild: its exchange saw the chief gone at this step's end
        take_over(run, step)


def succeeds_the_chief(run) -> bool:
    """Asynchronous groups over processes (Downpour, Distributed Hogwild): whether this process's exchange took the
    dead chief's place at a step's end (shoal.comm.succession: it asks at its step ends and its finish) and the session
    not yet (a synchronous group's successor takes its place in `heal`)."""
    return not run.plan.strategy.synchronous and succeeds_the_chief_at_the_end(run)


def succeeds_the_chief_at_the_end(run) -> bool:
    """After the exchange's finish: whether it took the dead chief's place there (and the session not yet): the
    asynchronous groups' (the stub's, the Hogwild group's), or a quorum's whose chief died after the last step's commit,
    before it closed the meetings (Quorum.await_close: AllReduce's and Sandblaster's replicas, Local SGD's groups)."""
    return (not run.chief and run.distributed and run.exchange is not None and not run.groups_in_memory
            and run.exchange.chief)


def take_over(run, step: int) -> None:
    """The dead chief's run log, evaluations and checkpoints, from this step on (report/succession.py)."""
    run.chief = True  # (run.evaluate records on the chief: this process's from now on)
    if run._terminal and run.rank != 0:  # (its stdout is its log file: the chief's lines go on the terminal too)
        run.say = succession.on_the_terminal_too(run.say)
    run.metrics = succession.take_over_run_log(run.plan, run.workspace, usable_device_names(run.plan.all_devices()),
                                               run.rank, step)
    duties = run.exchange.duties_taken_over.replace("tests and validates", "evaluates (run.evaluate)")  # (the loop's calls)
    run.say(f"Process {run.rank} took the chief's place after step {step}: {duties}")
    run.exchange.speak_for_the_job(run.say, summary_annotator(run))
    if run._interval is not None:  # it picks the interval checkpoints' steps now (the chief's published ones stand)
        run._interval.take_over()


def handover(run) -> list[torch.Tensor]:
    """What a restarted process takes from this one (session_state.handover)."""
    return session_state.handover(run.module, run.optimizers, run.schedulers, run.device)


def take_chiefs_state(run) -> None:
    """A restarted process, at run.batches(): knock, and once admitted take the chief's state (its `handover`)
    into this module and these optimizers and schedulers; the loop goes on from the step after the admission."""
    knocked_at = time.time()
    taken, tensors, rng, text = session_state.handover_receivers(run.module, run.optimizers, run.schedulers, run.device)
    try:
        start, admitted, digests = run.exchange.rejoin(run.rejoin.incarnation, lambda: taken)
    except MeetingsOver as err:  # restarted after the chief's last step: nothing of the loop is left to it
        run.say(str(err))
        also_on_the_terminal(str(err))  # (the launcher's line said it would rejoin)
        raise SystemExit(0) from None  # (the script after the loop is the job's end, which the others made)
    session_state.take_handover(text, tensors, rng, run.optimizers, run.schedulers, run.device)
    run.start_step = run.step = start
    if "from_group" in digests:  # Local SGD / DiLoCo: at a meeting, from a live group; this process says it
        sparse = run.exchange.sparse is not None  # (a PeriodicExchange's: SparseLoCo's outer step, or None)
        digests["took"] = (f"the anchor{'' if sparse else ', the outer updater' + chr(39) + 's state'} and worker group "
                           f"{digests['from_group']}'s module buffers, optimizers' and schedulers' state and torch's RNG "
                           f"state{' (its error feedback starts at zero)' if sparse else ''}, after the meeting after step "
                           f"{start - 1}")
        rejoined.report(run.workspace, run.rejoin, run.group, run.rank, start, admitted, digests, knocked_at)
        return
    digests["took"] = (f"the module's values and buffers, the optimizers' and schedulers' state and torch's RNG state from process "
                       f"{digests.get('from_process', 0)}, after step {admitted}")
    # this process's log; the chief says it on the terminal
    rejoined.report(run.workspace, run.rejoin, run.group, run.rank, start, admitted, digests, knocked_at, terminal=False)


def receive_chiefs_state(run) -> None:
    """`take_chiefs_state` where the optimizers' step pushes or meets: the zero-gradient step that makes the
    optimizers' state pushes to no server and meets no one meanwhile (`run._receiving`)."""
    run._receiving = True
    try:
        take_chiefs_state(run)
    finally:
        run._receiving = False


def workers_take_chiefs_state(run) -> None:
    """A restarted process of several workers (AllReduce over processes of threads, or Local SGD / DiLoCo's group of
    threads, --max-restarts): worker 0 takes the chief's state (`take_chiefs_state`: the chief hands over its worker
    0's, every replica being equal; Local SGD's: a live group's at a meeting, the anchor too), then
    every other worker's replica, optimizers and schedulers take worker 0's, and they all start at its step."""
    receive_chiefs_state(run)
    workers_copy_first(run)
    for worker in run._workers:
        worker.first_step = worker.at = run.start_step


def workers_copy_first(run) -> None:
    """A restarted process's worker 0 took the chief's state: every other worker's replica, optimizers and schedulers
    take worker 0's."""
    values = run._workers[0].module.state_dict()
    for worker in run._workers[1:]:
        worker.module.load_state_dict(values)
        for mine, theirs in zip(worker.optimizers, run.optimizers):
            mine.load_state_dict(session_worker.own_copy(theirs.state_dict()))
        for index, optimizer in enumerate(worker.optimizers):  # a scheduler's state, by its optimizer's place
            ours = [s for s in run.schedulers if s.optimizer is run.optimizers[index]]
            for mine, theirs in zip([s for s in worker.schedulers if s.optimizer is optimizer], ours):
                mine.load_state_dict(session_worker.own_copy(theirs.state_dict()))


def take_live_values(run) -> None:
    """A restarted Distributed Hogwild group, at run.batches(): it knocks at the live groups and takes the live values
    of the slices they master and its own slices as they last synced them (runtime/exchanges/hogwild.py), and joins at
    its peers' step (the steps since its last sync skipped), its schedulers stepped to it; its optimizer's state
    starts anew (as a job file's restarted group's server state: what it did since its last sync is lost)."""
    knocked_at = time.time()
    step, took = run.exchange.rejoin(run.rejoin.incarnation, end_step=run.job.train_steps)
    with warnings.catch_warnings():  # (torch warns of a scheduler stepped before its optimizer)
        warnings.simplefilter("ignore")
        for scheduler in run.schedulers:
            for _ in range(step):
                scheduler.step()
    run.start_step = run.step = step
    rejoined.report(run.workspace, run.rejoin, run.group, run.rank, step, 0,
                    {"took": took + ("; its optimizer's state starts anew, its schedulers stepped to this step"
                                     if run.optimizers else "")}
                    | ({"skipped_steps": list(run.exchange.skipped)} if run.exchange.skipped else {}), knocked_at)
