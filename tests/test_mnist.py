"""SINGA's MNIST MLP example on real MNIST, driven through the CLI as a user would."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from conftest import REPO


def run_example(conf: str, mnist_dir, tmp_path, *sets: str) -> list[dict]:
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    shutil.copy(REPO / "examples" / "mnist" / conf, job_dir / conf)
    (job_dir / "data").symlink_to(mnist_dir)  # the examples read data/ next to the job file
    args = [sys.executable, "-m", "shoal", "run", str(job_dir / conf), "--workspace", str(tmp_path / "ws")]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=3000)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in (tmp_path / "ws" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # ~35 s: the whole trajectory; the MNIST layouts of test_async_mnist stay in the default suite
@pytest.mark.parametrize("seed", [0])
def test_seed_mlp_follows_singas_published_trajectory(mnist_dir, tmp_path, seed):
    """SINGA's log (seed docs, "MLP Example"): test accuracy 0.6621 at step 60 and 0.7699 at step 120, loss 1.6137 and 1.2167."""
    records = run_example("job.conf", mnist_dir, tmp_path, "train_steps=121", f"seed={seed}")
    test = {r["step"]: r for r in records if r["phase"] == "test"}
    assert abs(test[60]["accuracy"] - 0.66) <= 0.10
    assert abs(test[120]["accuracy"] - 0.77) <= 0.10
    assert abs(test[60]["loss"] - 1.61) <= 0.25
    assert abs(test[120]["loss"] - 1.22) <= 0.25
    train = [r for r in records if r["phase"] == "train"]
    assert train[-1]["loss"] < train[0]["loss"] - 0.8


@pytest.mark.slow
def test_tuned_mlp_reaches_98_percent(mnist_dir, tmp_path):
    records = run_example("tuned.conf", mnist_dir, tmp_path)
    final = [r for r in records if r["phase"] == "test"][-1]
    assert final["accuracy"] >= 0.98
