"""Devices: workers on several devices (replicas, Caffe's tree), batch shares set by hand or measured."""
from __future__ import annotations

import itertools
import json
import os
import random
import re

import pytest
from cli_in_process import run_cli
import torch

import shoal
from shoal.neuralnet import checkpoint as ckpt_io
from shoal.planning.balance import LinearCost, ShareBalancer, fit_cost, split_batch
from shoal.planning.devices import broadcast_order, tree_levels
from shoal.runtime.replicas import tree_reduce
from shoal.planning.plan import UnsupportedClusterError

from conftest import REPO
from layouts import assert_ran

THREADS = {2: "in-memory Sandblaster, 2 threads", 3: "in-memory Sandblaster, 3 threads (uneven 11+11+10)", 4: "in-memory Sandblaster, 4 threads"}


def job_with(blobs_job, layout: str = "single worker", devices=(), batchsize=None, **kw):
    """The blobs job file on a row of tests/layouts.py, its workers on `devices`, the training batch split as `batchsize`."""
    extra = kw.pop("extra", "") + "".join(f' device: "{d}"' for d in devices)
    path = blobs_job(extra=extra, layout=layout, **kw)
    if batchsize:
        text = path.read_text()
        assert "batchsize: 32" in text
        path.write_text(text.replace("batchsize: 32", " ".join(f"batchsize: {b}" for b in batchsize), 1))
    return path


def trained_params(job, layout, workspace, steps: int = 8):
    shoal.train(job, workspace=workspace, log=lambda *a: None)
    assert_ran(workspace, layout)
    return ckpt_io.load(ckpt_io.checkpoint_file(workspace, steps)).params


# -- the tree and the split (pure) --------------------------------------------------
@pytest.mark.parametrize("n", range(1, 10))
def test_the_reduction_tree_brings_every_worker_to_worker_0_once(n):
    levels = tree_levels(n)
    assert len(levels) == (n - 1).bit_length()
    held = set(range(n))  # workers still holding a partial sum
    for level in levels:
        for into, frm in level:
            assert into < frm and into in held and frm in held
        held -= {frm for _, frm in level}
    assert held == {0}
    assert tree_levels(4) == [[(0, 1), (2, 3)], [(0, 2)]]  # Caffe's order: pairs, then pairs of pairs


@pytest.mark.parametrize("names", [["cuda:0", "cuda:1", "cuda:2", "cuda:3"], ["cuda:0", "cpu"], ["cpu", "cpu", "cpu:1", "cpu:1"], ["cpu:0", "cpu:1", "cpu:2"], ["cpu"]])
def test_broadcast_reaches_every_device_once_from_a_device_that_has_the_values(names):
    reached = {names[0]}
    for src, dst in broadcast_order(names):
        assert src in reached and dst not in reached
        reached.add(dst)
    assert reached == set(names)


def test_tree_reduce_is_the_share_weighted_sum_whatever_is_missing():
    """Workers without a gradient (or balanced out with share 0) anywhere in the tree."""
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(1)
    for _ in range(100):
        n = rng.randint(1, 7)
        shares = [rng.choice([0, rng.randint(1, 9)]) for _ in range(n)]
        has = [rng.random() < 0.7 for _ in range(n)]
        grads = [{"w": torch.randn(3, generator=gen) if h else None} for h in has]
        total = sum(shares) or 1
        expected = [g["w"] * (s / total) for g, s in zip(grads, shares) if s > 0 and g["w"] is not None]
        got = tree_reduce([({"w": None if g["w"] is None else g["w"].clone()}, s) for g, s in zip(grads, shares)], total)["w"]
        if not expected:
            assert got is None
        else:
            torch.testing.assert_close(got, sum(expected))


def test_split_batch_is_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        costs = [LinearCost(rng.choice([0, rng.uniform(0, 5)]), rng.uniform(0.01, 1)) for _ in range(rng.randint(1, 3))]
        total = rng.randint(1, 40)
        shares = split_batch(costs, total)
        assert sum(shares) == total and min(shares) >= 0
        best = min(max(c.seconds(n) for c, n in zip(costs, split)) for split in itertools.product(range(total + 1), repeat=len(costs)) if sum(split) == total)
        assert max(c.seconds(n) for c, n in zip(costs, shares)) == pytest.approx(best)


def test_a_device_that_only_slows_the_step_gets_no_share():
    """Caffe con Troll's case, decided by measurement: a GPU that does 256 samples in 10 ms plus launches,
    and a CPU that would need more than that for even one sample."""
    gpu, cpu = LinearCost(fixed=0.008, per_sample=0.002 / 256), LinearCost(fixed=0.005, per_sample=0.006)
    assert split_batch([gpu, cpu], 256) == [256, 0]
    faster_cpu = LinearCost(fixed=0.0, per_sample=0.0002)  # this one shortens the step: it gets rows
    shares = split_batch([gpu, faster_cpu], 256)
    assert 0 < shares[1] < shares[0] and sum(shares) == 256
    assert max(gpu.seconds(shares[0]), faster_cpu.seconds(shares[1])) < gpu.seconds(256)


def test_fit_cost_recovers_a_line_and_falls_back_to_proportional():
    line = fit_cost({10: 0.3, 20: 0.5, 40: 0.9})
    assert (line.fixed, line.per_sample) == pytest.approx((0.1, 0.02))
    assert fit_cost({16: 0.032}) == LinearCost(0.0, 0.002)
    assert fit_cost({16: 0.5, 20: 0.4}).fixed == 0.0  # a falling line is noise: proportional to the latest
    assert fit_cost({}) is None


def test_balancer_moves_to_the_measured_split_and_then_stays():
    per_sample = [0.001, 0.003]  # worker 1 is three times slower
    balancer = ShareBalancer([16, 16], freq=5)
    changes = []
    for _ in range(60):
        balancer.observe([p * n for p, n in zip(per_sample, balancer.shares)])
        proposal = balancer.propose()
        if proposal:
            changes.append(proposal)
    assert balancer.shares == [24, 8]
    assert changes == [[24, 8]]


def test_balancer_drops_a_device_whose_fixed_cost_exceeds_the_others_whole_step():
    costs = [LinearCost(0.0, 0.001), LinearCost(0.1, 0.001)]  # the second: 100 ms per step before any row
    balancer = ShareBalancer([16, 16], freq=5)
    for _ in range(60):
        balancer.observe([c.seconds(n) if n else None for c, n in zip(costs, balancer.shares)])
        balancer.propose()
    assert balancer.shares == [32, 0]


# -- training on several devices is training on one ---------------------------------
DEVICE_LAYOUTS = {
    "cpu + cpu:1": dict(n=2, devices=["cpu", "cpu:1"]),
    "3 cpu devices, uneven 11+11+10": dict(n=3, devices=["cpu:0", "cpu:1", "cpu:2"]),
    "2 workers per device, 4 workers": dict(n=4, devices=["cpu:0", "cpu:0", "cpu:1", "cpu:1"]),
    "root elsewhere, shares 24+8": dict(n=2, devices=["cpu:1", "cpu"], batchsize=[24, 8]),
    "replicas with dropout": dict(n=2, devices=["cpu:0", "cpu:1"], dropout=True),
}


@pytest.mark.parametrize("layout", DEVICE_LAYOUTS)
def test_a_multi_device_group_trains_exactly_like_one_worker(blobs_job, tmp_path, layout):
    spec = DEVICE_LAYOUTS[layout]
    updater = "type: kNesterov momentum: 0.5 weight_decay: 0.001"
    single = trained_params(job_with(blobs_job, train_steps=8, updater=updater, dropout=spec.get("dropout", False)), "single worker", tmp_path / "single")
    group_job = job_with(blobs_job, THREADS[spec["n"]], spec["devices"], spec.get("batchsize"), train_steps=8, updater=updater,
                         dropout=spec.get("dropout", False))
    group = trained_params(group_job, THREADS[spec["n"]], tmp_path / "group")
    for name in single:
        torch.testing.assert_close(group[name], single[name], rtol=1e-5, atol=1e-6)


def test_workers_on_replicas_in_several_processes_train_exactly_like_one_worker(blobs_job, tmp_path):
    """AllReduce over 2 processes, each worker on a device other than its process's params (host memory)."""
    layout = "AllReduce, 2 processes, 2 server slices"
    single = trained_params(job_with(blobs_job, train_steps=8), "single worker", tmp_path / "single")
    group = trained_params(job_with(blobs_job, layout, ["cpu:1"], train_steps=8), layout, tmp_path / "group")
    for name in single:
        torch.testing.assert_close(group[name], single[name], rtol=1e-5, atol=1e-6)


# -- measured shares ------------------------------------------------------------------
def test_auto_shares_follow_a_slowed_worker_and_never_change_the_maths(blobs_job, tmp_path):
    """Worker 1 made three times slower per sample: the group settles on 24 + 8 rows, and the params
    after the run are the single worker's (the shares changed mid-run)."""
    steps = 40
    single = trained_params(job_with(blobs_job, train_steps=steps), "single worker", tmp_path / "single", steps)
    job = job_with(blobs_job, THREADS[2], ["cpu:0", "cpu:1"], train_steps=steps, cluster_extra=dict(auto_batch_shares=True, auto_batch_freq=5))
    env = dict(os.environ, SHOAL_SLOW_WORKER="0:0.0005,1:0.0015")
    proc = run_cli("run", job, "--workspace", tmp_path / "auto", env=env, timeout=300, cwd=REPO)  # one process: this one
    assert proc.returncode == 0, proc.stderr
    assert_ran(tmp_path / "auto", THREADS[2])
    assert "Batch shares from step" in proc.stdout
    records = [json.loads(line) for line in (tmp_path / "auto" / "metrics.jsonl").read_text().splitlines()]
    final = [r["batch_shares"] for r in records if r["phase"] == "train"][-1]
    assert sum(final) == 32 and abs(final[0] - 24) <= 3, final
    balanced = ckpt_io.load(ckpt_io.checkpoint_file(tmp_path / "auto", steps)).params
    for name in single:
        torch.testing.assert_close(balanced[name], single[name], rtol=1e-5, atol=1e-6)


def test_auto_shares_are_refused_where_a_batch_cannot_be_re_split(blobs_job, tmp_path):
    job = job_with(blobs_job, "AllReduce, 2 processes", train_steps=2, cluster_extra=dict(auto_batch_shares=True))
    with pytest.raises(UnsupportedClusterError, match="auto_batch_shares: the workers of a group must share one process"):
        shoal.train(job, workspace=tmp_path / "ws", log=lambda *a: None)


@pytest.mark.parametrize("extra, message", [
    ('device: "gpu0"', "device: 'gpu0' is not a device"),
    ('gpu: 0 device: "cpu"', "give the workers' devices either as gpu"),
])
def test_bad_device_lists_are_refused_in_one_line_with_their_position(blobs_job, tmp_path, extra, message):
    job = blobs_job(train_steps=2, extra=extra)
    proc = run_cli("run", job, "--workspace", tmp_path / "ws", cwd=REPO, timeout=60)
    assert proc.returncode != 0
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"{job}:") and message in proc.stderr
    assert re.match(rf"{re.escape(str(job))}:\d+:\d+: ", proc.stderr)  # line and column of the field
    assert not (tmp_path / "ws").exists()


def test_plan_shows_each_workers_device_and_batch_share(blobs_job):
    job = job_with(blobs_job, THREADS[2], ["cuda:0", "cpu"], batchsize=[24, 8], cluster_extra=dict(auto_batch_shares=True))
    out = run_cli("plan", job, cwd=REPO, timeout=60).stdout
    assert "worker (group 0, id 0) on cuda:0, batch share 24 (at start; measured at run time)" in out
    assert "worker (group 0, id 1) on cpu, batch share 8 (at start; measured at run time)" in out


# -- on a GPU -------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("devices", [["cuda:0"], ["cuda:0", "cpu"], ["cpu", "cuda:0"]])
def test_a_group_with_gpu_workers_trains_like_one_cpu_worker(blobs_job, tmp_path, devices):
    layout = THREADS.get(len(devices), "single worker")
    single = trained_params(job_with(blobs_job, train_steps=8, dropout=True), "single worker", tmp_path / "single")
    group = trained_params(job_with(blobs_job, layout, devices, train_steps=8, dropout=True), layout, tmp_path / "group")
    for name in single:
        torch.testing.assert_close(group[name], single[name], rtol=1e-4, atol=1e-5)
