"""Train an existing torch.nn.Module under any cluster layout, without changing the model.

    model = nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))
    history = shoal.fit(model, nn.functional.cross_entropy, (x_train, y_train),
                        test_data=(x_test, y_test), steps=500, batch_size=64,
                        cluster=shoal.Cluster(nworker_groups=2, nworkers_per_procs=2),
                        updater={"type": "kSGD", "momentum": 0.9, "learning_rate": {"base_lr": 0.05}})

shoal turns the call into an ordinary job (frontend/module_path.py): the data
layer reads the datasets in place (nothing is copied into the workspace), the
module becomes one layer whose params are the module's parameters (by their
`named_parameters` names), the loss function another, and the cluster section
decides the framework exactly as in a job file. The module computes through
torch.func.functional_call on shoal's params, so it never learns whether it is
distributed. When training ends the trained values are copied back into
`model` (under a launcher such as torchrun, in rank 0's process: the others
return when their part of the job ends, their `model` untouched).

Layouts with several processes send the module, the loss function and the
datasets to the spawned processes through torch.multiprocessing (the parent's
own pipe, not disk or network; tensors travel as shared memory), so all must
be picklable: a module instance and a
module-level function, not a lambda. Module buffers (e.g. batch-norm running
statistics) stay local to each worker.

Training runs the module in train mode, test and validation in eval mode (no
dropout; batch norm on the running statistics of worker 0, the worker that
tests). A module that draws its own random numbers (dropout) draws them from
torch's global generator, so a synchronous layout matches one worker bit for
bit only for modules that draw none.
"""
from __future__ import annotations

import dataclasses

import functools
import math
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union

import torch
from google.protobuf import json_format

from shoal.config import job_pb2
from shoal.errors import warn
from shoal.frontend.fit_inputs import Data, _eval_batches, as_dataset, autocast_dtype
from shoal.frontend.keras import Cluster
from shoal.frontend.module_path import (DATA_LAYER, LOSS_LAYER, MODULE_LAYER, MODULE_LOSS_LAYER, FitError, FitSpec, loss_form,
                                        register_fit_layers)
from shoal.neuralnet.params import ParamStore
from shoal.frontend.fit_metrics import check_metrics, run_goals
from shoal.neuralnet.torch_optimizer import (OPTIMIZER_UPDATER, OUTER_OPTIMIZER_UPDATER, check_slices_allowed, made, made_scheduler,
                                             optimizer_factory, stand_ins)
from shoal.report.targets import set_run_goals

if TYPE_CHECKING:
    from shoal.planning.plan import JobPlan


def copy_module_values(model: torch.nn.Module, store: ParamStore) -> None:
    """Start from the module's own initial values (every process, before training)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in store.values:
                store.values[name].copy_(p.detach().to(store.values[name].device))


def _data_layer(net: job_pb2.NetProto, phase: int, batch: int) -> None:
    layer = net.layer.add(name="data", type=job_pb2.kUserLayer, user_type=DATA_LAYER)
    layer.store_conf.batchsize.append(batch)  # where the planner reads a batch size and splits it into shares
    layer.include.append(phase)


def fit_job(model: torch.nn.Module, form: str, *, batch_size: int, steps: int, test_batch: int, test_steps: int, test_freq: int,
            val_batch: int, val_steps: int, val_freq: int, disp_freq: int, cluster: job_pb2.ClusterProto, updater: dict,
            seed: int, checkpoint_freq: int, devices: Sequence[str] = (), checkpoint_interval_s: float = 600.0) -> job_pb2.JobProto:
    """The job of a fit call: its data, module and loss as user layers (module_path), the rest as in a job file."""
    job = job_pb2.JobProto(name="fit", train_steps=steps, disp_freq=disp_freq, seed=seed, checkpoint_freq=checkpoint_freq,
                           checkpoint_interval_s=checkpoint_interval_s)
    job.device.extend(devices)  # worker k of each process on devices[k], as a job file's `device` field says
    if test_steps > 0:
        # without a frequency, test once at the end (a test set given is never silently unused)
        job.test_steps, job.test_freq, job.test_after = test_steps, test_freq or steps, 0 if test_freq else steps
    if val_steps > 0 and val_freq > 0:
        job.validate_steps, job.validate_freq = val_steps, val_freq
    job.train_one_batch.alg = job_pb2.kBP
    json_format.ParseDict(updater, job.updater)
    if not job.updater.learning_rate.HasField("type"):
        job.updater.learning_rate.type = job_pb2.kFixed
    job.cluster.CopyFrom(cluster)
    net = job.neuralnet
    _data_layer(net, job_pb2.kTrain, batch_size)
    if test_steps > 0:
        _data_layer(net, job_pb2.kTest, test_batch)
    if val_steps > 0 and val_freq > 0:
        _data_layer(net, job_pb2.kVal, val_batch)
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    if form == "model":
        module = net.layer.add(name="loss", type=job_pb2.kUserLayer, user_type=MODULE_LOSS_LAYER, srclayers=["data"])
    else:
        module = net.layer.add(name="model", type=job_pb2.kUserLayer, user_type=MODULE_LAYER, srclayers=["data"])
        net.layer.add(name="loss", type=job_pb2.kUserLayer, user_type=LOSS_LAYER, srclayers=["model"])
    for name in trained:
        module.param.add(name=name)
    return job


def _probe(spec: FitSpec, factory: Callable) -> torch.optim.Optimizer:
    """What a (normalised) optimizer factory makes over stand-ins of the trained params."""
    params = dict(spec.model.named_parameters())
    return made(factory, stand_ins(spec.trained_names, [tuple(params[n].shape) for n in spec.trained_names]))


def _check_optimizer_layout(plan: JobPlan, spec: FitSpec) -> None:
    """A torch optimizer runs wherever owners update params: refuse, in one line, an optimizer not known to be
    element-wise where params are sliced over owners."""
    numel = {name: p.numel() for name, p in spec.model.named_parameters()}
    if not plan.in_one_process and any(s.param in numel and s.size != numel[s.param] for s in plan.placement.slices):
        check_slices_allowed(_probe(spec, spec.optimizer))  # the owners update slices of params


def _check_scheduler(spec: FitSpec) -> None:
    """A scheduler= that cannot be made over fit's optimizer is refused before anything is written (the owners, or the
    loop's ranks, build their own)."""
    if spec.scheduler is not None:
        made_scheduler(spec.scheduler, _probe(spec, spec.optimizer))


def _check_outer_layout(plan: JobPlan) -> None:
    if not plan.strategy.meets:
        raise FitError(f"shoal.fit: outer_optimizer= is Local SGD / DiLoCo's (cluster.nworker_groups > 1 with "
                       f"cluster.local_steps), not {plan.framework}'s")


SCHEDULER_STEPS = ("update", "group")


def _warn_batch_over_dataset(batch_size: int, train: torch.utils.data.Dataset) -> None:
    """A batch larger than the training set is legal (positions wrap round epochs) but repeats samples within a batch:
    say so in one line (once: under a launcher, in rank 0)."""
    if batch_size > len(train) and _launched_rank() == 0:
        warn(f"WARNING: shoal.fit: batch_size {batch_size} is larger than train_data ({len(train)} samples): every batch "
             "repeats samples (its positions wrap round into the next epochs)")


def fit(
    model: torch.nn.Module,
    loss_fn: Callable,
    train_data: Data,
    *,
    test_data: Optional[Data] = None,
    val_data: Optional[Data] = None,
    cluster: Optional[job_pb2.ClusterProto] = None,
    updater: Optional[dict] = None,
    optimizer: Optional[Callable] = None,
    scheduler: Optional[Callable] = None,
    scheduler_steps: str = "update",
    outer_optimizer: Optional[Callable] = None,
    clip_grad_norm: Optional[float] = None,
    batch_size: int = 64,
    steps: int = 100,
    test_freq: int = 0,
    test_batch: int = 100,
    val_freq: int = 0,
    val_batch: int = 100,
    disp_freq: int = 10,
    checkpoint_freq: int = 0,
    checkpoint_interval_s: float = 600.0,
    seed: int = 0,
    shuffle: bool = True,
    grad_accum_steps: int = 1,
    autocast: Optional[str] = None,
    metrics: Optional[dict] = None,
    higher_is_better=None,
    targets: Optional[dict] = None,
    val_steps: Optional[int] = None,
    loss_takes: Optional[str] = None,
    device: Union[str, torch.device, Sequence[str], None] = None,
    partition_dim: int = 0,
    cuts: Optional[dict] = None,
    workspace: Optional[Union[str, Path]] = None,
    resume: bool = False,
    log: Callable[[str], None] = print,
):
    """Train `model` on `train_data` as `cluster` says; returns the History.

    train_data/test_data/val_data: a map-style torch Dataset (samples of any structure: tensor,
    tuple, dict), or a pair (inputs, targets) of tensors or arrays; read in place, collated with
    torch's default_collate. The training set is reshuffled every epoch from `seed` (shuffle=False:
    in order). Or an IterableDataset (its own order, set_epoch(epoch) called before each epoch; a
    resume re-iterates the epoch and skips to its position), or a DataLoader factory
    `make_loader(batch_sampler) -> DataLoader(dataset, batch_sampler=batch_sampler, ...)` whose
    batch sampler yields the rows shoal chooses (shoal.data.streams, docs/python.md). A sample holding a Python
    list of numbers is refused in one line (default_collate would split it by position); a batch_size larger than
    the training set warns in one line. loss_fn: `loss_fn(output, target)` (the module gets each batch's first
    element, the loss its output as the module returns it, a tensor or a dict/tuple of tensors, and the second) or
    `loss_fn(model, batch)` (the loss calls the model itself);
    `loss_takes="output"` or `"model"` says which, else a first parameter named `model` or `module`
    means the second form. updater: SINGA's UpdaterProto as a dict (default plain SGD, learning rate
    0.01); or optimizer: a torch optimizer, run by whoever updates in the layout over the params or slices it
    owns (docs/python.md): a factory given the trained params, as (name, param) pairs when its first parameter's
    name starts with `named`, else as tensors (`lambda params: torch.optim.AdamW(params, ...)`); a callable
    taking no argument; or an optimizer over the model's parameters (`model.configure_optimizers(...)`, also
    when a factory returns one), rebuilt by name (neuralnet/torch_optimizer.py). scheduler:
    `lambda optimizer: torch.optim.lr_scheduler.LambdaLR(...)`, stepped once per update the optimizer applies
    (scheduler_steps="update"), or, with scheduler_steps="group", to each asynchronous group's own step before
    that group's update (Hogwild, Downpour: a schedule of `steps` ends at every group's last step). outer_optimizer (Local SGD / DiLoCo, cluster.nworker_groups
    with cluster.local_steps): a torch.optim factory applied to the groups' mean pseudo-gradient at each meeting,
    e.g. DiLoCo's `lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)`, instead of
    cluster.outer_updater. clip_grad_norm: with optimizer=, the whole gradient of each update is scaled as
    torch.nn.utils.clip_grad_norm_ does, its norm taken over all params whatever the layout (an asynchronous
    group clips its own push). The whole test set is used at each test (every `test_freq`
    steps, else once at the end), the whole validation set every `val_freq` steps. Checkpoints go into
    the workspace every `checkpoint_freq` steps; with checkpoint_freq=0, about every `checkpoint_interval_s`
    seconds (default 600; 0: off), and always at the end. resume=True
    continues from the workspace's newest checkpoint. grad_accum_steps=k: each worker computes its
    share of the `batch_size` rows as k micro-batches (about batch_size/k rows each, one backward each)
    and hands on their mean gradient, so a step is still one step on `batch_size` rows in a k-th of the
    activation memory (nanoGPT's gradient_accumulation_steps multiplies the batch instead: give
    batch_size = micro-batch × k for its behaviour). autocast="bf16": the module and the loss compute
    under torch.autocast(device type, torch.bfloat16) in training and evaluation; params, gradients and
    updates stay fp32. metrics: {name: callable} in the loss's form (`fn(model, batch)` or
    `fn(output, target)`, one number per batch), or shoal.perplexity (exp of the mean loss), computed
    at every test and validation in eval mode and averaged by samples over the set (val_steps: only
    the first val_steps batches of the validation set). higher_is_better: metric names whose larger
    values are better (or a dict name -> bool); otherwise read from the name (report.metrics). targets:
    {"val_loss": 1.9, "test_accuracy": 0.9}: summary.json's time_to_target gives the step and wall
    time each was first reached. device: where the workers compute — "cuda:0", or one device per worker
    of a process (["cuda:0", "cpu"]: worker 0 on the GPU, worker 1 on the CPU), as a job file's `device`
    field; None: the device the model's params are on (the CPU for a model not moved). partition_dim: 0 (each worker
    a whole replica on its share of the batch) or 1 (SINGA's feature partitioning: the module cut on its features over
    one synchronous group's processes, one worker each, torch's tensor parallelism, as `run.model` cuts a user's
    loop's module; `--set neuralnet.partition_dim=1` too); cuts: which Linears and attentions to cut then, in
    run.model's form ({"blocks.0.attn": "heads", "blocks.0.mlp.c_fc": "colwise", ...}; None: every Linear →
    element-wise → Linear pair in the module's nn.Sequentials and every attention). log: where fit's lines go
    (default print); over processes on fit's loop (one worker each: AllReduce, Local SGD / DiLoCo, Distributed
    Hogwild, Downpour) the chief rank's lines reach it too (relayed from logs/rank0.log), on the job path they go to the terminal.
    """
    from shoal.frontend import script

    _refuse_a_script_imported_again()
    form = loss_form(loss_fn, loss_takes)
    for name, value, least in (("steps", steps, 1), ("batch_size", batch_size, 1), ("test_batch", test_batch, 1),
                               ("val_batch", val_batch, 1), ("disp_freq", disp_freq, 1), ("test_freq", test_freq, 0),
                               ("val_freq", val_freq, 0), ("checkpoint_freq", checkpoint_freq, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise FitError(f"shoal.fit: {name} must be a whole number from {least}, got {value!r}")
    if (isinstance(checkpoint_interval_s, bool) or not isinstance(checkpoint_interval_s, (int, float))
            or not 0 <= checkpoint_interval_s < math.inf):
        raise FitError(f"shoal.fit: checkpoint_interval_s must be a number of seconds from 0 (0: off), got {checkpoint_interval_s!r}")
    if isinstance(grad_accum_steps, bool) or not isinstance(grad_accum_steps, int) or not 1 <= grad_accum_steps <= batch_size:
        raise FitError(f"shoal.fit: grad_accum_steps must be a whole number from 1 to batch_size ({batch_size}), got {grad_accum_steps!r}")
    datasets = {job_pb2.kTrain: as_dataset(train_data, "train_data")}
    if test_data is not None:
        datasets[job_pb2.kTest] = as_dataset(test_data, "test_data")
    if val_data is not None:
        datasets[job_pb2.kVal] = as_dataset(val_data, "val_data")
    test_batch, test_steps = _eval_batches(datasets.get(job_pb2.kTest), test_batch)
    val_batch, whole_val = _eval_batches(datasets.get(job_pb2.kVal), val_batch)
    if val_steps is not None and (isinstance(val_steps, bool) or not isinstance(val_steps, int) or val_steps < 1):
        raise FitError(f"shoal.fit: val_steps must be a whole number of batches from 1 (or None: the whole set), got {val_steps!r}")
    val_steps = whole_val if val_steps is None else min(val_steps, whole_val)
    metrics = check_metrics(metrics)
    goals = run_goals(higher_is_better, targets)
    if optimizer is not None and updater is not None:
        raise FitError("shoal.fit: give updater (SINGA's) or optimizer (a torch.optim factory), not both")
    if clip_grad_norm is not None and (optimizer is None or not clip_grad_norm > 0):
        raise FitError("shoal.fit: clip_grad_norm= is a positive bound on the gradient's global norm, for optimizer= "
                       "(SINGA's updater= clips per element with clip_low/clip_high)")
    if scheduler is not None and optimizer is None:
        raise FitError("shoal.fit: scheduler= steps a torch optimizer: give optimizer= too (SINGA's updater= has learning_rate)")
    if scheduler_steps not in SCHEDULER_STEPS:
        raise FitError(f"shoal.fit: scheduler_steps must be 'update' (once per update the optimizer applies) or 'group' "
                       f"(each asynchronous group's own step), got {scheduler_steps!r}")
    if scheduler_steps != "update" and scheduler is None:
        raise FitError("shoal.fit: scheduler_steps= says what a scheduler= follows: give scheduler= too")
    if isinstance(partition_dim, bool) or partition_dim not in (0, 1):
        raise FitError(f"shoal.fit: partition_dim must be 0 (the batch) or 1 (the module's features), got {partition_dim!r}")
    if cuts is not None and not isinstance(cuts, dict):
        raise FitError(f"shoal.fit: cuts= is a dict of module names to 'colwise', 'rowwise' or 'heads', got {type(cuts).__name__}")
    _start_process_server(cluster)
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    if optimizer is not None:  # every form (a factory on tensors or on names, an optimizer over the model) as one factory
        optimizer = optimizer_factory(optimizer, model, trained)
    if outer_optimizer is not None:
        outer_optimizer = optimizer_factory(outer_optimizer, model, trained, "outer_optimizer")
    _warn_batch_over_dataset(batch_size, datasets[job_pb2.kTrain])
    if optimizer is not None:
        updater = {"type": "kUserUpdater", "user_type": OPTIMIZER_UPDATER, "learning_rate": {"base_lr": 0}}  # torch's lr rules
    job = fit_job(model, form, batch_size=batch_size, steps=steps, test_batch=test_batch, test_steps=test_steps,
                  test_freq=test_freq, val_batch=val_batch, val_steps=val_steps, val_freq=val_freq, disp_freq=disp_freq,
                  cluster=cluster or Cluster(), updater=updater or {"type": "kSGD", "learning_rate": {"base_lr": 0.01}},
                  seed=seed, checkpoint_freq=checkpoint_freq, devices=worker_devices(device, model),
                  checkpoint_interval_s=float(checkpoint_interval_s))
    if outer_optimizer is not None:
        if job.cluster.HasField("outer_updater"):
            raise FitError("shoal.fit: give cluster.outer_updater (SINGA's) or outer_optimizer (a torch.optim factory), not both")
        job.cluster.outer_updater.CopyFrom(job_pb2.UpdaterProto(
            type=job_pb2.kUserUpdater, user_type=OUTER_OPTIMIZER_UPDATER, learning_rate=job_pb2.LRGenProto(type=job_pb2.kFixed)))
    if partition_dim:
        job.neuralnet.partition_dim = partition_dim
    job = script.applied(job)  # under `shoal run script.py`: the command line's --set (a seed set there shuffles too)
    if cuts is not None and job.neuralnet.partition_dim != 1:
        raise FitError("shoal.fit: cuts= names what to cut on the features: it needs partition_dim=1")
    spec = FitSpec(model, loss_fn, form, datasets, job.seed, shuffle, optimizer, scheduler, outer_optimizer, clip_grad_norm,
                   grad_accum_steps=grad_accum_steps, autocast=autocast_dtype(autocast), metrics=metrics, goals=goals,
                   scheduler_steps=scheduler_steps, cuts=cuts)
    set_run_goals(goals)  # the summary this process may write reports them (the ranks' chief: fit_loop.fit_rank)
    try:
        history = _train(job, spec, model, workspace, resume, log)
    finally:
        set_run_goals(None)  # a later run in this process declares its own
    if _launched_rank() == 0:  # under torchrun/Slurm the chief closes: another rank's part ends before the summary
        from shoal.report.progress import closing_line

        log(closing_line(history.workspace))  # what the run did, as `shoal run` closes
    return history


def _refuse_a_script_imported_again() -> None:
    """In a process shoal started (a rank, a server), multiprocessing imports the user's script again as `__mp_main__`
    to find the classes and functions fit sent; a script that calls fit at its top level would call it again there,
    and multiprocessing would fail in a page of traceback. Say it in one line and end this process instead."""
    import sys

    caller = sys._getframe(2).f_globals  # (fit's caller's module: run by multiprocessing as "__mp_main__")
    if caller.get("__name__") != "__mp_main__":
        return
    where = caller.get("__file__") or "your script"
    print(f"shoal.fit: {where} calls shoal.fit when it is imported, and each process shoal starts imports it again to "
          "find your model's classes: put the call under `if __name__ == \"__main__\":`", file=sys.stderr, flush=True)
    raise SystemExit(2)


# what fit's ranks import, into the server they fork from: torch._dynamo too, which torch imports at a torch optimizer's
# first add_param_group (torch._disable_dynamo): a second of CPU in each rank on fit's loop, whose SINGA updater= is a
# torch optimizer too (shoal.SingaOptimizer); the most of a short run's time over processes
FIT_RANK_IMPORTS = ("shoal.launcher.launch", "shoal.frontend.fit_loop", "shoal.frontend.session", "torch._dynamo")


def _start_process_server(cluster: Optional[job_pb2.ClusterProto]) -> None:
    """A layout of several processes that shoal starts: start the server they fork from (multiprocessing's forkserver)
    now, so that its imports (FIT_RANK_IMPORTS: seconds of CPU) run beside this process's checks and planning instead of
    after them, and each rank inherits them instead of importing its own."""
    from shoal.frontend import script
    from shoal.launcher import process_server

    if script.settings() is not None and script.settings().plan is not None:  # `shoal plan script.py`: nothing starts
        return
    process_server.start_for(cluster, list(FIT_RANK_IMPORTS))


def worker_devices(device, model: torch.nn.Module) -> list[str]:
    """fit's device= as the job's device list ([]: every worker on the CPU)."""
    if device is None:
        on = {p.device for p in model.parameters()}
        device = next(iter(on)) if len(on) == 1 else "cpu"
    names = [device] if isinstance(device, (str, torch.device)) else list(device)
    out = []
    for name in names:
        try:
            d = torch.device(name)
        except (RuntimeError, TypeError):
            raise FitError(f"shoal.fit: device={name!r} is not a device (give e.g. 'cuda:0' or 'cpu')") from None
        out.append(f"{d.type}:{0 if d.index is None else d.index}" if d.type == "cuda" else str(d))
    return [] if out == ["cpu"] else out


def _launched() -> bool:
    """Whether a launcher (torchrun, srun, …) started this process as one rank of a world (each rank runs the script)."""
    import os

    from shoal.launcher.launchers import detect

    return detect(os.environ) is not None


def _launched_rank() -> int:
    """This process's rank in a world a launcher (torchrun, srun, …) started; 0 when shoal starts the processes."""
    import os

    from shoal.launcher.launchers import detect

    launched = detect(os.environ)
    return launched.rank if launched is not None else 0


def _session_plan_shown(plan, spec: FitSpec):
    """What `shoal plan script.py` shows of a fit call that runs as its loop on the session: the session's plan, with
    the module's trained params cut into its slices as the loop cuts them."""
    from types import MappingProxyType

    from shoal.planning.plan import sliced_for

    trained = [(n, p) for n, p in spec.model.named_parameters() if n in spec.trained_names]
    sliced = sliced_for(plan, {n: p.numel() for n, p in trained})
    return dataclasses.replace(sliced, params=MappingProxyType({n: tuple(p.shape) for n, p in trained}))


def _train(job, spec: FitSpec, model, workspace, resume: bool, log):
    """fit's run: its loop on the session (frontend/fit_loop.py) where its layout runs there, decided from the session's
    job planned once, before any of the job path's work (module_path's layers built, the shape check, the module's
    plan); else the job path (those, and the Trainer)."""
    from shoal.frontend import api, fit_loop, script
    from shoal.config.validate import validate
    from shoal.launcher.run_job import plan_of
    from shoal.neuralnet.shapes import check_shapes
    from shoal.planning.plan import sliced_for

    planning = script.settings() is not None and script.settings().plan is not None  # `shoal plan script.py`: fit's job
    if planning and job.neuralnet.partition_dim == 1:  # a module cut on its features is the session's alone (run.model's
        from shoal.frontend.session_start import plan_session  # cut): `shoal plan` shows that job, and stops the script

        plan_session(fit_loop.session_job_of(job))
    plan = fit_loop.session_plan(job)
    shown = _session_plan_shown(plan, spec) if planning and plan is not None and on_session(plan) else None
    if not planning and plan is not None and on_session(plan):  # fit's loop on the session: the module trains in place
        if spec.optimizer is not None and fit_layout(plan) == "AllReduce over processes with server slices":
            _check_optimizer_layout(sliced_for(plan, {n: p.numel() for n, p in spec.model.named_parameters()
                                                      if n in spec.trained_names}), spec)  # (its processes' slices)
        _check_scheduler(spec)
        if spec.outer_optimizer is not None:
            _check_outer_layout(plan)
        _check_sendable(plan, spec)
        history = fit_loop.fit_on_session(job, fit_loop.fit_loop_of(job, spec), plan=plan, workspace=workspace,
                                          resume=resume, log=log)
        if not plan.in_one_process and _launched_rank() == 0:  # the ranks trained their own copies: the chief's values
            _load_trained_values(model, history.workspace, job.train_steps)
        return history
    register_fit_layers(spec)  # (module_path's layers, which the job's net names)
    validate(job, None, shape_check=check_shapes)
    if shown is not None:  # `shoal plan script.py`: the session's plan, which runs; the module's job, which --estimate counts
        script.plan_instead(job, runs=shown)
    plan = plan_of(job)  # the module's net planned once: the checks and the run take this plan
    if spec.optimizer is not None:
        _check_optimizer_layout(plan, spec)
    _check_scheduler(spec)
    if spec.outer_optimizer is not None:
        _check_outer_layout(plan)
    _check_sendable(plan, spec)
    where = Path(script.workspace(workspace) or "fit-workspace")
    # over processes the chief rank's lines go to its log file alone and reach log= here (as on the session)
    relayed = log is not print and not plan.in_one_process and not _launched()
    with fit_loop._relayed(where / "logs" / "rank0.log", log if relayed else None):
        history = api.train(job, workspace=where, resume=resume, log=log, progress=False, job_file="<shoal.fit>",
                            process_setup=functools.partial(register_fit_layers, spec),
                            initial_values=functools.partial(copy_module_values, model), plan=plan,
                            rank_main=job_rank_in_its_log if relayed else None)
    if _launched_rank() == 0:  # another launched rank has no checkpoint to read yet (or on its host at all)
        _load_trained_values(model, history.workspace, job.train_steps)
    return history


def job_rank_in_its_log(plan, rank: int, run_spec):
    """A rank of fit's job path over processes whose log= is the caller's: the job file's rank (assemble.run_process),
    the chief's lines to its log file alone (logs/rank0.log, which fit relays to log=), not to the terminal."""
    import dataclasses

    from shoal.launcher.ranks import to_its_file_only
    from shoal.report import terminal
    from shoal.runtime.assemble import run_process

    terminal.mute()  # (no rank, a restarted one included, writes to the caller's stdout: fit relays the chief's log)
    return run_process(plan, rank, dataclasses.replace(run_spec, log=to_its_file_only(run_spec.log)))


# The layouts fit runs as a loop of the session's calls (frontend/fit_loop.py), by `fit_layout`'s name; every other one
# still runs on the job path (module_path's layers and the Trainer): docs/architecture.md, "`shoal.fit` on the session".
# AllReduce's train records are the group's on both paths (the session's replicated exchange hears every process's
# window), Local SGD's the chief's group's, Downpour's the chief's losses with the job's rows, staleness and pushed bytes
# (DownpourExchange.metrics). Downpour over processes: scheduler_steps is run.scheduler's steps= ("group": each group's
# scheduler, stepped by its loop, rides on its pushes; "update", fit's default: the chief's schedule at every server
# update count, set by the servers, session_exchange.UpdateSchedule), and its chief writes summary.json's
# staleness_histogram as the job path's does (tests/test_fit_frictions.py, tests/test_fit_every_feature.py).
# Sandblaster over processes: the session's Sandblaster (the group's mean pushed to server processes running fit's
# optimizer), one worker's records and values to float rounding. AllReduce over processes with server slices: each
# process's slices' optimizer state alone, as the job path's owners hold it (runtime/session_slices.py).
ON_SESSION: frozenset = frozenset({"one worker", "one synchronous group in one process", "AllReduce over processes",
                                   "AllReduce over processes with server slices",
                                   "Local SGD / DiLoCo over processes", "Distributed Hogwild over processes",
                                   "Downpour over processes", "Sandblaster over processes",
                                   "in-memory Hogwild / Downpour", "a module cut on its features over processes",
                                   "Local SGD / DiLoCo groups in one process"})


def fit_layout(plan) -> str:
    """The layout of a fit call as ON_SESSION names it: "one worker" (one worker in one process), "one synchronous group
    in one process" (its workers as threads, run.each_worker), "in-memory Hogwild / Downpour" (asynchronous groups as threads
    of one process), "Local SGD / DiLoCo groups in one process" (each group's workers as threads, the groups meeting in
    memory), the layouts over processes of one worker or a few threads each (and Downpour's and Sandblaster's server
    processes), else the plan's label. A device list (device=[...], Caffe con Troll's CPU+GPU split: each worker on its
    device, run.model's) and measured batch shares (cluster.auto_batch_shares: run.batches re-splits a group's batch by
    the job path's balancer, session_shares.py) run on the session too; on a GPU the layouts whose session path is the
    CPU's alone (`session_start.on_the_cpu`) keep the job path."""
    from shoal.frontend.session_start import on_the_cpu, pushes_to_servers
    from shoal.runtime.session_slices import shards_optimizer_state

    if plan.tensor_parallel:  # (the layouts it cannot run: session_start.check_layout's one line)
        return "a module cut on its features over processes"
    if plan.in_one_process and plan.nworkers == 1:
        return "one worker"
    if (plan.in_one_process and plan.strategy.synchronous and not plan.strategy.meets
            and plan.nworker_groups == 1):
        return "one synchronous group in one process"  # (server slices here: the job path's one in-process server's)
    if in_memory_groups(plan):
        return "in-memory Hogwild / Downpour"
    if plan.in_one_process and plan.strategy.meets and on_the_cpu(plan):  # (session_start.meets_in_memory)
        return "Local SGD / DiLoCo groups in one process"
    # the workers of each process the session runs (one each, or several threads of the process's group: run.each_worker),
    # none a server's alone (Downpour's and Sandblaster's server processes are theirs: below)
    over_processes = not plan.in_one_process and not pushes_to_servers(plan) and workers_each_process(plan)
    if over_processes and plan.strategy.synchronous and not plan.strategy.meets:
        if shards_optimizer_state(plan):  # (ZeRO-1's, as the job path's owners)
            return "AllReduce over processes with server slices"
        # server slices under restarts or compression too: the replicated update, each process the whole state, as a
        # user's loop runs them (the job path's compressed sliced exchange, without restarts, is no longer fit's)
        return "AllReduce over processes"
    if over_processes and plan.strategy.meets:
        return "Local SGD / DiLoCo over processes"  # (outer_optimizer=, a torch one, too: shoal.session's outer_optimizer=)
    if over_processes and plan.strategy.syncs_with_peers and on_the_cpu(plan):  # (the strategy's word, not its label)
        return "Distributed Hogwild over processes"
    if downpour_over_processes(plan):
        return "Downpour over processes"
    if sandblaster_over_processes(plan):
        return "Sandblaster over processes"
    return plan.label


def workers_each_process(plan, servers_apart: bool = False) -> bool:
    """Each process of the layout hosts the workers the session runs: one, or several threads of the process's one group
    (the same number in each, restarts as session_start.several_workers_in_a_process allows); `servers_apart`: the
    layout's server processes (Downpour's, Sandblaster's) host no worker."""
    from shoal.frontend.session_start import several_workers_in_a_process

    processes = plan.placement.processes
    one_each = all(len(p.workers) == (0 if servers_apart and p.servers else 1) for p in processes)
    return one_each or several_workers_in_a_process(plan)


def in_memory_groups(plan) -> bool:
    """In-memory Hogwild's or Downpour's asynchronous groups, threads of one process on the CPU, running freely around one
    in-process server (with a warm-up too: group 0 trains alone first, the others start after it)."""
    from shoal.frontend.session_start import groups_in_memory, on_the_cpu

    return groups_in_memory(plan) and on_the_cpu(plan)


def sandblaster_over_processes(plan) -> bool:
    """Sandblaster's one synchronous group, one worker or several threads in each of its processes, pushing to server
    processes of their own, on the CPU (the session's Sandblaster: each push the group's mean, the servers running
    fit's optimizer)."""
    from shoal.frontend.session_start import on_the_cpu, pushes_to_servers

    return (not plan.in_one_process and on_the_cpu(plan) and plan.strategy.synchronous and not plan.strategy.meets
            and plan.nworker_groups == 1 and pushes_to_servers(plan) and workers_each_process(plan, servers_apart=True))


def downpour_over_processes(plan) -> bool:
    """Downpour's asynchronous groups pushing to server processes of their own, one worker or several threads of one
    group in each process, on the CPU (a GPU keeps the job path)."""
    from shoal.frontend.session_start import on_the_cpu, pushes_to_servers

    return (not plan.in_one_process and on_the_cpu(plan) and not plan.strategy.synchronous and not plan.strategy.meets
            and not plan.strategy.syncs_with_peers and pushes_to_servers(plan) and workers_each_process(plan, servers_apart=True))


def on_session(plan) -> bool:
    """Whether fit runs `plan`'s layout on the session (its loop: fit_loop.run_fit) rather than on the job path."""
    return fit_layout(plan) in ON_SESSION


SENT_FIELDS = ("model", "loss_fn", "datasets", "optimizer", "scheduler", "outer_optimizer", "metrics")


def _check_sendable(plan, spec: FitSpec) -> None:
    """Processes that shoal starts receive the fit call's objects pickled: refuse, in one line naming the argument,
    one that cannot be (a lambda, a local function). Under torchrun/Slurm each process runs the script itself."""
    import os
    import pickle

    from shoal.launcher.launchers import detect

    if detect(os.environ) is not None or plan.in_one_process:
        return
    for name in SENT_FIELDS:
        try:
            pickle.dumps(getattr(spec, name))
        except Exception as e:  # pickle raises PicklingError, AttributeError or TypeError, by what it met
            raise FitError(f"shoal.fit: {name}= cannot be sent to the layout's {plan.nprocs} processes ({e}); "
                           "give a module-level function or functools.partial instead of a lambda or a local function") from None


def _load_trained_values(model: torch.nn.Module, workspace: Path, steps: int) -> None:
    from shoal.neuralnet import checkpoint as ckpt_io

    # the run's final checkpoint: at train_steps, or past it where Distributed Hogwild's chief re-trained its share
    # of the steps a restarted group skipped (the newest written of those)
    final = [path for step, path in ckpt_io.list_checkpoints(workspace) if step >= steps]
    path = max(final, key=lambda p: p.stat().st_mtime_ns) if final else ckpt_io.checkpoint_file(workspace, steps)
    params = ckpt_io.load(path).params
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in params:
                p.copy_(params[name].to(p.device))
