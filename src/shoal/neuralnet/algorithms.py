"""train_one_batch algorithms (SINGA's AlgProto.alg): compute one batch's gradients.

Each returns {param name: gradient or None}; applying them is the server's job,
so the same algorithm runs under every cluster configuration.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from shoal.config import job_pb2
from shoal.neuralnet.layers.base import Context
from shoal.neuralnet.layers.rbm import SQUARED_ERROR, RBMHid, RBMVis, contrastive_divergence
from shoal.neuralnet.net import NeuralNet, Node

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


def back_propagation_through_time(conf: job_pb2.AlgProto, net: NeuralNet, ctx: Context) -> Grads:
    """kBPTT: BP over the net unrolled `unroll_len` times (truncated at the window's ends).

    The unrolled copies of a layer share its params (copy i > 0 aliases copy 0's), so
    autograd sums every copy's gradient into the one param, as SINGA's kAggGrad.
    A net that is not unrolled (unroll_len 1) trains as with kBP.
    """
    return back_propagation(conf, net, ctx)


def rbm_pairs(net: NeuralNet) -> list[tuple[Node, Node]]:
    """(visible, hidden) node pairs: each kRBMHid layer that reads a kRBMVis layer, and that layer."""
    by_name = {node.name: node for node in net.nodes}
    return [
        (by_name[node.srcs[0]], node)
        for node in net.nodes
        if isinstance(node.layer, RBMHid) and isinstance(by_name[node.srcs[0]].layer, RBMVis)
    ]


def contrastive_divergence_step(conf: job_pb2.AlgProto, net: NeuralNet, ctx: Context) -> Grads:
    """kCD: the positive phase over every layer, then cd_conf.cd_k Gibbs rounds per RBM.

    Only the RBM layers' params get gradients (the layers below an RBM being
    trained, e.g. earlier RBMs of a stack, stay as loaded). The visible layer
    reports "Squared Error" of the first reconstruction, as SINGA's.
    """
    pairs = rbm_pairs(net)
    if not pairs:
        raise ValueError("kCD needs a kRBMVis/kRBMHid pair in the kTrain net")
    grads: Grads = {name: None for name in net.param_names()}
    leaves = net.param_leaves()
    with torch.no_grad():
        _, outputs = net.forward(ctx)
        for vis, hid in pairs:
            v0 = outputs[vis.name]
            result = contrastive_divergence(
                vis.layer, hid.layer, v0, [leaves[p] for p in vis.params], [leaves[p] for p in hid.params], ctx, conf.cd_conf.cd_k
            )
            for names, values in ((vis.params, result.vis_grads), (hid.params, result.hid_grads)):
                for name, grad in zip(names, values):
                    if grad is not None:
                        grads[name] = grad if grads[name] is None else grads[name] + grad
            ctx.report(SQUARED_ERROR, result.squared_error, len(v0))
    return grads


def train_one_batch(conf: job_pb2.AlgProto, net: NeuralNet, ctx: Context) -> Grads:
    if conf.alg == job_pb2.kBP:
        return back_propagation(conf, net, ctx)
    if conf.alg == job_pb2.kCD:
        return contrastive_divergence_step(conf, net, ctx)
    if conf.alg == job_pb2.kBPTT:
        return back_propagation_through_time(conf, net, ctx)
    if conf.alg == job_pb2.kUserAlg and conf.user_alg in _USER_ALGS:
        return _USER_ALGS[conf.user_alg](conf, net, ctx)
    raise ValueError(f"train_one_batch.alg {job_pb2.AlgType.Name(conf.alg)} is not supported yet")
