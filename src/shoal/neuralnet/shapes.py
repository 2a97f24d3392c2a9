"""Checks for validation that need the built nets but no data: shapes, a loss to train on, memory."""
from __future__ import annotations

import math

import torch

from shoal.config import job_pb2
from shoal.config.errors import JobShapeError
from shoal.neuralnet.algorithms import rbm_pairs
from shoal.neuralnet.memory import FLOAT_BYTES, available_bytes, describe_bytes
from shoal.neuralnet.net import NetBuildError, NeuralNet
from shoal.neuralnet.params import ParamStore

GRADIENT_ALGS = (job_pb2.kBP, job_pb2.kBPTT)  # they backpropagate from the loss layers' sum


def check_shapes(job: job_pb2.JobProto) -> None:
    """Raise JobShapeError(field_path, message) if a layer's conf does not fit its sources,
    a kBP/kBPTT job has no loss layer to train on, or the job cannot fit in memory."""
    store = ParamStore(allocate=False)
    generator = torch.Generator().manual_seed(0)
    phases = [job_pb2.kTrain]
    if job.test_steps > 0:
        phases.append(job_pb2.kTest)
    if job.validate_steps > 0:
        phases.append(job_pb2.kVal)
    nets = {}
    for phase in phases:
        try:
            net = NeuralNet(job.neuralnet, phase, store, generator)
        except NetBuildError as err:
            raise JobShapeError(err.field_path, err.message) from None
        nets[phase] = net
        if phase == job_pb2.kTrain and job.train_one_batch.alg == job_pb2.kCD and not rbm_pairs(net):
            raise JobShapeError("train_one_batch.alg", "kCD needs a kRBMVis/kRBMHid pair in the kTrain net")
    training = job.train_steps > 0
    if training and job.train_one_batch.alg in GRADIENT_ALGS and not any(n.category == "loss" for n in nets[job_pb2.kTrain].nodes):
        alg = job_pb2.AlgType.Name(job.train_one_batch.alg)
        raise JobShapeError("train_one_batch.alg", f"{alg} needs a loss layer (e.g. kSoftmaxLoss) in the kTrain net, which has none")
    _check_memory(job, store, nets, training)


def _check_memory(job: job_pb2.JobProto, store: ParamStore, nets: dict[int, NeuralNet], training: bool) -> None:
    """Params (and, training, their gradients) plus one batch's layer outputs must fit in the memory available.

    A lower bound: updater state, replicas and a second process's copy come on top.
    """
    room = available_bytes()
    if not room:
        return
    param_bytes = {name: info.numel * FLOAT_BYTES for name, info in store.info.items()}
    items = []  # (bytes, field path, what)
    for phase, net in nets.items():
        batch = _batch_size(net)
        for node in net.nodes:
            where = f"neuralnet.layer[{node.conf_index}]"
            size = FLOAT_BYTES * batch * math.prod(node.layer.shape)
            items.append((size, phase, where, f"layer {node.name!r} outputs {describe_bytes(size)} per batch of {batch} ({tuple(node.layer.shape)} per sample)"))
            for i, name in enumerate(node.params):
                if name in param_bytes:
                    info = store.info[name]
                    items.append((param_bytes.pop(name), None, f"{where}.param[{i}]", f"param {name!r} of shape {info.shape} needs {describe_bytes(info.numel * FLOAT_BYTES)}"))
    params = sum(size for size, phase, _, _ in items if phase is None)
    outputs = max((sum(size for size, p, _, _ in items if p == phase) for phase in nets), default=0)
    copies = 2 if training else 1  # values and gradients; outputs and their gradients
    need = copies * (params + outputs)
    if need <= room:
        return
    _, _, where, what = max(items, key=lambda item: item[0])
    raise JobShapeError(
        where,
        f"the job needs at least {describe_bytes(need)} of memory (params {describe_bytes(params)}, one batch's layer outputs "
        f"{describe_bytes(outputs)}{', each twice for gradients' if training else ''}), more than the {describe_bytes(room)} available; "
        f"the largest part: {what}",
    )


def _batch_size(net: NeuralNet) -> int:
    """The largest batch an input layer of `net` reads (a group's whole batch)."""
    sizes = [1]
    for node in net.input_nodes():
        conf = node.layer.conf
        if conf.HasField("store_conf"):
            sizes.append(sum(conf.store_conf.batchsize) or 1)
        elif conf.HasField("char_rnn_conf"):
            sizes.append(conf.char_rnn_conf.batchsize)
    return max(sizes)
