"""Asynchronous groups keep the job's effective momentum: the servers' momentum is compensated for the asynchrony."""
from __future__ import annotations

import pytest
from google.protobuf import text_format

from shoal.config import job_pb2
from shoal.planning.plan import Framework, plan_job, server_updater
from shoal.strategies.registry import REGISTRY

from cli_in_process import run_cli
from conftest import mlp_job_text


def job_with(blobs_dir, cluster: str, momentum: float = 0.9, extra_cluster: str = "") -> job_pb2.JobProto:
    job = text_format.Parse(mlp_job_text(blobs_dir, updater=f"type: kSGD momentum: {momentum}"), job_pb2.JobProto())
    text_format.Parse(cluster + " " + extra_cluster, job.cluster)
    return job


@pytest.mark.parametrize("cluster, groups", [
    ("nworker_groups: 2 server_worker_separate: true", 2),
    ("nworker_groups: 2 nserver_groups: 2", 2),
    ("nworker_groups: 4 nworkers_per_procs: 4", 4),
])
def test_servers_use_one_minus_groups_times_one_minus_momentum(blobs_dir, cluster, groups):
    plan = plan_job(job_with(blobs_dir, cluster))
    assert not plan.framework.synchronous
    assert plan.updater.momentum == pytest.approx(max(0.0, 1 - groups * (1 - 0.9)), abs=1e-6)
    assert any("momentum 0.9 ->" in note for note in plan.notes)
    kept = plan_job(job_with(blobs_dir, cluster, extra_cluster="async_momentum: kAsConfigured"))
    assert kept.updater.momentum == pytest.approx(0.9) and not any("momentum" in n for n in kept.notes)


def test_synchronous_layouts_and_momentum_free_jobs_are_untouched(blobs_dir):
    for cluster in ("", "nworkers_per_group: 2 nworkers_per_procs: 2", "nworkers_per_group: 2"):
        assert plan_job(job_with(blobs_dir, cluster)).updater.momentum == pytest.approx(0.9)
    job = job_with(blobs_dir, "nworker_groups: 2 nworkers_per_procs: 2", momentum=0)
    assert server_updater(job, REGISTRY[Framework.IN_MEMORY_HOGWILD]).momentum == 0


def test_plan_says_what_the_servers_use(blobs_job):
    job = blobs_job()
    out = run_cli("plan", job, "--set", "cluster.nworker_groups=3", "--set", "cluster.nworkers_per_procs=3", timeout=120)  # in this process
    assert out.returncode == 0, out.stderr
    assert "updater.momentum 0.9 -> 0.7 at the servers: 3 asynchronous groups" in out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["cluster.nworker_groups=2", "cluster.server_worker_separate=true"],
                                    ["cluster.nworker_groups=2", "cluster.nserver_groups=2", "cluster.sync_freq=10"]])
def test_two_async_groups_reach_the_single_workers_accuracy_at_equal_steps(mnist_dir, tmp_path, layout):
    """benchmarks/async_momentum.py's claim on real MNIST at lr 0.1, where SINGA's plain momentum fails."""
    from benchmark_scripts import load_benchmark

    bench = load_benchmark("async_momentum")
    job = tmp_path / "small.conf"
    job.write_text(bench.small_mlp(mnist_dir, lr=0.1))
    single = bench.final_accuracy(job, [], tmp_path)
    assert bench.final_accuracy(job, layout, tmp_path) >= single
