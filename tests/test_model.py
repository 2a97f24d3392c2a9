"""shoal.frontend.keras: Keras-like Sequential / Energy models that write jobs, trained on real MNIST."""
from __future__ import annotations

import pytest
import torch

from shoal.frontend import api
from shoal.neuralnet import checkpoint as ckpt_io
from shoal.config import job_pb2
from shoal.frontend.keras import (
    LRN2D,
    RBM,
    SGD,
    AdaGrad,
    Autoencoder,
    AvgPooling2D,
    Cluster,
    Convolution2D,
    Dense,
    Dropout,
    Energy,
    MaxPooling2D,
    Sequential,
    Store,
)

QUIET = {"log": lambda *a: None}


def stores(mnist_dir, scale="std"):
    norm = {"mean_value": 127.5, "std_value": 127.5} if scale == "std" else {"std_value": 255.0}
    return Store(mnist_dir / "train_data.bin", batch_size=64, **norm), Store(mnist_dir / "test_data.bin", batch_size=100, **norm)


def mlp(workspace, cluster=None):
    m = Sequential("mlp", workspace=workspace)
    m.add(Dense(64, init="uniform", activation="relu", w_low=-0.1, w_high=0.1))
    m.add(Dense(10, init="uniform", activation="softmax", w_low=-0.1, w_high=0.1))
    m.compile(loss="categorical_crossentropy", optimizer=SGD(lr=0.05, momentum=0.9), cluster=cluster)
    return m


def test_sequential_mlp_learns_mnist_and_evaluates_its_checkpoint(mnist_dir, tmp_path):
    train, test = stores(mnist_dir)
    m = mlp(tmp_path / "ws")
    history = m.fit(train, nb_epoch=150, test_data=test, **QUIET)
    assert sorted(k for k in history if k != "test") == list(range(0, 150, 15))
    assert history[135]["loss"] < 0.5 * history[0]["loss"]
    (step, metrics), = m.evaluate(test, test_steps=20, **QUIET).items()
    assert step == 150 and metrics["accuracy"] > 0.7  # chance: 0.1
    assert metrics == pytest.approx(history["test"][150], rel=0.1)


@pytest.mark.parametrize("workers, device", [(2, None), (3, None), (2, ["cpu:0", "cpu:1"])])
def test_a_model_runs_under_any_synchronous_cluster_with_the_same_params(mnist_dir, tmp_path, workers, device):
    """SINGA's fit(device=[...]) too: workers on two devices (replicas, tree reduction)."""
    train, _ = stores(mnist_dir)
    mlp(tmp_path / "one").fit(train, nb_epoch=6, **QUIET)
    group = mlp(tmp_path / "group", Cluster(nworkers_per_group=workers, nworkers_per_procs=workers))
    group.fit(train, nb_epoch=6, device=device, **QUIET)
    one, group = (ckpt_io.load(ckpt_io.latest(tmp_path / n)).params for n in ("one", "group"))
    for name in one:
        torch.testing.assert_close(group[name], one[name], rtol=1e-5, atol=1e-6)


def test_energy_stack_initialises_an_autoencoder_that_fine_tuning_improves(mnist_dir, tmp_path):
    train, test = stores(mnist_dir, scale="unit")
    e = Energy("rbm", workspace=tmp_path / "rbm")
    e.add(RBM(64)).add(RBM(32)).add(RBM(8, gaussian=True, lr=0.01))
    e.compile()
    stack = e.fit(train, nb_epoch=40, test_data=test, **QUIET)
    for k in (1, 2, 3):
        errors = [m["Squared Error"] for m in stack[k]["test"].values()]
        assert errors[-1] < errors[0]
    ae = Sequential("ae", workspace=tmp_path / "ae")
    ae.add(Autoencoder([64, 32, 8], out_dim=784))
    ae.compile(loss="mean_squared_error", optimizer=AdaGrad(lr=0.01))
    before = ae.job(train, test, nb_epoch=100, test_steps=10, test_freq=100, checkpoint_path=e.checkpoints())
    loaded = api.evaluate(before, workspace=tmp_path / "before", **QUIET)["loss"]
    history = ae.fit(train, nb_epoch=100, test_data=test, test_freq=100, checkpoint_path=e.checkpoints(), **QUIET)
    assert history["test"][100]["loss"] < 0.9 * loaded


def test_every_layer_writes_a_job_that_validates(mnist_dir):
    m = Sequential("cnn")
    for layer in (Convolution2D(8, 5, pad=2, activation="relu"), MaxPooling2D(2, 2), LRN2D(3), Convolution2D(8, 3), AvgPooling2D(2, 2), Dropout(0.2), Dense(10, activation="softmax")):
        m.add(layer)
    m.compile(optimizer=SGD(lr=0.01, lr_type="manual", step=(0, 100), step_lr=(0.01, 0.001)), topk=2)
    train = Store(mnist_dir / "train_data.bin", shape=(1, 28, 28))
    job, _ = api.as_job(m.job(train, nb_epoch=10))
    types = [job_pb2.LayerType.Name(layer.type) for layer in job.neuralnet.layer]
    assert types == ["kRecordInput", "kConvolution", "kActivation", "kPooling", "kLRN", "kConvolution", "kPooling", "kDropout", "kInnerProduct", "kSoftmaxLoss"]
    assert job.neuralnet.layer[-1].softmaxloss_conf.topk == 2 and list(job.updater.learning_rate.fixedstep_conf.step) == [0, 100]


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: Sequential("m").fit(Store("x"), **QUIET), "call compile"),
        (lambda: Sequential("m").compile(loss="hinge"), "loss must be one of"),
        (lambda: Dense(3, activation="swish").confs(1, "data"), "activation must be one of"),
        (lambda: Dense(3, w_std=0.1, std=2), "unexpected argument 'std'"),
        (lambda: SGD(lr_type="cosine"), "lr_type must be"),
    ],
)
def test_mistakes_are_named(build, message):
    with pytest.raises((ValueError, TypeError), match=message):
        build()
