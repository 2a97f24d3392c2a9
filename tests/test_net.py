"""NeuralNet: phases, topological order, split semantics, shared params."""
from __future__ import annotations

import pytest
import torch
from google.protobuf import text_format

from shoal.config import job_pb2
from shoal.neuralnet.layers import Context
from shoal.neuralnet.net import NetBuildError, NeuralNet
from shoal.neuralnet.params import ParamStore

NET = """
layer { name: "data" type: kDummy dummy_conf { input: true shape: 4 shape: 3 } }
layer { name: "b" type: kInnerProduct srclayers: "a" innerproduct_conf { num_output: 2 }
        param { name: "wb" init { type: kGaussian } } param { name: "bb" init { type: kConstant value: 0 } } }
layer { name: "a" type: kInnerProduct srclayers: "data" innerproduct_conf { num_output: 3 }
        param { name: "wa" init { type: kGaussian } } param { name: "ba" init { type: kConstant value: 0 } } }
layer { name: "c" type: kInnerProduct srclayers: "a" innerproduct_conf { num_output: 2 }
        param { name: "wc" init { type: kGaussian } } param { name: "bc" init { type: kConstant value: 0 } } }
layer { name: "only_test" type: kSigmoid srclayers: "c" include: kTest }
"""


def build(text=NET, phase=job_pb2.kTrain, store=None):
    conf = text_format.Parse(text, job_pb2.NetProto())
    return NeuralNet(conf, phase, store or ParamStore(), torch.Generator().manual_seed(0))


def test_topological_order_and_phases():
    assert [n.name for n in build().nodes] == ["data", "a", "b", "c"]
    assert [n.name for n in build(phase=job_pb2.kTest).nodes] == ["data", "a", "b", "c", "only_test"]


def test_fan_out_sums_gradients_like_singas_split():
    net = build()
    ctx = Context(generator=torch.Generator().manual_seed(1))
    _, out = net.forward(ctx)
    (out["b"].sum() + out["c"].sum()).backward()
    grads = net.grads()
    # d/dWa of sum(b) + sum(c) = (colsum(Wb) + colsum(Wc))ᵀ x summed over the batch
    store = net.store
    x = out["data"]
    upstream = store.values["wb"].sum(0) + store.values["wc"].sum(0)
    assert torch.allclose(grads["wa"], upstream[:, None] * x.sum(0)[None, :], atol=1e-6)


def test_train_and_test_nets_share_param_memory_but_not_gradients():
    store = ParamStore()
    train, test = build(store=store), build(phase=job_pb2.kTest, store=store)
    store.values["wa"].add_(1.0)
    assert torch.equal(train._leaves["wa"], test._leaves["wa"])
    assert train._leaves["wa"] is not test._leaves["wa"]
    assert not test._leaves["wa"].requires_grad


def test_tied_transposed_weights_share_one_param_and_sum_gradients():
    text = """
    layer { name: "data" type: kDummy dummy_conf { input: true shape: 2 shape: 5 } }
    layer { name: "enc" type: kInnerProduct srclayers: "data" innerproduct_conf { num_output: 3 }
            param { name: "w" init { type: kGaussian } } param { name: "b1" } }
    layer { name: "dec" type: kInnerProduct srclayers: "enc" innerproduct_conf { num_output: 5 transpose: true }
            param { name: "w_t" share_from: "w" } param { name: "b2" } }
    """
    net = build(text)
    assert net.store.names() == ["w", "b1", "b2"]
    assert net.nodes[2].params == ["w", "b2"]
    _, out = net.forward(Context(generator=torch.Generator().manual_seed(0)))
    out["dec"].sum().backward()
    assert net.grads()["w"].shape == (3, 5)


def test_shape_mismatch_of_shared_param_is_a_build_error():
    text = NET.replace('param { name: "wc" init { type: kGaussian } }', 'param { name: "wc" share_from: "wa" }')
    with pytest.raises(NetBuildError, match="share_from 'wa' has shape"):
        build(text)


def test_unknown_layer_type_is_a_build_error():
    with pytest.raises(NetBuildError, match="no user layer registered as 'Nope'"):
        build('layer { name: "x" type: kUserLayer user_type: "Nope" }')
