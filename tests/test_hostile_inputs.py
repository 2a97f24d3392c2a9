"""Hostile and wrong inputs (issue 15): each ends as one line naming the file and where in it (or the
field), exit status 2, no traceback, no hang, and nothing already written lost.

Every case drives the CLI as a user would: `shoal plan JOB` for what validation refuses (fast: no
data is read), `shoal run JOB` for what only the data or a checkpoint can show.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import shoal as shoal_api
from cli_in_process import run_cli
from conftest import write_store
from shoal.errors import ShoalError
from shoal.neuralnet import checkpoint as ckpt_io

# a tiny job on a textfile of 4 features and 3 classes; {…} fields are filled per case
JOB = """\
name: tiny
train_steps: 4
disp_freq: 2
train_one_batch: {{alg: {alg}}}
updater: {{type: kSGD, learning_rate: {{base_lr: 0.1, type: kFixed}}}}
neuralnet:
  layer:
    - name: data
      type: kCSVInput
      store_conf: {{backend: {backend}, path: {store}, batchsize: {batch}, shape: {shape}, has_label: {has_label}}}
    - name: fc
      type: kInnerProduct
      srclayers: data
      innerproduct_conf: {{num_output: {classes}}}
      param: [{{name: w}}, {{name: b}}]
{loss}cluster: {{workspace: ws{cluster}}}
"""
LOSS = "    - {name: loss, type: kSoftmaxLoss, srclayers: [fc, data]}\n"
DEFAULTS = dict(alg="kBP", backend="textfile", store="train.csv", batch=4, shape=4, has_label="true", classes=3, loss=LOSS, cluster="")


def write_job(folder: Path, name: str = "job.yaml", edit: tuple[str, str] = ("", ""), **fields) -> Path:
    """The job with `fields` filled in, and `edit`'s first text replaced by its second."""
    path = folder / name
    path.write_text(JOB.format(**{**DEFAULTS, **fields}).replace(*edit))
    return path


def write_rows(path: Path, labels, values=None) -> Path:
    rows = values if values is not None else [["0.1", "0.2", "0.3", "0.4"]] * len(labels)
    path.write_text("".join(",".join([str(label), *row]) + "\n" for label, row in zip(labels, rows)))
    return path


@pytest.fixture
def folder(tmp_path) -> Path:
    write_rows(tmp_path / "train.csv", [i % 3 for i in range(12)])
    return tmp_path


def shoal_process(*args, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m shoal ARGS`: a real process (the resource bombs: no traceback at the interpreter's level either)."""
    return subprocess.run([sys.executable, "-m", "shoal", *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=timeout)


def shoal(*args, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """`shoal ARGS` in this process: the same exit status and output, without starting torch again per case."""
    return run_cli(*args, cwd=cwd, timeout=timeout)


def assert_refused(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit 2, no traceback, and exactly one line on stderr holding every fragment."""
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-3000:])
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


# -- resource bombs: refused fast, in one line --------------------------------------------
def billion_laughs(levels: int = 9) -> str:
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + f"\nname: *a{levels}\n"


BOMBS = {
    "billion laughs": ("bomb.yaml", billion_laughs(), ["bomb.yaml:", "expands the document past"]),
    "alias to the value holding it": ("bomb.yaml", "name: &a [1, *a]\n", ["bomb.yaml:1:", "refers to a value that contains it"]),
    "100k nested brackets": ("bomb.yaml", "name: " + "[" * 100_000 + "]" * 100_000 + "\n", ["bomb.yaml:1:", "nested deeper than"]),
    "100k nested mappings": ("bomb.json", '{"a": ' * 100_000 + "1" + "}" * 100_000 + "\n", ["bomb.json:1:", "nested deeper than"]),
    "deep block nesting": ("bomb.yaml", "".join(" " * i + "a:\n" for i in range(200)), ["bomb.yaml:", "nested deeper than"]),
    # protobuf's text parser recurses too; the plugin probe skips unknown extensions recursively
    "100k nested text-format messages": ("bomb.conf", 'plugin: "x.proto"\n' + "[a.b] { " * 100_000 + "}" * 100_000 + "\n", ["bomb.conf:2:", "nested deeper than"]),
    "100k nested text-format lists": ("bomb.conf", "cluster < " * 100_000 + ">" * 100_000 + "\n", ["bomb.conf:1:", "nested deeper than"]),
}


@pytest.mark.parametrize("case", ["billion laughs", "100k nested brackets", "100k nested text-format messages"])
def test_a_resource_bomb_is_refused_fast_in_one_line(tmp_path, case):
    name, text, fragments = BOMBS[case]
    (tmp_path / name).write_text(text)
    started = time.monotonic()
    # the laughs in a real process; the nested ones in this one (a crash or a traceback there fails the test as well,
    # without an interpreter and torch to start for each)
    proc = (shoal_process if case == "billion laughs" else shoal)("plan", name, cwd=tmp_path, timeout=60)
    assert_refused(proc, *fragments)
    # the 9-level laughs ran for minutes; a refusal costs what starting the CLI costs
    assert time.monotonic() - started < 45


@pytest.mark.parametrize("case", BOMBS)
def test_load_job_refuses_a_bomb_at_once(tmp_path, case):
    name, text, fragments = BOMBS[case]
    (tmp_path / name).write_text(text)
    started = time.monotonic()
    with pytest.raises(ShoalError, match=fragments[-1]):
        shoal_api.load_job(tmp_path / name)
    assert time.monotonic() - started < 5  # typically 0.1 s


def test_the_bounds_leave_real_yaml_aliases_alone(folder):
    # anchors for a repeated init are ordinary YAML
    text = JOB.format(**DEFAULTS).replace("param: [{name: w}, {name: b}]", "param: [{name: w, init: &u {type: kUniform, low: -0.1, high: 0.1}}, {name: b, init: *u}]")
    (folder / "job.yaml").write_text(text)
    proc = shoal("plan", "job.yaml", cwd=folder)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("kind", ["device", "named pipe", "huge"])
def test_a_job_file_that_is_not_a_file_is_refused_without_reading_it(tmp_path, kind):
    if kind == "device":
        job = Path("/dev/zero")
    elif kind == "named pipe":
        job = tmp_path / "job.conf"
        os.mkfifo(job)  # nobody ever writes to it
    else:
        job = tmp_path / "job.conf"
        job.write_text("# padding\n" * 1_700_000)  # 17 MB
    proc = shoal("plan", job, cwd=tmp_path, timeout=60)
    assert_refused(proc, str(job), "over 16 MB" if kind == "huge" else "is not a regular file")


# -- wrong jobs: one line at the field instead of a traceback, or instead of silence ---------------
WRONG_JOBS = {
    # tries to allocate 6.7 TB: refused before any allocation, naming the param, its shape and bytes
    "num_output: 2147483647": (dict(classes=2147483647, shape=784), ["job.yaml:15:", "param 'w' of shape (2147483647, 784)", "TB"]),
    "one batch's outputs beyond memory": (
        dict(classes=200_000_000, batch=1024), ["job.yaml:11:", "layer 'fc' outputs", "per batch of 1024", "more than the"]),
    "kBP without a loss layer": (dict(loss=""), ["job.yaml:4:", "kBP needs a loss layer"]),
    "kBPTT without a loss layer": (dict(loss="", alg="kBPTT"), ["job.yaml:4:", "kBPTT needs a loss layer"]),
    "shape: -784": (dict(shape=-784), ["job.yaml:10:", "store_conf.shape[0]", "got -784"]),
    "shape: 0": (dict(shape="[1, 0, 4]"), ["store_conf.shape[1]", "got 0"]),
    "a worker with no rows": (
        dict(batch=2, cluster=", nworkers_per_group: 3"), ["job.yaml:10:", "store_conf.batchsize[0]", "nworkers_per_group(3)"]),
    "start_port: 70000": (dict(cluster=", start_port: 70000"), ["job.yaml:17:", "cluster.start_port", "70000"]),
    "start_port: 0": (dict(cluster=", start_port: 0"), ["cluster.start_port", "1..65535"]),
    "threads_per_worker: -1": (dict(cluster=", threads_per_worker: -1"), ["cluster.threads_per_worker", "got -1"]),
    "max_staleness: -2": (dict(cluster=", max_staleness: -2"), ["cluster.max_staleness", "got -2"]),
    "base_lr: .nan": (dict(edit=("base_lr: 0.1", "base_lr: .nan")), ["job.yaml:5:", "base_lr must be a finite number, got nan"]),
    "--set std_value=inf": (
        dict(args=["--set", "neuralnet.layer[0].store_conf.std_value=inf"]), ["--set neuralnet.layer[0].store_conf.std_value=inf", "finite"]),
    "an empty separator": (dict(edit=("has_label: true", 'has_label: true, separator: ""')), ["job.yaml:10:", "separator is empty"]),
    "backend: lmdb": (dict(backend="lmdb"), ["job.yaml:10:", "store_conf.backend", "kvfile or textfile"]),
}


@pytest.mark.parametrize("case", WRONG_JOBS)
def test_a_wrong_job_is_refused_in_one_line_at_its_field(folder, case):
    fields, fragments = WRONG_JOBS[case]
    fields = dict(fields)
    args = fields.pop("args", [])
    write_job(folder, **fields)
    assert_refused(shoal("plan", "job.yaml", *args, cwd=folder), *fragments)


def test_a_test_batch_smaller_than_the_group_is_accepted(folder):
    # only a training batch is split over the group's workers
    text = JOB.format(**{**DEFAULTS, "cluster": ", nworkers_per_group: 2"}).replace("train_steps: 4", "train_steps: 4\ntest_steps: 1")
    text = text.replace("has_label: true}", "has_label: true}\n      exclude: kTest")
    text = text.replace("    - name: fc", "    - name: data\n      type: kCSVInput\n      exclude: kTrain\n"
                        "      store_conf: {backend: textfile, path: train.csv, batchsize: 1, shape: 4}\n    - name: fc")
    (folder / "job.yaml").write_text(text)
    proc = shoal("plan", "job.yaml", cwd=folder)
    assert proc.returncode == 0, proc.stderr


# -- wrong data: one line naming the store, the record and the value ----------------------------
def kvfile_with_labels(folder: Path, labels) -> str:
    write_store(folder / "train.bin", np.full((len(labels), 4), -1.5, dtype=np.float32), np.asarray(labels))
    return "train.bin"


STORES = {
    "textfile label above the classes": (
        lambda f: write_rows(f / "bad.csv", [0, 1, 2, 0, 1, 7, 2]).name, "textfile",
        ["bad.csv:6: record 5: label 7", "layer 'loss'", "3 classes"]),
    "textfile label below zero, after a blank line": (
        lambda f: (f / "bad.csv").write_text("0,1,2,3,4\n\n-1,1,2,3,4\n") and "bad.csv", "textfile",
        ["bad.csv:3: record 1: label -1"]),
    "kvfile label out of range": (
        lambda f: kvfile_with_labels(f, [0, 1, 2, 3]), "kvfile", ["train.bin: byte ", "record 3: label 3", "3 classes"]),
    "textfile with binary bytes": (
        lambda f: (f / "bad.csv").write_bytes(b"0,0.1,0.2,0.3,0.4\n\xff\xfe\x00\x01,1,2\n") and "bad.csv", "textfile",
        ["bad.csv:2:1: byte 0xff is not text"]),
    "a kvfile read as a textfile": (
        lambda f: kvfile_with_labels(f, [0, 1]), "textfile", ["train.bin:", "is not text", "store_conf.backend"]),
    "textfile with a NaN": (
        lambda f: write_rows(f / "bad.csv", [0, 1, 2], [["0.1"] * 4, ["0.1", "nan", "0.1", "0.1"], ["0.1"] * 4]).name, "textfile",
        ["bad.csv:2: record 1: holds a NaN"]),
    "labels the loss needs, but none in the store": (
        lambda f: (f / "bad.csv").write_text("0.1,0.2,0.3,0.4\n" * 4) and "bad.csv", "textfile-unlabelled",
        ["bad.csv: the records carry no labels", "layer 'loss'"]),
    "a device": (lambda f: "/dev/zero", "kvfile", ["/dev/zero: is a device", "not a regular file"]),
    "a device read as a textfile": (lambda f: "/dev/zero", "textfile", ["/dev/zero: is a device"]),
    "a named pipe": (lambda f: os.mkfifo(f / "pipe.bin") or "pipe.bin", "kvfile", ["pipe.bin: is a named pipe"]),
    "a folder read as a textfile": (lambda f: str(f), "textfile", ["is a folder"]),
}


@pytest.mark.parametrize("case", STORES)
def test_wrong_data_is_refused_naming_the_store_and_record(folder, case):
    make, backend, fragments = STORES[case]
    store = make(folder)
    has_label = "false" if backend == "textfile-unlabelled" else "true"
    job = write_job(folder, store=store, backend=backend.split("-")[0], has_label=has_label)
    written = {path: path.read_bytes() for path in (job, folder / store) if path.is_file()}
    proc = shoal("run", "job.yaml", cwd=folder, timeout=120)  # a device or a pipe would hang here
    assert_refused(proc, *fragments)
    assert not list((folder / "ws").glob("checkpoint/*"))
    assert {path: path.read_bytes() for path in written} == written


def test_a_wrong_mean_file_is_refused(folder):
    job = write_job(folder)
    job.write_text(job.read_text().replace("has_label: true}", "has_label: true, mean_file: /dev/zero}"))
    assert_refused(shoal("run", "job.yaml", cwd=folder), "/dev/zero: is a device")


# -- a checkpoint of another net ----------------------------------------------------------------
def write_checkpoint(path: Path, classes: int) -> Path:
    params = {"w": torch.zeros(classes, 4), "b": torch.zeros(classes)}
    return ckpt_io.save(path, ckpt_io.Checkpoint(step=4, params=params))


def test_testing_a_checkpoint_of_another_net_names_the_param_and_both_shapes(folder):
    job = write_job(folder)
    job.write_text(job.read_text().replace("train_steps: 4", "train_steps: 4\ntest_steps: 1"))
    checkpoint = write_checkpoint(folder / "other.safetensors", classes=5)
    proc = shoal("run", "job.yaml", "--test", "--checkpoint", checkpoint, cwd=folder)
    assert_refused(proc, "param 'w' has shape (5, 4) in the checkpoint and (3, 4) in this job's net")


def test_resuming_from_a_checkpoint_of_another_net_names_the_param_and_keeps_it(folder):
    write_job(folder)
    checkpoint = write_checkpoint(ckpt_io.checkpoint_file(folder / "ws", 4), classes=5)
    written = checkpoint.read_bytes()
    proc = shoal("run", "job.yaml", "--resume", cwd=folder)
    assert_refused(proc, "param 'w' has shape (5, 4) in the checkpoint and (3, 4) in this job's net")
    assert checkpoint.read_bytes() == written
