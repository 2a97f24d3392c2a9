"""`shoal plan --hosts` against a real run over a shaped link between two hosts (network namespaces, `tc`).

One point of benchmarks/shaped_links.py: AllReduce over two 1-core hosts joined by a 100 Mbit/s link.
The bytes that crossed the link are the plan's (within 5 %), and samples/s are within 25 % of the prediction given the
link's measured goodput (+18 % and +20 % on the idle machine, 2026-11-26; on a loaded one it has measured +3 % and
+27 %: run it idle).
"""
from __future__ import annotations

import os
import shutil

import pytest
from benchmark_scripts import load_benchmark

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shaped_links():
    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("ip", "tc", "taskset")):
        pytest.skip("needs root, iproute2 (ip, tc) and taskset")
    shaped_links = load_benchmark("shaped_links")
    if not (shaped_links.DATA / "train_data.bin").exists():
        pytest.skip(f"MNIST not prepared in {shaped_links.DATA}")
    return shaped_links


@pytest.fixture(scope="module")
def allreduce_row(shaped_links, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("shaped")
    rows = shaped_links.run_rows([100.0], steps=60, local_steps=10, only={"AllReduce"}, folder=tmp_path)
    assert [r.framework for r in rows] == ["AllReduce"]  # the layout ran: 2 nodes, one worker each
    assert (tmp_path / "mlp.conf").exists()
    return rows[0]


def test_allreduce_over_a_shaped_link_moves_the_predicted_bytes(allreduce_row):
    row = allreduce_row
    assert abs(row.predicted_bytes - row.measured_bytes) <= 0.05 * row.measured_bytes, row


def test_allreduce_over_a_shaped_link_runs_at_the_predicted_speed(allreduce_row):
    row = allreduce_row
    assert row.within(row.predicted_sps, row.measured_sps), row


def test_the_scaling_picture_shows_the_measured_point_on_the_predicted_curve(shaped_links, allreduce_row, tmp_path):
    [picture] = shaped_links.plot([allreduce_row], {"AllReduce": (1000.0, 900.0)}, tmp_path)
    assert picture == tmp_path / "shaped-links-100mbit.png"
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
