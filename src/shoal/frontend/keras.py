"""Keras-like models that write SINGA jobs (SINGA 0.x's tool/python `singa.model`, in shoal's style).

    from shoal.frontend.keras import SGD, Cluster, Dense, Sequential, Store

    m = Sequential("mlp")
    for n in (2500, 2000, 1500, 1000, 500):
        m.add(Dense(n, init="uniform", activation="stanh"))
    m.add(Dense(10, init="uniform", activation="softmax"))
    m.compile(loss="categorical_crossentropy", optimizer=SGD(lr=0.001, lr_type="step"), cluster=Cluster())
    train = Store("examples/mnist/data/train_data.bin", batch_size=64, shape=784, std_value=127.5, mean_value=127.5)
    m.fit(train, nb_epoch=1000)                     # {step: {"loss": ..., "accuracy": ...}}

A model is only a way to write a JobProto (`Sequential.job`): training goes through shoal.train,
so a model runs under any cluster configuration, like a job file. `Energy` stacks RBMs and
trains them greedily by contrastive divergence, each on the features of those below it.

Layers, and a Sequential model as a whole, also run interactively, as SINGA 0.3's Python
layers do: compute_feature / compute_gradient / get_params / set_params, an updater's
update(step, layer), ImageInput / LabelInput feeds (shoal.frontend.interactive).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shoal.config import job_pb2
from shoal.frontend.interactive import ImageInput, Interactive, InteractiveModel, InteractiveNet, LabelInput, Loss, Updater  # noqa: F401 (re-exported)

__all__ = [
    "Store", "param", "SGD", "AdaGrad", "Cluster", "Dense", "Activation", "Dropout", "Convolution2D", "MaxPooling2D",
    "AvgPooling2D", "LRN2D", "Autoencoder", "RBM", "Sequential", "Energy", "ImageInput", "LabelInput", "Loss", "Updater",
]

ACTIVATIONS = {
    "relu": {"type": job_pb2.kActivation, "activation_conf": job_pb2.ActivationProto(type=job_pb2.RELU)},
    "tanh": {"type": job_pb2.kActivation, "activation_conf": job_pb2.ActivationProto(type=job_pb2.TANH)},
    "stanh": {"type": job_pb2.kSTanh},
    "sigmoid": {"type": job_pb2.kSigmoid},
    "softmax": {"type": job_pb2.kSoftmax},
}
LOSSES = {"categorical_crossentropy": job_pb2.kSoftmaxLoss, "mean_squared_error": job_pb2.kEuclideanLoss}


# -- data, params, updaters, cluster ---------------------------------------------------------
@dataclass
class Store:
    """A record store (SINGA's `Store`): path, batch size, sample shape and normalisation."""

    path: str | Path
    batch_size: int = 64
    shape: int | tuple[int, ...] = 784
    backend: str = "kvfile"
    mean_value: float | None = None
    std_value: float | None = None
    random_skip: int = 0

    def conf(self, batch_size: int | None = None) -> job_pb2.StoreProto:
        shape = [self.shape] if isinstance(self.shape, int) else list(self.shape)
        conf = job_pb2.StoreProto(backend=self.backend, path=str(self.path), batchsize=[batch_size or self.batch_size], shape=shape)
        if self.mean_value is not None:
            conf.mean_value = self.mean_value
        if self.std_value is not None:
            conf.std_value = self.std_value
        if self.random_skip:
            conf.random_skip = self.random_skip
        return conf


def param(name: str, init: str = "gaussian", lr: float = 1, wd: float = 1, **values) -> job_pb2.ParamProto:
    """A ParamProto: init 'gaussian' (mean, std), 'uniform' (low, high) or 'constant' (value)."""
    kinds = {"gaussian": job_pb2.kGaussian, "uniform": job_pb2.kUniform, "constant": job_pb2.kConstant}
    if init not in kinds:
        raise ValueError(f"param {name}: init must be one of {', '.join(kinds)}, not {init!r}")
    return job_pb2.ParamProto(name=name, lr_scale=lr, wd_scale=wd, init=job_pb2.ParamGenProto(type=kinds[init], **values))


def weight_and_bias(prefix: str, index: int, init: str, kwargs: dict) -> list[job_pb2.ParamProto]:
    """SINGA's defaults (weight gaussian(0, 0.01) or the layer's init, bias constant 0), then w_*/b_* keyword overrides."""
    w = {"init": init, **({"std": 0.01} if init == "gaussian" else {})}
    b = {"init": "constant", "value": 0.0}
    for key, value in kwargs.items():
        if key.startswith("w_"):
            w[key[2:]] = value
        elif key.startswith("b_"):
            b[key[2:]] = value
        else:
            raise TypeError(f"unexpected argument {key!r} (param options start with w_ or b_)")
    return [param(f"w{prefix}{index}", **w), param(f"b{prefix}{index}", **b)]


def SGD(lr: float = 0.01, momentum: float = 0.0, decay: float = 0.0, lr_type: str | None = None, step=(), step_lr=()) -> Updater:
    """SINGA's SGD helper: lr_type None (fixed), 'step' (×0.997 every 60 steps), 'manual' (step_lr from each of `step`).
    The Updater's `conf` is the job's UpdaterProto; its update(step, layer) trains layers interactively."""
    conf = job_pb2.UpdaterProto(type=job_pb2.kSGD, momentum=momentum, weight_decay=decay)
    conf.learning_rate.base_lr = lr
    if lr_type == "step":
        conf.learning_rate.type = job_pb2.kStep
        conf.learning_rate.step_conf.change_freq, conf.learning_rate.step_conf.gamma = 60, 0.997
    elif lr_type == "manual":
        conf.learning_rate.type = job_pb2.kFixedStep
        conf.learning_rate.fixedstep_conf.step.extend(step)
        conf.learning_rate.fixedstep_conf.step_lr.extend(step_lr)
    elif lr_type is None:
        conf.learning_rate.type = job_pb2.kFixed
    else:
        raise ValueError(f"lr_type must be None, 'step' or 'manual', not {lr_type!r}")
    return Updater(conf)


def AdaGrad(lr: float = 0.01, decay: float = 0.0) -> Updater:
    conf = job_pb2.UpdaterProto(type=job_pb2.kAdaGrad, weight_decay=decay)
    conf.learning_rate.base_lr, conf.learning_rate.type = lr, job_pb2.kFixed
    return Updater(conf)


def as_updater(optimizer: Updater | job_pb2.UpdaterProto) -> Updater:
    """compile() takes an Updater (SGD(), AdaGrad()) or any UpdaterProto (kAdam, kRMSProp, ...)."""
    return optimizer if isinstance(optimizer, Updater) else Updater(optimizer)


def Cluster(workspace: str | Path | None = None, **fields) -> job_pb2.ClusterProto:
    """A ClusterProto: Cluster("ws", nworkers_per_group=2, nworkers_per_procs=2) is a 2-thread synchronous group."""
    conf = job_pb2.ClusterProto(**fields)
    if workspace is not None:
        conf.workspace = str(workspace)
    return conf


# -- layers ---------------------------------------------------------------------------------
class Dense(Interactive):
    """kInnerProduct with `units` outputs, then an optional activation (relu, tanh, stanh, sigmoid, softmax).
    Param options: w_init… / b_…, e.g. w_std=0.1, b_lr=2 (lr and wd are the lr_scale and wd_scale)."""

    def __init__(self, units: int, init: str = "gaussian", activation: str | None = None, **params):
        self.units, self.init, self.activation, self.params = units, init, activation, params
        weight_and_bias("", 0, init, params)  # check the param options now, not at fit()

    def confs(self, index: int, src: str) -> list[job_pb2.LayerProto]:
        fc = job_pb2.LayerProto(name=f"fc{index}", type=job_pb2.kInnerProduct, srclayers=[src])
        fc.innerproduct_conf.num_output = self.units
        fc.param.extend(weight_and_bias("", index, self.init, self.params))
        return [fc] + (Activation(self.activation).confs(index, fc.name) if self.activation else [])


@dataclass
class Activation(Interactive):
    type: str

    def confs(self, index: int, src: str) -> list[job_pb2.LayerProto]:
        if self.type not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, not {self.type!r}")
        return [job_pb2.LayerProto(name=f"{self.type}{index}", srclayers=[src], **ACTIVATIONS[self.type])]


@dataclass
class Dropout(Interactive):
    ratio: float = 0.5

    def confs(self, index: int, src: str) -> list[job_pb2.LayerProto]:
        return [job_pb2.LayerProto(name=f"dropout{index}", type=job_pb2.kDropout, srclayers=[src], dropout_conf=job_pb2.DropoutProto(dropout_ratio=self.ratio))]


class Convolution2D(Interactive):
    """kConvolution: nb_filter kernels of kernel × kernel, then an optional activation."""

    def __init__(self, nb_filter: int, kernel: int = 3, stride: int = 1, pad: int = 0, init: str = "gaussian", activation: str | None = None, **params):
        self.nb_filter, self.kernel, self.stride, self.pad, self.init, self.activation, self.params = nb_filter, kernel, stride, pad, init, activation, params
        weight_and_bias("", 0, init, params)

    def confs(self, index: int, src: str) -> list[job_pb2.LayerProto]:
        conv = job_pb2.LayerProto(name=f"conv{index}", type=job_pb2.kConvolution, srclayers=[src])
        conv.convolution_conf.num_filters, conv.convolution_conf.kernel = self.nb_filter, self.kernel
        conv.convolution_conf.stride, conv.convolution_conf.pad = self.stride, self.pad
        conv.param.extend(weight_and_bias("", index, self.init, self.params))
        return [conv] + (Activation(self.activation).confs(index, conv.name) if self.activation else [])


@dataclass
class MaxPooling2D(Interactive):
    pool_size: int = 2
    stride: int = 2
    method: int = job_pb2.PoolingProto.MAX

    def confs(self, index: int, src: str) -> list[job_pb2.LayerProto]:
        conf = job_pb2.PoolingProto(kernel=self.pool_size, stride=self.stride, pool=self.method)
        return [job_pb2.LayerProto(name=f"pool{index}", type=job_pb2.kPooling, srclayers=[src], pooling_conf=conf)]


@dataclass
class AvgPooling2D(MaxPooling2D):
    method: int = job_pb2.PoolingProto.AVG


@dataclass
class LRN2D(Interactive):
    size: int = 5
    alpha: float = 1.0
    beta: float = 0.75
    knorm: float = 1.0

    def confs(self, index: int, src: str) -> list[job_pb2.LayerProto]:
        conf = job_pb2.LRNProto(local_size=self.size, alpha=self.alpha, beta=self.beta, knorm=self.knorm)
        return [job_pb2.LayerProto(name=f"lrn{index}", type=job_pb2.kLRN, srclayers=[src], lrn_conf=conf)]


class Autoencoder(Interactive):
    """An encoder of sigmoid layers hid_dims[0] … hid_dims[-1] (the last one linear, the code) and the
    mirrored decoder back to out_dim; with param_share the decoder reuses the encoder's weights
    transposed, named as the RBMs of an `Energy` stack (w1…, b12… encoder, b11… decoder) so that
    fit(checkpoint_path=<the Energy's checkpoints>) starts from them."""

    def __init__(self, hid_dims: list[int], out_dim: int = 784, activation: str = "sigmoid", param_share: bool = True):
        self.hid_dims, self.out_dim, self.activation, self.param_share = list(hid_dims), out_dim, activation, param_share

    def confs(self, index: int, src: str) -> list[job_pb2.LayerProto]:
        dims, n, out = [self.out_dim] + self.hid_dims, len(self.hid_dims), []
        for k in range(1, 2 * n + 1):
            encoder = k <= n
            j = k if encoder else 2 * n + 1 - k  # the RBM this layer's weight comes from
            fc = job_pb2.LayerProto(name=f"Inner{k}", type=job_pb2.kInnerProduct, srclayers=[src])
            fc.innerproduct_conf.num_output = dims[k] if encoder else dims[j - 1]
            fc.innerproduct_conf.transpose = not encoder and self.param_share
            w = param(f"w{j}" if encoder or not self.param_share else f"w{k}", std=0.01)
            if not encoder and self.param_share:
                w = job_pb2.ParamProto(name=f"w{k}", share_from=f"w{j}")
            fc.param.extend([w, param(f"b{j}{2 if encoder else 1}", init="constant", value=0.0)])
            out.append(fc)
            src = fc.name
            if k != n:  # the code layer is linear
                out += [job_pb2.LayerProto(name=f"{self.activation}{k}", srclayers=[src], **ACTIVATIONS[self.activation])]
                src = out[-1].name
        return out


@dataclass
class RBM:
    """One RBM of an `Energy` stack: out_dim hidden units (Gaussian with gaussian=True)."""

    out_dim: int
    gaussian: bool = False
    w_std: float = 0.1
    lr: float = 0.1


# -- models ---------------------------------------------------------------------------------
def _data_layers(train: Store | None, test: Store | None, batch_size: int | None) -> list[job_pb2.LayerProto]:
    if train is None and test is not None:  # test only: the same store in every phase's net
        return [job_pb2.LayerProto(name="data", type=job_pb2.kRecordInput, store_conf=test.conf(batch_size))]
    layers = []
    for store, phase in ((train, job_pb2.kTrain), (test, job_pb2.kTest)):
        if store is not None:
            layers.append(job_pb2.LayerProto(name="data", type=job_pb2.kRecordInput, store_conf=store.conf(batch_size), include=[phase]))
    return layers


def _history(records: list[dict], phase: str) -> dict[int, dict[str, float]]:
    keep = ("step", "phase", "time", "samples_per_sec", "mode") + (("samples",) if phase != "train" else ())  # a test's size, not a metric
    return {r["step"]: {k: v for k, v in r.items() if k not in keep} for r in records if r["phase"] == phase}


class Sequential(InteractiveModel):
    """Layers applied one after the other to the data; compile() picks the loss and the updater.

    `seed` is the job's seed: its params' initial values, random skips and dropout masks. Run
    interactively (compute_feature, ..., see InteractiveModel), the model starts from the same params.
    """

    def __init__(self, name: str, workspace: str | Path | None = None, seed: int = 0):
        self.name, self.layers, self.seed = name, [], seed
        self.workspace = Path(workspace) if workspace else Path(f"workspace/{name}")
        self.loss, self.updater, self.optimizer, self.cluster, self.topk = None, None, None, job_pb2.ClusterProto(), 1
        self.net = InteractiveNet(seed)

    def add(self, layer) -> Sequential:
        self.layers.append(layer)
        layer.attach(self.net, len(self.layers))  # the index job() gives it: the same param names
        return self

    def compile(self, loss: str = "categorical_crossentropy", optimizer: Updater | job_pb2.UpdaterProto | None = None, cluster: job_pb2.ClusterProto | None = None, topk: int = 1) -> None:
        if loss not in LOSSES:
            raise ValueError(f"loss must be one of {', '.join(LOSSES)}, not {loss!r}")
        self.optimizer = as_updater(optimizer or SGD())
        self.loss, self.updater, self.topk = loss, self.optimizer.conf, topk
        self.cluster = cluster or job_pb2.ClusterProto()

    def job(self, train: Store | None, test: Store | None = None, nb_epoch: int = 0, batch_size: int | None = None, alg: str = "bp", **fields) -> job_pb2.JobProto:
        """The JobProto this model trains with: train/test stores, nb_epoch = train_steps, any JobProto field."""
        if self.loss is None:
            raise ValueError(f"model {self.name!r}: call compile() before fit() or evaluate()")
        fields.setdefault("seed", self.seed)
        # SINGA's fit(device=[gpu ids]); shoal's device names ("cuda:0", "cpu:1") work too
        devices = [d if isinstance(d, str) else f"cuda:{d}" for d in fields.pop("device", None) or []]
        job = job_pb2.JobProto(name=self.name, train_steps=nb_epoch, device=devices, **fields)
        job.train_one_batch.alg = {"bp": job_pb2.kBP, "cd": job_pb2.kCD}[alg]
        job.updater.CopyFrom(self.updater)
        job.cluster.CopyFrom(self.cluster)
        if not job.cluster.workspace:
            job.cluster.workspace = str(self.workspace)
        layers = _data_layers(train, test, batch_size)
        src = "data"
        for index, layer in enumerate(self.layers, 1):
            confs = layer.confs(index, src)
            layers += confs
            src = confs[-1].name
        if self.loss == "categorical_crossentropy" and layers[-1].type == job_pb2.kSoftmax:
            src = layers.pop().srclayers[0]  # SoftmaxLoss applies the softmax itself, as SINGA's compile does
        loss = job_pb2.LayerProto(name="loss", type=LOSSES[self.loss], srclayers=[src, "data"])
        if self.loss == "categorical_crossentropy":
            loss.softmaxloss_conf.topk = self.topk
        job.neuralnet.layer.extend(layers + [loss])
        return job

    def fit(self, data: Store, nb_epoch: int = 100, test_data: Store | None = None, batch_size: int | None = None, log=print, **fields) -> dict[int, dict[str, float]]:
        """Train nb_epoch steps (SINGA's name for train_steps); {step: train metrics}, plus test ones under "test"."""
        from shoal.frontend import api

        fields.setdefault("disp_freq", max(1, nb_epoch // 10))
        if test_data is not None:
            fields.setdefault("test_steps", 10)
            fields.setdefault("test_freq", max(1, nb_epoch // 10))
        history = api.train(self.job(data, test_data, nb_epoch, batch_size, **fields), log=log)
        out = _history(history.records, "train")
        if test_data is not None:
            out["test"] = _history(history.records, "test")
        return out

    def evaluate(self, data: Store, batch_size: int | None = None, test_steps: int = 10, checkpoint_path: str | Path | None = None, log=print) -> dict[int, dict[str, float]]:
        """Test the trained model (its workspace's newest checkpoint, or checkpoint_path): {step: test metrics}."""
        from shoal.frontend import api
        from shoal.neuralnet import checkpoint as ckpt_io

        job, _ = api.as_job(self.job(None, data, batch_size=batch_size, test_steps=test_steps))  # as `shoal run script.py` sets it
        path = Path(checkpoint_path) if checkpoint_path else ckpt_io.latest(Path(job.cluster.workspace))
        step = ckpt_io.load(path).step if path else 0
        return {step: api.evaluate(job, checkpoint=path, log=log)}


class Energy:
    """A stack of RBMs trained greedily by contrastive divergence (SINGA's examples/rbm as one model).

    RBM k trains on the features of RBMs 1 … k−1 (loaded from their checkpoints, not trained
    again), in workspace/rbm<k>. Param names follow examples/rbm: w<k>, visible bias b<k>1,
    hidden bias b<k>2, so an `Autoencoder` can start from the stack.
    """

    def __init__(self, name: str, workspace: str | Path | None = None):
        self.name, self.rbms = name, []
        self.workspace = Path(workspace) if workspace else Path(f"workspace/{name}")
        self.updater, self.cluster = None, job_pb2.ClusterProto()

    def add(self, rbm: RBM) -> Energy:
        self.rbms.append(rbm)
        return self

    def compile(self, optimizer: Updater | job_pb2.UpdaterProto | None = None, cluster: job_pb2.ClusterProto | None = None) -> None:
        self.updater, self.cluster = as_updater(optimizer or SGD(momentum=0.8, decay=0.0002)).conf, cluster or job_pb2.ClusterProto()

    def rbm_job(self, k: int, data: Store, nb_epoch: int, test_data: Store | None = None, **fields) -> job_pb2.JobProto:
        updater = job_pb2.UpdaterProto()
        updater.CopyFrom(self.updater or SGD(momentum=0.8, decay=0.0002).conf)
        updater.learning_rate.base_lr = self.rbms[k - 1].lr
        job = job_pb2.JobProto(name=f"{self.name}-rbm{k}", train_steps=nb_epoch, updater=updater, cluster=self.cluster, **fields)
        job.train_one_batch.alg = job_pb2.kCD
        job.cluster.workspace = str(self.workspace / f"rbm{k}")
        if k > 1:
            job.checkpoint_path.append(str(self.workspace / f"rbm{k - 1}"))
        dims, src = [None] + [r.out_dim for r in self.rbms], "data"
        layers = _data_layers(data, test_data, None)
        for j in range(1, k):
            fc = job_pb2.LayerProto(name=f"Inner{j}", type=job_pb2.kInnerProduct, srclayers=[src], param=[job_pb2.ParamProto(name=f"w{j}"), job_pb2.ParamProto(name=f"b{j}2")])
            fc.innerproduct_conf.num_output = dims[j]
            layers += [fc, job_pb2.LayerProto(name=f"Sigmoid{j}", type=job_pb2.kSigmoid, srclayers=[fc.name])]
            src = f"Sigmoid{j}"
        rbm = self.rbms[k - 1]
        conf = job_pb2.RBMProto(hdim=rbm.out_dim, gaussian=rbm.gaussian)
        vis = job_pb2.LayerProto(name="RBMVis", type=job_pb2.kRBMVis, srclayers=[src, "RBMHid"], rbm_conf=job_pb2.RBMProto(hdim=rbm.out_dim))
        vis.param.extend([param(f"w{k}", std=rbm.w_std), param(f"b{k}1", init="constant", wd=0, value=0.0)])
        hid = job_pb2.LayerProto(name="RBMHid", type=job_pb2.kRBMHid, srclayers=["RBMVis"], rbm_conf=conf)
        hid.param.extend([job_pb2.ParamProto(name=f"w{k}_", share_from=f"w{k}"), param(f"b{k}2", init="constant", wd=0, value=0.0)])
        job.neuralnet.layer.extend(layers + [vis, hid])
        return job

    def fit(self, data: Store, nb_epoch: int = 100, test_data: Store | None = None, log=print, **fields) -> dict[int, dict]:
        """Train every RBM nb_epoch steps, bottom up; {k: {step: metrics}} with "test" entries when test_data is given."""
        from shoal.frontend import api

        fields.setdefault("disp_freq", max(1, nb_epoch // 10))
        if test_data is not None:
            fields.setdefault("test_steps", 10)
            fields.setdefault("test_freq", max(1, nb_epoch // 2))
        out = {}
        for k in range(1, len(self.rbms) + 1):
            history = api.train(self.rbm_job(k, data, nb_epoch, test_data, **fields), log=log)
            out[k] = _history(history.records, "train") | ({"test": _history(history.records, "test")} if test_data else {})
        return out

    def checkpoints(self) -> list[str]:
        """checkpoint_path entries for a model that starts from the stack (e.g. an Autoencoder)."""
        return [str(self.workspace / f"rbm{k}") for k in range(1, len(self.rbms) + 1)]
