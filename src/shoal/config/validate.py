"""Checks a parsed job before anything runs; the first problem becomes a positioned JobError.

Each check yields `(field path, message)` problems, most basic first;
`validate` raises for the first. A later check may assume the earlier ones
passed (cycles are looked for only once every srclayers entry names a layer).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator

from google.protobuf.descriptor import FieldDescriptor

from shoal.config import job_pb2
from shoal.config.errors import JobShapeError
from shoal.config.phases import PHASE_NAMES, in_phase, layers_in_phase, phases_built
from shoal.config.positions import SourceMap

__all__ = ["in_phase", "job_problems", "layers_in_phase", "validate", "validate_cluster"]

Problem = tuple[str, str]  # (field path, message)
DEVICE_NAME = re.compile(r"^(cpu|cpu:\d+|cuda:\d+)$")  # "cpu:N": a CPU device with a param replica of its own
ShapeCheck = Callable[[job_pb2.JobProto], None]
_FLOAT_TYPES = (FieldDescriptor.CPPTYPE_FLOAT, FieldDescriptor.CPPTYPE_DOUBLE)
# the input layers that read store_conf through shoal's stores (a plugin's may read other backends)
STORE_LAYERS = {job_pb2.kRecordInput, job_pb2.kCSVInput}
STORE_BACKENDS = ("kvfile", "textfile")

# RBM layers name each other as sources: an undirected connection (SINGA docs, Fig. 3a)
RBM_TYPES = {job_pb2.kRBMVis, job_pb2.kRBMHid}
# a recurrent layer may name itself as a source: unrolling turns that into copy i-1 -> copy i
RECURRENT_TYPES = {job_pb2.kGRU}
COUNTERS = (
    "train_steps",
    "test_steps",
    "validate_steps",
    "warmup_steps",
    "disp_freq",
    "disp_after",
    "test_freq",
    "test_after",
    "validate_freq",
    "validate_after",
    "checkpoint_freq",
    "checkpoint_after",
)


def validate(job: job_pb2.JobProto, positions: SourceMap | None = None, shape_check: ShapeCheck | None = None) -> None:
    """Raise JobError for the first problem; `shape_check` (the net builder's) may raise JobShapeError."""
    sources = positions if positions is not None else SourceMap()
    problem = next(job_problems(job), None)
    if problem is not None:
        raise sources.error(*problem)
    if shape_check is not None:
        try:
            shape_check(job)
        except JobShapeError as err:
            raise sources.error(_layer_by_index(err.field_path, job.neuralnet), err.message) from None


def _layer_by_index(path: str, net: job_pb2.NetProto) -> str:
    """`neuralnet.layer[fc1].x` (a layer named, as the net builder may) -> `neuralnet.layer[2].x`."""
    m = re.match(r"neuralnet\.layer\[(?:name=)?([^\]]+)\]", path)
    if m and not m[1].isdigit():
        index = next((i for i, layer in enumerate(net.layer) if layer.name == m[1]), None)
        if index is not None:
            return f"neuralnet.layer[{index}]{path[m.end() :]}"
    return path


def job_problems(job: job_pb2.JobProto) -> Iterator[Problem]:
    """Every problem of `job` that needs no layer shapes, most basic first."""
    yield from _required_fields(job)
    yield from _missing_required(job, "")
    yield from _non_finite(job, "")
    for name in COUNTERS:
        if getattr(job, name) < 0:
            yield name, f"{name} must be >= 0, got {getattr(job, name)}"
    if job.checkpoint_interval_s < 0:
        yield "checkpoint_interval_s", f"checkpoint_interval_s must be >= 0 (seconds; 0: off), got {job.checkpoint_interval_s:g}"
    for i, device in enumerate(job.gpu):
        if device < 0:
            yield f"gpu[{i}]", f"gpu takes device ids >= 0, got {device}"
    for i, name in enumerate(job.device):
        if not DEVICE_NAME.match(name):
            yield f"device[{i}]", f'device: {name!r} is not a device; use "cpu", "cpu:N" or "cuda:N"'
    if job.device and job.gpu:
        yield "device[0]", "give the workers' devices either as gpu (SINGA's ids) or as device (shoal's names), not both"
    for name, message in validate_cluster(job.cluster):
        yield f"cluster.{name}", message
    if job.train_steps > 0:
        yield from _updater_problems(job.updater)
    yield from _layer_problems(job)
    for phase in phases_built(job):
        yield from _phase_problems(job.neuralnet, phase)


def _required_fields(job: job_pb2.JobProto) -> Iterator[Problem]:
    if not job.name:
        yield "name", "missing required field 'name'"
    if not job.neuralnet.layer:
        yield "neuralnet", "missing required field 'neuralnet' (with at least one layer)"
    if job.train_steps <= 0 and job.test_steps <= 0:
        # a test-only job (SINGA's char-rnn sample.conf) gives test_steps instead
        yield "train_steps", "missing required field 'train_steps' (or test_steps for a test-only job)"
    alg = job.train_one_batch
    if not job.HasField("train_one_batch"):
        yield "train_one_batch", "missing required field 'train_one_batch' { alg: kBP | kCD | kBPTT }"
    elif alg.alg == job_pb2.kUserAlg and not alg.user_alg:
        yield "train_one_batch.alg", "no alg given: kBP, kCD, kBPTT, or kUserAlg with user_alg naming a registered algorithm"
    if job.train_steps > 0 and not job.HasField("updater"):
        yield "updater", "missing required field 'updater' (a job with train_steps needs one)"


def _missing_required(message, path: str) -> Iterator[Problem]:
    """Fields a plugin's .proto declares `required` (shoal's own schema declares none; see job.proto)."""
    at = path + "." if path else ""
    for fd in message.DESCRIPTOR.fields:
        if fd.is_required and not message.HasField(fd.name):
            yield at + fd.name, f"missing required field '{fd.name}' of {message.DESCRIPTOR.name}"
    for fd, value in message.ListFields():
        if fd.message_type is None:
            continue
        name = at + (f"[{fd.full_name}]" if fd.is_extension else fd.name)
        for i, item in enumerate(value) if fd.is_repeated else [(None, value)]:
            yield from _missing_required(item, name if i is None else f"{name}[{i}]")


def _non_finite(message, path: str) -> Iterator[Problem]:
    """NaN or infinity in any number field (`base_lr: nan` would train to NaN, `std_value: inf` to zeros)."""
    at = path + "." if path else ""
    for fd, value in message.ListFields():
        name = at + (f"[{fd.full_name}]" if fd.is_extension else fd.name)
        items = list(enumerate(value)) if fd.is_repeated else [(None, value)]
        for i, item in items:
            where = name if i is None else f"{name}[{i}]"
            if fd.message_type is not None:
                yield from _non_finite(item, where)
            elif fd.cpp_type in _FLOAT_TYPES and not math.isfinite(item):
                yield where, f"{fd.name} must be a finite number, got {item}"


def validate_cluster(cluster: job_pb2.ClusterProto) -> list[Problem]:
    """(field, message) for every inconsistency of a cluster section: pure arithmetic, no placement."""
    counts = (
        "nworker_groups",
        "nserver_groups",
        "nworkers_per_group",
        "nservers_per_group",
        "nworkers_per_procs",
        "nservers_per_procs",
        "sync_freq",
    )
    counts += ("auto_batch_freq",)
    problems = [(name, f"{name} must be >= 1, got {getattr(cluster, name)}") for name in counts if getattr(cluster, name) < 1]
    if problems:
        return problems  # the arithmetic below would divide by zero
    if not 1 <= cluster.start_port <= 65535:
        problems.append(("start_port", f"start_port must be a TCP port, 1..65535, got {cluster.start_port}"))
    for name, low in (("threads_per_worker", 0), ("max_staleness", -1), ("warmup_steps", 0), ("max_update_lag", -1), ("max_restarts", 0)):
        if getattr(cluster, name) < low:
            problems.append((name, f"{name} must be >= {low}, got {getattr(cluster, name)}"))
    if not cluster.bucket_mb > 0:
        problems.append(("bucket_mb", f"bucket_mb must be > 0 (float32 megabytes), got {cluster.bucket_mb:g}"))
    for name in ("comm_timeout_s", "stall_timeout_s", "join_timeout_s"):
        if not getattr(cluster, name) > 0:
            problems.append((name, f"{name} must be > 0 (seconds), got {getattr(cluster, name):g}"))
    if cluster.nworker_groups % cluster.nserver_groups:
        problems.append(
            (
                "nserver_groups",
                f"nworker_groups({cluster.nworker_groups}) must be a multiple of nserver_groups({cluster.nserver_groups})",
            )
        )
    for kind in ("worker", "server"):
        per_group, per_procs = getattr(cluster, f"n{kind}s_per_group"), getattr(cluster, f"n{kind}s_per_procs")
        # a process holds part of one group, or whole groups (SINGA's cluster.cc)
        if per_procs % per_group and per_group % per_procs:
            problems.append(
                (
                    f"n{kind}s_per_procs",
                    f"n{kind}s_per_procs({per_procs}) must divide n{kind}s_per_group({per_group}) or be a multiple of it",
                )
            )
    return problems


# -- updater ------------------------------------------------------------------------
def _updater_problems(updater: job_pb2.UpdaterProto) -> Iterator[Problem]:
    if updater.type == job_pb2.kUserUpdater and not updater.user_type:
        yield (
            "updater.type",
            "no updater type given: kSGD, kAdaGrad, kRMSProp, kNesterov, kAdaDelta, kAdam, kAdamMax, or kUserUpdater with user_type",
        )
    for name in ("momentum", "weight_decay", "delta"):
        if getattr(updater, name) < 0:
            yield f"updater.{name}", f"{name} must be >= 0, got {getattr(updater, name):g}"
    if updater.clip_low > updater.clip_high:
        yield "updater.clip_low", f"clip_low({updater.clip_low:g}) is above clip_high({updater.clip_high:g})"
    rates = {job_pb2.kRMSProp: "rmsprop_conf.rho", job_pb2.kAdaDelta: "adadelta_conf.rho"}
    if updater.type in rates:
        conf, name = rates[updater.type].split(".")
        if not 0 < getattr(getattr(updater, conf), name) < 1:
            yield f"updater.{rates[updater.type]}", f"{name} must be in (0, 1), got {getattr(getattr(updater, conf), name):g}"
    betas = {job_pb2.kAdam: "adam_conf", job_pb2.kAdamMax: "adammax_conf"}
    if updater.type in betas:
        conf = getattr(updater, betas[updater.type])
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(conf, name) < 1:
                yield f"updater.{betas[updater.type]}.{name}", f"{name} must be in [0, 1), got {getattr(conf, name):g}"
    yield from _schedule_problems(updater.learning_rate)


def _schedule_problems(lr: job_pb2.LRGenProto) -> Iterator[Problem]:
    at, kind = "updater.learning_rate", job_pb2.ChangeMethod.Name(lr.type)
    if lr.type == job_pb2.kUserChange and not lr.user_type:
        yield (
            f"{at}.type",
            "no learning rate type given: kFixed, kStep, kFixedStep, kLinear, kExponential, kInverse, kInverseT, or kUserChange with user_type",
        )
    if lr.base_lr < 0:
        yield f"{at}.base_lr", f"base_lr must be >= 0, got {lr.base_lr:g}"
    conf_of = {job_pb2.kStep: "step_conf", job_pb2.kExponential: "exponential_conf", job_pb2.kLinear: "linear_conf"}
    if lr.type in conf_of:
        change_freq = getattr(lr, conf_of[lr.type]).change_freq
        if change_freq <= 0:
            yield (
                f"{at}.{conf_of[lr.type]}.change_freq",
                f"{kind} needs {conf_of[lr.type]} {{ change_freq: N }} with N > 0, got {change_freq}",
            )
    if lr.type == job_pb2.kLinear and not lr.linear_conf.HasField("final_lr"):
        yield f"{at}.linear_conf.final_lr", "kLinear needs linear_conf { final_lr: ... }"
    if lr.type == job_pb2.kInverseT and lr.inverset_conf.final_lr == 0:
        yield f"{at}.inverset_conf.final_lr", "kInverseT needs inverset_conf { final_lr: ... }, not 0"
    if lr.type == job_pb2.kFixedStep:
        steps, rates = list(lr.fixedstep_conf.step), list(lr.fixedstep_conf.step_lr)
        if not steps or len(steps) != len(rates):
            yield (
                f"{at}.fixedstep_conf",
                f"kFixedStep needs as many step_lr as step values, got {len(steps)} step and {len(rates)} step_lr",
            )
        for i in range(1, len(steps)):
            if steps[i] < steps[i - 1]:
                yield f"{at}.fixedstep_conf.step[{i}]", f"steps must increase: {steps[i]} comes after {steps[i - 1]}"


# -- layers -------------------------------------------------------------------------
def _layer_problems(job: job_pb2.JobProto) -> Iterator[Problem]:
    net, nworkers = job.neuralnet, job.cluster.nworkers_per_group
    if net.partition_dim not in (-1, 0, 1):
        yield "neuralnet.partition_dim", f"partition_dim must be 0 (batch), 1 (feature) or -1 (not partitioned), got {net.partition_dim}"
    if net.unroll_len < 1:
        yield "neuralnet.unroll_len", f"unroll_len must be >= 1, got {net.unroll_len}"
    yield from _include_exclude_mixed(net)
    params = {p.name for layer in net.layer for p in layer.param if p.name}
    for i, layer in enumerate(net.layer):
        at = f"neuralnet.layer[{i}]"
        if not layer.name:
            yield at, "missing required field 'name'"
        if layer.type == job_pb2.kUserLayer and not layer.user_type:
            yield f"{at}.type", f'layer "{layer.name}" has no type (a built-in kXxx, or kUserLayer with user_type)'
        if layer.partition_dim not in (-1, 0, 1):
            yield (
                f"{at}.partition_dim",
                f"partition_dim must be 0 (batch), 1 (feature) or -1 (not partitioned; unset: the net's), got {layer.partition_dim}",
            )
        if not -1 <= layer.location < nworkers:
            yield (
                f"{at}.location",
                f"location must be a worker of the group, 0..{nworkers - 1} (nworkers_per_group({nworkers})), or -1; got {layer.location}",
            )
        if layer.location >= 0 and layer.HasField("partition_dim") and layer.partition_dim != -1:
            yield f"{at}.partition_dim", f"location {layer.location} keeps the layer whole on one worker; partition_dim {layer.partition_dim} contradicts it"
        if layer.unroll_len < 1:
            yield f"{at}.unroll_len", f"unroll_len must be >= 1, got {layer.unroll_len}"
        for j, param in enumerate(layer.param):
            if param.share_from and (param.share_from not in params or param.share_from == param.name):
                yield f"{at}.param[{j}].share_from", f'share_from "{param.share_from}" names no other param'
        # a training batch is split over the group's workers, unless the input layer is kept whole
        kept_whole = layer.location >= 0 or (layer.partition_dim if layer.HasField("partition_dim") else net.partition_dim) == -1
        trains = in_phase(layer, job_pb2.kTrain) and not kept_whole
        if layer.HasField("store_conf"):
            yield from _store_problems(layer.store_conf, f"{at}.store_conf", layer.type in STORE_LAYERS)
            yield from _batchsize_problems(list(layer.store_conf.batchsize), f"{at}.store_conf.batchsize", nworkers, trains)
        if layer.type == job_pb2.kCharRNN:
            yield from _batchsize_problems([layer.char_rnn_conf.batchsize], f"{at}.char_rnn_conf.batchsize", nworkers, trains, repeated=False)


def _include_exclude_mixed(net: job_pb2.NetProto) -> Iterator[Problem]:
    first = {}
    for i, layer in enumerate(net.layer):
        for kind in ("include", "exclude"):
            if getattr(layer, kind):
                first.setdefault(kind, i)
    if len(first) == 2:
        kind, i = max(first.items(), key=lambda item: item[1])
        other = "exclude" if kind == "include" else "include"
        yield (
            f"neuralnet.layer[{i}].{kind}[0]",
            f'{kind} is used here and {other} by layer "{net.layer[first[other]].name}"; SINGA allows only one of them in a job',
        )


def _store_problems(store: job_pb2.StoreProto, at: str, shoal_store: bool) -> Iterator[Problem]:
    if shoal_store and store.backend and store.backend not in STORE_BACKENDS:
        yield f"{at}.backend", f"backend {store.backend!r} is not a store shoal reads: kvfile or textfile"
    if shoal_store and store.backend == "textfile" and not store.separator:
        yield f"{at}.separator", "separator is empty: give the character(s) between a line's fields, e.g. \",\""
    for j, size in enumerate(store.shape):
        if size <= 0:
            yield f"{at}.shape[{j}]", f"shape takes sizes > 0, got {size}"
    if store.random_skip < 0:
        yield f"{at}.random_skip", f"random_skip must be >= 0, got {store.random_skip}"


def _batchsize_problems(sizes: list[int], at: str, nworkers: int, trains: bool, repeated: bool = True) -> Iterator[Problem]:
    """One size is split over the group's workers when training (a test batch is read whole)."""
    for j, size in enumerate(sizes):
        if size <= 0:
            yield f"{at}[{j}]" if repeated else at, f"batchsize must be > 0, got {size}"
    if len(sizes) > 1 and len(sizes) != nworkers:
        yield (
            f"{at}[0]",
            f"{len(sizes)} batch sizes for nworkers_per_group({nworkers}) partitions: give one (split evenly) or one per partition",
        )
    if trains and len(sizes) == 1 and 0 < sizes[0] < nworkers:
        yield (
            f"{at}[0]" if repeated else at,
            f"batchsize {sizes[0]} leaves {nworkers - sizes[0]} of the nworkers_per_group({nworkers}) workers without a row to train on:"
            f" give a batchsize of at least {nworkers}, or fewer workers per group",
        )


# -- the net of one phase -----------------------------------------------------------
def _phase_problems(net: job_pb2.NetProto, phase: int) -> Iterator[Problem]:
    phase_name = PHASE_NAMES[phase]
    members = [(i, layer) for i, layer in enumerate(net.layer) if in_phase(layer, phase)]
    names: set[str] = set()
    for i, layer in members:
        if layer.name in names:
            yield f"neuralnet.layer[{i}].name", f'layer name "{layer.name}" is used twice in the {phase_name} net'
        names.add(layer.name)
    for i, layer in members:
        for j, src in enumerate(layer.srclayers):
            if src not in names:
                yield f"neuralnet.layer[{i}].srclayers[{j}]", f'srclayers "{src}" names no layer in the {phase_name} net'
        dynamic = layer.rnn_dummy_conf.dynamic_srclayer
        if dynamic and dynamic not in names:
            yield (
                f"neuralnet.layer[{i}].rnn_dummy_conf.dynamic_srclayer",
                f'dynamic_srclayer "{dynamic}" names no layer in the {phase_name} net',
            )
    cycle = _find_cycle(net, members)
    if cycle is not None:
        at, loop = cycle
        yield at, f"cycle in the {phase_name} net: {' -> '.join(loop)}"


def _find_cycle(net: job_pb2.NetProto, members: list[tuple[int, job_pb2.LayerProto]]) -> tuple[str, list[str]] | None:
    """(the srclayers entry that closes a cycle, the cycle's layers in data-flow order), or None."""
    by_name = {layer.name: (i, layer) for i, layer in members}

    def sources(layer: job_pb2.LayerProto) -> Iterator[tuple[int, str]]:
        for j, src in enumerate(layer.srclayers):
            other = by_name.get(src, (None, None))[1]
            if other is None or (layer.type in RBM_TYPES and other.type in RBM_TYPES):
                continue
            if src == layer.name and _recurrent(layer, net):
                continue
            yield j, src

    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for _, start in members:
        if start.name in state:
            continue
        path, pending = [start.name], [sources(start)]
        state[start.name] = 1
        while pending:
            edge = next(pending[-1], None)
            if edge is None:
                state[path.pop()] = 2
                pending.pop()
                continue
            j, src = edge
            if state.get(src) == 1:
                # path[k] reads path[k+1] ... path[-1] reads src == path[k]: data flows the other way
                loop = [src] + path[path.index(src) + 1 :][::-1] + [src]
                return f"neuralnet.layer[{by_name[path[-1]][0]}].srclayers[{j}]", loop
            if src not in state:
                state[src] = 1
                path.append(src)
                pending.append(sources(by_name[src][1]))
    return None


def _recurrent(layer: job_pb2.LayerProto, net: job_pb2.NetProto) -> bool:
    unroll_len = layer.unroll_len if layer.HasField("unroll_len") else net.unroll_len
    return layer.type in RECURRENT_TYPES or unroll_len > 1
