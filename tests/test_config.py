"""Job files: SINGA 0.3 files parse unmodified; bad files give positioned one-line errors."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from google.protobuf import json_format

from shoal.api import load_job as load_checked  # with shape checking, as the CLI uses it
from shoal.config import JobError, job_pb2, load_job
from shoal.config.loader import apply_overrides

from conftest import REPO

FIXTURES = Path(__file__).parent / "fixtures" / "singa"
FRAMEWORKS = {
    "sandblaster": "nworker_groups: 1  nserver_groups: 1  nworkers_per_group: 3  nservers_per_group: 2  server_worker_separate: true",
    "allreduce": "nworker_groups: 1  nserver_groups: 1  nworkers_per_group: 3  nservers_per_group: 3  server_worker_separate: false",
    "downpour": "nworker_groups: 2  nserver_groups: 1  nworkers_per_group: 2  nservers_per_group: 2  server_worker_separate: true",
    "hogwild": "nworker_groups: 3  nserver_groups: 3  nworkers_per_group: 1  nservers_per_group: 1  server_worker_separate: false",
    "inmem-downpour": "nworker_groups: 2  nworkers_per_procs: 2",
    "inmem-sandblaster": "nworkers_per_group: 2  nworkers_per_procs: 2",
}


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.conf")) + sorted((REPO / "examples").glob("*/*.conf")), ids=lambda p: p.name)
def test_singa_files_parse_and_validate_unmodified(path):
    job = load_job(path)
    assert job.name and job.neuralnet.layer


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("*/*.conf")), ids=lambda p: p.name)
def test_examples_pass_shape_checks(path):
    load_checked(path)


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_framework_cluster_snippets_from_the_seed_docs(tmp_path, name):
    text = (REPO / "examples/mnist/job.conf").read_text()
    text = text[: text.index("cluster {")] + "cluster {\n  " + FRAMEWORKS[name] + "\n}\n"
    path = tmp_path / "job.conf"
    path.write_text(text)
    assert load_job(path).cluster.nworker_groups >= 1


def test_singa_defaults_are_kept():
    job = job_pb2.JobProto()
    assert job.cluster.nworker_groups == 1 and job.cluster.share_memory and job.cluster.sync_freq == 1
    assert job.reset_param_version and job.num_openblas_threads == 1
    assert job.updater.delta == pytest.approx(1e-8)
    assert job.neuralnet.layer.add().partition_dim == -1
    assert job_pb2.LayerProto().type == job_pb2.kUserLayer
    assert job_pb2.kSTanh == 212 and job_pb2.kSoftmaxLoss == 301 and job_pb2.kCudnnBM == 255 and job_pb2.kRNNDummy == 505


MLP = (REPO / "examples/mnist/job.conf").read_text()


def error_for(tmp_path, text: str, name="job.conf", check_shapes=False) -> str:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(JobError) as err:
        (load_checked if check_shapes else load_job)(path)
    message = str(err.value)
    assert "\n" not in message
    return message


def line_of(text: str, needle: str, occurrence: int = 0) -> int:
    lines = [i + 1 for i, l in enumerate(text.splitlines()) if needle in l]
    return lines[occurrence]


def test_unknown_field(tmp_path):
    text = MLP.replace("disp_freq: 10", "disp_frequency: 10")
    assert error_for(tmp_path, text).startswith(f"{tmp_path}/job.conf:{line_of(text, 'disp_frequency')}:1: JobProto has no field \"disp_frequency\"")


def test_unknown_enum(tmp_path):
    text = MLP.replace("type: kSTanh", "type: kSuperTanh", 1)
    msg = error_for(tmp_path, text)
    assert f"job.conf:{line_of(text, 'kSuperTanh')}:" in msg and "kSuperTanh" in msg


def test_missing_srclayer(tmp_path):
    text = MLP.replace('srclayers: "tanh3"', 'srclayers: "tanh33"')
    msg = error_for(tmp_path, text)
    line = line_of(text, '"tanh33"')
    assert f"job.conf:{line}:5: srclayers \"tanh33\" names no layer in the kTrain net" in msg


def test_duplicate_layer_name(tmp_path):
    text = MLP.replace('name: "tanh2"', 'name: "tanh1"')
    msg = error_for(tmp_path, text)
    line = line_of(text, 'name: "tanh1"', 1)
    assert f":{line}:" in msg and "duplicate layer name 'tanh1'" in msg


def test_cycle(tmp_path):
    text = MLP.replace('srclayers: "data"\n    innerproduct_conf {\n      num_output: 2500', 'srclayers: "tanh2"\n    innerproduct_conf {\n      num_output: 2500')
    msg = error_for(tmp_path, text)
    assert "cycle in the kTrain net" in msg and "fc1 -> tanh1 -> fc2 -> tanh2 -> fc1" in msg


def test_rbm_pair_is_not_a_cycle():
    assert load_job(FIXTURES / "rbm1.conf").train_one_batch.alg == job_pb2.kCD


def test_share_from_missing(tmp_path):
    text = MLP.replace('name: "w2"', 'name: "w2"\n      share_from: "w9"')
    assert "share_from 'w9' names no param" in error_for(tmp_path, text)


def test_share_from_shape_mismatch(tmp_path):
    text = MLP.replace('name: "w2"', 'name: "w2"\n      share_from: "w1"')
    msg = error_for(tmp_path, text, check_shapes=True)
    line = line_of(text, 'name: "w2"') - 1  # the param block
    assert f"job.conf:{line}:" in msg and "shape" in msg


def test_include_and_exclude_mixed(tmp_path):
    text = MLP.replace("exclude: kTrain", "include: kTest")
    assert "include and exclude are both used" in error_for(tmp_path, text)


def test_shapes_that_do_not_fit(tmp_path):
    conv = (REPO / "examples/mnist/conv.conf").read_text().replace("kernel: 5", "kernel: 50", 1)
    msg = error_for(tmp_path, conv, check_shapes=True)
    line = line_of(conv, 'name: "conv1"') - 1
    assert f"job.conf:{line}:" in msg and "does not fit" in msg


def test_missing_required_fields(tmp_path):
    assert "missing required field name" in error_for(tmp_path, MLP.replace('name: "mlp"\n', ""))
    assert "missing train_one_batch" in error_for(tmp_path, MLP.replace("train_one_batch {\n  alg: kBP\n}\n", ""))


def test_cluster_arithmetic(tmp_path):
    text = MLP.replace("nworker_groups: 1\n  nserver_groups: 1", "nworker_groups: 3\n  nserver_groups: 2")
    assert "nworker_groups(3) must be a multiple of nserver_groups(2)" in error_for(tmp_path, text)


def test_batchsize_list_must_match_partitions(tmp_path):
    text = MLP.replace("batchsize: 64", "batchsize: 40\n      batchsize: 24\n      batchsize: 1")
    assert "3 batch sizes given for 1 partitions" in error_for(tmp_path, text)


def test_missing_job_file(tmp_path):
    with pytest.raises(JobError, match="no such job file"):
        load_job(tmp_path / "nope.conf")


def test_yaml_gives_the_same_job_as_text(tmp_path):
    text_job = load_job(REPO / "examples/mnist/job.conf")
    as_dict = json_format.MessageToDict(text_job, preserving_proto_field_name=True)
    as_dict.pop("job_dir")
    # a scalar where a repeated field is expected is accepted, as in text format
    as_dict["neuralnet"]["layer"][0]["exclude"] = "kTest"
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(as_dict))
    yaml_job = load_job(path)
    yaml_job.ClearField("job_dir")
    text_job.ClearField("job_dir")
    assert yaml_job == text_job


def test_yaml_errors_name_the_field_path(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("name: x\ntrain_steps: 5\ntrain_one_batch: {alg: kBP}\nupdater: {type: kSGD, learning_rate: {type: kFixed}}\n"
                    "neuralnet:\n  layer:\n    - {name: a, type: kDummy}\n    - {name: b, type: kReLU, srclayers: [zz]}\n")
    with pytest.raises(JobError) as err:
        load_job(path)
    assert str(err.value) == f"{path}: neuralnet.layer[1].srclayers[0]: srclayers \"zz\" names no layer in the kTrain net"
    path.write_text("name: x\nneuralnet: {layer: [{name: a, type: kNope}]}\n")
    with pytest.raises(JobError, match="kNope"):
        load_job(path)
    path.write_text("name: [unclosed\n")
    with pytest.raises(JobError, match=r"job.yaml:\d+:\d+"):
        load_job(path)


def test_overrides():
    job = load_job(REPO / "examples/mnist/job.conf")
    apply_overrides(
        job,
        ["train_steps=7", "cluster.nworkers_per_group=2", "updater.learning_rate.base_lr=0.5", "neuralnet.layer[name=fc1].innerproduct_conf.num_output=11",
         "neuralnet.layer[3].innerproduct_conf.bias_term=false", "gpu=0,1", "train_one_batch.alg=kCD"],
    )
    assert job.train_steps == 7 and job.cluster.nworkers_per_group == 2
    assert job.updater.learning_rate.base_lr == pytest.approx(0.5)
    assert job.neuralnet.layer[2].innerproduct_conf.num_output == 11
    assert job.neuralnet.layer[3].innerproduct_conf.bias_term is False
    assert list(job.gpu) == [0, 1] and job.train_one_batch.alg == job_pb2.kCD


@pytest.mark.parametrize(
    "override, fragment",
    [("cluster.nworkrs=2", "ClusterProto has no field 'nworkrs'"), ("train_steps=many", "'many' is not a valid value"),
     ("neuralnet.layer[name=nope].name=x", "no layer named 'nope'"), ("neuralnet.layer[99].name=x", "layer[99] does not exist"),
     ("train_one_batch.alg=kMagic", "'kMagic'"), ("train_steps", "expected FIELD=VALUE")],
)
def test_bad_overrides(override, fragment):
    job = load_job(REPO / "examples/mnist/job.conf")
    with pytest.raises(JobError) as err:
        apply_overrides(job, [override])
    assert fragment in str(err.value)
