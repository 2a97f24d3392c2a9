"""Every framework with its workers on a GPU (issue 29 point 3); each test skips without CUDA.

On one host `shoal run` gives worker k of every process device[k], so its processes share a GPU: NCCL
refuses two ranks on one device, the plan puts their groups on gloo and the exchanges (and a partitioned
group's bridges, over each pair of workers' group) stage CUDA tensors through host memory. A separate
server (Sandblaster) holds its slices in host memory: a mixed CPU+GPU group. One GPU per process over
NCCL is two nodes on this host (`--nnodes 2`), each seeing another GPU as cuda:0 (CUDA_VISIBLE_DEVICES);
it needs two GPUs.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import shoal
from layouts import LAYOUTS, Layout, assert_ran
from shoal.neuralnet import checkpoint as ckpt_io

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

STEPS = 8
LOCAL_SGD = Layout(dict(nworker_groups=2, local_steps=2), 2, 2, "Local SGD")


def on_gpu(blobs_job, layout: str, devices=("cuda:0",), **kw):
    return blobs_job(train_steps=STEPS, layout=layout, extra="".join(f' device: "{d}"' for d in devices), **kw)


def trained(job, workspace, layout=None, *overrides):
    shoal.train(shoal.load_job(job, list(overrides)), workspace=workspace, log=lambda *a: None)
    if layout is not None:
        assert_ran(workspace, layout)
    return ckpt_io.load(ckpt_io.checkpoint_file(workspace, STEPS)).params


def assert_close_params(got, expected):
    for name in expected:
        torch.testing.assert_close(got[name].cpu(), expected[name].cpu(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layout, devices", [
    ("AllReduce, 2 processes", ["cuda:0"]),  # two processes on one GPU: gloo, staged through the host
    ("AllReduce, 2 processes x 2 threads", ["cuda:0", "cpu"]),  # a GPU and a CPU worker in each process
    ("Sandblaster, 2 workers + 1 server, 3 processes", ["cuda:0"]),  # GPU workers, a CPU server: a mixed group
    ("Sandblaster, 2 workers + 2 servers, 4 processes", ["cuda:0"]),
])
def test_synchronous_layouts_on_a_gpu_equal_one_cpu_worker(blobs_job, tmp_path, layout, devices):
    single = trained(blobs_job(train_steps=STEPS), tmp_path / "single")
    group = trained(on_gpu(blobs_job, layout, devices), tmp_path / "group", layout)
    assert_close_params(group, single)


PLACED_ON_WORKER_3 = ["neuralnet.layer[name=fc1].location=3", "neuralnet.layer[name=relu].location=3"]


@pytest.mark.parametrize("layout, devices, overrides", [
    # fc1 and relu cut on features over the two processes on one GPU: the bridge pair's group is gloo, staged
    ("AllReduce, 2 processes", ["cuda:0"], ["neuralnet.partition_dim=1"]),
    # fc1 and relu on worker 3 (process 1's CPU worker), the rest on both processes' GPU and CPU workers
    ("AllReduce, 2 processes x 2 threads", ["cuda:0", "cpu"], PLACED_ON_WORKER_3),
])
def test_a_partitioned_group_spanning_processes_on_a_gpu_equals_one_cpu_worker(blobs_job, tmp_path, layout, devices, overrides):
    """Bridges between processes: broadcasts over the plan's group of each pair of workers, each end on its device."""
    single = trained(blobs_job(train_steps=STEPS), tmp_path / "single")
    group = trained(on_gpu(blobs_job, layout, devices), tmp_path / "group", layout, *overrides)
    assert_close_params(group, single)


@pytest.mark.parametrize("compression", ["kBF16", "kTopK"])
def test_compressed_allreduce_on_a_gpu_learns(blobs_job, tmp_path, compression):
    layout = "AllReduce, 2 processes"
    shoal.train(shoal.load_job(on_gpu(blobs_job, layout), [f"cluster.compression={compression}"]),
                workspace=tmp_path / "ws", log=lambda *a: None)
    assert assert_ran(tmp_path / "ws", layout)["final_test"]["accuracy"] > 0.5


def test_local_sgd_on_a_gpu_equals_its_cpu_run(blobs_job, tmp_path):
    """Both processes on one GPU (gloo, staged): the meetings' all-reduce moves what the CPU run's does."""
    cpu = trained(blobs_job(train_steps=STEPS), tmp_path / "cpu", LOCAL_SGD, *LOCAL_SGD.overrides())
    gpu = trained(on_gpu(blobs_job, "single worker"), tmp_path / "gpu", LOCAL_SGD, *LOCAL_SGD.overrides())
    assert_close_params(gpu, cpu)


@pytest.mark.parametrize("layout", ["Downpour, 2 groups + 1 server, 3 processes", "Distributed Hogwild, 2 groups"])
def test_asynchronous_layouts_with_gpu_workers_run_and_learn(blobs_job, tmp_path, layout):
    """Request/response protocols: the stubs copy to the host once, gloo's point-to-point carries it."""
    shoal.train(on_gpu(blobs_job, layout), workspace=tmp_path / "ws", log=lambda *a: None)
    summary = assert_ran(tmp_path / "ws", layout)
    assert summary["final_test"]["accuracy"] > 0.5


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="one GPU per process needs two GPUs")
@pytest.mark.parametrize("layout", ["AllReduce, 2 processes", "local sgd"])
def test_one_gpu_per_process_over_nccl_equals_one_cpu_worker(blobs_job, tmp_path, layout):
    """Two nodes on this host, each its own GPU as cuda:0: every member of every group on a GPU of its own, so
    the plan's groups ride NCCL (asserted on the plan), and the run equals the CPU run."""
    from shoal.comm.dist import free_port
    from shoal.planning.plan import plan_job

    row = LOCAL_SGD if layout == "local sgd" else LAYOUTS[layout]
    expected = trained(blobs_job(train_steps=STEPS), tmp_path / "cpu", None, *row.overrides())
    job = on_gpu(blobs_job, "single worker")  # (blobs_job rewrites one file: the CPU run is done)
    plan = plan_job(shoal.load_job(job, row.overrides()), nnodes=2)
    assert plan.process_groups and all(g.nccl for g in plan.process_groups)
    port = free_port()
    nodes = [subprocess.Popen([sys.executable, "-m", "shoal", "run", str(job), "--nnodes", "2", "--node-rank", str(n),
                               "--master", f"127.0.0.1:{port}", "--workspace", str(tmp_path / f"node{n}"), *row.cli()],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, CUDA_VISIBLE_DEVICES=str(n), SHOAL_JOB_SECRET="0" * 64))
             for n in range(2)]
    outs = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outs
    got = ckpt_io.load(ckpt_io.checkpoint_file(tmp_path / "node0", STEPS)).params
    assert_close_params(got, expected)
