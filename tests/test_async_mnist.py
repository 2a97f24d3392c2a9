"""Every framework trains an MLP on real MNIST to a stated accuracy within a step budget (CLI, real processes)."""
from __future__ import annotations

import json
import os

import pytest
from cli_in_process import run_cli
from layouts import LAYOUTS, assert_ran

STEPS = 150  # per group
ACCURACY = 0.85  # test accuracy after STEPS steps of 64 (measured: single 0.88, Downpour 0.88, Hogwild 0.90)


def mlp_job(mnist_dir, layout: str) -> str:
    """The MNIST MLP on a row of tests/layouts.py."""
    return f"""
name: "mnist-small-mlp"
train_steps: {STEPS}
test_steps: 20
test_freq: {STEPS}
disp_freq: 50
train_one_batch {{ alg: kBP }}
updater {{ type: kSGD momentum: 0.9 learning_rate {{ type: kFixed base_lr: 0.05 }} }}
neuralnet {{
  layer {{ name: "data" type: kRecordInput exclude: kTest
    store_conf {{ backend: "kvfile" path: "{mnist_dir}/train_data.bin" batchsize: 64 shape: 784 std_value: 255 random_skip: 5000 }} }}
  layer {{ name: "data" type: kRecordInput exclude: kTrain
    store_conf {{ backend: "kvfile" path: "{mnist_dir}/test_data.bin" batchsize: 100 shape: 784 std_value: 255 }} }}
  layer {{ name: "fc1" type: kInnerProduct srclayers: "data" innerproduct_conf {{ num_output: 128 }}
    param {{ name: "w1" init {{ type: kUniform low: -0.05 high: 0.05 }} }} param {{ name: "b1" init {{ type: kConstant value: 0 }} }} }}
  layer {{ name: "relu" type: kReLU srclayers: "fc1" }}
  layer {{ name: "fc2" type: kInnerProduct srclayers: "relu" innerproduct_conf {{ num_output: 10 }}
    param {{ name: "w2" init {{ type: kUniform low: -0.05 high: 0.05 }} }} param {{ name: "b2" init {{ type: kConstant value: 0 }} }} }}
  layer {{ name: "loss" type: kSoftmaxLoss srclayers: "fc2" srclayers: "data" }}
}}
{LAYOUTS[layout].section()}
"""


FRAMEWORKS = [  # rows of tests/layouts.py; the mechanics of each are tested on small data (test_async.py, test_sync.py)
    "single worker",
    pytest.param("in-memory Sandblaster, 2 threads", marks=pytest.mark.slow),
    pytest.param("in-memory Hogwild, 2 groups", marks=pytest.mark.slow),
    pytest.param("Downpour, 2 groups + 1 server, 3 processes", marks=pytest.mark.slow),
    pytest.param("Distributed Hogwild, 2 groups", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_framework_trains_mnist(mnist_dir, tmp_path, framework):
    job = tmp_path / "job.conf"
    job.write_text(mlp_job(mnist_dir, framework))
    env = {**os.environ, "SHOAL_COMM_TIMEOUT": "30"}
    # `shoal run` in this process (no interpreter to start and torch to import for it); the ranks are real processes
    proc = run_cli("run", job, "--workspace", tmp_path / "ws", env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert_ran(tmp_path / "ws", framework)
    records = [json.loads(line) for line in (tmp_path / "ws" / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in records if r["phase"] == "test"][-1]
    assert final["step"] == STEPS and final["accuracy"] >= ACCURACY, final
