"""Validation of a parsed job before anything runs; the first problem is a positioned JobError.

Field paths used here index every segment (`neuralnet[0].layer[3].srclayers[1]`),
matching shoal.config.positions; messages show the readable form.
"""
from __future__ import annotations

from typing import Callable, Optional

from shoal.config import job_pb2
from shoal.config.errors import JobError, JobShapeError
from shoal.config.positions import Position, lookup

PHASES = {job_pb2.kTrain: "kTrain", job_pb2.kVal: "kVal", job_pb2.kTest: "kTest"}
# RBM layers name each other as sources (an undirected connection, SINGA's Fig. 3a)
RBM_TYPES = {job_pb2.kRBMVis, job_pb2.kRBMHid}
# layers whose recurrence is unrolled, so a self-referencing source is legal
RECURRENT_TYPES = {job_pb2.kGRU}


def in_phase(layer: job_pb2.LayerProto, phase: int) -> bool:
    """SINGA's filter: a layer is in `phase` if include lists it, or (without include) unless excluded."""
    return phase in layer.include if layer.include else phase not in layer.exclude


def layers_in_phase(net: job_pb2.NetProto, phase: int) -> list[job_pb2.LayerProto]:
    return [layer for layer in net.layer if in_phase(layer, phase)]


def validate_cluster(cluster: job_pb2.ClusterProto) -> list[tuple[str, str]]:
    """(field, message) for every inconsistency of the cluster section; pure arithmetic."""
    problems = []
    counts = ("nworker_groups", "nserver_groups", "nworkers_per_group", "nservers_per_group", "nworkers_per_procs", "nservers_per_procs", "sync_freq")
    for name in counts:
        if getattr(cluster, name) < 1:
            problems.append((name, f"must be >= 1, got {getattr(cluster, name)}"))
    if problems:
        return problems
    if cluster.nworker_groups % cluster.nserver_groups:
        problems.append(("nserver_groups", f"nworker_groups({cluster.nworker_groups}) must be a multiple of nserver_groups({cluster.nserver_groups})"))
    for kind in ("worker", "server"):
        per_group, per_procs = getattr(cluster, f"n{kind}s_per_group"), getattr(cluster, f"n{kind}s_per_procs")
        if per_procs % per_group and per_group % per_procs:
            problems.append(
                (f"n{kind}s_per_procs", f"n{kind}s_per_procs({per_procs}) must divide n{kind}s_per_group({per_group}) or be a multiple of it")
            )
    return problems


class _Checker:
    def __init__(self, job: job_pb2.JobProto, positions: Optional[dict[str, Position]], source: str):
        self.job, self.positions, self.source = job, positions, source

    def fail(self, key: str, message: str) -> None:
        pos = lookup(self.positions, key)
        if pos:
            raise JobError(self.source, message, pos[0], pos[1])
        raise JobError(self.source, message, field_path=_readable(key))

    def run(self, shape_check: Optional[Callable[[job_pb2.JobProto], None]]) -> None:
        job = self.job
        # train_steps may be absent: SINGA's test-only jobs (char-rnn sample.conf) omit it
        for name in ("name", "neuralnet"):
            if not job.HasField(name):
                self.fail(name, f"missing required field {name}")
        if not job.neuralnet.layer:
            self.fail("neuralnet[0]", "neuralnet has no layer")
        if job.train_steps > 0:
            if not job.HasField("train_one_batch") or (job.train_one_batch.alg == job_pb2.kUserAlg and not job.train_one_batch.user_alg):
                self.fail("train_one_batch[0]", "missing train_one_batch { alg: kBP | kCD | kBPTT }")
            if job.updater.type == job_pb2.kUserUpdater and not job.updater.user_type:
                self.fail("updater[0]", "missing updater { type: ... } (kSGD, kAdaGrad, kRMSProp, kNesterov, kAdaDelta, kAdam, kAdamMax)")
            lr = job.updater.learning_rate
            if lr.type == job_pb2.kUserChange and not lr.user_type:
                self.fail("updater[0].learning_rate[0]", "missing learning_rate { type: ... } (kFixed, kStep, ...)")
        for field, message in validate_cluster(job.cluster):
            self.fail(f"cluster[0].{field}[0]", message)
        self.check_layers()
        if shape_check is not None:
            try:
                shape_check(job)
            except JobShapeError as err:
                self.fail(_indexed(err.field_path), err.message)

    def check_layers(self) -> None:
        net = self.job.neuralnet
        uses_include = [i for i, l in enumerate(net.layer) if l.include]
        uses_exclude = [i for i, l in enumerate(net.layer) if l.exclude]
        if uses_include and uses_exclude:
            i = max(uses_include[0], uses_exclude[0])
            self.fail(f"neuralnet[0].layer[{i}]", "include and exclude are both used in this file; SINGA allows only one of them")
        params = {p.name for l in net.layer for p in l.param if p.name}
        nparts = self.job.cluster.nworkers_per_group
        for i, layer in enumerate(net.layer):
            if not layer.name:
                self.fail(f"neuralnet[0].layer[{i}]", "layer has no name")
            for j, p in enumerate(layer.param):
                if p.share_from and p.share_from not in params:
                    self.fail(f"neuralnet[0].layer[{i}].param[{j}].share_from[0]", f"share_from {p.share_from!r} names no param")
            if layer.HasField("store_conf"):
                sizes = list(layer.store_conf.batchsize)
                if any(s <= 0 for s in sizes):
                    self.fail(f"neuralnet[0].layer[{i}].store_conf[0].batchsize[0]", "batchsize must be > 0")
                if len(sizes) > 1 and len(sizes) != nparts:
                    self.fail(
                        f"neuralnet[0].layer[{i}].store_conf[0].batchsize[0]",
                        f"{len(sizes)} batch sizes given for {nparts} partitions (nworkers_per_group); give one value or one per partition",
                    )
        for phase, phase_name in PHASES.items():
            if (phase == job_pb2.kTest and self.job.test_steps <= 0) or (phase == job_pb2.kVal and self.job.validate_steps <= 0):
                continue  # SINGA builds the test and validation nets only when they will run
            indexed = [(i, layer) for i, layer in enumerate(net.layer) if in_phase(layer, phase)]
            seen: dict[str, int] = {}
            for i, layer in indexed:
                if layer.name in seen:
                    self.fail(f"neuralnet[0].layer[{i}].name[0]", f"duplicate layer name {layer.name!r} in the {phase_name} net (also layer {seen[layer.name]})")
                seen[layer.name] = i
            for i, layer in indexed:
                for j, src in enumerate(layer.srclayers):
                    if src not in seen:
                        self.fail(f"neuralnet[0].layer[{i}].srclayers[{j}]", f'srclayers "{src}" names no layer in the {phase_name} net')
            self.check_cycles(indexed, phase_name)

    def check_cycles(self, indexed, phase_name: str) -> None:
        layers = [layer for _, layer in indexed]
        index_of = {layer.name: i for i, layer in indexed}
        by_name = {l.name: l for l in layers}

        def edges(layer):
            for src in layer.srclayers:
                other = by_name[src]
                if layer.type in RBM_TYPES and other.type in RBM_TYPES:
                    continue
                if src == layer.name and layer.type in RECURRENT_TYPES:
                    continue
                yield other

        state: dict[str, int] = {}
        for start in layers:
            stack = [(start, iter(edges(start)))]
            path = [start.name]
            if state.get(start.name):
                continue
            state[start.name] = 1
            while stack:
                layer, it = stack[-1]
                nxt = next(it, None)
                if nxt is None:
                    state[layer.name] = 2
                    stack.pop()
                    path.pop()
                    continue
                if state.get(nxt.name) == 1:
                    cycle = path[path.index(nxt.name):] + [nxt.name]
                    self.fail(f"neuralnet[0].layer[{index_of[nxt.name]}]", f"cycle in the {phase_name} net: {' -> '.join(reversed(cycle))}")
                if not state.get(nxt.name):
                    state[nxt.name] = 1
                    stack.append((nxt, iter(edges(nxt))))
                    path.append(nxt.name)


def _indexed(readable: str) -> str:
    """`neuralnet.layer[3].param[0]` -> `neuralnet[0].layer[3].param[0]` (positions' key form)."""
    out = []
    for part in readable.split("."):
        out.append(part if part.endswith("]") else f"{part}[0]")
    return ".".join(out)


def _readable(indexed: str) -> str:
    return ".".join(p[:-3] if p.endswith("[0]") and not p.startswith(("layer[", "param[", "srclayers[")) else p for p in indexed.split("."))


def validate(
    job: job_pb2.JobProto,
    positions: Optional[dict[str, Position]] = None,
    source: str = "<python>",
    shape_check: Optional[Callable[[job_pb2.JobProto], None]] = None,
) -> None:
    """Raise JobError for the first problem found; `shape_check` builds the nets to check shapes."""
    _Checker(job, positions, source).run(shape_check)
