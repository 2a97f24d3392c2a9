"""Unrolling (SINGA's NeuralNet::Unrolling), feedback edges, and kBPTT / kCD on the unrolled graph."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from google.protobuf import text_format
from test_layers_rnn import torch_gru_cell

from shoal.neuralnet.algorithms import train_one_batch
from shoal.config import job_pb2
from shoal.neuralnet.layers import Context
from shoal.neuralnet.net import NetBuildError, NeuralNet
from shoal.neuralnet.params import ParamStore
from shoal.neuralnet.unroll import unroll

GRU_PARAMS = ["z_hx", "r_hx", "c_hx", "z_hh", "r_hh", "c_hh", "z_b", "r_b", "c_b"]


def layers(text):
    return list(text_format.Parse(text, job_pb2.NetProto()).layer)


def wiring(text, net_unroll_len):
    return {c.name: list(c.srclayers) for c in unroll(layers(text), net_unroll_len).confs}


def test_a_net_without_unroll_len_keeps_its_names():
    text = 'layer { name: "a" type: kDummy } layer { name: "b" type: kDummy srclayers: "a" }'
    assert wiring(text, 1) == {"a": [], "b": ["a"]}


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize(
    "conn, expected",
    [
        ("kUnrollOneToOne", lambda n, j: [f"{j}#x"]),
        ("kUnrollOneToAll", lambda n, j: [f"{i}#x" for i in range(n)]),
        ("kUnrollFirstToLast", lambda n, j: [f"{n - 1}#x"] if j == 0 else []),
    ],
)
def test_connection_types(n, conn, expected):
    text = f'layer {{ name: "x" type: kDummy }} layer {{ name: "y" type: kDummy srclayers: "x" unroll_conn_type: {conn} }}'
    got = wiring(text, n)
    assert [name for name in got if name.endswith("#y")] == [f"{j}#y" for j in range(n)]
    for j in range(n):
        assert got[f"{j}#y"] == expected(n, j)


@pytest.mark.parametrize("shift", [1, 2])
def test_shift_reads_an_earlier_copy_and_a_layer_may_read_itself(shift):
    text = f'layer {{ name: "x" type: kDummy }} layer {{ name: "h" type: kDummy srclayers: "x" srclayers: "h" shift: 0 shift: {shift} }}'
    got = wiring(text, 4)
    for j in range(4):
        assert got[f"{j}#h"] == [f"{j}#x"] + ([f"{j - shift}#h"] if j >= shift else [])


def test_a_layer_keeps_its_own_unroll_len_and_the_gru_chains_its_copies():
    text = """
    layer { name: "data" type: kDummy unroll_len: 1 }
    layer { name: "x" type: kDummy srclayers: "data" unroll_conn_type: kUnrollOneToAll }
    layer { name: "g" type: kGRU srclayers: "x" }
    """
    got = wiring(text, 3)
    assert got["0#data"] == [] and "1#data" not in got
    assert [got[f"{j}#x"] for j in range(3)] == [["0#data"]] * 3
    assert [got[f"{j}#g"] for j in range(3)] == [["0#x"], ["1#x", "0#g"], ["2#x", "1#g"]]


def test_a_layer_reading_its_own_copy_is_an_error():
    text = 'layer { name: "h" type: kDummy srclayers: "h" shift: 0 }'
    with pytest.raises(NetBuildError, match=r"layer\[h\].shift: a layer that reads itself needs shift"):
        NeuralNet(text_format.Parse(text, job_pb2.NetProto(unroll_len=2)), job_pb2.kTrain, ParamStore(), torch.Generator())


CHAR_NET = """
unroll_len: {steps}
layer {{ name: "data" type: kDummy unroll_len: 1 dummy_conf {{ input: true shape: {batch} shape: {ids} }} }}
layer {{ name: "onehot" type: kOneHot srclayers: "data" unroll_conn_type: kUnrollOneToAll onehot_conf {{ vocab_size: {vocab} }} }}
layer {{ name: "label" type: kRNNLabel srclayers: "data" unroll_conn_type: kUnrollOneToAll }}
layer {{ name: "gru" type: kGRU srclayers: "onehot" gru_conf {{ dim_hidden: {hidden} }}
  {gru_params} }}
layer {{ name: "ip" type: kInnerProduct srclayers: "gru" innerproduct_conf {{ num_output: {vocab} }}
  param {{ name: "w" init {{ type: kGaussian std: 0.3 }} }} param {{ name: "b" }} }}
layer {{ name: "loss" type: kSoftmaxLoss srclayers: "ip" srclayers: "label" }}
"""


@pytest.mark.parametrize("steps", [1, 3, 6])
def test_bptt_gradients_are_those_of_the_whole_sequence(steps):
    """kBPTT on the unrolled net = autograd through a torch.nn.GRUCell loop with one set of weights."""
    batch, vocab, hidden = 4, 7, 5
    gru_params = " ".join(f'param {{ name: "{n}" init {{ type: kGaussian std: 0.4 }} }}' for n in GRU_PARAMS)
    text = CHAR_NET.format(steps=steps, batch=batch, ids=steps + 1, vocab=vocab, hidden=hidden, gru_params=gru_params)
    store = ParamStore()
    net = NeuralNet(text_format.Parse(text, job_pb2.NetProto()), job_pb2.kTrain, store, torch.Generator().manual_seed(0))
    assert store.names() == GRU_PARAMS + ["w", "b"]  # the copies add no params
    ids = torch.randint(0, vocab, (batch, steps + 1), generator=torch.Generator().manual_seed(1))
    ctx = Context(generator=torch.Generator().manual_seed(2), feeds={"0#data": (ids.float(), None)})
    # a kDummy input ignores feeds: give it the ids through its forward
    net.nodes[0].layer.forward = lambda xs, params, labels, ctx: ids.float()
    grads = train_one_batch(job_pb2.AlgProto(alg=job_pb2.kBPTT), net, ctx)

    values = {n: store.values[n].double().clone().requires_grad_(True) for n in store.names()}
    cell = torch_gru_cell([values[n].detach() for n in GRU_PARAMS], vocab, hidden)
    h, loss = torch.zeros(batch, hidden, dtype=torch.float64), 0
    for t in range(steps):
        x = F.one_hot(ids[:, t], vocab).double()
        z_hx, r_hx, c_hx, z_hh, r_hh, c_hh, z_b, r_b, c_b = (values[n] for n in GRU_PARAMS)
        z = torch.sigmoid(x @ z_hx.t() + h @ z_hh.t() + z_b)
        r = torch.sigmoid(x @ r_hx.t() + h @ r_hh.t() + r_b)
        c = torch.tanh(x @ c_hx.t() + c_b + r * (h @ c_hh.t()))
        h_next = (1 - z) * c + z * h
        torch.testing.assert_close(h_next, cell(x, h))  # the same cell as torch's
        h = h_next
        loss = loss + F.cross_entropy(h @ values["w"].t() + values["b"], ids[:, t + 1])
    loss.backward()
    for name in store.names():
        torch.testing.assert_close(grads[name].double(), values[name].grad, rtol=1e-4, atol=1e-5)


RBM_NET = """
layer { name: "data" type: kDummy dummy_conf { input: true shape: 8 shape: 6 } }
layer { name: "vis" type: kRBMVis srclayers: "data" srclayers: "hid" rbm_conf { hdim: 4 }
  param { name: "w" init { type: kGaussian std: 0.5 } } param { name: "bv" } }
layer { name: "hid" type: kRBMHid srclayers: "vis" rbm_conf { hdim: 4 }
  param { name: "w_" share_from: "w" } param { name: "bh" } }
"""


def test_rbm_layers_that_list_each_other_are_no_cycle():
    net = NeuralNet(text_format.Parse(RBM_NET, job_pb2.NetProto()), job_pb2.kTrain, ParamStore(), torch.Generator())
    assert [(n.name, n.srcs, n.feedback) for n in net.nodes] == [("data", [], []), ("vis", ["data"], ["hid"]), ("hid", ["vis"], [])]
    cyclic = 'layer { name: "a" type: kSigmoid srclayers: "b" } layer { name: "b" type: kSigmoid srclayers: "a" }'
    with pytest.raises(NetBuildError, match="cycle a -> b -> a"):
        NeuralNet(text_format.Parse(cyclic, job_pb2.NetProto()), job_pb2.kTrain, ParamStore(), torch.Generator())


@pytest.mark.parametrize("k", [1, 3])
def test_cd_gives_the_rbm_pair_its_gradients_and_reports_squared_error(k):
    store = ParamStore()
    net = NeuralNet(text_format.Parse(RBM_NET, job_pb2.NetProto()), job_pb2.kTrain, store, torch.Generator().manual_seed(0))
    reports = {}
    ctx = Context(generator=torch.Generator().manual_seed(1), report=lambda n, v, c: reports.setdefault(n, v))
    grads = train_one_batch(job_pb2.AlgProto(alg=job_pb2.kCD, cd_conf=job_pb2.CDProto(cd_k=k)), net, ctx)
    assert set(grads) == {"w", "bv", "bh"} and all(g is not None and g.abs().sum() > 0 for g in grads.values())
    assert reports["Squared Error"] > 0
    test_net = NeuralNet(text_format.Parse(RBM_NET, job_pb2.NetProto()), job_pb2.kTest, store, torch.Generator())
    reports.clear()
    test_net.forward(Context(phase=job_pb2.kTest, generator=torch.Generator().manual_seed(1), report=lambda n, v, c: reports.setdefault(n, v)))
    assert reports["Squared Error"] > 0  # outside training the visible layer closes the loop itself
