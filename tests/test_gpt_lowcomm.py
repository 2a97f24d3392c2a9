"""benchmarks/gpt_lowcomm.py's claims on a small GPT (2 layers, 64 wide, block 32, batch 8 per group, 200 steps per
group, real Shakespeare data), each job a fresh process in a network namespace of its own: DiLoCo H=50 stays within
2 % of synchronous training's validation loss at equal tokens, moving about H times fewer bytes (2H with bf16
pseudo-gradients); Downpour with AdamW at the server and a bounded lag is at least one worker's validation loss at
equal steps per group. Slow: a few minutes on an idle 2-core machine."""
from __future__ import annotations

import pytest
from benchmark_scripts import load_benchmark

from conftest import REPO

pytestmark = pytest.mark.slow
STEPS = 200  # 4 meetings of H = 50


@pytest.fixture(scope="module")
def bench():
    if any(not (REPO / "examples/gpt/data" / n).is_file() for n in ("train.txt", "val.txt", "vocab.txt")):
        pytest.skip("examples/gpt/data not prepared (shoal prepare shakespeare --out examples/gpt/data)")
    return load_benchmark("gpt_lowcomm")


def ran(result: dict, processes: int, workers: int, framework: str) -> None:
    assert (result["ran"]["processes"], result["ran"]["workers"], result["ran"]["framework"]) == (processes, workers, framework)


def test_diloco_is_within_two_percent_of_synchronous_on_h_times_fewer_bytes(bench):
    if not bench.netns_available():
        pytest.skip("bytes on the wire need a network namespace per job (root and `ip netns`)")
    results = bench.measure(STEPS, [1337], small=True, only=[bench.SYNC, "DiLoCo H=50, 2 groups", "DiLoCo H=50 + bf16"])
    sync, diloco, bf16 = (results[n][0] for n in (bench.SYNC, "DiLoCo H=50, 2 groups", "DiLoCo H=50 + bf16"))
    ran(sync, 2, 2, "AllReduce")
    ran(diloco, 2, 2, "Local SGD")
    for run in (diloco, bf16):
        assert run["val_loss"] <= 1.02 * sync["val_loss"], (run["val_loss"], sync["val_loss"])
    # both move one model's worth per exchange (every step / every H steps): about H times fewer bytes, 2H in bf16
    assert sync["wire_bytes"] / diloco["wire_bytes"] >= 0.8 * bench.LOCAL_STEPS, (sync["wire_bytes"], diloco["wire_bytes"])
    assert sync["wire_bytes"] / bf16["wire_bytes"] >= 1.6 * bench.LOCAL_STEPS, (sync["wire_bytes"], bf16["wire_bytes"])


def test_downpour_with_adamw_at_the_server_and_bounded_lag_is_at_least_one_worker(bench):
    results = bench.measure(STEPS, [1337], small=True, only=[bench.ONE, "Downpour"])
    one, downpour = results[bench.ONE][0], results["Downpour, 2 groups, lag <= 2"][0]
    ran(one, 1, 1, "single worker")
    ran(downpour, 3, 2, "Downpour")
    assert downpour["lag_max"] is not None and downpour["lag_max"] <= bench.LAG
    assert downpour["val_loss"] <= one["val_loss"], (downpour["val_loss"], one["val_loss"])
