"""NeuralNet: the DAG of layers for one phase, and its forward pass.

Building a net is pure graph code (which layers, in which order, which
shapes, which params); running it is a loop over the nodes in topological
order. A layer that feeds several layers needs no explicit Split node:
autograd sums the gradients that flow back into a shared output, which is
exactly the semantics of SINGA's automatically inserted kSplit.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

import shoal.neuralnet.layers  # noqa: F401  (registers the built-in layer types)
from shoal.config import job_pb2
from shoal.config.validate import in_phase
from shoal.errors import ShoalError
from shoal.neuralnet.layers.base import Context, Layer, LayerConfigError
from shoal.neuralnet.layers.registry import layer_class
from shoal.neuralnet.params import ParamStore
from shoal.neuralnet.unroll import UnrollError, unroll

PHASE_NAMES = {job_pb2.kTrain: "train", job_pb2.kVal: "val", job_pb2.kTest: "test"}


class NetBuildError(ShoalError, ValueError):
    """The net cannot be built: `field_path` says where in the job it went wrong."""

    def __init__(self, field_path: str, message: str):
        super().__init__(f"{field_path}: {message}")
        self.field_path = field_path
        self.message = message


@dataclass
class Node:
    """One layer of a built net: its layer object, sources and param names."""

    name: str
    layer: Layer
    srcs: list[str]
    # owner names of the layer's params, in the layer's order
    params: list[str] = field(default_factory=list)
    # index of the LayerProto in job.neuralnet.layer (for error positions)
    conf_index: int = -1
    # sources the layer does not read in forward: the back edges of an undirected model (RBMVis <- RBMHid)
    feedback: list[str] = field(default_factory=list)

    @property
    def category(self) -> str:
        return self.layer.category


def forward_sources(conf: job_pb2.LayerProto) -> list[str]:
    """The srclayers a layer reads in forward; the rest are feedback edges, outside the DAG."""
    try:
        count = layer_class(conf).forward_sources
    except KeyError:  # unknown types are reported when the layer is built
        count = None
    return list(conf.srclayers if count is None else conf.srclayers[:count])


def topological_order(confs: list[job_pb2.LayerProto]) -> list[job_pb2.LayerProto]:
    """Layers ordered so every source comes before its consumers (stable: file order wins ties).

    Feedback edges (see `forward_sources`) are left out: SINGA writes an RBM as
    two layers that list each other, and only the visible → hidden edge is a
    data dependency.
    """
    by_name = {c.name: c for c in confs}
    order: list[job_pb2.LayerProto] = []
    state: dict[str, int] = {}  # 1 = visiting, 2 = done

    def visit(conf: job_pb2.LayerProto, path: list[str]) -> None:
        mark = state.get(conf.name)
        if mark == 2:
            return
        if mark == 1:
            cycle = path[path.index(conf.name):] + [conf.name]
            raise NetBuildError(f"neuralnet.layer[{conf.name}]", "cycle " + " -> ".join(cycle))
        state[conf.name] = 1
        for src in forward_sources(conf):
            if src not in by_name:
                raise NetBuildError(f"neuralnet.layer[{conf.name}].srclayers", f"{src!r} names no layer")
            visit(by_name[src], path + [conf.name])
        state[conf.name] = 2
        order.append(conf)

    for conf in confs:
        visit(conf, [])
    return order


def effective_layer_confs(net_conf: job_pb2.NetProto, phase: int) -> list[tuple[int, job_pb2.LayerProto]]:
    """(index in the file, conf) of the layers in `phase`, with net-level defaults applied."""
    out = []
    for index, conf in enumerate(net_conf.layer):
        if not in_phase(conf, phase):
            continue
        conf = job_pb2.LayerProto.FromString(conf.SerializeToString())
        if conf.partition_dim == -1:
            conf.partition_dim = net_conf.partition_dim
        out.append((index, conf))
    return out


class NeuralNet:
    """The layers of one phase, built from the job and bound to a ParamStore."""

    def __init__(self, net_conf: job_pb2.NetProto, phase: int, store: ParamStore, generator: torch.Generator):
        self.phase = phase
        self.store = store
        indexed = effective_layer_confs(net_conf, phase)
        try:
            unrolled = unroll([c for _, c in indexed], net_conf.unroll_len)
        except UnrollError as err:
            raise NetBuildError(err.field_path, err.message) from None
        file_index = {c.name: i for i, c in indexed}
        index_of = {name: file_index[layer] for name, layer in unrolled.source_layer.items()}
        self.nodes: list[Node] = []
        by_name: dict[str, Node] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        for conf in topological_order(unrolled.confs):
            where = f"neuralnet.layer[{index_of[conf.name]}]"
            srcs = forward_sources(conf)
            try:
                layer = layer_class(conf)(conf, [shapes[s] for s in srcs])
            except KeyError as err:
                raise NetBuildError(f"{where}.type", str(err.args[0])) from None
            except LayerConfigError as err:
                raise NetBuildError(where, str(err)) from None
            if any(size <= 0 for size in layer.shape):
                raise NetBuildError(where, f"layer {conf.name!r} would output shape {tuple(layer.shape)} per sample: every size must be > 0")
            shapes[conf.name] = tuple(layer.shape)
            first_copy = by_name.get(unrolled.origin[conf.name])
            params = self._declare_params(layer, conf, where, generator, first_copy)
            node = Node(conf.name, layer, srcs, params, index_of[conf.name], feedback=list(conf.srclayers[len(srcs):]))
            self.nodes.append(node)
            by_name[conf.name] = node
        self._mark_label_readers(by_name)
        self._leaves: dict[str, torch.Tensor] = {}
        self.bind()

    def _mark_label_readers(self, by_name: dict[str, Node]) -> None:
        """Tell each input layer which layer reads its labels as class ids, and how many classes that layer has
        (`layer.label_reader`), so that a store's labels are checked once, when it is opened."""
        for node in self.nodes:
            classes = node.layer.label_classes
            if not classes or not node.srcs:
                continue
            source = by_name[node.srcs[1] if len(node.srcs) > 1 else node.srcs[0]]  # as layers.loss.labels_of
            if source.category == "input" and not source.srcs:
                known = source.layer.label_reader
                if known is None or classes < known[1]:
                    source.layer.label_reader = (node.name, classes)

    def _declare_params(self, layer: Layer, conf: job_pb2.LayerProto, where: str, generator: torch.Generator, first_copy: Optional[Node]) -> list[str]:
        """Declare the layer's params in the store; an unrolled copy i > 0 shares those of copy 0, named `<i>#<param>`."""
        shapes = layer.param_shapes()
        if first_copy is not None:
            prefix = conf.name.split("#", 1)[0]
            for i, owner in enumerate(first_copy.params):
                if i >= len(conf.param):
                    conf.param.add()
                conf.param[i].name = f"{prefix}#{first_copy.layer.conf.param[i].name}"
                conf.param[i].share_from = owner
        if len(conf.param) < len(shapes):
            # SINGA requires one param entry per blob; name the missing ones after the layer
            for i in range(len(conf.param), len(shapes)):
                conf.param.add(name=f"{conf.name}/p{i}")
        names = []
        trainable = layer.param_trainable()
        for i, shape in enumerate(shapes):
            pconf = conf.param[i]
            if not pconf.name:
                pconf.name = f"{conf.name}/p{i}"
            try:
                names.append(self.store.declare(pconf, tuple(shape), generator, trainable=trainable[i]))
            except (KeyError, ValueError) as err:
                raise NetBuildError(f"{where}.param[{i}]", str(err.args[0])) from None
        return names

    # -- params -----------------------------------------------------------
    def bind(self) -> None:
        """(Re)create this net's leaf views of the store's values (shared memory, own grads).

        `.data` gives each leaf its own autograd version counter: asynchronous groups
        (Hogwild) update the shared values while other groups' backward passes still
        hold them, which autograd would otherwise reject as an in-place modification.
        """
        self._leaves = {}
        for node in self.nodes:
            for name in node.params:
                if name not in self._leaves:
                    self._leaves[name] = self.store.values[name].data.requires_grad_(self.phase == job_pb2.kTrain)

    def param_names(self) -> list[str]:
        return list(self._leaves)

    def param_leaves(self) -> dict[str, torch.Tensor]:
        """This net's leaf tensor per owner param name (where backward accumulates its gradient;
        algorithms that make their own gradients, such as CD, write them here)."""
        return dict(self._leaves)

    def grads(self) -> dict[str, Optional[torch.Tensor]]:
        return {name: leaf.grad for name, leaf in self._leaves.items()}

    def zero_grad(self) -> None:
        for leaf in self._leaves.values():
            leaf.grad = None

    @property
    def samples(self) -> bool:
        """A sampling net: an kRNNDummy reads a layer's output of the previous pass (rnn_dummy_conf.dynamic_srclayer)."""
        return any(n.layer.conf.rnn_dummy_conf.dynamic_srclayer for n in self.nodes if n.layer.conf.HasField("rnn_dummy_conf"))

    # -- running ------------------------------------------------------------
    def input_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.category == "input" and not n.srcs]

    def forward(self, ctx: Context) -> tuple[Optional[torch.Tensor], dict[str, torch.Tensor]]:
        """Run every layer once; return (sum of the loss layers' losses or None, outputs).

        Outside training, layers with feedback edges then close their loop
        (an RBM reports its reconstruction error); in training the algorithm
        (kCD) runs that chain itself. With ctx.carry (sampling), the outputs
        are kept there for the next pass.
        """
        outputs: dict[str, torch.Tensor] = {}
        aux: dict[str, Optional[torch.Tensor]] = {}
        losses = []
        for node in self.nodes:
            xs = [outputs[s] for s in node.srcs]
            labels = [aux[s] for s in node.srcs]
            result = node.layer.forward(xs, [self._leaves[p] for p in node.params], labels, ctx)
            if isinstance(result, tuple):
                outputs[node.name], aux[node.name] = result
            else:
                outputs[node.name], aux[node.name] = result, (labels[0] if labels else None)
            if node.category == "loss":
                losses.append(outputs[node.name])
        if ctx.phase != job_pb2.kTrain:
            for node in self.nodes:
                if node.feedback:
                    node.layer.close_loop([outputs[s] for s in node.srcs], [outputs[s] for s in node.feedback], [self._leaves[p] for p in node.params], ctx)
        if ctx.carry is not None:
            ctx.carry.clear()
            ctx.carry.update(outputs)
        # one loss is its own sum (the same value and gradient, without a stack and a sum in the graph)
        if not losses:
            total = None
        elif len(losses) == 1 and losses[0].dim() == 0:
            total = losses[0]
        else:
            total = torch.stack(losses).sum()
        return total, outputs

    def describe(self) -> list[dict]:
        """Node-link friendly description: name, type, per-sample shape, sources, params."""
        return [
            {
                "name": n.name,
                "type": job_pb2.LayerType.Name(n.layer.conf.type),
                "shape": list(n.layer.shape),
                "srclayers": n.srcs,
                "params": n.params,
                "partition_dim": n.layer.conf.partition_dim,
            }
            for n in self.nodes
        ]
