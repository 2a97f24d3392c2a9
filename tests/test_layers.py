"""Neuron and image layers, and the registry: forward against independent references, backward by gradcheck (float64).

The helpers here (make, run, gradcheck, rand, Reports) are shared by the other test_layers_* files.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from google.protobuf import text_format

import shoal.neuralnet.layers  # noqa: F401  (registration)
from shoal.config import job_pb2
from shoal.neuralnet.layers import (
    Context,
    Layer,
    LayerConfigError,
    layer_class,
    register_user_layer,
    registered_types,
)


# -- helpers -------------------------------------------------------------------------
def make(text: str, *src_shapes) -> Layer:
    """The layer built from a LayerProto text, its sources having these per-sample shapes."""
    conf = text_format.Parse(text, job_pb2.LayerProto())
    if not conf.name:
        conf.name = "layer"
    return layer_class(conf)(conf, list(src_shapes))


class Reports(dict):
    """A ctx.report sink: name → (value, count), the value read to the host (a layer may report a 0-d tensor)."""

    def __call__(self, name, value, count):
        self[name] = (float(value), count)


def run(layer, xs, params=(), labels=None, phase=job_pb2.kTrain, seed=0, report=None, feeds=None, full=False):
    """One forward pass with a fresh generator seeded `seed`; the output (or (output, aux) with full=True)."""
    ctx = Context(phase=phase, generator=torch.Generator().manual_seed(seed), report=report if report is not None else (lambda *a: None), feeds=feeds or {})
    out = layer.forward(list(xs), list(params), labels if labels is not None else [None] * len(xs), ctx)
    if full:
        return out if isinstance(out, tuple) else (out, None)
    return out[0] if isinstance(out, tuple) else out


def gradcheck(layer, xs, params=(), labels=None, phase=job_pb2.kTrain, seed=0):
    """Autograd's gradients of the layer w.r.t. every input and param match finite differences (float64)."""
    tensors = [t.detach().double().requires_grad_(True) for t in list(xs) + list(params)]
    n = len(xs)
    assert torch.autograd.gradcheck(lambda *ts: run(layer, ts[:n], ts[n:], labels, phase, seed), tensors, eps=1e-6, atol=1e-5)


def rand(*shape, seed=None):
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return torch.randn(*shape, dtype=torch.float64, generator=generator)


torch.manual_seed(0)


# -- inner product ---------------------------------------------------------------------
def test_inner_product():
    layer = make("type: kInnerProduct innerproduct_conf { num_output: 3 }", (2, 2))
    assert layer.shape == (3,) and layer.param_shapes() == [(3, 4), (3,)] and layer.one_to_all
    x, w, b = rand(5, 2, 2), rand(3, 4), rand(3)
    expected = x.numpy().reshape(5, 4) @ w.numpy().T + b.numpy()
    np.testing.assert_allclose(run(layer, [x], [w, b]).numpy(), expected)
    gradcheck(layer, [x], [w, b])


def test_inner_product_transposed_without_bias():
    layer = make("type: kInnerProduct innerproduct_conf { num_output: 3 transpose: true bias_term: false }", (4,))
    assert layer.param_shapes() == [(4, 3)]
    x, w = rand(2, 4), rand(4, 3)
    np.testing.assert_allclose(run(layer, [x], [w]).numpy(), x.numpy() @ w.numpy())
    gradcheck(layer, [x], [w])


def test_inner_product_without_num_output_names_layer_and_field():
    with pytest.raises(LayerConfigError, match=r"layer 'fc' \(kInnerProduct\): innerproduct_conf.num_output is required"):
        make('name: "fc" type: kInnerProduct', (4,))


# -- activations, softmax, dropout, batch norm -------------------------------------------
def sigmoid(x):
    return 1 / (1 + np.exp(-x))


@pytest.mark.parametrize(
    "text, reference",
    [
        ("type: kSTanh", lambda x: 1.7159047 * np.tanh(0.6666667 * x)),
        ("type: kSigmoid", sigmoid),
        ("type: kReLU", lambda x: np.maximum(x, 0)),
        ("type: kReLU relu_conf { negative_slope: 0.1 }", lambda x: np.where(x > 0, x, 0.1 * x)),
        ("type: kActivation activation_conf { type: TANH }", np.tanh),
        ("type: kCudnnActivation activation_conf { type: SIGMOID }", sigmoid),
        ("type: kActivation activation_conf { type: STANH }", lambda x: 1.7159047 * np.tanh(0.6666667 * x)),
        ("type: kActivation activation_conf { type: RELU }", lambda x: np.maximum(x, 0)),
        ("type: kActivation", lambda x: np.maximum(x, 0)),  # RELU is the default
    ],
)
def test_activations(text, reference):
    layer = make(text, (2, 3))
    x = rand(4, 2, 3)
    assert layer.shape == (2, 3)
    np.testing.assert_allclose(run(layer, [x]).numpy(), reference(x.numpy()), rtol=1e-6)
    gradcheck(layer, [x + 0.01])  # away from ReLU's kink at exactly 0


def test_softmax_per_instance_groups():
    layer = make("type: kCudnnSoftmax softmax_conf { num_softmax_per_instance: 2 }", (6,))
    x = rand(3, 6)
    e = np.exp(x.numpy().reshape(3, 2, 3))
    np.testing.assert_allclose(run(layer, [x]).numpy(), (e / e.sum(-1, keepdims=True)).reshape(3, 6))
    gradcheck(layer, [x])
    with pytest.raises(LayerConfigError, match="num_softmax_per_instance 4 does not divide"):
        make("type: kSoftmax softmax_conf { num_softmax_per_instance: 4 }", (6,))


def test_dropout_scales_kept_units_and_is_identity_at_test():
    layer = make("type: kDropout dropout_conf { dropout_ratio: 0.25 }", (1000,))
    x = torch.ones(4, 1000, dtype=torch.float64)
    y = run(layer, [x], seed=3)
    kept = y != 0
    assert torch.allclose(y[kept], torch.full_like(y[kept], 1 / 0.75))
    assert 0.70 < kept.double().mean() < 0.80
    assert torch.equal(run(layer, [x], seed=3), y)  # same seed, same mask
    assert not torch.equal(run(layer, [x], seed=4), y)
    assert torch.equal(run(layer, [x], phase=job_pb2.kTest), x)
    assert torch.equal(run(layer, [x], phase=job_pb2.kVal), x)
    gradcheck(make("type: kDropout", (6,)), [rand(3, 6)], seed=5)  # gradient flows through the kept units only
    with pytest.raises(LayerConfigError, match="dropout_ratio must be in"):
        make("type: kDropout dropout_conf { dropout_ratio: 1 }", (6,))


def batch_norm_reference(x, mean, var, scale, bias, eps=1e-5):
    shape = (1, -1) + (1,) * (x.ndim - 2)
    return (x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + eps) * scale.reshape(shape) + bias.reshape(shape)


def test_batch_norm_trains_on_batch_stats_and_tests_on_running_stats():
    layer = make("type: kCudnnBM", (3, 4, 4))
    assert layer.param_shapes() == [(3,)] * 4 and layer.param_trainable() == [True, True, False, False]
    x = rand(5, 3, 4, 4) * 2 + 1
    scale, bias = rand(3), rand(3)
    mean, var = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    y = run(layer, [x], [scale, bias, mean, var])
    xn = x.numpy()
    mu, biased, unbiased = xn.mean(axis=(0, 2, 3)), xn.var(axis=(0, 2, 3)), xn.var(axis=(0, 2, 3), ddof=1)
    np.testing.assert_allclose(y.numpy(), batch_norm_reference(xn, mu, biased, scale.numpy(), bias.numpy()), rtol=1e-6, atol=1e-8)
    # running ← 0.9 · running + 0.1 · batch statistic (bm_conf.momentum 0.9), in place
    np.testing.assert_allclose(mean.numpy(), 0.1 * mu, rtol=1e-6)
    np.testing.assert_allclose(var.numpy(), 0.9 + 0.1 * unbiased, rtol=1e-6)
    test_y = run(layer, [x], [scale, bias, mean, var], phase=job_pb2.kTest)
    np.testing.assert_allclose(test_y.numpy(), batch_norm_reference(xn, mean.numpy(), var.numpy(), scale.numpy(), bias.numpy()), rtol=1e-6)
    np.testing.assert_allclose(mean.numpy(), 0.1 * mu, rtol=1e-6)  # testing leaves the running stats alone
    gradcheck(make("type: kCudnnBM", (3, 2, 2)), [x[:3, :, :2, :2]], [scale, bias, mean.clone(), var.clone()])


def test_batch_norm_over_flat_features_with_own_momentum():
    layer = make("type: kBM bm_conf { momentum: 0.5 epsilon: 0.001 }", (4,))
    x, scale, bias = rand(6, 4), rand(4), rand(4)
    mean, var = torch.ones(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    y = run(layer, [x], [scale, bias, mean, var])
    xn = x.numpy()
    np.testing.assert_allclose(y.numpy(), batch_norm_reference(xn, xn.mean(0), xn.var(0), scale.numpy(), bias.numpy(), 1e-3), rtol=1e-6)
    np.testing.assert_allclose(mean.numpy(), 0.5 + 0.5 * xn.mean(0), rtol=1e-6)
    # the running statistics have no gradient: an updater leaves them to the layer
    leaves = [t.clone().requires_grad_(True) for t in (scale, bias, mean, var)]
    run(layer, [x], leaves).sum().backward()
    assert leaves[0].grad is not None and leaves[2].grad is None and leaves[3].grad is None


# -- convolution ------------------------------------------------------------------------
def reference_conv(x, w, b, stride, pad):
    """Direct loops over output positions (numpy)."""
    n, _c, h, wd = x.shape
    f, _, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad[0], pad[0]), (pad[1], pad[1])))
    oh, ow = (h + 2 * pad[0] - kh) // stride[0] + 1, (wd + 2 * pad[1] - kw) // stride[1] + 1
    out = np.zeros((n, f, oh, ow))
    for i in range(oh):
        for j in range(ow):
            patch = xp[:, :, i * stride[0] : i * stride[0] + kh, j * stride[1] : j * stride[1] + kw]
            out[:, :, i, j] = np.tensordot(patch, w, axes=([1, 2, 3], [1, 2, 3])) + b
    return out


def test_convolution_with_x_y_variants():
    layer = make("type: kConvolution convolution_conf { num_filters: 2 kernel: 3 kernel_x: 2 pad: 1 stride: 2 stride_x: 1 }", (3, 7, 6))
    assert layer.param_shapes() == [(2, 3, 3, 2), (2,)] and layer.one_to_all
    x, w, b = rand(2, 3, 7, 6), rand(2, 3, 3, 2), rand(2)
    expected = reference_conv(x.numpy(), w.numpy(), b.numpy(), (2, 1), (1, 1))
    assert layer.shape == expected.shape[1:] == (2, 4, 7)
    np.testing.assert_allclose(run(layer, [x], [w, b]).numpy(), expected, rtol=1e-6)


def test_convolution_gradients_and_single_channel_input():
    layer = make("type: kCConvolution convolution_conf { num_filters: 2 kernel: 2 pad: 1 stride: 2 }", (2, 3, 3))
    assert layer.shape == (2, 2, 2)
    gradcheck(layer, [rand(2, 2, 3, 3)], [rand(2, 2, 2, 2), rand(2)])
    # an H×W source is one channel, as SINGA reads a 3-D blob
    flat_image = make("type: kCudnnConv convolution_conf { num_filters: 1 kernel: 3 bias_term: false }", (5, 5))
    assert flat_image.shape == (1, 3, 3) and flat_image.param_shapes() == [(1, 1, 3, 3)]
    x, w = rand(2, 5, 5), rand(1, 1, 3, 3)
    np.testing.assert_allclose(run(flat_image, [x], [w]).numpy(), reference_conv(x.numpy()[:, None], w.numpy(), 0, (1, 1), (0, 0)))


def test_convolution_confs_that_do_not_fit_are_config_errors():
    with pytest.raises(LayerConfigError, match=r"layer 'c' \(kConvolution\): convolution_conf kernel \(9, 9\) does not fit the 5×5 input"):
        make('name: "c" type: kConvolution convolution_conf { num_filters: 2 kernel: 9 }', (1, 5, 5))
    with pytest.raises(LayerConfigError, match="C×H×W"):
        make("type: kConvolution convolution_conf { num_filters: 2 kernel: 3 }", (25,))
    with pytest.raises(LayerConfigError, match="num_filters is required"):
        make("type: kConvolution convolution_conf { kernel: 3 }", (1, 5, 5))


# -- pooling ----------------------------------------------------------------------------
def reference_pool(x, kernel, stride, pad, kind):
    """SINGA's CPooling loops (ForwardMaxPooling / ForwardAvgPooling in src/utils/common.cc), numpy."""
    n, c, h, w = x.shape
    oh, ow = (h + 2 * pad - kernel) // stride + 1, (w + 2 * pad - kernel) // stride + 1
    out = np.zeros((n, c, oh, ow))
    for i in range(oh):
        for j in range(ow):
            hs, ws = i * stride - pad, j * stride - pad
            he, we = min(hs + kernel, h + pad), min(ws + kernel, w + pad)
            size = (he - hs) * (we - ws)
            hs, ws, he, we = max(hs, 0), max(ws, 0), min(he, h), min(we, w)
            window = x[:, :, hs:he, ws:we]
            out[:, :, i, j] = window.max(axis=(2, 3)) if kind == "MAX" else window.sum(axis=(2, 3)) / size
    return out


@pytest.mark.parametrize("kind", ["MAX", "AVG"])
@pytest.mark.parametrize("size, kernel, stride, pad", [(8, 3, 2, 0), (7, 3, 2, 1), (6, 2, 2, 0), (5, 3, 3, 1), (5, 2, 1, 1)])
def test_pooling_matches_singa(kind, size, kernel, stride, pad):
    layer = make(f"type: kCPooling pooling_conf {{ pool: {kind} kernel: {kernel} stride: {stride} pad: {pad} }}", (2, size, size))
    x = rand(2, 2, size, size)
    expected = reference_pool(x.numpy(), kernel, stride, pad, kind)
    assert layer.shape == expected.shape[1:]
    np.testing.assert_allclose(run(layer, [x]).numpy(), expected, rtol=1e-6)
    gradcheck(layer, [x[:1]])


def test_pooling_rounds_down_as_singa_not_up_as_caffe():
    # cifar10's pool1: 32×32, kernel 3, stride 2 → 15×15 in SINGA (Caffe's ceil would give 16×16)
    assert make("type: kPooling pooling_conf { kernel: 3 stride: 2 }", (32, 32, 32)).shape == (32, 15, 15)
    assert make("type: kCudnnPool pooling_conf { kernel: 2 stride: 2 pool: AVG }", (1, 7, 9)).shape == (1, 3, 4)


def test_pooling_confs_that_do_not_fit_are_config_errors():
    with pytest.raises(LayerConfigError, match="pad 2 must be at most half the kernel 3"):
        make("type: kPooling pooling_conf { kernel: 3 pad: 2 }", (1, 8, 8))
    with pytest.raises(LayerConfigError, match="kernel 5 does not fit the 4×4 input"):
        make("type: kPooling pooling_conf { kernel: 5 }", (1, 4, 4))


# -- LRN --------------------------------------------------------------------------------
def test_lrn_across_channels_divides_alpha_by_local_size():
    layer = make("type: kLRN lrn_conf { local_size: 3 alpha: 0.5 beta: 0.75 knorm: 2 }", (4, 2, 2))
    x = rand(2, 4, 2, 2)
    xn = x.numpy()
    sq = np.pad(xn**2, ((0, 0), (1, 1), (0, 0), (0, 0)))
    window = sq[:, 0:4] + sq[:, 1:5] + sq[:, 2:6]
    expected = xn / (2 + 0.5 / 3 * window) ** 0.75
    np.testing.assert_allclose(run(layer, [x]).numpy(), expected, rtol=1e-6)
    gradcheck(layer, [x])
    assert layer_class(job_pb2.LayerProto(type=job_pb2.kCudnnLRN)) is type(layer)


# -- registry ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "aliases",
    [
        ("kConvolution", "kCConvolution", "kCudnnConv"),
        ("kPooling", "kCPooling", "kCudnnPool"),
        ("kLRN", "kCudnnLRN"),
        ("kSoftmax", "kCudnnSoftmax"),
        ("kActivation", "kCudnnActivation"),
        ("kBM", "kCudnnBM"),
        ("kSoftmaxLoss", "kCudnnSoftmaxLoss"),
        ("kRecordInput", "kCSVInput"),
        ("kBridgeSrc", "kBridgeDst"),
    ],
)
def test_aliases_share_one_class(aliases):
    classes = {layer_class(job_pb2.LayerProto(type=job_pb2.LayerType.Value(name))) for name in aliases}
    assert len(classes) == 1


def test_every_layer_type_has_a_class():
    """Every LayerType of SINGA 0.3's job.proto builds, or (deprecated ones) fails with a pointer to its replacement."""
    assert set(registered_types()) == set(job_pb2.LayerType.keys()) - {"kUserLayer"}


@pytest.mark.parametrize("name, advice", [("kShardData", "kRecordInput"), ("kMnist", "mean_value"), ("kPrefetch", "prefetching"), ("kRGBImage", "kImagePreprocess"), ("kLabel", "labels"), ("kLMDBData", "kRecordInput")])
def test_deprecated_types_name_their_replacement(name, advice):
    with pytest.raises(LayerConfigError, match=f"{name} is deprecated in SINGA 0.3.*{advice}"):
        make(f"type: {name}")


def test_user_layers_are_found_by_user_type():
    @register_user_layer("Doubler")
    class Doubler(Layer):
        def forward(self, xs, params, labels, ctx):
            return 2 * xs[0]

    layer = make('type: kUserLayer user_type: "Doubler"', (3,))
    assert isinstance(layer, Doubler) and torch.equal(run(layer, [torch.ones(1, 3)]), torch.full((1, 3), 2.0))
    with pytest.raises(KeyError, match="no user layer registered as 'Nope'"):
        make('type: kUserLayer user_type: "Nope"', (3,))
