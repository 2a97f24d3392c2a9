"""Downpour's and Sandblaster's pushes to server processes in a user's loop: the servers run the user's optimizer.

run.optimizer(opt) under Downpour or Sandblaster (`push_to_servers`): the optimizer's recipe (torch.optim's class,
defaults and groups by param name; a SINGA updater's momentum compensated under asynchrony: `compensated`) goes to the
servers, which build it, and opt.step()'s pre-hook pushes the gradients and installs the servers' answer (`push`);
before the first step the chief's values start the servers and the other groups pull theirs (`start_pushing`; a
restarted process the servers' live values, or Sandblaster's replicas the chief's state). run.scheduler(s,
steps="update") gives the servers the chief's schedule by their update count (`schedule_by_updates`). In-memory
Downpour's and Hogwild's server in one process is built from the same recipe (session_threads.py's
`WorkerThreads.start_groups`). Each function takes the `Session` (frontend/session.py) it acts for; the exchange
itself is runtime/session_exchange.py's.
"""
from __future__ import annotations

import functools
import time
import warnings

import torch

from shoal.frontend import session_healing, session_worker
from shoal.frontend.session_start import SessionError
from shoal.runtime import rejoined, session_exchange


def push_to_servers(run, optimizer: torch.optim.Optimizer, index: int) -> None:
    """Downpour: the servers run this optimizer (built from its recipe: torch.optim's class, defaults and groups by
    param name), so opt.step() pushes the gradients and installs the servers' answer instead of updating here."""
    if run.module is None:
        raise SessionError(f"run.optimizer: give the module to run.model(...) first ({run.plan.label}'s servers build "
                           "the optimizer over its params)")
    if index:
        raise SessionError(f"run.optimizer: {run.plan.label}'s servers run one optimizer over the module: give "
                           "run.optimizer one optimizer holding every trained param")
    named = [(n, p) for n, p in run.module.named_parameters() if p.requires_grad]
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    left = [n for n, p in named if id(p) not in held]
    if left:
        raise SessionError(f"run.optimizer: {run.plan.label}'s servers update every trained param of the module, and "
                           f"this optimizer does not hold {left[0]!r}")
    try:
        recipe = session_exchange.optimizer_recipe(optimizer, named)
    except session_exchange.RecipeError as err:
        raise SessionError(str(err)) from None
    recipe = compensated(run, recipe)
    if run.chief:
        session_exchange.publish_description([n for n, _ in named], [tuple(p.shape) for _, p in named], recipe)
    saved = dict(run._mine.exchange) if run._mine is not None else None
    run._saved_server_state = session_exchange.whole_updater_state(saved)
    run.exchange = session_exchange.downpour_exchange(run.plan, run.rank, run._store, run.group, recipe, optimizer,
                                                      run.start_step, saved, run.metrics, run.say,
                                                      rejoining=run.rejoin is not None)
    if run._workers:  # several workers in this process: their opt.step()s push once (session_worker's _push_process)
        return
    if run.plan.strategy.synchronous:  # Sandblaster: the group's mean in every .grad when backward ends, as under DDP
        # (--max-restarts: the worker processes' quorum's, which goes on without a dead one: sandblaster_loop.py)
        mean = run.exchange if run._served_replicas else session_exchange.StubGroupMean(named, run.exchange)
        run.mean = session_exchange.GradientMean(named, mean, run._share, lambda: run.step)
        run._group_window = run._served_replicas  # (the Train line's averages: every process's, the quorum's)
    optimizer.register_step_pre_hook(functools.partial(push, run))


def compensated(run, recipe: dict) -> dict:
    """The servers' recipe: a SINGA updater's momentum compensated under asynchrony, said by the chief in the job
    file's line (session_exchange.compensated)."""
    recipe, said = session_exchange.compensated(run.plan, recipe)
    if run.chief:
        for line in said:
            run.say(line)
    return recipe


def push(run, optimizer, args, kwargs) -> None:
    """Downpour's step: this process's gradients to the servers (with the optimizer's hyper-parameters as the
    user's scheduler left them), the servers' new values into the module's params; `.grad` is then None, so the
    user's optimizer, which runs next, updates nothing here."""
    if run._receiving:
        return
    grads = {n: p.grad for n, p in run.module.named_parameters() if p.requires_grad}
    started = time.perf_counter()
    share = run._share
    if run.plan.strategy.synchronous:  # Sandblaster: every process holds the group's mean: the stub's alone is pushed, whole
        share = run.exchange.global_batch if run.rank == run.exchange.stub else 0
    run.exchange.step(run.step, [(grads, share)])
    run.exchange_seconds += time.perf_counter() - started
    session_worker.drop_grads(optimizer)


def schedule_by_updates(run, scheduler) -> None:
    """run.scheduler(s, steps="update") under Downpour's or in-memory groups' servers: the chief works out the
    hyper-parameters `s` sets at every update count the run can reach (the groups' steps: nworker_groups ×
    train_steps), which the servers set before each update (session_exchange.UpdateSchedule); `s` is put back."""
    lr_scheduler = torch.optim.lr_scheduler
    if not isinstance(scheduler, lr_scheduler.LRScheduler) or isinstance(scheduler, lr_scheduler.ReduceLROnPlateau):
        raise SessionError(f"run.scheduler: steps='update' takes a torch LR scheduler stepped without a metric "
                           f"(LambdaLR, SequentialLR, CosineAnnealingLR...), got {type(scheduler).__name__}")
    if not run.optimizers or scheduler.optimizer is not run.optimizers[0]:
        raise SessionError("run.scheduler: steps='update' schedules the optimizer given to run.optimizer (the servers "
                           "run it): give run.optimizer(...) first, and a scheduler over it")
    if getattr(scheduler, "last_epoch", 0) != 0 or run._loop_started:
        raise SessionError("run.scheduler: steps='update' takes the scheduler as made (at its first position), "
                           "before the loop: the servers follow its schedule from their first update")
    if run.chief:
        run._update_schedule = session_exchange.update_schedule(scheduler, run._hyper_layout,
                                                                run.plan.nworker_groups * run.job.train_steps)


def pushing(run):
    """Downpour's exchange, made at run.optimizer()."""
    if run.exchange is None:
        raise SessionError("run.batches: give the optimizer to run.optimizer(...) first (Downpour's servers run it)")
    return run.exchange


def start_pushing(run) -> None:
    """Downpour, before the first step: the chief's values (and, resumed, the updater state) start the servers; the
    other groups take the servers' values, and start where group 0's warm-up ends (their schedulers stepped there)."""
    if run.rejoin is not None and run._served_replicas:  # Sandblaster's replicas: the chief's state, as AllReduce's
        session_healing.receive_chiefs_state(run)  # (its optimizers' zero-gradient step pushes nothing)
        return
    if run.rejoin is not None:  # restarted (--max-restarts): the servers' live values and the steps the group did
        knocked_at = time.time()
        start, version = pushing(run).rejoin(run.rejoin.incarnation)
        rejoined.report(run.workspace, run.rejoin, run.group, run.rank, start, version,
                        {**run.exchange.digests, "took": f"the servers' live values of version {version}; its "
                         "schedulers stepped to that step"}, knocked_at)
    else:
        if run.chief:  # (before the servers' first values: every push finds it there)
            session_exchange.publish_schedule(run._update_schedule)
        start = pushing(run).start_loop(run.start_step, run._saved_server_state)
    with warnings.catch_warnings():  # (torch warns of a scheduler stepped before its optimizer)
        warnings.simplefilter("ignore")
        for scheduler in run.schedulers:
            for _ in range(start - run.start_step):
                scheduler.step()
    run.start_step = run.step = start
