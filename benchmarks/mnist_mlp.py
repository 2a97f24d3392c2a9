"""The small MNIST MLP that the asynchronous benchmarks and their slow tests train: 784-256-128-10, ReLU, SGD with
momentum 0.9, batch 64 per group, Gaussian init. One job text, varied by its arguments, so that every figure in
docs/async.md and docs/benchmarks.md comes from the same net.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional


def small_mlp(data: Path, *, steps: int = 400, lr: float = 0.05, seed: int = 1, batch: int = 64, random_skip: int = 5000,
              name: str = "small-mlp", disp_freq: int = 100, disp_after: Optional[int] = None) -> str:
    """The job text: `steps` steps tested once at the end on the whole test set (100 batches of 100) of MNIST in `data`."""
    after = f"disp_after: {disp_after}\n" if disp_after is not None else ""
    return f"""
name: "{name}"
train_steps: {steps}
test_steps: 100
test_freq: {steps}
disp_freq: {disp_freq}
{after}seed: {seed}
train_one_batch {{ alg: kBP }}
updater {{ type: kSGD momentum: 0.9 learning_rate {{ type: kFixed base_lr: {lr} }} }}
neuralnet {{
  layer {{ name: "data" type: kRecordInput include: kTrain
          store_conf {{ backend: "kvfile" path: "{data}/train_data.bin" batchsize: {batch} shape: 784 std_value: 255 random_skip: {random_skip} }} }}
  layer {{ name: "data" type: kRecordInput include: kTest
          store_conf {{ backend: "kvfile" path: "{data}/test_data.bin" batchsize: 100 shape: 784 std_value: 255 }} }}
  layer {{ name: "fc1" type: kInnerProduct srclayers: "data" innerproduct_conf {{ num_output: 256 }}
          param {{ name: "w1" init {{ type: kGaussian std: 0.05 }} }} param {{ name: "b1" init {{ type: kConstant value: 0 }} }} }}
  layer {{ name: "relu1" type: kReLU srclayers: "fc1" }}
  layer {{ name: "fc2" type: kInnerProduct srclayers: "relu1" innerproduct_conf {{ num_output: 128 }}
          param {{ name: "w2" init {{ type: kGaussian std: 0.05 }} }} param {{ name: "b2" init {{ type: kConstant value: 0 }} }} }}
  layer {{ name: "relu2" type: kReLU srclayers: "fc2" }}
  layer {{ name: "fc3" type: kInnerProduct srclayers: "relu2" innerproduct_conf {{ num_output: 10 }}
          param {{ name: "w3" init {{ type: kGaussian std: 0.05 }} }} param {{ name: "b3" init {{ type: kConstant value: 0 }} }} }}
  layer {{ name: "loss" type: kSoftmaxLoss srclayers: "fc3" srclayers: "data" }}
}}
"""
