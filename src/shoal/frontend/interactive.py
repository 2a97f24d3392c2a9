"""SINGA 0.3's interactive training calls on shoal.frontend.keras layers (its `train_mnist.py` style).

    image, label = ImageInput(28, 28), LabelInput()
    layers = [Dense(2500, init="uniform", activation="stanh"), ..., Dense(10, init="uniform")]
    loss, sgd = Loss("softmaxloss"), SGD(lr=0.001, lr_type="step")
    for step in range(1000):
        h = image.feed(x)
        label.feed(y)
        for layer in layers:
            h = layer.compute_feature(h)
        loss.compute_feature(h, label)
        loss.compute_gradient()              # backward through every layer that led to the loss
        for layer in layers:
            sgd.update(step, layer)          # the job's updater and LR schedule; consumes the gradient

A layer computes with the shoal.neuralnet.layers classes a job builds from its LayerProtos (`confs`), so
it computes what the layer computes in a job. Its params live in an `InteractiveNet`: the one of
the Sequential model it was added to, else one shared by all stand-alone layers of the process.
A net initialises params in the order its layers first run, from a generator seeded as a job's
(`seed`), so a model run interactively starts from the params `shoal.train` starts from.

SINGA's CamelCase names (ComputeFeature, ComputeGradient, GetParams, SetParams, Feed, Update,
UpdateParams) are aliases of the snake_case methods.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np
import torch

from shoal.config import job_pb2
from shoal.neuralnet.layers import Context, Layer, layer_class
from shoal.neuralnet.params import ParamInfo, ParamStore
from shoal.neuralnet.updaters import make_updater

PHASES = {"train": job_pb2.kTrain, "test": job_pb2.kTest}
LOSS_LAYERS = {
    "softmaxloss": job_pb2.kSoftmaxLoss,
    "categorical_crossentropy": job_pb2.kSoftmaxLoss,
    "euclideanloss": job_pb2.kEuclideanLoss,
    "mean_squared_error": job_pb2.kEuclideanLoss,
}
ArrayLike = Union[torch.Tensor, np.ndarray, list]


class InteractiveNet:
    """The params of interactively run layers, kept as one job's net keeps them.

    Params are initialised when their layer first runs, in that order, from a generator seeded
    with `seed` (a job's first net does the same in layer order); forward passes draw (dropout
    masks) from a second generator seeded seed + 1, as a job's worker 0 of group 0.
    """

    def __init__(self, seed: int = 0):
        self.store = ParamStore()
        self.init_generator = torch.Generator().manual_seed(seed)
        self.generator = torch.Generator().manual_seed(seed + 1)
        self.layers_built = 0  # stand-alone layers take the next index: params w1, b1, w2, ...

    def next_index(self) -> int:
        self.layers_built += 1
        return self.layers_built

    def declare(self, layer: Layer) -> list[str]:
        """Create (or find, when shared) the layer's params; return their owner names."""
        names = []
        for i, (shape, trainable) in enumerate(zip(layer.param_shapes(), layer.param_trainable())):
            conf = layer.conf.param[i] if i < len(layer.conf.param) else job_pb2.ParamProto()
            if not conf.name:  # as a job's net names a param the conf leaves unnamed
                conf = job_pb2.ParamProto(name=f"{layer.name}/p{i}")
            name = self.store.declare(conf, tuple(shape), self.init_generator, trainable)
            self.store.values[name].requires_grad_(trainable)
            names.append(name)
        return names

    def params(self) -> dict[str, np.ndarray]:
        return {name: _array(value) for name, value in self.store.values.items()}


_DEFAULT_NET: Optional[InteractiveNet] = None


def default_net() -> InteractiveNet:
    """The net of layers run without a model (created on first use, seed 0)."""
    global _DEFAULT_NET
    if _DEFAULT_NET is None:
        _DEFAULT_NET = InteractiveNet()
    return _DEFAULT_NET


def _array(value: torch.Tensor) -> np.ndarray:
    return value.detach().cpu().numpy().copy()


def _tensor(data: ArrayLike) -> torch.Tensor:
    """Arrays become tensors; floating point data becomes float32 (the dtype of params)."""
    t = data if isinstance(data, torch.Tensor) else torch.as_tensor(np.asarray(data))
    return t.float() if t.is_floating_point() and t.dtype != torch.float32 else t


class Source:
    """Something a layer's compute_feature may read: its `output`, with `aux` (labels) alongside."""

    output: Optional[torch.Tensor] = None
    aux: Optional[torch.Tensor] = None


def _source(src) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(data, labels) of one argument of compute_feature: a layer, a tensor or an array.

    A tensor or array of integers is labels (a loss reads them); other data carries none.
    """
    if isinstance(src, Source):
        if src.output is None:
            raise ValueError(f"{type(src).__name__} has no output yet: feed() it or run its compute_feature() first")
        return src.output, src.aux
    t = _tensor(src)
    return t, (t if not t.is_floating_point() else None)


class ImageInput(Source):
    """SINGA's ImageInput(height, width, nb_channel): feed(images) is the batch as (B, channels, height, width) float32."""

    def __init__(self, height: int, width: int, channels: int = 1):
        self.sample_shape = (channels, height, width)

    def feed(self, images: ArrayLike) -> torch.Tensor:
        x = _tensor(images).float()
        per_sample = int(np.prod(self.sample_shape))
        if x.numel() == 0 or x.numel() % per_sample:
            raise ValueError(f"ImageInput{self.sample_shape}: got {tuple(x.shape)}, not a batch of {per_sample}-value images")
        self.output, self.aux = x.reshape((-1,) + self.sample_shape), None
        return self.output

    Feed = feed


class LabelInput(Source):
    """SINGA's LabelInput: feed(labels) is the batch's integer class labels, which a loss reads."""

    def feed(self, labels: ArrayLike) -> torch.Tensor:
        self.output = self.aux = _tensor(labels).reshape(-1).long()
        return self.output

    Feed = feed


@dataclass
class _Built:
    """A model layer built for per-sample input shapes: its shoal layers (e.g. kInnerProduct, then
    kSTanh), each with its params' owner names, and their latest outputs."""

    net: InteractiveNet
    src_shapes: list[tuple[int, ...]]
    layers: list[tuple[Layer, list[str]]] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)


@dataclass
class _LayerState:
    net: Optional[InteractiveNet] = None  # None until attached to a model or first run
    index: Optional[int] = None  # the layer's position in its model: its params are w<index>, b<index>
    built: Optional[_Built] = None
    output: Optional[torch.Tensor] = None
    aux: Optional[torch.Tensor] = None
    metrics: dict[str, float] = field(default_factory=dict)


class Interactive(Source):
    """SINGA 0.3's layer calls for a shoal.frontend.keras layer; the subclass's `confs(index, src)` gives its LayerProtos.

    State is created on first use, so the dataclass layers keep their fields and equality.
    """

    def _state(self) -> _LayerState:
        if "_interactive" not in self.__dict__:
            self.__dict__["_interactive"] = _LayerState()
        return self.__dict__["_interactive"]

    def attach(self, net: InteractiveNet, index: int) -> None:
        """Keep this layer's params in `net` under the names of layer `index` (a model's add() calls this)."""
        state = self._state()
        if state.built is not None and state.built.net is not net:
            raise ValueError(f"{type(self).__name__} has already run with other params; add a new layer to the model")
        state.net, state.index = net, index

    @property
    def output(self) -> Optional[torch.Tensor]:
        return self._state().output

    @property
    def aux(self) -> Optional[torch.Tensor]:
        return self._state().aux

    @property
    def metrics(self) -> dict[str, float]:
        """What the last compute_feature reported (a loss: `loss`, `accuracy`)."""
        return dict(self._state().metrics)

    def _built(self, src_shapes: list[tuple[int, ...]]) -> _Built:
        state = self._state()
        built = state.built
        if built is not None:
            if built.src_shapes != src_shapes:
                raise ValueError(f"{type(self).__name__} was built for inputs of per-sample shape {built.src_shapes}, got {src_shapes}")
            return built
        net = state.net or default_net()
        index = state.index if state.index is not None else net.next_index()
        built = _Built(net, src_shapes)
        shapes = src_shapes
        for conf in self.confs(index, "input"):
            layer = layer_class(conf)(conf, shapes)
            built.layers.append((layer, net.declare(layer)))
            shapes = [tuple(layer.shape)]
        state.net, state.index, state.built = net, index, built
        return built

    def compute_feature(self, *srcs, phase: str = "train") -> torch.Tensor:
        """Forward on the sources (layers, tensors or arrays) and return the output; phase 'train' or 'test'."""
        if phase not in PHASES:
            raise ValueError(f"phase must be 'train' or 'test', not {phase!r}")
        if not srcs:
            raise ValueError(f"{type(self).__name__}.compute_feature needs its source(s)")
        xs, auxes = map(list, zip(*(_source(s) for s in srcs)))
        built = self._built([tuple(x.shape[1:]) for x in xs])
        metrics: dict[str, float] = {}
        ctx = Context(phase=PHASES[phase], generator=built.net.generator, report=lambda name, value, count: metrics.__setitem__(name, float(value)))
        values = built.net.store.values
        built.outputs = []
        with torch.set_grad_enabled(phase == "train"):
            for layer, params in built.layers:
                result = layer.forward(xs, [values[p] for p in params], auxes, ctx)
                y, aux = result if isinstance(result, tuple) else (result, auxes[0] if auxes else None)
                built.outputs.append(y)
                xs, auxes = [y], [aux]
        state = self._state()
        state.output, state.aux, state.metrics = y, aux, metrics
        return y

    def feature_before_softmax(self) -> torch.Tensor:
        """The last output before a final softmax (kSoftmaxLoss applies the softmax itself), else the output."""
        built = self._state().built
        if built is None or not built.outputs:
            raise ValueError(f"{type(self).__name__} has not run yet")
        last = built.layers[-1][0]
        return built.outputs[-2] if last.conf.type == job_pb2.kSoftmax and len(built.outputs) > 1 else built.outputs[-1]

    def trainable_params(self) -> list[tuple[torch.Tensor, ParamInfo]]:
        """(value, info) of each param the updater trains (an empty list before the layer has run)."""
        built = self._state().built
        if built is None:
            return []
        store = built.net.store
        return [(store.values[n], store.info[n]) for _, names in built.layers for n in names if store.info[n].trainable]

    def _param_names(self) -> list[str]:
        built = self._state().built
        if built is None:
            raise ValueError(f"{type(self).__name__} has no params yet: they are made for its input's shape when compute_feature first runs")
        return [n for _, names in built.layers for n in names]

    def get_params(self) -> list[np.ndarray]:
        """Copies of the params in the layer's order (SINGA's weight, then bias)."""
        names = self._param_names()
        values = self._state().built.net.store.values
        return [_array(values[n]) for n in names]

    def set_params(self, *arrays: ArrayLike) -> None:
        """Overwrite the params in the layer's order (as get_params returns them)."""
        names = self._param_names()
        if len(arrays) != len(names):
            raise ValueError(f"{type(self).__name__} has {len(names)} params ({', '.join(names)}), got {len(arrays)} arrays")
        set_values(self._state().built.net.store, dict(zip(names, arrays)))

    def update_params(self, step: int, updater: "Updater") -> None:
        """SINGA's UpdateParams(step, updater): updater.update(step, self)."""
        updater.update(step, self)

    ComputeFeature = compute_feature
    GetParams = get_params
    SetParams = set_params
    UpdateParams = update_params


def set_values(store: ParamStore, arrays: dict[str, ArrayLike]) -> None:
    """Copy arrays into a store's params by name, shapes checked."""
    for name, array in arrays.items():
        if name not in store.values:
            raise KeyError(f"no param named {name!r} (params: {', '.join(store.values)})")
        value, new = store.values[name], _tensor(array)
        if tuple(new.shape) != tuple(value.shape):
            raise ValueError(f"param {name!r} has shape {tuple(value.shape)}, got {tuple(new.shape)}")
        with torch.no_grad():
            value.copy_(new)


class Loss(Interactive):
    """SINGA's Loss layer: 'softmaxloss' (= categorical_crossentropy) or 'euclideanloss' (= mean_squared_error).

    compute_feature(scores, labels) returns the batch's loss (`metrics` has the loss and
    accuracy); compute_gradient() back-propagates it into every param that led to it.
    """

    def __init__(self, type: str = "softmaxloss", topk: int = 1):
        if type not in LOSS_LAYERS:
            raise ValueError(f"loss must be one of {', '.join(LOSS_LAYERS)}, not {type!r}")
        self.type, self.topk = type, topk

    def confs(self, index: int, src: str) -> list[job_pb2.LayerProto]:
        conf = job_pb2.LayerProto(name=f"loss{index}", type=LOSS_LAYERS[self.type], srclayers=[src, "labels"])
        if conf.type == job_pb2.kSoftmaxLoss:
            conf.softmaxloss_conf.topk = self.topk
        return [conf]

    def compute_gradient(self) -> None:
        loss = self.output
        if loss is None or not loss.requires_grad:
            raise ValueError("Loss.compute_gradient: run compute_feature(..., phase='train') on this loss first")
        loss.backward()

    ComputeGradient = compute_gradient


class Updater:
    """A job's updater (UpdaterProto: SGD, AdaGrad, ... with its learning-rate schedule) on layers' params.

    update(step, *layers) applies shoal.neuralnet.updaters' update to each trainable param with a gradient,
    with the param's lr_scale and wd_scale, and consumes the gradient (the next backward starts
    from zero, as a job's step does). Updater state (momentum history, ...) is kept per param.
    """

    def __init__(self, conf: job_pb2.UpdaterProto):
        self.conf = conf
        self.rule = make_updater(conf)
        self.slots: dict[int, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}  # id(param) -> (param, its state)

    def update(self, step: int, *layers: Interactive) -> None:
        for layer in layers:
            for value, info in layer.trainable_params():
                if value.grad is None:  # no loss reached it, or a shared param already updated
                    continue
                _, state = self.slots.setdefault(id(value), (value, self.rule.init_state(value)))
                self.rule.update(step, value, value.grad, state, info.lr_scale, info.wd_scale)
                value.grad = None

    Update = update


class InteractiveModel:
    """SINGA 0.3's calls on a whole model (a Sequential: `layers`, `net`, compiled `loss`, `topk`, `optimizer`).

        loss = m.compute_feature(x, y)      # x through every layer, then the compiled loss; m.metrics
        m.compute_gradient()
        m.update(step)                      # the compiled updater on every layer
        scores = m.compute_feature(x, phase="test")      # without targets: the last layer's output

    With categorical_crossentropy a final softmax is left to the loss, as in the job the model
    writes; mean_squared_error compares with the target given (for an autoencoder, x itself).
    """

    def loss_layer(self) -> Loss:
        if self.loss is None:
            raise ValueError(f"model {self.name!r}: call compile() before computing a loss")
        layer = self.__dict__.get("_loss_layer")
        if layer is None or (layer.type, layer.topk) != (self.loss, self.topk):
            layer = self.__dict__["_loss_layer"] = Loss(self.loss, self.topk)
            layer.attach(self.net, len(self.layers) + 1)
        return layer

    def compute_feature(self, data, *targets, phase: str = "train") -> torch.Tensor:
        h = data
        for layer in self.layers:
            h = layer.compute_feature(h, phase=phase)
        if not targets:
            return h
        loss = self.loss_layer()
        scores = self.layers[-1].feature_before_softmax() if LOSS_LAYERS[self.loss] == job_pb2.kSoftmaxLoss else h
        return loss.compute_feature(scores, *targets, phase=phase)

    def compute_gradient(self) -> None:
        self.loss_layer().compute_gradient()

    def update(self, step: int) -> None:
        if self.optimizer is None:
            raise ValueError(f"model {self.name!r}: call compile() before update()")
        self.optimizer.update(step, *self.layers)

    @property
    def metrics(self) -> dict[str, float]:
        """What the loss reported at the last compute_feature with targets (loss, accuracy)."""
        return self.loss_layer().metrics

    def get_params(self) -> dict[str, np.ndarray]:
        """Copies of every param, by name (w1, b1, ... as in the model's job and its checkpoints)."""
        return self.net.params()

    def set_params(self, params: dict[str, ArrayLike]) -> None:
        """Overwrite params by name, e.g. with a checkpoint's (shoal.neuralnet.checkpoint.load(path).params)."""
        set_values(self.net.store, params)

    ComputeFeature = compute_feature
    ComputeGradient = compute_gradient
    Update = update
    GetParams = get_params
    SetParams = set_params
