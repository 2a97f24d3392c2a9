"""Train an existing torch.nn.Module under any cluster layout, without changing the model.

    model = nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))
    history = shoal.fit(model, nn.functional.cross_entropy, (x_train, y_train),
                        test_data=(x_test, y_test), steps=500, batch_size=64,
                        cluster=shoal.Cluster(nworker_groups=2, nworkers_per_procs=2),
                        updater={"type": "kSGD", "momentum": 0.9, "learning_rate": {"base_lr": 0.05}})

shoal turns the call into an ordinary job: the data become record stores in
the workspace, the module becomes one layer whose params are the module's
parameters (by their `named_parameters` names), the loss function another, and
the cluster section decides the framework exactly as in a job file. The
module computes through torch.func.functional_call on shoal's params, so it
never learns whether it is distributed. When training ends the trained values
are copied back into `model`.

Layouts with several processes send the module and loss function to the
spawned processes through torch.multiprocessing (the parent's own pipe, not
disk or network), so both must be picklable: a module instance and a
module-level function, not a lambda. Module buffers (e.g. batch-norm running
statistics) stay local to each worker.

Training runs the module in train mode, test and validation in eval mode (no
dropout; batch norm on the running statistics of worker 0, the worker that
tests). A module that draws its own random numbers (dropout) draws them from
torch's global generator, so a synchronous layout matches one worker bit for
bit only for modules that draw none.
"""
from __future__ import annotations

import copy
import functools
import math
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np
import torch
from google.protobuf import json_format

from shoal.config import job_pb2
from shoal.data.kvfile import KVFileWriter
from shoal.neuralnet.layers.base import Layer
from shoal.neuralnet.layers.registry import register_user_layer
from shoal.frontend.keras import Cluster
from shoal.neuralnet.params import ParamStore

MODULE_LAYER, LOSS_LAYER = "shoal.fit.Module", "shoal.fit.Loss"
Data = Union[tuple, torch.utils.data.Dataset]


def _arrays(data: Data) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) as numpy arrays from a pair of tensors/arrays or an indexable dataset."""
    if isinstance(data, tuple) and len(data) == 2:
        x, y = data
    else:
        pairs = [data[i] for i in range(len(data))]
        x, y = torch.stack([torch.as_tensor(p[0]) for p in pairs]), torch.stack([torch.as_tensor(p[1]) for p in pairs])
    x, y = np.asarray(torch.as_tensor(x).float()), np.asarray(torch.as_tensor(y))
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"shoal.fit: targets must be one integer class label per sample, got dtype {y.dtype} shape {y.shape}")
    if len(x) != len(y):
        raise ValueError(f"shoal.fit: {len(x)} inputs but {len(y)} targets")
    return x, y


def _write_store(path: Path, x: np.ndarray, y: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with KVFileWriter(path) as writer:
        for i in range(len(x)):
            record = job_pb2.RecordProto(shape=list(x.shape[1:]), label=int(y[i]))
            record.data.extend(x[i].ravel().tolist())
            writer.write(f"{i:08d}", record.SerializeToString())


def register_fit_layers(model: torch.nn.Module, loss_fn: Callable) -> None:
    """Bind the model and loss to the two user layer types of a fit job (in every process)."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    # the module copy of the worker that computes a batch's first rows (worker 0) in this process:
    # test and validation read its buffers (e.g. batch-norm running statistics), not their own copy's
    trained: dict[str, torch.nn.Module] = {}

    @register_user_layer(MODULE_LAYER)
    class ModuleLayer(Layer):
        def __init__(self, conf, src_shapes):
            super().__init__(conf, src_shapes)
            # functional_call swaps a module's parameters in place while it runs, so workers that
            # run at once (threads) each need their own copy of the module
            self.module = copy.deepcopy(model)
            self.module.eval()  # the shape probe: one zero sample must not move batch-norm statistics
            with torch.no_grad():
                self.shape = tuple(self.module(torch.zeros((1, *self.src_shapes[0]))).shape[1:])

        def param_shapes(self):
            return [tuple(p.shape) for n, p in model.named_parameters() if n in names]

        def forward(self, xs, params, labels, ctx):
            training = ctx.phase == job_pb2.kTrain
            if self.module.training != training:  # dropout off and running statistics used outside training
                self.module.train(training)
            values = dict(zip(names, params))
            if training and (ctx.rows is None or ctx.rows[0] == 0):
                trained.setdefault("worker0", self.module)
            elif not training and "worker0" in trained:
                values = {**{n: b.to(xs[0].device) for n, b in trained["worker0"].named_buffers()}, **values}
            return torch.func.functional_call(self.module, values, (xs[0],), strict=False)

    @register_user_layer(LOSS_LAYER)
    class LossLayer(Layer):
        category = "loss"

        def forward(self, xs, params, labels, ctx):
            output, target = xs[0], labels[1]
            loss = loss_fn(output, target)
            with torch.no_grad():
                ctx.report("loss", loss.item(), len(target))
                if output.dim() == 2:
                    ctx.report("accuracy", (output.argmax(1) == target).float().mean().item(), len(target))
            return loss


def copy_module_values(model: torch.nn.Module, store: ParamStore) -> None:
    """Start from the module's own initial values (every process, before training)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in store.values:
                store.values[name].copy_(p.detach().to(store.values[name].device))


def fit_job(model: torch.nn.Module, sample_shape: tuple[int, ...], train_path: Path, test_path: Optional[Path], *,
            batch_size: int, steps: int, test_freq: int, test_steps: int, test_batch: int, disp_freq: int,
            cluster: job_pb2.ClusterProto, updater: dict, seed: int, checkpoint_freq: int) -> job_pb2.JobProto:
    job = job_pb2.JobProto(name="fit", train_steps=steps, disp_freq=disp_freq, seed=seed, checkpoint_freq=checkpoint_freq)
    if test_path is not None and test_steps > 0:
        job.test_steps, job.test_freq = test_steps, test_freq
    job.train_one_batch.alg = job_pb2.kBP
    json_format.ParseDict(updater, job.updater)
    if not job.updater.learning_rate.HasField("type"):
        job.updater.learning_rate.type = job_pb2.kFixed
    job.cluster.CopyFrom(cluster)
    net = job.neuralnet
    data = net.layer.add(name="data", type=job_pb2.kRecordInput)
    data.store_conf.path, data.store_conf.backend = str(train_path), "kvfile"
    data.store_conf.batchsize.append(batch_size)
    data.store_conf.shape.extend(sample_shape)
    data.include.append(job_pb2.kTrain)
    if test_path is not None:
        test = net.layer.add(name="data", type=job_pb2.kRecordInput)
        test.store_conf.CopyFrom(data.store_conf)
        test.store_conf.path = str(test_path)
        test.store_conf.ClearField("batchsize")
        test.store_conf.batchsize.append(test_batch)
        test.include.append(job_pb2.kTest)
    module = net.layer.add(name="model", type=job_pb2.kUserLayer, user_type=MODULE_LAYER, srclayers=["data"])
    for name, _ in model.named_parameters():
        module.param.add(name=name)
    net.layer.add(name="loss", type=job_pb2.kUserLayer, user_type=LOSS_LAYER, srclayers=["model", "data"])
    return job


def fit(
    model: torch.nn.Module,
    loss_fn: Callable,
    train_data: Data,
    *,
    test_data: Optional[Data] = None,
    cluster: Optional[job_pb2.ClusterProto] = None,
    updater: Optional[dict] = None,
    batch_size: int = 64,
    steps: int = 100,
    test_freq: int = 0,
    test_batch: int = 100,
    disp_freq: int = 10,
    checkpoint_freq: int = 0,
    seed: int = 0,
    workspace: Optional[Union[str, Path]] = None,
    log: Callable[[str], None] = print,
):
    """Train `model` with `loss_fn(output, target)` on `train_data` as `cluster` says; returns the History.

    train_data/test_data: (inputs, integer class targets) as tensors or arrays, or an
    indexable dataset of such pairs. updater: SINGA's UpdaterProto as a dict
    (default plain SGD, learning rate 0.01). The whole test set is used at each test.
    """
    from shoal.frontend import script
    from shoal.frontend import api
    from shoal.runtime.workspace import FIT_DATA, claim

    cluster = cluster or Cluster()
    workspace = Path(script.workspace(workspace) or "fit-workspace")
    claim(workspace, writes=(FIT_DATA,))  # before the data goes in: never into a data/ of the user's
    x, y = _arrays(train_data)
    train_path, test_path = workspace / FIT_DATA / "train.bin", None
    _write_store(train_path, x, y)
    test_steps = 0
    if test_data is not None:
        tx, ty = _arrays(test_data)
        test_path = workspace / FIT_DATA / "test.bin"
        _write_store(test_path, tx, ty)
        test_batch = min(test_batch, len(tx))
        test_steps = math.ceil(len(tx) / test_batch)
    job = fit_job(model, tuple(x.shape[1:]), train_path, test_path, batch_size=batch_size, steps=steps,
                  test_freq=test_freq, test_steps=test_steps, test_batch=test_batch, disp_freq=disp_freq,
                  cluster=cluster, updater=updater or {"type": "kSGD", "learning_rate": {"base_lr": 0.01}},
                  seed=seed, checkpoint_freq=checkpoint_freq)
    register_fit_layers(model, loss_fn)
    from shoal.config.validate import validate
    from shoal.neuralnet.shapes import check_shapes

    job = script.applied(job)  # under `shoal run script.py`: the command line's --set
    validate(job, None, shape_check=check_shapes)
    history = api.train(job, workspace=workspace, log=log, progress=False, job_file="<shoal.fit>",
                        process_setup=functools.partial(register_fit_layers, model, loss_fn),
                        initial_values=functools.partial(copy_module_values, model))
    _load_trained_values(model, workspace, job.train_steps)
    return history


def _load_trained_values(model: torch.nn.Module, workspace: Path, steps: int) -> None:
    from shoal.neuralnet import checkpoint as ckpt_io

    params = ckpt_io.load(ckpt_io.checkpoint_file(workspace, steps)).params
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in params:
                p.copy_(params[name].to(p.device))
