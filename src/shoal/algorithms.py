"""train_one_batch algorithms (SINGA's AlgProto.alg): compute one batch's gradients.

Each returns {param name: gradient or None}; applying them is the server's job,
so the same algorithm runs under every cluster configuration.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from shoal.config import job_pb2
from shoal.layers.base import Context
from shoal.net import NeuralNet

Grads = dict[str, Optional[torch.Tensor]]
Algorithm = Callable[[job_pb2.AlgProto, NeuralNet, Context], Grads]
_USER_ALGS: dict[str, Algorithm] = {}


def register_algorithm(user_alg: str) -> Callable[[Algorithm], Algorithm]:
    """Register a kUserAlg implementation, selected by `train_one_batch { user_alg: "..." }`."""

    def wrap(fn: Algorithm) -> Algorithm:
        _USER_ALGS[user_alg] = fn
        return fn

    return wrap


def back_propagation(conf: job_pb2.AlgProto, net: NeuralNet, ctx: Context) -> Grads:
    """kBP: forward over all layers, backward from the sum of the loss layers' losses."""
    net.zero_grad()
    loss, _ = net.forward(ctx)
    if loss is None:
        raise ValueError("kBP needs a loss layer in the kTrain net")
    loss.backward()
    return net.grads()


def train_one_batch(conf: job_pb2.AlgProto, net: NeuralNet, ctx: Context) -> Grads:
    if conf.alg == job_pb2.kBP:
        return back_propagation(conf, net, ctx)
    if conf.alg == job_pb2.kUserAlg and conf.user_alg in _USER_ALGS:
        return _USER_ALGS[conf.user_alg](conf, net, ctx)
    raise ValueError(f"train_one_batch.alg {job_pb2.AlgType.Name(conf.alg)} is not supported yet")
