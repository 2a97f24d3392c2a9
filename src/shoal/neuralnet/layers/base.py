"""The Layer contract every layer type implements.

A layer is one named node of a NeuralNet. It computes with torch ops and
autograd does its backward pass. It knows nothing about workers, servers or
partitions: the partitioner hands it a (possibly narrower) LayerProto and a
(possibly smaller) batch, and it computes the same function.

Shapes are *per sample* (the batch dimension is left out), so one layer object
works for any batch share.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, ClassVar, Optional, Sequence, Union

import torch

from shoal.config.job_pb2 import LayerProto, kTrain
from shoal.errors import ShoalError

Shape = tuple[int, ...]
# A layer returns its output, or (output, aux) where aux travels with the
# output as SINGA's aux_data does (labels of a batch, next-char ids, ...).
LayerResult = Union[torch.Tensor, tuple[torch.Tensor, Optional[torch.Tensor]]]


class LayerConfigError(ShoalError, ValueError):
    """A layer's configuration does not fit its sources (shape, missing field)."""


@dataclass
class Context:
    """What a layer may read besides its inputs and params during one pass."""

    phase: int = kTrain
    # every random draw of a layer (dropout masks, sampling) comes from here
    generator: Optional[torch.Generator] = None
    # data fed to input layers for this pass, by layer name: (data, labels)
    feeds: dict = field(default_factory=dict)
    # metric sink: report(name, value, count) with value averaged over count samples: a number or a 0-d tensor
    # (a loss stays on its device until shown: report.metrics.MetricWindow)
    report: Callable[[str, Union[float, torch.Tensor], int], None] = lambda name, value, count: None
    device: torch.device = torch.device("cpu")
    # sampling: the previous pass's outputs by layer name (a recurrent layer's last state,
    # an RNNDummy's dynamic source); None in training and ordinary evaluation
    carry: Optional[dict] = None
    # (offset, share, global batch) of this worker's rows within the group's batch:
    # per-sample random draws are made for the whole batch (see layers.common.draw)
    rows: Optional[tuple[int, int, int]] = None
    # the rows of each worker's part of the group's batch (a partitioned group): a kSlice on
    # the batch dimension cuts by them, so its parts line up with the input layers' shares
    batch_shares: Optional[list[int]] = None


class Layer:
    """Base class. Subclasses set `self.shape` in __init__ and implement forward."""

    # 'input' | 'neuron' | 'loss' | 'output' | 'connection'
    category: ClassVar[str] = "neuron"
    # True for Convolution/InnerProduct: every output unit reads every input
    # unit (SINGA's kOneToAll), which decides where the partitioner slices.
    one_to_all: ClassVar[bool] = False
    # True when each output feature (the first per-sample axis: a unit, a channel) depends
    # only on the same input feature: the layer can run on a slice of its source's features
    feature_local: ClassVar[bool] = False
    # True when forward draws random numbers in training (dropout masks, random crops)
    draws_random: ClassVar[bool] = False
    # True for a layer computing a whole torch module (shoal.fit): shoal cannot cut its features, only its batch
    opaque: ClassVar[bool] = False
    # how many leading srclayers forward() reads (None: all); the others are feedback
    # edges of an undirected model, outside the DAG, handed to close_loop
    forward_sources: ClassVar[Optional[int]] = None
    # a layer reading its labels as class ids 0 .. label_classes-1 sets this (softmax loss, accuracy)
    label_classes: Optional[int] = None
    # an input layer: (the layer reading its labels as class ids, its class count), set by the net
    label_reader: Optional[tuple[str, int]] = None
    # an input layer: how many consecutive micro-batches a worker's share is computed in (gradient accumulation)
    micro_batches: int = 1

    def __init__(self, conf: LayerProto, src_shapes: Sequence[Shape]):
        self.conf = conf
        self.name = conf.name
        self.src_shapes = [tuple(s) for s in src_shapes]
        self.shape: Shape = self.src_shapes[0] if self.src_shapes else ()

    def param_shapes(self) -> list[Shape]:
        """Shapes of the params this layer needs, in the order of conf.param."""
        return []

    def narrowed(self, features: int) -> Optional[tuple[LayerProto, list[int]]]:
        """For a one-to-all layer: a copy of conf computing only `features` of the outputs, and
        for each param the axis that holds the outputs (None: the layer cannot split its outputs)."""
        return None

    def measured_costs(self):
        """An opaque layer's measured costs per sample (planning/module_costs.ModuleCosts: a shoal.fit module, whose
        inside the cost model cannot see), or None: the cost model derives them from the layer's type and shapes."""
        return None

    def param_trainable(self) -> list[bool]:
        """Which params an updater trains (False: statistics the layer updates itself, e.g. batch norm's)."""
        return [True] * len(self.param_shapes())

    def forward(
        self,
        xs: list[torch.Tensor],
        params: list[torch.Tensor],
        labels: list[Optional[torch.Tensor]],
        ctx: Context,
    ) -> LayerResult:
        raise NotImplementedError

    def close_loop(self, xs: list[torch.Tensor], feedback: list[torch.Tensor], params: list[torch.Tensor], ctx: Context) -> None:
        """Outside training, after the forward pass: see the feedback sources' outputs (layers with feedback edges)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, shape={self.shape})"
