"""`--set path.to.field=value` overrides: applied before validation, errors name the override."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.config import JobError, apply_overrides, job_pb2, load_job

MLP = Path(__file__).parent / "fixtures" / "singa" / "mnist-mlp.conf"


def test_overrides_set_fields_of_every_kind():
    job = load_job(
        MLP,
        [
            "train_steps=7",
            "cluster.nworkers_per_group=2",
            "updater.learning_rate.base_lr=0.5",
            "neuralnet.layer[name=fc1].innerproduct_conf.num_output=11",
            "neuralnet.layer[4].innerproduct_conf.bias_term=false",
            "neuralnet.layer[0].store_conf.path='other.bin'",
            "gpu=0,1",
            "gpu[1]=3",
            "train_one_batch.alg=kCD",
            "updater.type=kAdaGrad",
        ],
    )
    assert job.train_steps == 7 and job.cluster.nworkers_per_group == 2
    assert job.updater.learning_rate.base_lr == pytest.approx(0.5)
    assert job.neuralnet.layer[2].innerproduct_conf.num_output == 11
    assert job.neuralnet.layer[4].innerproduct_conf.bias_term is False
    assert job.neuralnet.layer[0].store_conf.path == "other.bin"
    assert list(job.gpu) == [0, 3] and job.train_one_batch.alg == job_pb2.kCD and job.updater.type == job_pb2.kAdaGrad


def test_apply_overrides_returns_the_paths_it_set():
    job = load_job(MLP)
    assert apply_overrides(job, ["neuralnet.layer[name=fc2].param[0].lr_scale=2", "gpu=1"]) == {
        "neuralnet.layer[4].param[0].lr_scale": "neuralnet.layer[name=fc2].param[0].lr_scale=2",
        "gpu": "gpu=1",
    }


@pytest.mark.parametrize(
    "override, message",
    [
        ("cluster.nworkrs=2", "ClusterProto has no field 'nworkrs' (did you mean 'nworker_groups'?)"),
        ("cluster.nworkers_per_grop=2", "ClusterProto has no field 'nworkers_per_grop' (did you mean 'nworkers_per_group'?)"),
        ("train_steps=many", "train_steps takes an integer, not 'many'"),
        ("train_steps=99999999999", "train_steps: Value out of range: 99999999999"),
        ("debug=maybe", "debug takes true or false, not 'maybe'"),
        ("updater.momentum=fast", "momentum takes a number, not 'fast'"),
        ("train_one_batch.alg=kMagic", "AlgType has no value 'kMagic'"),
        ("neuralnet.layer[name=nope].name=x", 'no layer named "nope"'),
        ("neuralnet.layer[99].name=x", "layer[99] does not exist: there are 14"),
        ("neuralnet.layer.name=x", "layer is repeated: say which, e.g. layer[0] or layer[name=...]"),
        ("cluster=2", "cluster is a message: set one of its fields, e.g. cluster.nworker_groups=..."),
        ("train_steps.x=2", "train_steps is not a message, so it has no field 'x'"),
        ("train_steps[0]=2", "train_steps is not repeated: drop [0]"),
        ("train_steps", "expected FIELD=VALUE, e.g. cluster.nworkers_per_group=2"),
        ("cluster.nworker-groups=2", "cannot read 'nworker-groups': expected name, name[index] or name[name=...]"),
    ],
)
def test_bad_overrides_name_the_override(override, message):
    with pytest.raises(JobError) as caught:
        load_job(MLP, [override])
    assert str(caught.value) == f"--set {override}: {message}"


def test_validation_errors_caused_by_an_override_name_it():
    with pytest.raises(JobError) as caught:
        load_job(MLP, ["cluster.nworkers_per_group=0"])
    assert str(caught.value) == "--set cluster.nworkers_per_group=0: nworkers_per_group must be >= 1, got 0"
    # the file's own position of an overridden field no longer applies
    with pytest.raises(JobError) as caught:
        load_job(MLP, ["neuralnet.layer[name=fc2].srclayers=fc9"])
    assert str(caught.value) == '--set neuralnet.layer[name=fc2].srclayers=fc9: srclayers "fc9" names no layer in the kTrain net'
    # a problem the override causes elsewhere points into the file
    with pytest.raises(JobError) as caught:
        load_job(MLP, ["neuralnet.layer[name=fc1].name=fc0"])
    text = MLP.read_text()
    start = text.index('srclayers:"fc1"') + len("srclayers:")
    line, col = text.count("\n", 0, start) + 1, start - text.rfind("\n", 0, start)
    assert str(caught.value) == f'{MLP}:{line}:{col}: srclayers "fc1" names no layer in the kTrain net'
