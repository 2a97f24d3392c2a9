"""The partitioner: one train net cut over the workers of a group, with connection layers inserted.

Each layer of the user's net gets a *partitioning*:

- ``batch``   (partition_dim 0): a copy per worker, each on its share of the batch's rows;
  params replicated (each copy's gradient is a part of the sum).
- ``feature`` (partition_dim 1): a copy per worker, each on the whole batch computing a slice
  of the outputs: a one-to-all layer (InnerProduct, Convolution) owns the matching disjoint
  slice of its weight and bias; a feature-local layer (ReLU, pooling) reads the same slice
  of its source's features.
- ``whole``   (`location: K`, or partition_dim -1): one copy on worker K, on the whole batch.

Where neighbouring layers are partitioned differently the partitioner inserts SINGA's
connection layers (docs/partitioning.md has the table): kSlice to cut a blob, kConcate to
join the parts, a kBridgeSrc/kBridgeDst pair wherever a blob crosses to another worker, and
kSplit wherever one output feeds several layers. The result is a plan: nodes in one global
topological order, each on one worker, which the runtime executes (runtime/partitioned.py),
`shoal plan` prints and `shoal viz` draws. Pure: no params, no data, no threads.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Mapping, Optional

import torch

from shoal.config import job_pb2
from shoal.neuralnet.layers.base import Layer, LayerConfigError
from shoal.neuralnet.layers.connection import split_sizes
from shoal.neuralnet.layers.registry import layer_class
from shoal.neuralnet.net import NetBuildError, NeuralNet
from shoal.neuralnet.params import ParamStore

BATCH, FEATURE, WHOLE = "batch", "feature", "whole"
DIM_OF = {BATCH: 0, FEATURE: 1}


class PartitionError(NetBuildError):
    """The net cannot be partitioned as asked: `field_path` names the layer's field."""


@dataclass(frozen=True)
class ParamView:
    """The part of a store param a node computes with: `size` entries from `start` along `axis` (-1: all of it)."""

    name: str
    axis: int = -1
    start: int = 0
    size: int = 0


@dataclass(frozen=True)
class PartNode:
    """One node of the partitioned net: a copy of a user layer, or an inserted connection layer. Frozen, as the
    JobPlan that holds it (the layer object is the one part a plan does not freeze: it computes and has a shape)."""

    name: str
    worker: int
    layer: Layer  # built on this node's conf and source shapes (the runtime computes with it)
    srcs: tuple[str, ...]
    origin: str  # the user's layer this node computes (connection layers: the layer whose output they carry)
    partitioning: str  # batch | feature | whole (connection layers: how the blob they output is cut)
    part: int = 0  # which part of the batch rows / features (batch, feature)
    params: tuple[ParamView, ...] = ()
    inserted: bool = False  # a connection layer the partitioner added
    peer: str = ""  # a bridge's other end

    @property
    def type(self) -> str:
        return job_pb2.LayerType.Name(self.layer.conf.type)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.layer.shape)


@dataclass(frozen=True)
class PartitionPlan:
    nworkers: int
    nodes: tuple[PartNode, ...]  # one global topological order; each worker runs its own in this order
    partitioning: Mapping[str, tuple[str, int]]  # user layer -> (partitioning, worker of a whole layer), read-only
    notes: tuple[str, ...] = ()  # layers computed otherwise than the net's default, and why

    def __deepcopy__(self, memo: dict) -> "PartitionPlan":
        """A copy with its own nodes and layers (a trainer's group wraps their layers); the rest is read-only, shared."""
        return replace(self, nodes=copy.deepcopy(self.nodes, memo))

    @property
    def partitioned(self) -> bool:
        """Whether any layer is cut otherwise than on the batch (the plain data-parallel group)."""
        return any(kind != BATCH for kind, _ in self.partitioning.values())

    def worker_nodes(self, worker: int) -> list[PartNode]:
        return [n for n in self.nodes if n.worker == worker]

    def updated_where_computed(self) -> dict[ParamView, int]:
        """The param views no other worker computes with, each with its worker: a feature slice, or a
        param of layers kept whole on one worker. Their gradients need no summing, so the worker can
        update them itself (the seed docs' "servers placed with their workers"); replicated params
        (batch-partitioned layers) must be summed over the workers first."""
        users: dict[str, dict[int, set[ParamView]]] = {}
        for n in self.nodes:
            for view in n.params:
                users.setdefault(view.name, {}).setdefault(n.worker, set()).add(view)
        owned: dict[ParamView, int] = {}
        for by_worker in users.values():
            views = [(view, worker) for worker, vs in by_worker.items() for view in vs]
            alone = len(by_worker) == 1
            disjoint_slices = all(v.axis >= 0 and v.axis == views[0][0].axis for v, _ in views) and all(
                a.start + a.size <= b.start or b.start + b.size <= a.start for (a, _), (b, _) in _pairs(views)
            )
            if alone or (disjoint_slices and all(len(vs) == 1 for vs in by_worker.values())):
                owned.update(views)
        return owned

    def node(self, name: str) -> PartNode:
        return next(n for n in self.nodes if n.name == name)

    def to_node_link(self) -> dict:
        """As SINGA's visualization/train_net.json: nodes (layer, type, shape, worker, partition) and links."""
        nodes = [
            {
                "id": n.name,
                "layer": n.origin,
                "type": n.type,
                "shape": list(n.shape),
                "worker": n.worker,
                "partition": n.partitioning,
                "part": n.part,
                "connection": n.inserted,
                "params": [
                    {"name": v.name, "axis": v.axis, "start": v.start, "size": v.size} if v.axis >= 0 else {"name": v.name}
                    for v in n.params
                ],
            }
            for n in self.nodes
        ]
        links = [{"source": src, "target": n.name} for n in self.nodes for src in n.srcs]
        for n in self.nodes:  # a bridge pair is one edge of the partitioned graph, between workers
            if n.layer.conf.type == job_pb2.kBridgeDst:
                links.append({"source": n.peer, "target": n.name})
        return {"directed": True, "multigraph": False, "graph": {"nworkers": self.nworkers}, "nodes": nodes, "links": links}


def _pairs(items: list) -> list[tuple]:
    return [(a, b) for i, a in enumerate(items) for b in items[i + 1 :]]


def layer_partitioning(net_conf: job_pb2.NetProto, conf: job_pb2.LayerProto, layer: Layer, nworkers: int) -> tuple[str, int, Optional[str]]:
    """(partitioning, worker, note) of one user layer; PartitionError when the layer cannot be cut as asked.

    `location: K` and an explicit `partition_dim: -1` keep the layer whole (on worker K, default 0).
    Otherwise the layer's partition_dim, or the net's. A layer that cannot split its features
    (inputs, losses, softmax, LRN, layers drawing random numbers) runs on the batch dimension when
    it only inherits partition_dim 1 from the net, and is refused when it asks for it itself.
    """
    own = conf.HasField("partition_dim") and conf.partition_dim != -1
    dim = conf.partition_dim if own else net_conf.partition_dim
    if layer.opaque:
        _refuse_cutting_a_module(conf, layer, own, dim)
    if conf.location >= 0 or (conf.HasField("partition_dim") and conf.partition_dim == -1):
        return WHOLE, max(conf.location, 0), None
    if dim == -1:
        return WHOLE, 0, None
    if dim == 0:
        return BATCH, 0, None
    splittable = (layer.one_to_all and layer.narrowed(1) is not None) or (layer.feature_local and not layer.draws_random)
    why = ""
    if layer.category in ("input", "loss", "output") or not splittable:
        why = f"{job_pb2.LayerType.Name(conf.type)} cannot split its features"
    elif not layer.shape or layer.shape[0] < nworkers:
        why = f"{layer.shape[0] if layer.shape else 0} features cannot be cut over {nworkers} workers"
    if why:
        if own:
            raise PartitionError("partition_dim", f"partition_dim 1: {why}; use 0 (batch) or location")
        return BATCH, 0, f"{layer.name}: on the batch dimension ({why})"
    return FEATURE, 0, None


def _refuse_cutting_a_module(conf: job_pb2.LayerProto, layer: Layer, own: bool, dim: int) -> None:
    """A whole torch module (shoal.fit) runs on its share of the batch on every worker: the planner cannot see the
    layers inside it to cut their features or place them on workers, so asking for either is refused, not ignored."""
    what = f"layer {layer.name!r} is a whole torch module (shoal.fit), whose inside shoal cannot see"
    if conf.location >= 0 or (conf.HasField("partition_dim") and conf.partition_dim == -1):
        field, value = ("location", conf.location) if conf.location >= 0 else ("partition_dim", -1)
        raise PartitionError(field, f"{field} {value}: {what}, so it runs on every worker of the group on its share "
                             f"of the batch, not on one; remove {field}")
    if dim != 0:
        raise PartitionError("partition_dim" if own else "neuralnet.partition_dim",
                             f"partition_dim {dim}: {what}, so it cannot be cut on its features or split into "
                             "layers over the group's workers; use partition_dim 0 (the batch)")


class _Builder:
    """Builds the node list; `place` adds a node, `part_of` finds (or makes) the blob a consumer needs."""

    def __init__(self, nworkers: int):
        self.p = nworkers
        self.nodes: list[PartNode] = []
        self.by_name: dict[str, PartNode] = {}
        self.bridges: dict[tuple[str, int], str] = {}  # (node, destination worker) -> bridge_dst name
        self.cache: dict[tuple, str] = {}  # inserted slices/concates already made

    def place(self, conf: job_pb2.LayerProto, worker: int, srcs: list[str], origin: str, partitioning: str, part: int = 0,
              params: Optional[list[ParamView]] = None, inserted: bool = False, peer: str = "") -> PartNode:
        conf.name = conf.name or origin
        del conf.srclayers[:]
        conf.srclayers.extend(srcs)
        try:
            layer = layer_class(conf)(conf, [self.by_name[s].shape for s in srcs])
        except LayerConfigError as err:
            raise PartitionError(f"neuralnet.layer[{origin}]", str(err)) from None
        node = PartNode(conf.name, worker, layer, tuple(srcs), origin, partitioning, part, tuple(params or ()), inserted, peer)
        self.nodes.append(node)
        self.by_name[node.name] = node
        return node

    def on(self, name: str, worker: int) -> str:
        """`name`'s output as seen on `worker`: itself, or a bridge pair carrying it there (one per destination)."""
        src = self.by_name[name]
        if src.worker == worker:
            return name
        key = (name, worker)
        if key not in self.bridges:
            link = f"{name}->w{worker}"
            send = job_pb2.LayerProto(name=f"bridge_src({link})", type=job_pb2.kBridgeSrc)
            recv = job_pb2.LayerProto(name=f"bridge_dst({link})", type=job_pb2.kBridgeDst)
            self.place(send, src.worker, [name], src.origin, src.partitioning, src.part, inserted=True, peer=recv.name)
            node = self.place(recv, worker, [], src.origin, src.partitioning, src.part, inserted=True, peer=send.name)
            node.layer.shape = src.shape  # a bridge_dst has no source in its worker's net
            self.bridges[key] = recv.name
        return self.bridges[key]

    def piece(self, name: str, dim: int, part: int) -> str:
        """kSlice: part `part` of `name`'s output along dim (0 rows, 1 features), on `name`'s worker."""
        key = ("slice", name, dim, part)
        if key not in self.cache:
            src = self.by_name[name]
            conf = job_pb2.LayerProto(name=f"slice{dim}({name})#{part}", type=job_pb2.kSlice, partition_id=part)
            conf.slice_conf.slice_dim, conf.slice_conf.num_slices = dim, self.p
            kind = BATCH if dim == 0 else FEATURE
            self.cache[key] = self.place(conf, src.worker, [name], src.origin, kind, part, inserted=True).name
        return self.cache[key]

    def join(self, names: list[str], dim: int, worker: int, origin: str, partitioning: str, part: int) -> str:
        """kConcate of `names` along dim on `worker` (bridging the parts that live elsewhere)."""
        key = ("concate", tuple(names), dim, worker)
        if key not in self.cache:
            srcs = [self.on(n, worker) for n in names]
            conf = job_pb2.LayerProto(name=f"concate{dim}({origin})@{worker}", type=job_pb2.kConcate)
            if ("name", conf.name) in self.cache:  # the same layer joined twice on one worker (two different cuts)
                conf.name += f"#{part}"
            self.cache[("name", conf.name)] = ""
            conf.concate_conf.concate_dim = dim
            self.cache[key] = self.place(conf, worker, srcs, origin, partitioning, part, inserted=True).name
        return self.cache[key]


def _needed(b: _Builder, src: str, copies: list[str], kind: str, worker: int, want: str, part: int) -> str:
    """The node giving `want` (batch part / feature part / whole) of layer `src` on `worker`."""
    p = b.p
    if kind == WHOLE:
        whole = copies[0]
        if want == WHOLE:
            return b.on(whole, worker)
        return b.on(b.piece(whole, DIM_OF[want], part), worker)
    if want == kind:
        return copies[part]  # same cut: copy i feeds copy i, on the same worker
    if want == WHOLE:
        return b.join(copies, DIM_OF[kind], worker, src, WHOLE, 0)
    # cut the other way: each worker slices its part along `want`, the parts of `part` are joined along `kind`
    pieces = [b.piece(copies[i], DIM_OF[want], part) for i in range(p)]
    return b.join(pieces, DIM_OF[kind], worker, src, want, part)


def _insert_splits(nodes: list[PartNode], by_name: dict[str, PartNode]) -> list[PartNode]:
    """SINGA's AddModelSplitLayers on the partitioned graph: an output read by several nodes goes through a kSplit."""
    readers: dict[str, list[str]] = {}
    for n in nodes:
        for s in n.srcs:
            readers.setdefault(s, []).append(n.name)
    through: dict[str, dict[str, str]] = {}  # reader -> {source: the split it reads that source through}
    out: list[PartNode] = []
    for n in nodes:
        out.append(n)
        fan = readers.get(n.name, [])
        if len(fan) > 1 and n.layer.category != "input":
            conf = job_pb2.LayerProto(name=f"split({n.name})", type=job_pb2.kSplit, srclayers=[n.name])
            conf.split_conf.num_splits = len(fan)
            split = PartNode(conf.name, n.worker, layer_class(conf)(conf, [n.shape]), (n.name,), n.origin, n.partitioning, n.part, inserted=True)
            out.append(split)
            by_name[split.name] = split
            for reader in fan:
                through.setdefault(reader, {})[n.name] = split.name
    for i, n in enumerate(out):
        if n.name in through:  # frozen nodes: a reader is replaced by one reading the splits
            srcs = tuple(through[n.name].get(s, s) for s in n.srcs)
            del n.layer.conf.srclayers[:]
            n.layer.conf.srclayers.extend(srcs)
            out[i] = by_name[n.name] = replace(n, srcs=srcs)
    return out


def partition(net: NeuralNet, net_conf: job_pb2.NetProto, nworkers: int) -> PartitionPlan:
    """Cut `net` (a built kTrain net) over `nworkers` workers; PartitionError / NetBuildError name the layer."""
    p = max(1, nworkers)
    b = _Builder(p)
    copies: dict[str, list[str]] = {}  # user layer -> its copies (by part; one for a whole layer)
    kinds: dict[str, tuple[str, int]] = {}
    notes: list[str] = []
    for node in net.nodes:
        where = f"neuralnet.layer[{node.conf_index}]"
        if node.feedback or "#" in node.name:
            if p > 1 and any(k != BATCH for k, _ in kinds.values()):
                raise PartitionError(where, "unrolled and energy (RBM) nets are only partitioned on the batch dimension")
        try:
            # the file's conf: the built layer's has the net's partition_dim filled in
            own = net_conf.layer[node.conf_index]
            kind, home, note = layer_partitioning(net_conf, own, node.layer, p) if p > 1 else (BATCH, 0, None)
        except PartitionError as err:
            # a layer's own field under its position; a net-wide field (neuralnet.partition_dim) as it is
            field = err.field_path if err.field_path.startswith("neuralnet.") else f"{where}.{err.field_path}"
            raise PartitionError(field, err.message) from None
        if note:
            notes.append(note)
        kinds[node.name] = (kind, home)
        one_to_all = node.layer.one_to_all
        want = WHOLE if (kind == FEATURE and one_to_all) else kind
        sizes = split_sizes(node.layer.shape[0], p) if kind == FEATURE else []
        names = []
        for part in range(p if kind != WHOLE else 1):
            worker = home if kind == WHOLE else part
            srcs = [_needed(b, s, copies[s], kinds[s][0], worker, want, part) for s in node.srcs]
            conf = job_pb2.LayerProto()
            conf.CopyFrom(node.layer.conf)
            views = [ParamView(name) for name in node.params]
            if kind == FEATURE and one_to_all:
                narrowed, axes = node.layer.narrowed(sizes[part])
                conf.CopyFrom(narrowed)
                start = sum(sizes[:part])
                views = [ParamView(name, axis, start, sizes[part]) for name, axis in zip(node.params, axes)]
            conf.name = node.name if kind == WHOLE else f"{node.name}@{part}"
            conf.partition_id, conf.num_partitions = part, (1 if kind == WHOLE else p)
            names.append(b.place(conf, worker, srcs, node.name, kind, part, views).name)
        copies[node.name] = names
    _check_random_draws(b.nodes, p)
    nodes = _insert_splits(b.nodes, b.by_name)
    return PartitionPlan(p, tuple(nodes), MappingProxyType(kinds), tuple(notes))


def _check_random_draws(nodes: list[PartNode], nworkers: int) -> None:
    """Every worker draws from the group's one random stream: they must make the same draws in the same order."""
    sequences = [[n.origin for n in nodes if n.worker == w and n.layer.draws_random] for w in range(nworkers)]
    drawing = [s for s in sequences if s]
    if any(s != drawing[0] for s in drawing[1:]):
        layer = next(n.origin for n in nodes if n.layer.draws_random)
        raise PartitionError(
            f"neuralnet.layer[{layer}].partition_dim",
            "layers drawing random numbers must run on the batch dimension (partition_dim 0) on every worker of a partitioned group",
        )


def plan_partition(job: job_pb2.JobProto) -> PartitionPlan:
    """The partitioned train net of `job`'s groups (nworkers_per_group parts); raises NetBuildError / PartitionError."""
    net = NeuralNet(job.neuralnet, job_pb2.kTrain, ParamStore(allocate=False), torch.Generator())
    return partition(net, job.neuralnet, job.cluster.nworkers_per_group)


__all__ = ["BATCH", "FEATURE", "WHOLE", "NetBuildError", "ParamView", "PartNode", "PartitionError", "PartitionPlan", "partition", "plan_partition"]
