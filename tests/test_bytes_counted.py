"""summary.json's bytes_sent: every process's bytes of the whole run, to its last message (AllReduce, Local SGD,
Downpour, Distributed Hogwild).

The display records' sent_bytes end at the last display: a run whose last meeting falls after it (train_steps a
multiple of local_steps, disp_freq not) recorded one meeting too few there (issue 40: 9 of 10 meetings at H = 50,
500 steps). The summary counts them all, summed over the processes, and counts on across a --resume.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from safetensors.torch import load_file

from cli_in_process import run_cli
from layouts import LAYOUTS, Layout
from shoal.config import load_job
from shoal.planning.costs import Calibration
from shoal.planning.estimate import estimate
from shoal.planning.plan import plan_job

LOCAL_SGD = Layout(dict(nworker_groups=2, local_steps=5), 2, 2, "Local SGD")  # a group per process
ALLREDUCE = LAYOUTS["AllReduce, 2 processes"]
DOWNPOUR = LAYOUTS["Downpour, 2 groups + 1 server, 3 processes"]
HOGWILD = LAYOUTS["Distributed Hogwild, 2 groups"]
CALIB = Calibration(host="test", cores=2, gemm_gflops={1: 10.0}, mem_gbps={1: 10.0}, link_gbps=1.0, link_latency_s=0.0)


def run(job, ws, layout: Layout, *sets: str, resume: bool = False) -> dict:
    args = ["run", job, "--workspace", ws, "--no-progress", *layout.cli(), *(["--resume"] if resume else [])]
    for s in sets:
        args += ["--set", s]
    proc = run_cli(*args, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads((ws / "summary.json").read_text())


def train_records(ws: Path) -> list[dict]:
    return [r for r in map(json.loads, (ws / "metrics.jsonl").read_text().splitlines()) if r.get("phase") == "train"]


def payload(ws: Path, step: int) -> int:
    """A meeting's message as the meeting counts it: every param's pseudo-gradient in float32."""
    values = load_file(str(ws / "checkpoint" / f"step{step}-worker0.safetensors"))
    return sum(4 * v.numel() for k, v in values.items() if k.startswith("param/"))


def test_local_sgd_counts_every_meeting_of_every_process(blobs_job, tmp_path):
    """20 steps, a meeting every 5 (after steps 4, 9, 14, 19), a display every 7 (steps 0, 7, 14): the records end at
    step 14 with 3 meetings; the summary holds all 4, of both groups."""
    job, ws = blobs_job(train_steps=20, hidden=64), tmp_path / "ws"
    summary = run(job, ws, LOCAL_SGD, "disp_freq=7")
    message = payload(ws, 20)
    train = train_records(ws)
    assert train[-1]["step"] == 14 and sum(r["sent_bytes"] for r in train) == 3 * message  # the chief's, to step 14
    assert summary["bytes_sent"] == 4 * 2 * message  # 4 meetings × 2 groups


def test_local_sgd_counts_on_across_a_resume(blobs_job, tmp_path):
    """Stopped at step 12 (checkpointed: meetings after 4 and 9 done), resumed to 20: the whole run's 4 meetings."""
    job, ws = blobs_job(train_steps=20, hidden=64), tmp_path / "ws"
    run(job, ws, LOCAL_SGD, "disp_freq=7", "train_steps=12")
    summary = run(job, ws, LOCAL_SGD, "disp_freq=7", resume=True)
    assert summary["bytes_sent"] == 4 * 2 * payload(ws, 20)


def test_allreduce_counts_every_step_of_every_process(blobs_job, tmp_path):
    """Each process's bytes per step (the planner's, which tests/test_compression.py holds to the runtime's count)
    × the 20 steps: 5 of them after the last display (step 14); and as much when the run is stopped and resumed."""
    job, ws = blobs_job(train_steps=20, hidden=64), tmp_path / "ws"
    summary = run(job, ws, ALLREDUCE, "disp_freq=7")
    per_step = sum(p.sent for p in estimate(plan_job(load_job(job, ALLREDUCE.overrides()), cores=2), CALIB).processes)
    assert per_step > 0 and summary["bytes_sent"] == 20 * per_step
    resumed = tmp_path / "resumed"  # stopped at step 12, resumed to 20: each process counts on from its checkpoint part
    run(job, resumed, ALLREDUCE, "disp_freq=7", "train_steps=12")
    assert run(job, resumed, ALLREDUCE, "disp_freq=7", resume=True)["bytes_sent"] == 20 * per_step


def trainable_numel(ws: Path, step: int) -> int:
    return sum(v.numel() for k, v in load_file(str(ws / "checkpoint" / f"step{step}-worker0.safetensors")).items()
               if k.startswith("param/"))


def test_downpour_counts_every_push_of_every_group_and_the_servers_answers(blobs_job, tmp_path):
    """Every push of both groups (the whole gradient, float32, to the one server) and its answer (the whole values), to
    the last one: the server counts them and tells the chief in its last answer; restarts allowed, also the chief's
    mirror of the server's updater state (momentum: as many elements as the values, every 2 of the chief's steps)
    and counters. The records hold only the chief's pushes, to the last display (step 14 of 20)."""
    job, ws = blobs_job(train_steps=20, hidden=64), tmp_path / "ws"
    summary = run(job, ws, DOWNPOUR, "disp_freq=7", "cluster.max_restarts=1")  # (the job's updater: momentum 0.9)
    pushes = sum(g["updates"] for g in summary["staleness_histogram"]["groups"].values())
    assert pushes == 2 * 20
    message = 4 * trainable_numel(ws, 20)
    mirrors = len(range(0, 20, 2))  # downpour_mirror.mirror_interval: ceil(state / (0.25 x 2 x values)) = 2
    counters = summary["bytes_sent"] - pushes * 2 * message - mirrors * message  # each push and its answer, each mirror
    assert 0 < counters < mirrors * 8 * 64 and counters % 8 == 0  # the mirrors' int64 counters
    assert sum(r["pushed_bytes"] for r in train_records(ws)) == 15 * message  # the chief's pushes, to step 14


def test_distributed_hogwild_counts_every_sync_of_every_group(blobs_job, tmp_path):
    """Each group syncs after every 5 of its 20 steps (4 syncs, the last after step 19, past the last display at 14),
    each its 8-byte header, its delta of the other group's slices and their fresh values: 2 groups x 4 syncs, every
    param once each way per pair of syncs. Each group's count comes to the chief with its STOP."""
    job, ws = blobs_job(train_steps=20, hidden=64), tmp_path / "ws"
    summary = run(job, ws, HOGWILD, "disp_freq=7", "cluster.sync_freq=5")
    numel = trainable_numel(ws, 20)
    train = train_records(ws)
    assert train[-1]["step"] == 14 and sum(r["syncs"] for r in train) == 3  # the chief's, to step 14
    assert summary["bytes_sent"] == 4 * (2 * 8 + 2 * 4 * numel)


@pytest.mark.parametrize("layout, sets", [(DOWNPOUR, ()), (HOGWILD, ("cluster.sync_freq=5",))], ids=["Downpour", "Distributed Hogwild"])
def test_asynchronous_groups_count_on_across_a_resume(blobs_job, tmp_path, layout, sets):
    """Stopped at step 12 (checkpointed), resumed to 20: as much as the run that never stopped (the chief's checkpoint
    holds the servers' count, a Hogwild group's part its own)."""
    job = blobs_job(train_steps=20, hidden=64)
    whole = run(job, tmp_path / "whole", layout, "disp_freq=7", *sets)["bytes_sent"]
    resumed = tmp_path / "resumed"
    first = run(job, resumed, layout, "disp_freq=7", "train_steps=12", *sets)["bytes_sent"]
    assert 0 < first < whole
    assert run(job, resumed, layout, "disp_freq=7", *sets, resume=True)["bytes_sent"] == whole


# -- against the wire: a network namespace of the job's own, its loopback's bytes ------------------------------------

def _sh(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True)


@pytest.fixture
def namespace():
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and iproute2 (ip netns)")
    name = f"shoal-bytes-{uuid.uuid4().hex[:8]}"
    if _sh("ip", "netns", "add", name).returncode != 0:
        pytest.skip("cannot make a network namespace here")
    try:
        assert _sh("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up").returncode == 0
        yield name
    finally:
        _sh("ip", "netns", "del", name)


def _lo_bytes(ns: str) -> int:
    """Bytes the namespace's loopback carried (each packet once: what one process sends, another receives)."""
    out = _sh("ip", "netns", "exec", ns, "cat", "/sys/class/net/lo/statistics/tx_bytes")
    return int(out.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [LOCAL_SGD, ALLREDUCE, DOWNPOUR, HOGWILD], ids=["Local SGD", "AllReduce", "Downpour", "Distributed Hogwild"])
def test_bytes_sent_matches_the_loopback_of_the_jobs_own_namespace(blobs_job, tmp_path, namespace, layout):
    """The job alone in a namespace: its loopback's bytes less an idle baseline (nothing: a fresh namespace is silent;
    measured anyway) are shoal's count plus what it does not count: TCP/IP headers, the store's start-up and
    heartbeats, the display collectives. With 0.7 MB of messages or more those stay within 10 % (Local SGD +5.4 %, AllReduce +6.4 %, Downpour +6.8 %, Distributed Hogwild +4.1 %, 2026-11-28)."""
    job, ws = blobs_job(train_steps=20, hidden=1024), tmp_path / "ws"
    idle = _lo_bytes(namespace)
    _sh("sleep", "1")
    baseline = _lo_bytes(namespace) - idle
    before = _lo_bytes(namespace)
    sets = sum((["--set", s] for s in (*layout.overrides(), "disp_freq=7")), [])
    proc = subprocess.run(["ip", "netns", "exec", namespace, sys.executable, "-m", "shoal", "run", str(job), "--workspace",
                           str(ws), "--no-progress", *sets], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    wire = _lo_bytes(namespace) - before - baseline
    counted = json.loads((ws / "summary.json").read_text())["bytes_sent"]
    print(f"{layout.framework}: counted {counted:,} bytes, the loopback carried {wire:,} ({wire / counted - 1:+.1%})")
    assert counted > 600_000 and counted <= wire <= 1.10 * counted, (counted, wire, baseline)
