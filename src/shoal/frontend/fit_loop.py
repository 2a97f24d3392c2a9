"""`shoal.fit`'s loop written with the session's public calls (issue 39, point 2): what fit does, as a user's loop.

    run = shoal.session(cluster, train_steps=steps, ...)           # fit's keywords: the layout, workspace, resume
    model = run.model(model)
    opt = run.optimizer(torch optimizer from optimizer=, or shoal.SingaOptimizer(updater=))
    sched = run.scheduler(scheduler(opt), steps=scheduler_steps)  # stepped after each update, as fit's
    for step, batch in run.batches(train, batch_size, shuffle=shuffle):
        validate / test at fit's frequencies (the next val_steps batches: fit's cursor), before the step's update
        for each micro-batch (grad_accum_steps): under run.accumulating() but the last, loss × its rows' part, backward
        clip_grad_norm_; opt.step(); opt.zero_grad(); sched.step()
        run.log(step, loss=..., accuracy=...)                      # fit's train record
        (the session checkpoints every checkpoint_freq steps, or every checkpoint_interval_s seconds at the steps its
        chief picks)
    validate / test the trained model; run.checkpoint()            # fit's final phases and checkpoint

The loop is the body `run.each_worker` runs once per worker of the process (several workers in one process: each in a
thread, with a worker's view of these calls; one worker: the body runs on `run` itself), so one body runs every layout.
Nothing here reaches past the session's public calls (run.each_worker, and each worker's model, optimizer, scheduler,
batches, accumulating, evaluate, log, checkpoint) and attributes (job, device, chief, processes, local_workers, start_step,
resumed, index); fit's History is read back from the run log. Which layouts fit runs here and which still on the job path
(module_path's layers): `fit.ON_SESSION`, `fit.on_session`.
"""
from __future__ import annotations

import copy
import dataclasses
import threading
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from shoal.config.phases import fires
from shoal.data.in_place import PositionSource, batch_rows
from shoal.frontend.fit_metrics import FitError, report_accuracy
from shoal.frontend.session_eval import EvaluateError
from shoal.frontend.module_path import output_tensor, scalar_loss, split_pair
from shoal.report.metrics import MetricWindow, read_metrics
from shoal.runtime.worker import micro_batch_rows


@dataclass
class Phase:
    """A held-out set as fit evaluates it: its batch, its batches per evaluation and how often (0: at the end only)."""

    data: Any
    batch: int
    steps: int
    freq: int
    after: int = 0
    cursor: int = 0  # fit's val_steps cursor: the next evaluation starts where this one ended (positions in the set)


@dataclass
class FitLoop:
    """What fit's keywords say about its loop, checked by fit (frontend/fit.py) before it comes here."""

    model: torch.nn.Module
    loss_fn: Callable
    form: str  # "output" (loss_fn(output, target)) or "model" (loss_fn(model, batch)): module_path.loss_form
    train: Any
    batch_size: int
    steps: int
    seed: int = 0
    shuffle: bool = True
    updater: Optional[dict] = None  # SINGA's (UpdaterProto's fields), run as shoal.SingaOptimizer
    optimizer: Optional[Callable] = None  # fit's normalised factory on (name, param) pairs
    scheduler: Optional[Callable] = None
    scheduler_steps: str = "update"  # fit's: what its position counts under asynchronous groups (run.scheduler's steps=)
    clip_grad_norm: Optional[float] = None
    grad_accum_steps: int = 1
    autocast: Optional[torch.dtype] = None
    metrics: dict = field(default_factory=dict)
    test: Optional[Phase] = None
    val: Optional[Phase] = None
    checkpoint_interval_s: float = 600.0
    goals: Any = None  # fit's higher_is_better and targets (report.targets.RunGoals): the summary the chief writes has them
    outer_optimizer: Optional[Callable] = None  # Local SGD / DiLoCo's outer step (shoal.session's outer_optimizer=)
    cuts: Optional[dict] = None  # partition_dim 1: what run.model cuts (None: what it finds)


def _rows(batch: Any, start: int, count: int) -> Any:
    """Rows start .. start + count of a collated batch (a tensor, or a tuple/list/dict of them)."""
    if isinstance(batch, torch.Tensor):
        return batch[start:start + count]
    if isinstance(batch, dict):
        return {k: _rows(v, start, count) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_rows(v, start, count) for v in batch)
    return batch


def _loss(model: torch.nn.Module, spec: FitLoop, batch: Any, computing, report) -> torch.Tensor:
    """One (micro-)batch's training loss in fit's form, its loss (and accuracy) reported as fit's loss layer does."""
    if spec.form == "model":
        with computing():
            loss = scalar_loss(spec.loss_fn(model, batch))
        report("loss", loss.detach(), batch_rows(batch))
        return loss
    inputs, target = split_pair(batch)
    with computing():
        output = model(inputs)
        output_tensor(output)  # (one holding no tensor: refused in fit's one line)
        loss = scalar_loss(spec.loss_fn(output, target))
    with torch.no_grad():
        rows = batch_rows(output)
        report("loss", loss.detach(), rows)
        report_accuracy(spec.metrics, output, target, rows, report)
    return loss


def _evaluate(run, spec: FitLoop, phase: Phase, name: str) -> None:
    """fit's test or validation: `phase.steps` batches from its cursor (every sample once where the batch divides the set)."""
    data = phase.data
    n = len(data) if hasattr(data, "__len__") else 0
    if phase.cursor and n and not isinstance(data, PositionSource):  # the next batches: the set seen from the cursor
        data = torch.utils.data.Subset(data, [(phase.cursor + i) % n for i in range(n)])
    try:
        _evaluated(run, spec, phase, name, data)
    except EvaluateError as err:  # fit's error, in fit's words (the metric that failed, say)
        raise FitError("shoal.fit: " + str(err).removeprefix("run.evaluate: ")) from None
    if n:
        phase.cursor = (phase.cursor + phase.steps * phase.batch) % n


def _evaluated(run, spec: FitLoop, phase: Phase, name: str, data) -> None:
    run.evaluate(data, spec.loss_fn, batch_size=phase.batch, steps=phase.steps, metrics=spec.metrics or None, phase=name,
                 loss_takes=spec.form, autocast=spec.autocast)


def _optimizer(spec: FitLoop, model: torch.nn.Module) -> torch.optim.Optimizer:
    from shoal.neuralnet.singa_optimizer import SingaOptimizer
    from shoal.neuralnet.torch_optimizer import made

    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if spec.optimizer is not None:
        return made(spec.optimizer, trained)
    updater = spec.updater if spec.updater is not None else {"type": "kSGD", "learning_rate": {"base_lr": 0.01}}
    return SingaOptimizer([p for _, p in trained], updater)


def run_fit(run, spec: FitLoop, log: Callable[[str], None] = print) -> None:
    """fit's loop on `run` (a shoal.session()): train, evaluate and checkpoint as fit does, once per worker of this
    process (`run.each_worker`: worker 0 trains fit's module itself, every other worker a copy of it)."""
    modes = [(m, m.training) for m in spec.model.modules()]  # the caller's module keeps its modes
    given_on = {p.device for p in spec.model.parameters()}  # (and its device: worker 0 trains it in place on its own)
    # each worker's replica, made here before the threads start (worker.model makes them all equal to worker 0's)
    replicas = [spec.model] + [copy.deepcopy(spec.model) for _ in range(1, run.local_workers)]
    for phase in (spec.val, spec.test):  # resumed: the cursors where the evaluations before the checkpoint left them
        if phase is not None and phase.steps and run.resumed is not None and run.start_step:
            done = sum(fires(phase.freq, phase.after, s) for s in range(min(run.start_step, run.job.train_steps)))
            n = len(phase.data) if hasattr(phase.data, "__len__") else 0
            phase.cursor = done * phase.steps * phase.batch % n if n else 0

    def body(worker) -> None:
        model = worker.model(replicas[worker.index], **({"cuts": spec.cuts} if spec.cuts is not None else {}))
        model.train()  # fit trains in train mode (dropout on) whatever mode the module came in; evaluate uses eval mode
        _train(run, worker, spec, model, log)

    try:
        run.each_worker(body)
    finally:
        for m, training in modes:
            m.training = training
        if len(given_on) == 1:  # (device="cuda:0" for a module on the CPU: it ends there, trained, as on the job path)
            spec.model.to(next(iter(given_on)))


def _train(run, worker, spec: FitLoop, model: torch.nn.Module, log: Callable[[str], None]) -> None:
    """One worker's loop: `worker` is `run` itself (one worker in the process) or its view of one of the process's
    workers (run.each_worker); what is per process (the job, the resume, the chief) is read from `run`."""
    from shoal.neuralnet.torch_optimizer import made_scheduler

    opt = worker.optimizer(_optimizer(spec, model))
    sched = (worker.scheduler(made_scheduler(spec.scheduler, opt), steps=spec.scheduler_steps)
             if spec.scheduler is not None else None)
    computing = ((lambda: torch.autocast(device_type=worker.device.type, dtype=spec.autocast)) if spec.autocast is not None
                 else nullcontext)
    resumed_at = run.start_step if run.resumed is not None else None
    first = worker.index == 0  # (it evaluates, moves fit's val_steps cursor and says the checkpoints)
    step, last = run.start_step - 1, run.job.train_steps  # (`shoal run script.py --set train_steps=` wins over steps=)
    for step, batch in worker.batches(spec.train, batch_size=spec.batch_size, shuffle=spec.shuffle, seed=spec.seed):
        # before the step's update, as fit validates (recorded at `step`); after a checkpoint written after step - 1's
        # update, so a run resumed from that checkpoint evaluates here again
        for phase, name in ((spec.val, "val"), (spec.test, "test")):
            if first and phase is not None and phase.steps and fires(phase.freq, phase.after, step):
                _evaluate(worker, spec, phase, name)
        rows = batch_rows(batch)
        parts = micro_batch_rows(0, rows, spec.grad_accum_steps)  # as fit's worker cuts its share
        window, values = MetricWindow(), {}
        report = window.report if len(parts) > 1 else lambda name, value, _rows: values.__setitem__(name, value)
        for k, (offset, count) in enumerate(parts):
            part = batch if len(parts) == 1 else _rows(batch, offset, count)
            with worker.accumulating() if k + 1 < len(parts) else nullcontext():  # one mean gradient of the micro-batches
                loss = _loss(model, spec, part, computing, report)
                (loss * (count / rows) if len(parts) > 1 else loss).backward()
        if spec.clip_grad_norm is not None:  # (the group's mean gradient: its global norm, as one worker's)
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.clip_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()
        worker.log(step, **(values or window.averages()))
        # (checkpoint_freq's and checkpoint_interval_s's checkpoints: the session's, at its step boundary)
    # (resumed from the final checkpoint, or rejoined after the last step: nothing left to do, as fit's trainer; a worker
    # whose group starts after a warm-up as long as the run trained nothing, and joins the final checkpoint's meeting)
    if (step + 1 < last and run.start_step >= last) or (resumed_at is not None and resumed_at >= last):
        return
    for phase, name in ((spec.val, "val"), (spec.test, "test")):
        if first and phase is not None and phase.steps and phase.freq:
            _evaluate(worker, spec, phase, name)
    path = worker.checkpoint()
    if run.chief and first:
        log(f"Checkpoint written to {path}")


def history(workspace: Path, start: int):
    """fit's History: the records this run appended to the run log (from byte `start`)."""
    from shoal.runtime.trainer import History

    path = Path(workspace) / "metrics.jsonl"
    return History(Path(workspace), read_metrics(path, start) if path.exists() else [])


def _session(job, spec: FitLoop, workspace, resume, log):
    from shoal.frontend.session import session

    return session(job.cluster, train_steps=spec.steps, seed=spec.seed, disp_freq=job.disp_freq,
                   checkpoint_freq=job.checkpoint_freq, checkpoint_interval_s=job.checkpoint_interval_s,
                   workspace=workspace, resume=resume, name="fit", partition_dim=max(job.neuralnet.partition_dim, 0),
                   outer_optimizer=spec.outer_optimizer, device=list(job.device) or None, log=log)


def _run_on(run, job_text: str, spec: FitLoop, log) -> None:
    from shoal.report.job_copy import write_job_copy

    if run.chief:  # the job as it ran (fit's, with its data, module and loss layers): what --resume=auto compares
        write_job_copy(job_text, run.workspace)
    try:
        run_fit(run, spec, log)
    finally:
        run.close()


def fit_rank(job_text: str, spec: FitLoop, to_terminal: bool, plan, rank: int, run_spec) -> None:
    """A rank of fit's layout over the processes shoal started (the launcher's RunOptions.rank_main, sent as fit sends
    its objects: through the forkserver): fit's loop on this rank's session. `to_terminal`: the chief's lines go to the
    terminal too (fit's log= is print); else only to logs/rank0.log, which fit relays to its log= (`_relayed`)."""
    from google.protobuf import text_format

    from shoal.config import job_pb2
    from shoal.frontend.session_start import as_rank
    from shoal.launcher.ranks import to_its_file_only
    from shoal.report import terminal
    from shoal.report.targets import set_run_goals

    job = text_format.Parse(job_text, job_pb2.JobProto())
    set_run_goals(spec.goals)  # (this process's chief, or the member that takes its place, writes the summary)
    # the module came as torch.multiprocessing sends tensors, in memory every rank shares: each rank trains its own copy
    spec = dataclasses.replace(spec, model=copy.deepcopy(spec.model))
    if not to_terminal:  # (the chief's first incarnation says its lines to its log file alone; no rank to the terminal)
        run_spec = dataclasses.replace(run_spec, log=to_its_file_only(run_spec.log))
        terminal.mute()
    with as_rank(plan, rank, run_spec, terminal=to_terminal):
        run = _session(job, spec, run_spec.workspace, False, run_spec.log)
    _run_on(run, job_text, spec, run_spec.log)


def session_job_of(job):
    """fit's job (frontend/fit.fit_job, the command line's --set applied) as the session's job."""
    from shoal.frontend.session_start import session_job

    session = session_job(job.cluster, job.train_steps, job.seed, job.disp_freq, job.checkpoint_freq, "fit",
                          job.checkpoint_interval_s, max(job.neuralnet.partition_dim, 0), list(job.device))
    if session.cluster.outer_updater.user_type:  # (outer_optimizer=: planned before the module binds it)
        from shoal.frontend.session_outer import plannable

        plannable(session)
    return session


def session_plan(job):
    """fit's job as the session's (`session_job_of`), planned once on this launch's nodes: what fit decides its path from
    (`fit.on_session`); None where the session cannot take the job (an invalid cluster, say: the job path says why, in
    fit's words)."""
    from shoal.errors import ShoalError
    from shoal.frontend.session_start import planned, started_by_a_launcher

    if any(layer.partition_dim > 0 or layer.HasField("location") for layer in job.neuralnet.layer):
        return None  # a module partitioned by layer: the job path refuses it in one line (the session would not say)
    try:
        session = session_job_of(job)
        launched = started_by_a_launcher()
        return planned(session, launched.nnodes if launched is not None else 1)  # (the plan the session runs on)
    except ShoalError:
        return None


def fit_on_session(job, spec: FitLoop, *, plan, workspace, resume: bool, log: Callable[[str], None] = print):
    """fit's call (its job: frontend/fit.fit_job; `plan`: its `session_plan`) as a session and its loop; returns fit's
    History (this run's records of the run log). In one process, here; a layout of several processes that shoal starts:
    one per rank, each running `fit_rank`, this process waiting for them (as `shoal run script.py` does)."""
    import functools

    from google.protobuf import text_format

    from shoal.frontend import script
    from shoal.frontend.session_outer import setup_of
    from shoal.frontend.session_start import check_layout, started_by_a_launcher

    where = Path(script.workspace(workspace) or "fit-workspace")
    metrics = where / "metrics.jsonl"
    start = metrics.stat().st_size if resume and metrics.exists() else 0  # (a fresh run's log starts anew)
    job_text = text_format.MessageToString(job)
    if started_by_a_launcher() is None:
        check_layout(plan)
        if not plan.in_one_process:
            from shoal.launcher.options import RunOptions
            from shoal.launcher.run_job import train_job

            with _relayed(where / "logs" / "rank0.log", None if log is print else log):
                train_job(plan.job, RunOptions(workspace=where, resume=resume, log=log, plan=plan, progress=False,
                                               rank_main=functools.partial(fit_rank, job_text, spec, log is print),
                                               process_setup=setup_of(plan.job)),
                          job_file="<shoal.fit>")
            return history(where, start)
    run = _session(job, spec, where, resume, log)
    _run_on(run, job_text, spec, log)
    return history(run.workspace, start)


@contextmanager
def _relayed(path: Path, log: Optional[Callable[[str], None]], every_s: float = 0.1) -> Iterator[None]:
    """While the body runs, each line the chief rank appends to `path` (its log file) is handed to fit's `log=` in this
    process, within `every_s`: any callable, a lambda too, which could not be sent to the ranks. None: nothing relayed."""
    if log is None:
        yield
        return
    start = path.stat().st_size if path.exists() else 0  # (a resumed run's log holds the earlier runs' lines)
    done = threading.Event()

    def relay() -> None:
        nonlocal start
        while True:
            finished = done.wait(every_s)
            if path.exists():
                with open(path, "rb") as f:
                    f.seek(start)
                    text = f.read()
                whole = text[:text.rfind(b"\n") + 1]  # (a line still being written waits for its end)
                start += len(whole)
                for line in whole.decode(errors="replace").splitlines():
                    log(line)
            if finished:
                return

    thread = threading.Thread(target=relay, name="shoal-fit-log", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _as_dict(updater) -> dict:
    """SINGA's updater as the dict of its fields (a proto message is not sent to processes: the FitLoop is)."""
    from google.protobuf import json_format

    return json_format.MessageToDict(updater, preserving_proto_field_name=True)


def fit_loop_of(job, spec) -> FitLoop:
    """fit's job (frontend/fit.fit_job, the command line's --set applied) and FitSpec as the loop's FitLoop."""
    from shoal.config import job_pb2

    batch = {phase: layer.store_conf.batchsize[0] for layer in job.neuralnet.layer if layer.store_conf.batchsize
             for phase in layer.include}
    test = val = None
    if job.test_steps > 0:
        test = Phase(spec.datasets[job_pb2.kTest], batch[job_pb2.kTest], job.test_steps, job.test_freq, job.test_after)
    if job.validate_steps > 0 and job.validate_freq > 0:
        val = Phase(spec.datasets[job_pb2.kVal], batch[job_pb2.kVal], job.validate_steps, job.validate_freq, job.validate_after)
    singa = job.updater.type != job_pb2.kUserUpdater
    return FitLoop(spec.model, spec.loss_fn, spec.form, spec.datasets[job_pb2.kTrain], batch[job_pb2.kTrain],
                   job.train_steps, seed=job.seed, shuffle=spec.shuffle, updater=_as_dict(job.updater) if singa else None,
                   optimizer=spec.optimizer, scheduler=spec.scheduler, scheduler_steps=spec.scheduler_steps,
                   clip_grad_norm=spec.clip_grad_norm, outer_optimizer=spec.outer_optimizer,
                   grad_accum_steps=spec.grad_accum_steps, autocast=spec.autocast, metrics=dict(spec.metrics or {}),
                   test=test, val=val, checkpoint_interval_s=job.checkpoint_interval_s, goals=spec.goals, cuts=spec.cuts)
