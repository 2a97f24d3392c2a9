"""Compressed Downpour pushes: bf16/fp16 halves the bytes, top-k with error feedback sends ~1 % of them."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from shoal.config import job_pb2
from shoal.runtime.exchanges.compression import TopKCodec, codec_for, wire_bytes


@pytest.mark.parametrize("kind, ratio", [(job_pb2.kBF16, 2.0), (job_pb2.kFP16, 2.0), (job_pb2.kTopK, 4 / (0.01 * 6))])
def test_bytes_on_the_wire(kind, ratio):
    cluster = job_pb2.ClusterProto(compression=kind)
    flat = torch.randn(10_000)
    sent = codec_for(cluster).encode(flat)
    assert flat.numel() * 4 / wire_bytes(sent) == pytest.approx(ratio, rel=0.01)
    decoded = codec_for(cluster).decode(sent, flat.numel())
    assert decoded.shape == flat.shape and decoded.dtype == torch.float32


def test_top_k_error_feedback_sends_everything_eventually():
    """What is not sent stays in the residual: sent so far + residual == everything pushed so far (to bf16 rounding)."""
    codec, gen = TopKCodec(0.05), torch.Generator().manual_seed(0)
    pushed, sent = torch.zeros(400), torch.zeros(400)
    for _ in range(30):
        g = torch.randn(400, generator=gen)
        pushed += g
        sent += codec.decode(codec.encode(g), 400)
    assert torch.allclose(sent + codec.residual, pushed, atol=1e-4)
    assert codec.residual.abs().max() < pushed.abs().max()  # the large entries went out


def run(job, ws, *sets):
    args = [sys.executable, "-m", "shoal", "run", str(job), "--workspace", str(ws), "--no-progress"]
    for s in sets:
        args += ["--set", s]
    return subprocess.run(args, capture_output=True, text=True, timeout=300)


DOWNPOUR = ["cluster.nworker_groups=2", "cluster.server_worker_separate=true"]


def pushed_per_step(ws) -> float:
    train = [json.loads(line) for line in (ws / "metrics.jsonl").read_text().splitlines() if '"phase": "train"' in line]
    return sum(r["pushed_bytes"] for r in train[1:]) / (train[-1]["step"] - train[0]["step"])


def test_downpour_pushes_top_k_in_fewer_bytes_and_still_learns(blobs_job, tmp_path):
    job = blobs_job(train_steps=30)
    dense = run(job, tmp_path / "dense", *DOWNPOUR)
    sparse = run(job, tmp_path / "sparse", *DOWNPOUR, "cluster.compression=kTopK", "cluster.topk_fraction=0.02")
    assert dense.returncode == 0 and sparse.returncode == 0, dense.stderr + sparse.stderr
    assert pushed_per_step(tmp_path / "dense") / pushed_per_step(tmp_path / "sparse") > 25  # 2 % as 6-byte entries: ~33x
    summary = json.loads((tmp_path / "sparse" / "summary.json").read_text())
    assert summary["framework"] == "Downpour" and summary["final_test"]["accuracy"] > 0.8


def test_compression_is_refused_where_it_does_not_apply_and_noted_where_it_does(blobs_job):
    job = blobs_job()
    plan = lambda *sets: subprocess.run([sys.executable, "-m", "shoal", "plan", str(job), *sum((["--set", s] for s in sets), [])],
                                        capture_output=True, text=True, timeout=120)  # noqa: E731
    refused = plan("cluster.nworkers_per_group=2", "cluster.compression=kBF16")
    assert refused.returncode == 2 and refused.stderr.startswith("cluster.compression: compressed pushes apply to Downpour only")
    noted = plan(*DOWNPOUR, "cluster.compression=kTopK")
    assert noted.returncode == 0 and "pushes compressed (top-0.01 with error feedback)" in noted.stdout
