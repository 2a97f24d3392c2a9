"""Sequence and generative layers: kOneHot, kEmbedding, kGRU, the char-rnn layers, and the RBM."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from test_layers import gradcheck, make, rand, run

from shoal.neuralnet.layers import Context, LayerConfigError
from shoal.neuralnet.layers.char_rnn import char_windows, encode_text
from shoal.neuralnet.layers.rbm import contrastive_divergence
from shoal.neuralnet.layers.rnn import GRU_PARAMS


# -- ids to vectors -------------------------------------------------------------------
def test_one_hot_and_embedding():
    ids = torch.tensor([[2.0], [0.0]])
    onehot = make("type: kOneHot onehot_conf { vocab_size: 4 }", (1,))
    assert onehot.shape == (4,) and run(onehot, [ids]).tolist() == [[0, 0, 1, 0], [1, 0, 0, 0]]
    emb = make("type: kEmbedding embedding_conf { vocab_size: 4 feature_dim: 3 }", (1,))
    assert emb.shape == (3,) and emb.param_shapes() == [(4, 3)]
    table = rand(4, 3).requires_grad_(True)
    out = run(emb, [ids], [table])
    assert torch.equal(out, table[[2, 0]])
    (out * torch.tensor([[1.0], [10.0]], dtype=torch.float64)).sum().backward()
    assert table.grad.tolist() == [[10.0] * 3, [0.0] * 3, [1.0] * 3, [0.0] * 3]  # each row collects its samples' gradients


def test_unrolled_copies_read_their_own_step():
    steps = torch.tensor([[1.0, 3.0, 0.0], [2.0, 2.0, 1.0]])  # kCharRNN: 3 ids per sample
    second = make("type: kOneHot unroll_index: 1 onehot_conf { vocab_size: 4 }", (3,))
    assert run(second, [steps]).argmax(1).tolist() == [3, 2]
    third = make("type: kEmbedding unroll_index: 2 embedding_conf { vocab_size: 4 feature_dim: 2 }", (3,))
    table = rand(4, 2)
    assert torch.equal(run(third, [steps], [table]), table[[0, 1]])
    with pytest.raises(LayerConfigError, match="unroll_index 3 reads past the 3 ids"):
        make("type: kOneHot unroll_index: 3 onehot_conf { vocab_size: 4 }", (3,))
    with pytest.raises(LayerConfigError, match="onehot_conf.vocab_size is required"):
        make("type: kOneHot", (1,))


# -- GRU --------------------------------------------------------------------------------
def gru_params(vdim, hidden, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    shapes = [(hidden, vdim)] * 3 + [(hidden, hidden)] * 3 + ([(hidden,)] * 3 if bias else [])
    return [torch.randn(s, generator=g, dtype=torch.float64) * 0.5 for s in shapes]


def torch_gru_cell(params, vdim, hidden):
    """torch.nn.GRUCell holding the same weights: its gates are ordered (r, z, n); SINGA's bias sits on the input side."""
    z_hx, r_hx, c_hx, z_hh, r_hh, c_hh, z_b, r_b, c_b = params
    cell = torch.nn.GRUCell(vdim, hidden, dtype=torch.float64)
    with torch.no_grad():
        cell.weight_ih.copy_(torch.cat([r_hx, z_hx, c_hx]))
        cell.weight_hh.copy_(torch.cat([r_hh, z_hh, c_hh]))
        cell.bias_ih.copy_(torch.cat([r_b, z_b, c_b]))
        cell.bias_hh.zero_()
    return cell


def test_gru_step_matches_torch_gru_cell():
    layer = make("type: kGRU gru_conf { dim_hidden: 4 }", (2, 3), (4,))
    assert layer.shape == (4,) and len(GRU_PARAMS) == 9
    assert layer.param_shapes() == [(4, 6)] * 3 + [(4, 4)] * 3 + [(4,)] * 3
    params = gru_params(6, 4)
    x, h = rand(5, 2, 3), rand(5, 4)
    cell = torch_gru_cell(params, 6, 4)
    with torch.no_grad():
        np.testing.assert_allclose(run(layer, [x, h], params).numpy(), cell(x.reshape(5, 6), h).numpy(), rtol=1e-10)
        first = make("type: kGRU gru_conf { dim_hidden: 4 }", (2, 3))  # no previous state: h = 0
        np.testing.assert_allclose(run(first, [x], params).numpy(), cell(x.reshape(5, 6)).numpy(), rtol=1e-10)


def test_gru_gradients_without_bias():
    layer = make("type: kGRU gru_conf { dim_hidden: 3 bias_term: false }", (2,), (3,))
    assert len(layer.param_shapes()) == 6
    gradcheck(layer, [rand(2, 2), rand(2, 3)], gru_params(2, 3, bias=False))
    with pytest.raises(LayerConfigError, match="dim_hidden is required"):
        make("type: kGRU", (2,))
    with pytest.raises(LayerConfigError, match="previous state"):
        make("type: kGRU gru_conf { dim_hidden: 3 }", (2,), (4,))


# -- char-rnn ---------------------------------------------------------------------------
def test_char_windows_follow_singa_offsets():
    ids = np.arange(20)  # 2 segments of 10
    assert char_windows(ids, 2, 4, 0).tolist() == [[0, 1, 2, 3, 4], [10, 11, 12, 13, 14]]
    assert char_windows(ids, 2, 4, 1).tolist() == [[4, 5, 6, 7, 8], [14, 15, 16, 17, 18]]
    assert char_windows(ids, 2, 4, 2).tolist() == [[8, 9, 10, 11, 12], [18, 19, 0, 1, 2]]  # past the end: wraps
    assert char_windows(ids, 2, 4, 3).tolist() == char_windows(ids, 2, 4, 0).tolist()  # offset 12 ≥ 10: back to 0
    assert encode_text("abca", "abc").tolist() == [0, 1, 2, 0]
    with pytest.raises(KeyError, match="'d' is not in the vocabulary"):
        encode_text("ad", "abc")


def test_char_rnn_step_trains_end_to_end():
    """data → onehot copy 1 → GRU → ip → softmax loss against the kRNNLabel copy 1 labels."""
    data = make('name: "data" type: kCharRNN char_rnn_conf { path: "t" vocab_path: "v" unroll_len: 3 }')
    assert data.shape == (4,) and data.category == "input"
    windows = torch.from_numpy(char_windows(encode_text("hello world, hello shoal", "helo wrd,sa"), 2, 3, 0))
    steps, _ = run(data, [], feeds={"data": (windows, None)}, full=True)
    onehot = make("type: kOneHot unroll_index: 1 onehot_conf { vocab_size: 11 }", (4,))
    label = make("type: kRNNLabel unroll_index: 1", (4,))
    ids, labels = run(label, [steps], full=True)
    assert labels.tolist() == windows[:, 2].tolist() and ids.dtype == torch.float32
    gru = make("type: kGRU gru_conf { dim_hidden: 5 }", (11,))
    ip = make("type: kInnerProduct innerproduct_conf { num_output: 11 }", (5,))
    loss_layer = make("type: kSoftmaxLoss", (11,), ())
    params = [p.float().requires_grad_(True) for p in gru_params(11, 5)]
    w, b = torch.zeros(11, 5, requires_grad=True), torch.zeros(11, requires_grad=True)
    hidden = run(gru, [run(onehot, [steps])], params)
    loss = run(loss_layer, [run(ip, [hidden], [w, b]), ids], labels=[None, labels])
    loss.backward()
    assert loss.item() == pytest.approx(np.log(11), rel=1e-6) and all(p.grad is not None for p in params)
    with pytest.raises(LayerConfigError, match="unroll_index 3 needs id 4"):
        make("type: kRNNLabel unroll_index: 3", (4,))


def test_rnn_dummy_draws_integers_until_given_data():
    dummy = make('name: "data" type: kRNNDummy rnn_dummy_conf { shape: 5 integer: true low: 0 high: 3 dynamic_srclayer: "argsort" }')
    assert dummy.shape == () and dummy.category == "input"
    ids = run(dummy, [], seed=2)
    assert ids.shape == (5,) and set(ids.tolist()) <= {0.0, 1.0, 2.0} and torch.equal(ids, run(dummy, [], seed=2))
    previous = torch.tensor([[7.0]])
    assert run(dummy, [], feeds={"data": (previous, None)}) is previous
    with pytest.raises(LayerConfigError, match="low .* must be below high"):
        make("type: kRNNDummy rnn_dummy_conf { shape: 1 }")


def test_char_rnn_output_writes_characters(tmp_path):
    (tmp_path / "vocab.txt").write_text("abc")
    out = make(f'type: kCharRNNOutput char_rnn_conf {{ vocab_path: "{tmp_path}/vocab.txt" }}', (1,))
    out.stream = io.StringIO()
    run(out, [torch.tensor([[2.0], [0.0]])])
    run(out, [torch.tensor([[1.0], [1.0]])])
    assert out.stream.getvalue() == "cabb"


# -- RBM --------------------------------------------------------------------------------
def free_energy(v, weight, vbias, hbias, gaussian):
    """F(v) = −v·b_v − Σ_j softplus(v·W_jᵀ + b_h,j) for binary hidden units; −v·b_v − ½‖v·Wᵀ + b_h‖² for Gaussian ones."""
    pre = v @ weight.t() + hbias
    hidden_term = 0.5 * (pre**2).sum(1) if gaussian else torch.nn.functional.softplus(pre).sum(1)
    return -(v @ vbias) - hidden_term


def rbm_pair(gaussian=False):
    flag = " gaussian: true" if gaussian else ""
    vis = make(f"type: kRBMVis rbm_conf {{ hdim: 3{flag} }}", (2, 3))
    hid = make(f"type: kRBMHid rbm_conf {{ hdim: 3{flag} }}", (2, 3))
    return vis, hid


@pytest.mark.parametrize("gaussian", [False, True])
@pytest.mark.parametrize("k", [1, 3])
def test_contrastive_divergence_is_the_free_energy_gradient(gaussian, k):
    vis, hid = rbm_pair(gaussian)
    assert vis.param_shapes() == [(3, 6), (6,)] and hid.param_shapes() == [(3, 6), (3,)] and hid.shape == (3,)
    weight, vbias, hbias = rand(3, 6, seed=1), rand(6, seed=2), rand(3, seed=3)
    v0 = torch.rand(4, 2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    assert torch.equal(run(vis, [v0], [weight, vbias]), v0)  # the positive phase: the data itself
    ctx = Context(generator=torch.Generator().manual_seed(5))
    result = contrastive_divergence(vis, hid, v0, [weight, vbias], [weight, hbias], ctx, k=k)
    leaves = [t.clone().requires_grad_(True) for t in (weight, vbias, hbias)]
    v0_flat = v0.reshape(4, 6)
    ((free_energy(v0_flat, *leaves, gaussian) - free_energy(result.visible, *leaves, gaussian)).sum() / 4).backward()
    np.testing.assert_allclose(result.vis_grads[0].numpy(), leaves[0].grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(result.vis_grads[1].numpy(), leaves[1].grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(result.hid_grads[1].numpy(), leaves[2].grad.numpy(), rtol=1e-10, atol=1e-12)
    assert result.hid_grads[0] is None


def test_contrastive_divergence_samples_hidden_units_and_reports_squared_error():
    vis, hid = rbm_pair()
    weight, vbias, hbias = rand(3, 6, seed=1), rand(6, seed=2), rand(3, seed=3)
    v0 = torch.rand(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    result = contrastive_divergence(vis, hid, v0, [weight, vbias], [weight, hbias], Context(generator=torch.Generator().manual_seed(9)))
    # the same chain by hand: h0 = σ(v0 Wᵀ + b_h); h̃ = 1[u < h0], u drawn from the same seed; v1 = σ(h̃ W + b_v)
    h0 = torch.sigmoid(v0 @ weight.t() + hbias)
    u = torch.rand(4, 3, generator=torch.Generator().manual_seed(9)).double()
    v1 = torch.sigmoid((u < h0).double() @ weight + vbias)
    np.testing.assert_allclose(result.visible.numpy(), v1.numpy(), rtol=1e-12)
    assert result.squared_error == pytest.approx(((v0 - v1) ** 2).sum().item() / 4)
    with pytest.raises(LayerConfigError, match="rbm_conf.hdim is required"):
        make("type: kRBMHid", (6,))
