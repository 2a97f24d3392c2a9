"""The process groups the plan names for the exchanges' collectives (pure: no process group is made)."""
from __future__ import annotations

import pytest

import shoal
from layouts import LAYOUTS
from shoal.planning.plan import plan_job
from shoal.planning.process_groups import ProcessGroupPlan, nccl_capable


def plan_groups(blobs_job, layout: str, devices=(), *overrides, nnodes: int = 1):
    job = blobs_job(layout=layout, extra="".join(f' device: "{d}"' for d in devices))
    # the strategy's groups: the whole job (every plan of several processes names it last, the world's own handle)
    # is tests/test_architecture_collectives.py's
    return [g for g in plan_job(shoal.load_job(job, list(overrides)), cores=2, nnodes=nnodes).process_groups if not g.world]


def groups_of(blobs_job, layout: str, devices=(), *overrides, nnodes: int = 1):
    return [(g.name, g.ranks, g.nccl) for g in plan_groups(blobs_job, layout, devices, *overrides, nnodes=nnodes)]


def test_each_owner_of_slices_gets_a_group_of_the_worker_processes_and_itself(blobs_job):
    assert groups_of(blobs_job, "AllReduce, 2 processes, 2 server slices") == [
        ("sliced/owner0", (0, 1), False), ("sliced/owner1", (0, 1), False)]
    # separate servers: each one's group is the workers and that server, not the other server
    assert groups_of(blobs_job, "Sandblaster, 2 workers + 2 servers, 4 processes") == [
        ("sliced/owner2", (0, 1, 2), False), ("sliced/owner3", (0, 1, 3), False)]


def test_nccl_only_where_every_member_has_a_gpu_of_its_own(blobs_job):
    # one host: every process's worker 0 on cuda:0, a shared GPU; two nodes: a GPU each
    assert groups_of(blobs_job, "AllReduce, 2 processes", ["cuda:0"]) == [("sliced/owner0", (0, 1), False)]
    assert groups_of(blobs_job, "AllReduce, 2 processes", ["cuda:0"], nnodes=2) == [("sliced/owner0", (0, 1), True)]
    # a server without workers has no GPU: its group stays on gloo (its CUDA members stage through the host)
    assert groups_of(blobs_job, "Sandblaster, 2 workers + 1 server, 3 processes", ["cuda:0"], nnodes=3) == [
        ("sliced/owner2", (0, 1, 2), False)]
    local_sgd = ["cluster.nworker_groups=2", "cluster.local_steps=5"]
    assert groups_of(blobs_job, "single worker", ["cuda:0"], *local_sgd, nnodes=2) == [("meeting", (0, 1), True)]


def test_a_partitioned_group_spanning_processes_gets_a_dedicated_group_per_bridged_pair_of_workers(blobs_job):
    """Bridges between processes run over the plan's groups: one per pair of workers a bridge joins across processes,
    never the world's handle (dedicated), so two pairs on the same two processes get two groups."""
    feature = ["neuralnet.partition_dim=1"]
    assert [g for g in plan_groups(blobs_job, "AllReduce, 2 processes", (), *feature) if g.name.startswith("bridges/")] == [
        ProcessGroupPlan("bridges/g0/w0+w1", (0, 1), False, dedicated=True)]
    # fc1 and relu on worker 3 (process 1): workers 0 and 1 (process 0) bridge to it; worker 2 shares its process
    placed = ["neuralnet.layer[name=fc1].location=3", "neuralnet.layer[name=relu].location=3"]
    assert groups_of(blobs_job, "AllReduce, 2 processes x 2 threads", (), *placed) == [
        ("sliced/owner0", (0, 1), False), ("sliced/owner1", (0, 1), False),
        ("bridges/g0/w0+w3", (0, 1), False), ("bridges/g0/w1+w3", (0, 1), False)]
    # a GPU of its own on each node: the pair's CUDA tensors ride NCCL
    assert groups_of(blobs_job, "AllReduce, 2 processes", ["cuda:0"], *feature, nnodes=2)[-1] == ("bridges/g0/w0+w1", (0, 1), True)
    # data parallel only (no layer cut): plain workers, no bridges
    assert groups_of(blobs_job, "AllReduce, 2 processes") == [("sliced/owner0", (0, 1), False)]


@pytest.mark.parametrize("layout", ["single worker", "in-memory Sandblaster, 2 threads", "Downpour, 2 groups + 1 server, 3 processes"])
def test_layouts_without_collectives_name_no_group(blobs_job, layout):
    assert groups_of(blobs_job, layout) == []


@pytest.mark.parametrize("devices, nodes, capable", [
    ([["cuda:0"], ["cuda:1"]], [0, 0], True),
    ([["cuda:0"], ["cuda:0"]], [0, 1], True),
    ([["cuda:0"], ["cuda:0"]], [0, 0], False),  # two ranks on one GPU: NCCL refuses
    ([["cuda:0"], ["cpu"]], [0, 0], False),
    ([["cuda:0", "cpu:1"], ["cuda:1"]], [0, 0], False),
    ([["cuda:0"], []], [0, 0], False),  # a member without workers
])
def test_nccl_capable(devices, nodes, capable):
    assert nccl_capable(devices, nodes) is capable


def test_shoal_plan_shows_the_groups(blobs_job):
    from shoal.planning.describe import describe, render

    job = blobs_job(layout="Sandblaster, 2 workers + 2 servers, 4 processes")
    plan = plan_job(shoal.load_job(job), cores=2)
    assert "process group sliced/owner3: ranks 0, 1, 3 (CUDA tensors: gloo via the host)" in render(plan).splitlines()
    assert describe(plan)["process_groups"][0] == {"name": "sliced/owner2", "ranks": [0, 1, 2], "cuda_over": "gloo via the host"}


def test_downpour_names_the_group_of_each_worker_groups_processes(blobs_job):
    """A worker group over several processes reduces to its stub over a group the plan names (gloo: host tensors);
    a group in one process needs none (test_layouts_without_collectives_name_no_group)."""
    assert groups_of(blobs_job, "Downpour, 2 groups x 2 workers + 2 servers, 6 processes", ["cuda:0"]) == [
        ("workers/g0", (0, 1), False), ("workers/g1", (2, 3), False)]
