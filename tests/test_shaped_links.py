"""`shoal plan --hosts` against a real run over a shaped link between two hosts (network namespaces, `tc`).

One point of benchmarks/shaped_links.py: AllReduce over two 1-core hosts joined by a 100 Mbit/s link.
The bytes that crossed the link are the plan's; samples/s within 25 % of the prediction needs the
machine otherwise idle (it is a slow test, run by hand with the benchmark's other points).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


@pytest.fixture
def shaped_links():
    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("ip", "tc", "taskset")):
        pytest.skip("needs root, iproute2 (ip, tc) and taskset")
    import importlib.util

    spec = importlib.util.spec_from_file_location("shoal_benchmarks_shaped_links", REPO / "benchmarks" / "shaped_links.py")
    shaped_links = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shaped_links)
    if not (shaped_links.DATA / "train_data.bin").exists():
        pytest.skip(f"MNIST not prepared in {shaped_links.DATA}")
    return shaped_links


def test_allreduce_over_a_shaped_link_runs_as_predicted(shaped_links, tmp_path):
    rows = shaped_links.run_rows([100.0], steps=60, local_steps=10, only={"AllReduce"}, folder=tmp_path)
    assert [r.framework for r in rows] == ["AllReduce"]
    (row,) = rows
    assert (tmp_path / "mlp.conf").exists()
    assert row.within(row.predicted_bytes, row.measured_bytes), row
    assert abs(row.predicted_bytes - row.measured_bytes) <= 0.10 * row.measured_bytes, row
    assert row.within(row.predicted_sps, row.measured_sps), row
