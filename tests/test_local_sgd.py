"""Local SGD and DiLoCo as cluster configurations: groups on their own copies meet every local_steps steps."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import shoal
from benchmark_scripts import load_benchmark
from cli_in_process import run_cli
from layouts import Layout, assert_ran, load
from shoal.planning.plan import UnsupportedClusterError, plan_job


def run(job, ws, *sets, resume=False):
    """`shoal run` in this process (its forkserver starts the ranks: no interpreter and torch start-up per run)."""
    args = ["run", job, "--workspace", ws, "--no-progress", *(["--resume"] if resume else [])]
    for s in sets:
        args += ["--set", s]
    return run_cli(*args, timeout=300)


def params(ws, step):
    return {k: v for k, v in load_file(str(ws / "checkpoint" / f"step{step}-worker0.safetensors")).items() if k.startswith("param/")}


LOCAL_SGD = ["cluster.nworker_groups=2", "cluster.local_steps=5"]


@pytest.mark.slow  # the default suite's 5-minute budget; covered in it by a cheaper test
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
    plan = run_cli("plan", job, *sum((["--set", s] for s in LOCAL_SGD + outer), []))  # in this process: run() starts real ones
    assert plan.returncode == 2 and plan.stderr.startswith("cluster.outer_updater.learning_rate.type")
    proc = run(job, tmp_path / "ws", *LOCAL_SGD, *outer, "cluster.outer_updater.learning_rate.type=kFixed", "checkpoint_freq=7")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "ws" / "summary.json").read_text())["framework"] == "DiLoCo"
    state = load_file(str(tmp_path / "ws" / "checkpoint" / "step7-worker0.safetensors"))
    assert any(k.endswith("/outer.anchor") for k in state) and any("/outer." in k and not k.endswith("anchor") for k in state)


@pytest.mark.slow  # the default suite's 5-minute budget; covered in it by a cheaper test
def test_resume_mid_round_continues_from_the_checkpointed_anchor(blobs_job, tmp_path):
    """Stopped at step 7 (mid-round: meetings after steps 4 and 9), resumed to 12: the round goes on, meetings count on."""
    job, ws = blobs_job(train_steps=12), tmp_path / "ws"
    sets = ["cluster.nworker_groups=2", "cluster.nworkers_per_procs=2", "cluster.local_steps=5"]
    assert run(job, ws, *sets, "train_steps=7").returncode == 0
    resumed = run(job, ws, *sets, resume=True)
    assert resumed.returncode == 0, resumed.stderr
    assert "Resume from checkpoint file" in resumed.stdout and "step7-worker0" in resumed.stdout
    train = [json.loads(line) for line in (ws / "metrics.jsonl").read_text().splitlines() if '"phase": "train"' in line]
    assert train[-1]["step"] == 10 and train[-1]["meetings"] == 2
    assert all(torch.isfinite(v).all() for v in params(ws, 12).values())


# -- post-local SGD's warm-up (cluster.local_warmup_steps) ---------------------------------------------------------

THREADS = Layout(dict(nworker_groups=2, nworkers_per_procs=2), 1, 2, "Local SGD")
WARM = Layout(dict(THREADS.cluster, local_steps=5, local_warmup_steps=3), 1, 2, "Local SGD")
MEETS_AFTER = {0, 1, 2, 7}  # every step of the 3-step warm-up, then every 5 steps: (step + 1 - 3) % 5 == 0
DILOCO = ["cluster.outer_updater.type=kNesterov", "cluster.outer_updater.momentum=0.9",
          "cluster.outer_updater.learning_rate.type=kFixed", "cluster.outer_updater.learning_rate.base_lr=0.7"]


def train_records(ws):
    return [json.loads(line) for line in (ws / "metrics.jsonl").read_text().splitlines() if '"phase": "train"' in line]


def fit(job, layout, ws, *overrides, resume=False):
    """shoal.train in this process (the layout's groups are its threads)."""
    conf = load(job, layout, *overrides)
    shoal.train(conf, workspace=ws, resume=resume, log=lambda *a: None)
    assert_ran(ws, layout)
    return params(ws, conf.train_steps)


def test_warmup_meets_every_step_then_every_local_steps(blobs_job, tmp_path):
    job, ws = blobs_job(train_steps=12), tmp_path / "ws"
    elements = sum(v.numel() for v in fit(job, WARM, ws, "disp_freq=1").values())
    train = train_records(ws)
    assert [r["step"] for r in train] == list(range(12))
    assert [r["meetings"] for r in train] == [sum(m <= s for m in MEETS_AFTER) for s in range(12)]
    assert [r["sent_bytes"] for r in train] == [4 * elements if s in MEETS_AFTER else 0 for s in range(12)]  # float32 pseudo-gradients
    plan = run_cli("plan", job, *WARM.cli())
    assert plan.returncode == 0, plan.stderr
    assert "groups meet after each of the first 3 steps (synchronous warm-up), then every 5 steps: 4 meeting(s) in 12 steps" in plan.stdout


def test_warmup_meetings_are_plain_averages_whatever_the_outer_updater(blobs_job, tmp_path):
    """DiLoCo whose warm-up lasts the whole run computes what Local SGD meeting every step does: the outer
    Nesterov momentum only applies from the first local round on (without the warm-up it would be DiLoCo, H = 5)."""
    job = blobs_job(train_steps=8)
    diloco_threads = Layout(THREADS.cluster, 1, 2, "DiLoCo")
    warm = fit(job, diloco_threads, tmp_path / "warm", *DILOCO, "cluster.local_steps=5", "cluster.local_warmup_steps=8")
    every_step = fit(job, THREADS, tmp_path / "every", "cluster.local_steps=1")
    assert all(torch.allclose(warm[k], every_step[k], atol=1e-6) for k in warm)
    diloco = fit(job, diloco_threads, tmp_path / "diloco", *DILOCO, "cluster.local_steps=5")
    assert any(not torch.allclose(warm[k], diloco[k], atol=1e-4) for k in warm)


def test_resume_across_the_warmup_boundary_is_exact(blobs_job, tmp_path):
    """Stopped at step 2 (inside the warm-up, right after a meeting: every group holds the anchor) and resumed:
    the warm-up's last meeting and the first local round happen as in an uninterrupted run, and group 1 reads
    its own shard again (not group 0's, whose checkpoint it restores)."""
    job = blobs_job(train_steps=12, updater="type: kSGD")  # no momentum: a group's whole state is its values
    whole = fit(job, WARM, tmp_path / "whole")
    ws = tmp_path / "resumed"
    fit(job, WARM, ws, "train_steps=2")
    resumed = fit(job, WARM, ws, resume=True)
    assert (ws / "checkpoint" / "step2-worker0.safetensors").exists() and train_records(ws)[-1]["meetings"] == 4
    assert all(torch.allclose(whole[k], resumed[k], atol=1e-6) for k in whole)


def test_warmup_without_local_sgd_and_a_negative_one_are_refused(blobs_job):
    job = blobs_job(train_steps=4)
    for sets, field in ((["cluster.local_warmup_steps=3"], "cluster.local_warmup_steps: applies to Local SGD only"),
                        ([*LOCAL_SGD, "cluster.local_warmup_steps=-1"], "cluster.local_warmup_steps: must be >= 0")):
        with pytest.raises(UnsupportedClusterError, match=f"^{field}"):
            plan_job(shoal.load_job(job, sets))


def test_estimate_counts_one_all_reduce_per_meeting(blobs_job):
    job = blobs_job(train_steps=100)
    sets = ["cluster.nworker_groups=2", "cluster.local_steps=50"]
    plan = run_cli("plan", job, "--estimate", "--json", *sum((["--set", s] for s in sets), []))
    assert plan.returncode == 0, plan.stderr
    estimate = json.loads(plan.stdout)["estimate"]
    elements = 16 * 32 + 32 + 32 * 4 + 4  # the blobs MLP's params
    # 2 meetings in 100 steps; a 2-process ring all-reduce: each process sends half the values twice
    assert [p["sent"] for p in estimate["processes"]] == [int(4 * elements * 2 / 100)] * 2


# -- the claims on real MNIST (benchmarks/local_sgd.py's layouts and measurement) ---------------------------------

def benchmark():
    module = load_benchmark("local_sgd")
    if not (module.DATA / "test_data.bin").exists():
        pytest.skip(f"{module.DATA}: run `shoal prepare mnist --out {module.DATA}` first")
    return module


def layout_named(bench, name):
    return next(layout for layout in bench.LAYOUTS if layout.name.startswith(name))


@pytest.mark.slow
def test_local_sgd_h50_is_within_half_a_point_of_synchronous_training_at_equal_samples(tmp_path):
    bench = benchmark()
    sync, local = layout_named(bench, "synchronous, 2 workers (in-memory"), layout_named(bench, "Local SGD H=50, 2 groups (threads)")
    seeds = (1, 2, 3)
    accuracy = {layout.name: sum(bench.run_layout(layout, 400, seed, False, tmp_path).accuracy for seed in seeds) / len(seeds)
                for layout in (sync, local)}
    assert accuracy[local.name] >= accuracy[sync.name] - 0.005, accuracy


@pytest.mark.slow
def test_local_sgd_h50_sends_40x_fewer_bytes_per_sample_than_downpour_on_the_wire(tmp_path):
    """Each job in a network namespace of its own: its loopback counter is its traffic and nothing else's."""
    bench = benchmark()
    if not bench.netns_available():
        pytest.skip("needs root and `ip netns` (a network namespace per job)")
    downpour, local = layout_named(bench, "Downpour, 2 groups"), layout_named(bench, "Local SGD H=50, 2 groups (processes)")
    results = {layout.name: bench.run_layout(layout, 100, 1, True, tmp_path) for layout in (downpour, local)}
    wire = {name: r.wire_bytes / r.samples for name, r in results.items()}
    assert wire[downpour.name] >= 40 * wire[local.name], wire
    for r in results.values():  # what the wire carried is what the planner predicts, give or take the control traffic
        assert r.analytic_per_sample <= r.wire_bytes / r.samples <= 1.1 * r.analytic_per_sample, r
    counted = results[local.name]
    assert abs(counted.counted_bytes / counted.samples - counted.analytic_per_sample) < 1  # the exchange's own count agrees
