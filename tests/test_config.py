"""Job files: SINGA 0.3 files parse and validate unmodified; bad files fail with a positioned one-line error."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from conftest import REPO

from shoal.config import (
    JobError,
    JobShapeError,
    job_pb2,
    layers_in_phase,
    load_job,
    validate_cluster,
)

FIXTURES = Path(__file__).parent / "fixtures" / "singa"
SINGA_FILES = sorted(FIXTURES.glob("*.conf"))

# the `cluster {...}` snippets of SINGA's frameworks doc (reference §2.2) and quick-start
FRAMEWORKS = {
    "sandblaster": "nworker_groups: 1  nserver_groups: 1  nworkers_per_group: 3  nservers_per_group: 2  server_worker_separate: true",
    "allreduce": "nworker_groups: 1  nserver_groups: 1  nworkers_per_group: 3  nservers_per_group: 3  server_worker_separate: false",
    "downpour": "nworker_groups: 2  nserver_groups: 1  nworkers_per_group: 2  nservers_per_group: 2  server_worker_separate: true",
    "hogwild": "nworker_groups: 3  nserver_groups: 3  nworkers_per_group: 1  nservers_per_group: 1  server_worker_separate: false",
    "inmem-downpour": "nworker_groups: 2  nworkers_per_procs: 2",
    "inmem-sandblaster": "nworkers_per_group: 2  nworkers_per_procs: 2",
}

# what each fixture's SINGA-specific syntax must have parsed into
FEATURES = {
    "mnist-mlp.conf": lambda j: (
        [l.name for l in layers_in_phase(j.neuralnet, job_pb2.kTest)][:2] == ["data", "fc1"]
        and j.neuralnet.layer[-1].softmaxloss_conf.topk == 1
        and j.updater.learning_rate.step_conf.gamma == pytest.approx(0.997)
    ),
    "mnist-conv.conf": lambda j: (
        j.updater.learning_rate.type == job_pb2.kInverse
        and j.neuralnet.layer[2].type == job_pb2.kCConvolution
        and j.neuralnet.layer[3].type == job_pb2.kCPooling
    ),
    "cifar10.conf": lambda j: (
        list(j.updater.learning_rate.fixedstep_conf.step) == [0, 60000, 65000]
        and list(j.neuralnet.layer[0].store_conf.shape) == [3, 32, 32]
        and j.neuralnet.layer[0].store_conf.mean_file.endswith("image_mean.bin")
    ),
    "hybrid.conf": lambda j: (
        j.cluster.nworkers_per_group == 2
        and j.cluster.nworkers_per_procs == 2
        and {l.partition_dim for l in j.neuralnet.layer} >= {0, 1}
    ),
    "cudnn_bm.conf": lambda j: (
        any(l.type == job_pb2.kCudnnBM and len(l.param) == 4 for l in j.neuralnet.layer)
        and any(l.activation_conf.type == job_pb2.RELU and l.share_src_blobs for l in j.neuralnet.layer)
        and any(l.pooling_conf.pool == job_pb2.PoolingProto.AVG for l in j.neuralnet.layer)
    ),
    "rbm1.conf": lambda j: (
        j.train_one_batch.alg == job_pb2.kCD
        and j.neuralnet.layer[3].param[0].share_from == "w1"
        and j.neuralnet.layer[3].rbm_conf.gaussian
    ),
    "autoencoder.conf": lambda j: (
        j.updater.type == job_pb2.kAdaGrad
        and len(j.checkpoint_path) == 2
        and any(l.innerproduct_conf.transpose for l in j.neuralnet.layer)
        and j.neuralnet.layer[-1].type == job_pb2.kEuclideanLoss
    ),
    "char-rnn.conf": lambda j: (
        j.train_one_batch.alg == job_pb2.kBPTT
        and j.neuralnet.unroll_len == 50
        and list(j.gpu) == [0]
        and j.neuralnet.layer[1].unroll_conn_type[0] == job_pb2.kUnrollOneToAll
        and len(j.neuralnet.layer[3].param) == 9
        and j.updater.rmsprop_conf.rho == pytest.approx(0.95)
        and (j.updater.clip_low, j.updater.clip_high) == (-5, 5)
    ),
    "char-rnn-sample.conf": lambda j: (
        not j.HasField("train_steps")
        and j.test_steps == 100
        and len(j.checkpoint_path) == 1
        and j.neuralnet.layer[0].rnn_dummy_conf.dynamic_srclayer == "argsort"
        and j.neuralnet.layer[-1].char_rnn_conf.vocab_path
    ),
    "alexnet.conf": lambda j: (
        j.neuralnet.layer[2].rgbimage_conf.cropsize == 227
        and j.neuralnet.layer[2].rgbimage_conf.meanfile
        and any(l.lrn_conf.knorm == 1 and l.type == job_pb2.kLRN for l in j.neuralnet.layer)
        and any(l.HasField("dropout_conf") for l in j.neuralnet.layer)
    ),
}


@pytest.mark.parametrize("path", SINGA_FILES, ids=lambda p: p.name)
def test_singa_files_parse_and_validate_unmodified(path):
    job = load_job(path)
    assert FEATURES[path.name](job)
    assert job.job_dir == str(FIXTURES.resolve())


def test_every_fixture_has_its_feature_check():
    assert {p.name for p in SINGA_FILES} == set(FEATURES)


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_framework_cluster_snippets(tmp_path, name):
    text = (FIXTURES / "mnist-mlp.conf").read_text()
    text = text[: text.index("cluster {")] + "cluster {\n  " + FRAMEWORKS[name] + "\n}\n"
    (tmp_path / "job.conf").write_text(text)
    job = load_job(tmp_path / "job.conf")
    for field_value in FRAMEWORKS[name].split("  "):
        field, value = field_value.split(": ")
        assert str(getattr(job.cluster, field)).lower() == value


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("*/*.conf")), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_examples_pass_the_shape_checks(path):
    # shoal.frontend.api plugs the net builder's shape check into load_job
    from shoal.config.plugins import load_plugins
    from shoal.frontend.api import load_job as load_with_shapes

    # an example whose layers are a plugin: its README's `shoal run --plugin ...` (docs/layers.md)
    load_plugins([path.parent / name for name in EXAMPLE_PLUGINS.get(path.parent.name, [])])
    load_with_shapes(path)


EXAMPLE_PLUGINS = {"rnnlm": ["rnnlm.proto", "rnnlm.py"]}


def test_singa_defaults_are_kept():
    job = job_pb2.JobProto()
    assert job.cluster.nworker_groups == 1 and job.cluster.share_memory and job.cluster.sync_freq == 1
    assert job.reset_param_version and job.num_openblas_threads == 1 and job.updater.delta == pytest.approx(1e-8)
    assert job_pb2.LayerProto().partition_dim == -1 and job_pb2.LayerProto().type == job_pb2.kUserLayer
    assert job_pb2.kSTanh == 212 and job_pb2.kSoftmaxLoss == 301 and job_pb2.kCudnnBM == 255 and job_pb2.kRNNDummy == 505


# -- bad files ----------------------------------------------------------------------
TINY = """\
name: "tiny"
train_steps: 10
test_steps: 2
train_one_batch { alg: kBP }
updater {
  type: kSGD
  learning_rate { type: kFixed base_lr: 0.1 }
}
neuralnet {
  layer {
    name: "data"
    type: kRecordInput
    store_conf { path: "train.bin" batchsize: 8 shape: 4 }
    exclude: kTest
  }
  layer {
    name: "data"
    type: kRecordInput
    store_conf { path: "test.bin" batchsize: 8 shape: 4 }
    exclude: kTrain
  }
  layer {
    name: "fc1"
    type: kInnerProduct
    srclayers: "data"
    innerproduct_conf { num_output: 3 }
    param { name: "w1" }
    param { name: "b1" }
  }
  layer {
    name: "relu1"
    type: kReLU
    srclayers: "fc1"
  }
  layer {
    name: "fc2"
    type: kInnerProduct
    srclayers: "relu1"
    innerproduct_conf { num_output: 2 }
    param { name: "w2" }
    param { name: "b2" }
  }
  layer {
    name: "loss"
    type: kSoftmaxLoss
    srclayers: "fc2"
    srclayers: "data"
  }
}
cluster {
  nworker_groups: 1
  nserver_groups: 1
  nworkers_per_group: 1
  nworkers_per_procs: 1
}
"""


def at(text: str, needle: str, occurrence: int = 0) -> str:
    """`line:col` (1-based) of the `occurrence`-th `needle` in `text`; a `^` in the needle marks the column."""
    offset = max(needle.find("^"), 0)
    needle = needle.replace("^", "")
    start = -1
    for _ in range(occurrence + 1):
        start = text.index(needle, start + 1)
    start += offset
    line = text.count("\n", 0, start) + 1
    return f"{line}:{start - (text.rfind(chr(10), 0, start) + 1) + 1}"


def error_for(tmp_path: Path, text: str, **kwargs) -> str:
    path = tmp_path / "job.conf"
    path.write_text(text)
    with pytest.raises(JobError) as caught:
        load_job(path, **kwargs)
    message = str(caught.value)
    assert "\n" not in message
    return message.replace(str(tmp_path) + "/", "")


def edit(old: str, new: str, count: int = 1) -> str:
    assert old in TINY, old
    return TINY.replace(old, new, count)


def test_the_base_job_is_valid(tmp_path):
    (tmp_path / "job.conf").write_text(TINY)
    assert load_job(tmp_path / "job.conf").name == "tiny"


# (edited job, needle the error points at (occurrence), message)
POSITIONED = {
    "unknown field": (
        edit("test_steps: 2", "test_stepz: 2"),
        ("test_stepz", 0),
        "JobProto has no field 'test_stepz' (did you mean 'test_steps'?)",
    ),
    "unknown enum value": (
        edit("type: kReLU", "type: kRelu"),
        ("kRelu", 0),
        "LayerType has no value 'kRelu' (did you mean 'kReLU'?)",
    ),
    "singular field twice": (
        edit("train_steps: 10", "train_steps: 10 train_steps: 20"),
        ("20", 0),
        "train_steps is given twice, but JobProto.train_steps is not a repeated field",
    ),
    "syntax": (edit('name: "fc2"', 'name: "fc2'), ('"fc2', 0), "String missing ending quote: '\"fc2'"),
    "srclayers names no layer": (
        edit('srclayers: "relu1"', 'srclayers: "relu7"'),
        ('"relu7"', 0),
        'srclayers "relu7" names no layer in the kTrain net',
    ),
    "duplicate name in a phase": (
        edit('name: "relu1"', 'name: "fc1"'),
        ('"fc1"', 1),
        'layer name "fc1" is used twice in the kTrain net',
    ),
    "include and exclude mixed": (
        edit("exclude: kTrain", "include: kTest"),
        ("kTest", 1),
        'include is used here and exclude by layer "data"; SINGA allows only one of them in a job',
    ),
    "cycle": (
        edit(
            'srclayers: "data"\n    innerproduct_conf { num_output: 3 }',
            'srclayers: "fc2"\n    innerproduct_conf { num_output: 3 }',
        ),
        ('"fc1"', 1),
        "cycle in the kTrain net: fc1 -> relu1 -> fc2 -> fc1",
    ),
    "self loop outside unrolling": (
        edit('srclayers: "fc1"', 'srclayers: "relu1"'),
        ('"relu1"', 1),
        "cycle in the kTrain net: relu1 -> relu1",
    ),
    "share_from names no param": (
        edit('param { name: "w2" }', 'param { name: "w2" share_from: "w9" }'),
        ('"w9"', 0),
        'share_from "w9" names no other param',
    ),
    "cluster counts": (
        edit("nworkers_per_group: 1", "nworkers_per_group: 0"),
        ("nworkers_per_group: ^0", 0),
        "nworkers_per_group must be >= 1, got 0",
    ),
    "worker groups per server group": (
        edit("nworker_groups: 1\n  nserver_groups: 1", "nworker_groups: 3\n  nserver_groups: 2"),
        ("nserver_groups: ^2", 0),
        "nworker_groups(3) must be a multiple of nserver_groups(2)",
    ),
    "workers per process": (
        edit("nworkers_per_group: 1\n  nworkers_per_procs: 1", "nworkers_per_group: 2\n  nworkers_per_procs: 3"),
        ("nworkers_per_procs: ^3", 0),
        "nworkers_per_procs(3) must divide nworkers_per_group(2) or be a multiple of it",
    ),
    "sync_freq": (
        edit("nworkers_per_procs: 1", "nworkers_per_procs: 1\n  sync_freq: 0"),
        ("sync_freq: ^0", 0),
        "sync_freq must be >= 1, got 0",
    ),
    "kStep without change_freq": (
        edit("type: kFixed base_lr: 0.1", "type: kStep base_lr: 0.1"),
        ("learning_rate", 0),
        "kStep needs step_conf { change_freq: N } with N > 0, got 0",
    ),
    "kStep with change_freq 0": (
        edit("type: kFixed base_lr: 0.1", "type: kStep step_conf { change_freq: 0 }"),
        ("change_freq: ^0", 0),
        "kStep needs step_conf { change_freq: N } with N > 0, got 0",
    ),
    "kFixedStep lists of different lengths": (
        edit("type: kFixed", "type: kFixedStep fixedstep_conf { step: 0 step: 5 step_lr: 0.1 }"),
        ("fixedstep_conf", 0),
        "kFixedStep needs as many step_lr as step values, got 2 step and 1 step_lr",
    ),
    "clip bounds": (
        edit("type: kSGD", "type: kSGD\n  clip_low: 5\n  clip_high: -5"),
        ("clip_low: ^5", 0),
        "clip_low(5) is above clip_high(-5)",
    ),
    "updater without type": (
        edit("type: kSGD\n", ""),
        ("updater", 0),
        "no updater type given: kSGD, kAdaGrad, kRMSProp, kNesterov, kAdaDelta, kAdam, kAdamMax, or kUserUpdater with user_type",
    ),
    "batch sizes per partition": (
        edit("batchsize: 8", "batchsize: 4 batchsize: 4"),
        ("batchsize: ^4", 0),
        "2 batch sizes for nworkers_per_group(1) partitions: give one (split evenly) or one per partition",
    ),
    "batch size 0": (edit("batchsize: 8", "batchsize: 0"), ("batchsize: ^0", 0), "batchsize must be > 0, got 0"),
    "layer without type": (
        edit("    type: kReLU\n", ""),
        ("layer {", 3),
        'layer "relu1" has no type (a built-in kXxx, or kUserLayer with user_type)',
    ),
    "alg missing": (
        edit("train_one_batch { alg: kBP }", "train_one_batch { }"),
        ("train_one_batch", 0),
        "no alg given: kBP, kCD, kBPTT, or kUserAlg with user_alg naming a registered algorithm",
    ),
    "negative frequency": (
        edit("test_steps: 2", "test_steps: 2\ntest_freq: -1"),
        ("test_freq: ^-1", 0),
        "test_freq must be >= 0, got -1",
    ),
    "location outside the group": (
        edit('name: "relu1"', 'name: "relu1"\n    location: 1'),
        ("location: ^1", 0),
        "location must be a worker of the group, 0..0 (nworkers_per_group(1)), or -1; got 1",
    ),
}


@pytest.mark.parametrize("case", POSITIONED)
def test_bad_file_errors_point_at_the_field(tmp_path, case):
    text, (needle, occurrence), message = POSITIONED[case]
    assert error_for(tmp_path, text) == f"job.conf:{at(text, needle, occurrence)}: {message}"


def test_srclayers_are_checked_in_the_phase_that_uses_them(tmp_path):
    text = edit('name: "fc2"', 'name: "fc2"\n    exclude: kTest')
    assert (
        error_for(tmp_path, text) == f'job.conf:{at(text, chr(34) + "fc2", 1)}: srclayers "fc2" names no layer in the kTest net'
    )
    # the test net is built (and checked) only when test_steps > 0, as SINGA does
    (tmp_path / "job.conf").write_text(text.replace("test_steps: 2", "test_steps: 0"))
    assert load_job(tmp_path / "job.conf").test_steps == 0


def test_missing_required_fields_name_the_field(tmp_path):
    assert error_for(tmp_path, edit('name: "tiny"\n', "")) == "job.conf: name: missing required field 'name'"
    no_steps = edit("train_steps: 10\n", "").replace("test_steps: 2", "test_steps: 0")
    assert (
        error_for(tmp_path, no_steps)
        == "job.conf: train_steps: missing required field 'train_steps' (or test_steps for a test-only job)"
    )
    assert error_for(tmp_path, edit("train_one_batch { alg: kBP }\n", "")) == (
        "job.conf: train_one_batch: missing required field 'train_one_batch' { alg: kBP | kCD | kBPTT }"
    )
    no_updater = TINY[: TINY.index("updater")] + TINY[TINY.index("neuralnet") :]
    assert (
        error_for(tmp_path, no_updater)
        == "job.conf: updater: missing required field 'updater' (a job with train_steps needs one)"
    )


def test_a_test_only_job_needs_no_updater(tmp_path):
    text = TINY.replace("train_steps: 10\n", "")
    (tmp_path / "job.conf").write_text(text[: text.index("updater")] + text[text.index("neuralnet") :])
    assert load_job(tmp_path / "job.conf").test_steps == 2


def test_same_name_in_different_phases_is_fine_and_phases_filter():
    job = load_job(FIXTURES / "mnist-mlp.conf")
    train, test = (layers_in_phase(job.neuralnet, p) for p in (job_pb2.kTrain, job_pb2.kTest))
    assert train[0].store_conf.batchsize == [64] and test[0].store_conf.batchsize == [100]
    assert len(train) == len(test) == len(job.neuralnet.layer) - 1
    assert (
        layers_in_phase(load_job(FIXTURES / "cifar10.conf").neuralnet, job_pb2.kVal)[0].name == "conv1"
    )  # include: kTrain/kTest only


def test_unrolled_recurrent_layer_may_name_itself(tmp_path):
    text = (FIXTURES / "char-rnn.conf").read_text().replace('srclayers: "onehot"', 'srclayers: "onehot"\n    srclayers: "gru1"')
    (tmp_path / "job.conf").write_text(text)
    assert load_job(tmp_path / "job.conf").neuralnet.layer[3].srclayers == ["onehot", "gru1"]


def test_dynamic_srclayer_must_name_a_layer(tmp_path):
    text = (FIXTURES / "char-rnn-sample.conf").read_text().replace('dynamic_srclayer: "argsort"', 'dynamic_srclayer: "argsrot"')
    assert (
        error_for(tmp_path, text)
        == f'job.conf:{at(text, chr(34) + "argsrot")}: dynamic_srclayer "argsrot" names no layer in the kTest net'
    )


def test_shape_check_errors_are_positioned(tmp_path):
    def shape_check(job):
        raise JobShapeError("neuralnet.layer[fc2].param[0]", "w2 has shape (2, 3) but its owner w1 has (3, 4)")

    (tmp_path / "job.conf").write_text(TINY)
    with pytest.raises(JobError) as caught:
        load_job(tmp_path / "job.conf", shape_check=shape_check)
    assert str(caught.value) == f"{tmp_path}/job.conf:{at(TINY, 'param', 2)}: w2 has shape (2, 3) but its owner w1 has (3, 4)"
    assert caught.value.field_path == "neuralnet.layer[4].param[0]"


def test_real_shape_check_reports_share_from_mismatch(tmp_path):
    from shoal.neuralnet.shapes import check_shapes

    text = edit('param { name: "w2" }', 'param { name: "w2" share_from: "w1" }')
    message = error_for(tmp_path, text, shape_check=check_shapes)
    assert message.startswith(f"job.conf:{at(text, 'param', 2)}: ") and "shape" in message


@pytest.mark.parametrize(
    "cluster, problems",
    [
        ({}, []),
        ({"nworkers_per_group": 2, "nworkers_per_procs": 4, "nworker_groups": 2}, []),  # a process holds whole groups
        ({"nworker_groups": 4, "nserver_groups": 2}, []),
        (
            {"nworker_groups": 0, "sync_freq": 0},
            [("nworker_groups", "nworker_groups must be >= 1, got 0"), ("sync_freq", "sync_freq must be >= 1, got 0")],
        ),
        (
            {"nservers_per_group": 4, "nservers_per_procs": 3},
            [("nservers_per_procs", "nservers_per_procs(3) must divide nservers_per_group(4) or be a multiple of it")],
        ),
    ],
)
def test_validate_cluster(cluster, problems):
    assert validate_cluster(job_pb2.ClusterProto(**cluster)) == problems


def test_job_error_formats_and_pickles():
    assert str(JobError("job.conf", "boom", 12, 5, "neuralnet.layer[3]")) == "job.conf:12:5: boom"
    assert (
        str(JobError("job.yaml", "boom", 12, 5, "neuralnet.layer[3]", show_path=True))
        == "job.yaml:12:5: neuralnet.layer[3]: boom"
    )
    assert str(JobError("<python>", "boom", field_path="train_steps")) == "<python>: train_steps: boom"
    assert str(JobError("job.conf", "two\nlines")) == "job.conf: two lines"
    error = pickle.loads(pickle.dumps(JobError("job.yaml", "boom", 1, 2, "name", show_path=True)))
    assert (str(error), error.line, error.col, error.field_path) == ("job.yaml:1:2: name: boom", 1, 2, "name")


def test_the_cli_exits_with_the_one_line_error(tmp_path, capsys):
    from shoal.frontend.cli import main

    text = edit('srclayers: "relu1"', 'srclayers: "relu7"')
    (tmp_path / "job.conf").write_text(text)
    assert main(["plan", str(tmp_path / "job.conf")]) == 2
    assert (
        capsys.readouterr().err
        == f'{tmp_path}/job.conf:{at(text, chr(34) + "relu7")}: srclayers "relu7" names no layer in the kTrain net\n'
    )
    assert main(["plan", str(tmp_path / "job.conf"), "--set", "cluster.nworkrs=2"]) == 2
    assert capsys.readouterr().err.startswith("--set cluster.nworkrs=2: ClusterProto has no field 'nworkrs'")
