"""Interactive layer calls (SINGA 0.3's Feed → ComputeFeature → ComputeGradient → Update loop) on real MNIST.

The loop computes with the layers and updaters a job uses, so it must train exactly the params
shoal.train trains on the same batches from the same initial values.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REPO

from shoal.neuralnet import checkpoint as ckpt_io
from shoal.data.dataset import open_store
from shoal.frontend.keras import SGD, AdaGrad, Convolution2D, Dense, Dropout, ImageInput, LabelInput, Loss, MaxPooling2D, Sequential, Store

BATCH, STEPS = 32, 6
UPDATERS = {
    # the learning rate changes at step 3, so the schedule is exercised too
    "SGD": lambda: SGD(lr=0.1, momentum=0.9, decay=0.001, lr_type="manual", step=(0, 3), step_lr=(0.1, 0.03)),
    "AdaGrad": lambda: AdaGrad(lr=0.05, decay=0.001),
}


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def mlp(workspace, updater: str, final_activation):
    m = Sequential("mlp", workspace=workspace, seed=3)
    m.add(Dense(32, init="uniform", activation="stanh", w_low=-0.1, w_high=0.1, b_lr=2, b_wd=0))
    m.add(Dropout(0.2))  # its masks come from the job's worker generator: the loop must draw the same
    m.add(Dense(10, init="gaussian", activation=final_activation, w_std=0.1))
    m.compile(loss="categorical_crossentropy", optimizer=UPDATERS[updater]())
    return m


def mnist_batches(store: Store, count: int):
    data = open_store(store.conf())
    for step in range(count):
        images, labels = data.rows(step * store.batch_size, store.batch_size)
        yield (torch.from_numpy(images) - 127.5) / 127.5, labels  # what the job's kRecordInput computes


@pytest.mark.parametrize("updater", UPDATERS)
@pytest.mark.parametrize("loop", ["layers", "model"])
def test_the_interactive_loop_trains_the_params_shoal_train_trains(mnist_dir, tmp_path, updater, loop):
    train = Store(mnist_dir / "train_data.bin", batch_size=BATCH, mean_value=127.5, std_value=127.5)
    # the model loop leaves the final softmax to the loss, as the job does; the layer loop has none
    final = "softmax" if loop == "model" else None
    mlp(tmp_path / "job", updater, final).fit(train, nb_epoch=STEPS, log=lambda *a: None)
    expected = ckpt_io.load(ckpt_io.latest(tmp_path / "job")).params

    m = mlp(tmp_path / "unused", updater, final)
    image, label, loss, sgd = ImageInput(28, 28), LabelInput(), Loss("softmaxloss"), UPDATERS[updater]()
    initial = None
    for step, (x, y) in enumerate(mnist_batches(train, STEPS)):
        if loop == "model":
            m.compute_feature(x, y)
            m.compute_gradient()
            initial = initial or m.get_params()
            m.update(step)
        else:  # SINGA's spelling, one layer at a time
            h = image.Feed(x)
            label.Feed(y)
            for layer in m.layers:
                h = layer.ComputeFeature(h)
            loss.ComputeFeature(h, label)
            loss.ComputeGradient()
            initial = initial or m.GetParams()
            for layer in m.layers:
                sgd.Update(step, layer)
    trained = m.get_params()
    assert sorted(trained) == sorted(expected) == ["b1", "b3", "w1", "w3"]
    for name in expected:
        assert np.abs(initial[name] - expected[name].numpy()).max() > 1e-3, f"{name} did not train"
        np.testing.assert_allclose(trained[name], expected[name].numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


def test_params_move_between_layers_and_checkpoints(mnist_dir):
    """get_params / set_params: a conv layer's weight and bias, and a model's params by name."""
    x = torch.randn(4, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    conv, pool = Convolution2D(4, 5, pad=2, activation="relu"), MaxPooling2D(2, 2)
    before = pool.compute_feature(conv.compute_feature(x))
    weight, bias = conv.get_params()
    assert weight.shape == (4, 1, 5, 5) and bias.shape == (4,)
    conv.set_params(np.zeros_like(weight), np.full_like(bias, 0.5))
    after = pool.compute_feature(conv.compute_feature(x))
    assert before.shape == after.shape == (4, 4, 14, 14)
    assert torch.all(after == 0.5)
    with pytest.raises(ValueError, match="has shape"):
        conv.set_params(weight[:2], bias)
    m = Sequential("m")
    m.add(Dense(8)).add(Dense(3))
    m.compile()
    m.compute_feature(x)
    params = m.get_params()
    params["w2"] = params["w2"] * 2
    m.set_params({"w2": params["w2"]})
    np.testing.assert_array_equal(m.layers[1].get_params()[0], params["w2"])


def test_mistakes_are_named():
    with pytest.raises(ValueError, match="has no params yet"):
        Dense(3).get_params()
    with pytest.raises(ValueError, match="no output yet"):
        Dense(3).compute_feature(LabelInput())
    with pytest.raises(ValueError, match="not a batch of 784-value images"):
        ImageInput(28, 28).feed(np.zeros((2, 700)))
    with pytest.raises(ValueError, match="compute_feature\\(..., phase='train'\\)"):
        loss = Loss()
        loss.compute_feature(np.zeros((2, 3), np.float32), np.array([0, 1]), phase="test")
        loss.compute_gradient()
    dense = Dense(3)
    dense.compute_feature(np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="per-sample shape"):
        dense.compute_feature(np.zeros((2, 5), np.float32))
    with pytest.raises(ValueError, match="call compile"):
        Sequential("m").add(Dense(3)).compute_feature(np.zeros((2, 4), np.float32), np.array([0, 1]))


def test_example_script_learns_mnist(mnist_dir):
    cmd = [sys.executable, str(REPO / "examples" / "mnist" / "interactive.py"), "--data", str(mnist_dir),
           "--widths", "128", "--lr", "0.01", "--momentum", "0.9", "--steps", "200", "--disp-freq", "50"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    losses = [float(v) for v in re.findall(r"^step \d+: loss ([\d.]+)", result.stdout, re.M)]
    accuracy = float(re.search(r"^test accuracy ([\d.]+) on 1000 images after 200 steps$", result.stdout, re.M)[1])
    assert len(losses) == 5 and losses[-1] < 0.5 * losses[0], result.stdout
    assert accuracy > 0.8, result.stdout  # chance: 0.1
