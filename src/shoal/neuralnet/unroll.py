"""Unrolling recurrent layers into feed-forward copies (SINGA's NeuralNet::Unrolling).

A layer with `unroll_len: n` (its own, or the net's, which every layer that
sets none inherits) becomes n copies named `<i>#<name>` with `unroll_index: i`.
Each of its srclayers is wired by the matching `unroll_conn_type` (default
kUnrollOneToOne) and `shift` (default 0):

    kUnrollOneToOne     copy j reads copy j − shift of the source (none for j < shift);
                        shift defaults to 0, or 1 for a layer that lists itself
    kUnrollOneToAll     every copy reads every copy of the source
    kUnrollFirstToLast  copy 0 reads the source's last copy

A layer that lists itself with shift 1 reads its own previous copy: that is a
recurrent connection. A recurrent layer type (kGRU) that does not list itself
gets that connection anyway, as its last source: SINGA's char-rnn job writes
none and expects its GRU copies to form a chain.

Params are not touched here: the net makes copy i > 0 of a param an alias
(`share_from`) of copy 0's, so all copies train one set of weights and
autograd sums their gradients (SINGA's kAggGrad). A net in which no layer has
unroll_len > 1 is returned as it is, with its names unchanged.

Pure graph code: LayerProto in, LayerProto out.
"""
from __future__ import annotations

from dataclasses import dataclass

from shoal.config import job_pb2
from shoal.errors import ShoalError

RECURRENT_TYPES = {job_pb2.kGRU}


class UnrollError(ShoalError, ValueError):
    def __init__(self, field_path: str, message: str):
        super().__init__(f"{field_path}: {message}")
        self.field_path = field_path
        self.message = message


@dataclass
class Unrolled:
    """The unrolled layer confs, and for each copy the name of its copy 0 (for param sharing)."""

    confs: list[job_pb2.LayerProto]
    origin: dict[str, str]  # copy name -> copy 0's name (copy 0 maps to itself)
    source_layer: dict[str, str]  # copy name -> the layer name in the job file


def copy_name(index: int, name: str) -> str:
    return f"{index}#{name}"


def unroll_lengths(confs: list[job_pb2.LayerProto], net_unroll_len: int) -> dict[str, int]:
    """Each layer's unroll_len: its own when set, else the net's."""
    return {c.name: c.unroll_len if c.HasField("unroll_len") else net_unroll_len for c in confs}


def unroll(confs: list[job_pb2.LayerProto], net_unroll_len: int = 1) -> Unrolled:
    lengths = unroll_lengths(confs, net_unroll_len)
    for conf in confs:
        if lengths[conf.name] < 1:
            raise UnrollError(f"neuralnet.layer[{conf.name}].unroll_len", f"must be ≥ 1, got {lengths[conf.name]}")
    if all(n == 1 for n in lengths.values()):
        return Unrolled(list(confs), {c.name: c.name for c in confs}, {c.name: c.name for c in confs})

    copies: dict[str, list[job_pb2.LayerProto]] = {}
    out, origin, source_layer = [], {}, {}
    for conf in confs:
        group = []
        for i in range(lengths[conf.name]):
            c = job_pb2.LayerProto()
            c.CopyFrom(conf)
            c.name = copy_name(i, conf.name)
            c.unroll_index = i
            for field in ("unroll_len", "unroll_conn_type", "shift", "srclayers"):
                c.ClearField(field)
            group.append(c)
            origin[c.name] = copy_name(0, conf.name)
            source_layer[c.name] = conf.name
        copies[conf.name] = group
        out.extend(group)

    for conf in confs:
        group = copies[conf.name]
        where = f"neuralnet.layer[{conf.name}]"
        for k, src in enumerate(conf.srclayers):
            if src not in copies:
                raise UnrollError(f"{where}.srclayers", f"{src!r} names no layer")
            conn = conf.unroll_conn_type[k] if k < len(conf.unroll_conn_type) else job_pb2.kUnrollOneToOne
            # reading itself means reading its previous copy unless a shift says otherwise
            shift = conf.shift[k] if k < len(conf.shift) else int(src == conf.name)
            if src == conf.name and conn == job_pb2.kUnrollOneToOne and shift < 1:
                raise UnrollError(f"{where}.shift", "a layer that reads itself needs shift ≥ 1 (its previous copy)")
            srcs = copies[src]
            for j, c in enumerate(group):
                if conn == job_pb2.kUnrollOneToAll:
                    c.srclayers.extend(s.name for s in srcs)
                elif conn == job_pb2.kUnrollOneToOne:
                    if 0 <= j - shift < len(srcs):
                        c.srclayers.append(srcs[j - shift].name)
                    elif j >= shift:
                        raise UnrollError(f"{where}.srclayers", f"copy {j} reads copy {j - shift} of {src!r}, which has {len(srcs)} copies")
                elif conn == job_pb2.kUnrollFirstToLast:
                    if j == 0:
                        c.srclayers.append(srcs[-1].name)
                else:
                    raise UnrollError(f"{where}.unroll_conn_type", f"{job_pb2.UnrollConnType.Name(conn)} is not supported")
        if conf.type in RECURRENT_TYPES and conf.name not in conf.srclayers:
            for j in range(1, len(group)):
                group[j].srclayers.append(group[j - 1].name)
    return Unrolled(out, origin, source_layer)
