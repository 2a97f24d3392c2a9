"""RBMs trained by contrastive divergence (kCD) and the deep autoencoder they initialise, on real MNIST.

The tests run examples/rbm/*.conf as a user would (shoal.train / shoal.evaluate, --set
overrides) with narrower layers and fewer steps, so the whole stack trains in seconds.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from cli_in_process import run_cli
from conftest import REPO

import shoal
from layouts import LAYOUTS, assert_ran
from shoal.neuralnet import checkpoint as ckpt_io

EXAMPLES = REPO / "examples" / "rbm"
SMALL = [784, 96, 48, 24, 8]  # the stack's widths (SINGA: 784-1000-500-250-30)
QUIET = {"log": lambda *a: None}
GROUPS = {  # synchronous 2-worker groups: threads of one process, or two processes (rows of tests/layouts.py)
    "2 threads": "in-memory Sandblaster, 2 threads",
    "2 processes": "AllReduce, 2 processes",
}


def data_sets(mnist_dir) -> list[str]:
    return [
        f"neuralnet.layer[0].store_conf.path={mnist_dir / 'train_data.bin'}",
        f"neuralnet.layer[1].store_conf.path={mnist_dir / 'test_data.bin'}",
    ]


def rbm_job(k, mnist_dir, root, steps=None, dims=SMALL, extra=()):
    # the Gaussian top RBM learns at lr 0.001 (as SINGA's rbm4.conf): it gets more steps
    steps = steps or (300 if k == 4 else 60)
    sets = data_sets(mnist_dir) + [f"train_steps={steps}", f"test_freq={steps // 3}", "test_steps=5", f"cluster.workspace={root / f'rbm{k}'}"]
    sets += [f"neuralnet.layer[name=Inner{j}].innerproduct_conf.num_output={dims[j]}" for j in range(1, k)]
    sets += [f"neuralnet.layer[name={name}].rbm_conf.hdim={dims[k]}" for name in ("RBMVis", "RBMHid")]
    if k > 1:
        sets.append(f"checkpoint_path={root / f'rbm{k - 1}'}")
    return shoal.load_job(EXAMPLES / f"rbm{k}.conf", sets + list(extra))


def autoencoder_job(mnist_dir, root, steps=100, dims=SMALL):
    sets = data_sets(mnist_dir) + [f"train_steps={steps}", f"test_freq={steps}", "test_steps=10", f"cluster.workspace={root / 'autoencoder'}"]
    sets += [f"neuralnet.layer[name=Inner{j}].innerproduct_conf.num_output={dims[j]}" for j in range(1, 5)]
    sets += [f"neuralnet.layer[name=Inner{9 - j}].innerproduct_conf.num_output={dims[j - 1]}" for j in range(2, 5)]
    sets.append("checkpoint_path=" + ",".join(str(root / f"rbm{k}") for k in range(1, 5)))
    return shoal.load_job(EXAMPLES / "autoencoder.conf", sets)


@pytest.fixture(scope="session")  # not rebuilt when xdist interleaves another module's tests (loadgroup keeps its tests on one worker)
def stack(mnist_dir, tmp_path_factory):
    """The four RBMs, each trained on the features of the ones below it: (root, {k: test errors})."""
    root = tmp_path_factory.mktemp("rbm")
    errors = {}
    for k in range(1, 5):
        history = shoal.train(rbm_job(k, mnist_dir, root), **QUIET)
        errors[k] = [r["Squared Error"] for r in history.phase("test")]
    return root, errors


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.xdist_group("rbm_stack")  # one worker builds the module's fixture (scripts/test.sh: --dist loadgroup)
def test_each_rbm_reconstruction_error_falls_steadily(stack, k):
    _, errors = stack
    assert len(errors[k]) == 4  # at 0, 1/3 and 2/3 of the steps, and the final test
    assert all(b < a for a, b in zip(errors[k], errors[k][1:])), errors[k]
    assert errors[k][-1] < 0.85 * errors[k][0], errors[k]


@pytest.mark.xdist_group("rbm_stack")  # one worker builds the module's fixture (scripts/test.sh: --dist loadgroup)
def test_later_rbms_start_from_the_earlier_ones_checkpoints(stack):
    root, _ = stack
    rbm1 = ckpt_io.load(ckpt_io.latest(root / "rbm1")).params
    rbm4 = ckpt_io.load(ckpt_io.latest(root / "rbm4")).params
    # RBM 1's weights feed RBMs 2-4 but only kCD's RBM pair is trained: they arrive unchanged
    torch.testing.assert_close(rbm4["w1"], rbm1["w1"], rtol=0, atol=0)
    assert set(rbm4) == {"w1", "b12", "w2", "b22", "w3", "b32", "w4", "b41", "b42"}


@pytest.mark.xdist_group("rbm_stack")  # one worker builds the module's fixture (scripts/test.sh: --dist loadgroup)
def test_finetuned_autoencoder_reconstructs_test_digits_better_than_the_rbm_stack(stack, mnist_dir, tmp_path):
    root, _ = stack
    job = autoencoder_job(mnist_dir, root)
    before = shoal.evaluate(job, workspace=tmp_path / "before", **QUIET)["loss"]
    after = shoal.train(job, **QUIET).final_test["loss"]
    assert after < 0.8 * before, (before, after)


@pytest.mark.parametrize("k", [1, 4])  # binary and Gaussian hidden units
@pytest.mark.parametrize("layout", GROUPS)
@pytest.mark.xdist_group("rbm_stack")  # one worker builds the module's fixture (scripts/test.sh: --dist loadgroup)
def test_two_workers_train_the_same_rbm_as_one(stack, mnist_dir, tmp_path, k, layout):
    """Hidden units are sampled per row of the whole batch, so a 2-worker group draws what one worker draws."""
    root, _ = stack
    params = []
    for name, row in (("one", "single worker"), ("two", GROUPS[layout])):
        job = rbm_job(k, mnist_dir, root, steps=8, extra=[f"cluster.workspace={tmp_path / name}", "test_steps=0"] + LAYOUTS[row].overrides())
        shoal.train(job, **QUIET)
        assert_ran(tmp_path / name, row)
        params.append(ckpt_io.load(ckpt_io.latest(tmp_path / name)).params)
    for name in params[0]:
        torch.testing.assert_close(params[1][name], params[0][name], rtol=1e-5, atol=1e-6)


def run_pipeline(mnist_dir, workspace, *args) -> dict:
    """examples/rbm/run.py as a user runs it; checks what every run must show and returns its summary."""
    data = [f"--set=neuralnet.layer[0].store_conf.path={mnist_dir / 'train_data.bin'}", f"--set=neuralnet.layer[1].store_conf.path={mnist_dir / 'test_data.bin'}"]
    cmd = [sys.executable, str(EXAMPLES / "run.py"), "--workspace", str(workspace), *data, *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800)
    summary = json.loads((workspace / "summary.json").read_text())
    for k in "1234":
        assert summary["rbm"][k]["last"] < summary["rbm"][k]["first"], summary
    assert summary["after_finetuning"] < summary["before_finetuning"], summary
    assert summary["test_store"] == str(mnist_dir / "test_data.bin")  # the pictures' digits come from the job's test store
    for picture in ("filters.png", "reconstructions.png"):
        assert (workspace / picture).stat().st_size > 10_000
    return summary


@pytest.mark.slow  # the default suite's 5-minute budget (its RBMs train in the default tests below; this runs the example end to end)
def test_pipeline_script_trains_a_narrow_stack_and_draws_pictures(mnist_dir, tmp_path):
    """examples/rbm/run.py end to end in seconds: a 784-32-16-8-4 stack, 10 CD steps per RBM, 100 fine-tuning steps."""
    run_pipeline(mnist_dir, tmp_path, "--dims", "784,32,16,8,4", "--steps", "10", "--finetune-steps", "100", "--set=test_steps=5")


@pytest.mark.slow
def test_pipeline_script_trains_the_full_size_stack_and_draws_pictures(mnist_dir, tmp_path):
    """examples/rbm/run.py at SINGA's widths, CI-sized step counts."""
    run_pipeline(mnist_dir, tmp_path, "--steps", "150", "--finetune-steps", "150")


def test_cd_without_an_rbm_is_refused_before_training(tmp_path):
    conf = (EXAMPLES / "autoencoder.conf").read_text().replace("alg: kBP", "alg: kCD")
    (tmp_path / "job.conf").write_text(conf)
    result = run_cli("run", tmp_path / "job.conf", cwd=tmp_path, timeout=300)  # (in this process: a refusal, nothing runs)
    assert result.returncode == 2
    at = conf.index("kCD")
    line, col = conf[:at].count("\n") + 1, at - conf.rindex("\n", 0, at)
    assert result.stderr.strip().splitlines() == [f"{tmp_path / 'job.conf'}:{line}:{col}: kCD needs a kRBMVis/kRBMHid pair in the kTrain net"]
