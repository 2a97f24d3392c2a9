"""Local SGD and DiLoCo as cluster configurations: groups on their own copies meet every local_steps steps."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file


def run(job, ws, *sets):
    args = [sys.executable, "-m", "shoal", "run", str(job), "--workspace", str(ws), "--no-progress"]
    for s in sets:
        args += ["--set", s]
    return subprocess.run(args, capture_output=True, text=True, timeout=300)


def params(ws, step):
    return {k: v for k, v in load_file(str(ws / "checkpoint" / f"step{step}-worker0.safetensors")).items() if k.startswith("param/")}


LOCAL_SGD = ["cluster.nworker_groups=2", "cluster.local_steps=5"]


def test_groups_as_threads_and_as_processes_compute_the_same_local_sgd(blobs_job, tmp_path):
    job = blobs_job(train_steps=20)
    threads = run(job, tmp_path / "threads", *LOCAL_SGD, "cluster.nworkers_per_procs=2")
    processes = run(job, tmp_path / "processes", *LOCAL_SGD)
    assert threads.returncode == 0 and processes.returncode == 0, threads.stderr + processes.stderr
    for ws, nprocs in ((tmp_path / "threads", 1), (tmp_path / "processes", 2)):
        summary = json.loads((ws / "summary.json").read_text())
        assert (summary["framework"], summary["processes"], summary["workers"]) == ("Local SGD", nprocs, 2)
        train = [json.loads(line) for line in (ws / "metrics.jsonl").read_text().splitlines() if '"phase": "train"' in line]
        assert train[-1]["meetings"] == train[-1]["step"] // 5 + (1 if (train[-1]["step"] + 1) % 5 == 0 else 0)
    a, b = params(tmp_path / "threads", 20), params(tmp_path / "processes", 20)
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    single = run(job, tmp_path / "single")
    assert single.returncode == 0
    assert any(not torch.allclose(a[k], params(tmp_path / "single", 20)[k]) for k in a)  # the layout did change the maths


def test_diloco_is_named_planned_and_its_outer_updater_checked(blobs_job, tmp_path):
    job = blobs_job(train_steps=10)
    outer = ["cluster.outer_updater.type=kNesterov", "cluster.outer_updater.momentum=0.9",
             "cluster.outer_updater.learning_rate.base_lr=0.7"]
    plan = subprocess.run([sys.executable, "-m", "shoal", "plan", str(job), *sum((["--set", s] for s in LOCAL_SGD + outer), [])],
                          capture_output=True, text=True, timeout=120)
    assert plan.returncode == 2 and plan.stderr.startswith("cluster.outer_updater.learning_rate.type")
    proc = run(job, tmp_path / "ws", *LOCAL_SGD, *outer, "cluster.outer_updater.learning_rate.type=kFixed", "checkpoint_freq=7")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "ws" / "summary.json").read_text())["framework"] == "DiLoCo"
    state = load_file(str(tmp_path / "ws" / "checkpoint" / "step7-worker0.safetensors"))
    assert any(k.endswith("/outer.anchor") for k in state) and any("/outer." in k and not k.endswith("anchor") for k in state)


def test_resume_mid_round_continues_from_the_checkpointed_anchor(blobs_job, tmp_path):
    """Stopped at step 7 (mid-round: meetings after steps 4 and 9), resumed to 12: the round goes on, meetings count on."""
    job, ws = blobs_job(train_steps=12), tmp_path / "ws"
    sets = ["cluster.nworker_groups=2", "cluster.nworkers_per_procs=2", "cluster.local_steps=5"]
    assert run(job, ws, *sets, "train_steps=7").returncode == 0
    resumed = subprocess.run([sys.executable, "-m", "shoal", "run", str(job), "--workspace", str(ws), "--no-progress", "--resume",
                              *sum((["--set", s] for s in sets), [])], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "Resume from checkpoint file" in resumed.stdout and "step7-worker0" in resumed.stdout
    train = [json.loads(line) for line in (ws / "metrics.jsonl").read_text().splitlines() if '"phase": "train"' in line]
    assert train[-1]["step"] == 10 and train[-1]["meetings"] == 2
    assert all(torch.isfinite(v).all() for v in params(ws, 12).values())
