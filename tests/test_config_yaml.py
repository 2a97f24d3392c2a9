"""Jobs as YAML, JSON or Python dicts: the same JobProto as text format, errors with field path and position."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from shoal.config import JobError, job_from_dict, job_pb2, load_job

FIXTURES = Path(__file__).parent / "fixtures"

TINY = """\
name: tiny
train_steps: 5
train_one_batch: {alg: kBP}
updater: {type: kSGD, learning_rate: {type: kFixed, base_lr: 1e-3}}
neuralnet:
  layer:
    - {name: a, type: kDummy}
    - {name: b, type: kReLU, srclayers: a}
"""


def without_job_dir(job: job_pb2.JobProto) -> job_pb2.JobProto:
    job.ClearField("job_dir")
    return job


def test_yaml_fixture_is_the_same_job_as_the_text_conf():
    text_job = load_job(FIXTURES / "singa" / "mnist-mlp.conf")
    yaml_job = load_job(FIXTURES / "mnist-mlp.yaml")
    assert without_job_dir(yaml_job) == without_job_dir(text_job)


def test_dict_and_json_give_the_same_job(tmp_path):
    data = yaml.safe_load((FIXTURES / "mnist-mlp.yaml").read_text())
    expected = without_job_dir(load_job(FIXTURES / "mnist-mlp.yaml"))
    assert job_from_dict(data) == expected
    (tmp_path / "job.json").write_text(json.dumps(data, indent=2))
    assert without_job_dir(load_job(tmp_path / "job.json")) == expected


def test_yaml_scalars_follow_the_field_types():
    job = job_from_dict(yaml.safe_load(TINY))
    assert job.updater.learning_rate.base_lr == pytest.approx(1e-3)  # "1e-3" is a string to YAML 1.1
    assert list(job.neuralnet.layer[1].srclayers) == ["a"]  # a scalar for a repeated field
    assert job.neuralnet.layer[1].type == job_pb2.kReLU


def yaml_error(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(JobError) as caught:
        load_job(path)
    assert "\n" not in str(caught.value)
    return str(caught.value).replace(str(tmp_path) + "/", "")


def at(text: str, needle: str) -> str:
    """`line:col` (1-based) of `needle` in `text`; a `^` in the needle marks the column."""
    start = text.index(needle.replace("^", "")) + max(needle.find("^"), 0)
    return f"{text.count(chr(10), 0, start) + 1}:{start - text.rfind(chr(10), 0, start)}"


# (replace, with, where the error points, message after the position)
YAML_ERRORS = [
    ("srclayers: a", "srclayers: [zz]", "zz", 'neuralnet.layer[1].srclayers[0]: srclayers "zz" names no layer in the kTrain net'),
    ("type: kReLU", "typ: kReLU", "typ: kReLU", "neuralnet.layer[1].typ: LayerProto has no field 'typ' (did you mean 'type'?)"),
    ("type: kDummy", "type: kDumy", "kDumy", "neuralnet.layer[0].type: LayerType has no value 'kDumy' (did you mean 'kDummy'?)"),
    ("train_steps: 5", "train_steps: many", "many", "train_steps: train_steps takes an integer, not a string 'many'"),
    ("train_steps: 5", "train_steps: 2.5", "2.5", "train_steps: train_steps takes an integer, not float 2.5"),
    (
        "train_steps: 5",
        "train_steps: 99999999999",
        "9999",
        "train_steps: train_steps takes an integer in [-2147483648, 2147483647], not 99999999999",
    ),
    ("name: tiny", "name: [a, b]", "[a, b]", "name: name is not repeated: give one value, not a list"),
    ("{alg: kBP}", "kBP", "kBP", "train_one_batch: expected a mapping of AlgProto fields, got a string"),
    (
        "type: kFixed,",
        "type: kStep,",
        "learning_rate",
        "updater.learning_rate.step_conf.change_freq: kStep needs step_conf { change_freq: N } with N > 0, got 0",
    ),
    (
        "srclayers: a}",
        "srclayers: a, name: c}",
        "a, ^name: c",
        "'name' is given twice; a repeated field takes a list: name: [a, b]",
    ),
    (
        "name: tiny",
        "name: tiny\nname: other",
        "name: other",
        "'name' is given twice; a repeated field takes a list: name: [a, b]",
    ),
    ("{alg: kBP}\n", "{alg: kBP\n", "updater^:", "expected ',' or '}', but got ':'"),
]


@pytest.mark.parametrize("old, new, needle, message", YAML_ERRORS, ids=[case[3][:40] for case in YAML_ERRORS])
def test_yaml_errors_give_field_path_and_position(tmp_path, old, new, needle, message):
    assert old in TINY
    text = TINY.replace(old, new, 1)
    assert yaml_error(tmp_path, text) == f"job.yaml:{at(text, needle)}: {message}"


def test_yaml_that_is_not_a_mapping(tmp_path):
    assert yaml_error(tmp_path, "- a\n- b\n") == "job.yaml: expected a mapping of JobProto fields, got a list"
    assert yaml_error(tmp_path, "") == "job.yaml: name: missing required field 'name'"


def test_dict_errors_name_the_field_path():
    data = yaml.safe_load(TINY)
    data["neuralnet"]["layer"][1]["srclayers"] = ["a", "zz"]
    with pytest.raises(JobError) as caught:
        job_from_dict(data)
    assert str(caught.value) == '<python>: neuralnet.layer[1].srclayers[1]: srclayers "zz" names no layer in the kTrain net'
    assert (caught.value.source, caught.value.line, caught.value.field_path) == (
        "<python>",
        None,
        "neuralnet.layer[1].srclayers[1]",
    )
    with pytest.raises(
        JobError, match=r"^<python>: cluster\.nworkers_per_group: nworkers_per_group takes an integer, not a mapping"
    ):
        job_from_dict({**yaml.safe_load(TINY), "cluster": {"nworkers_per_group": {"x": 2}}})
