"""The layout's facts the plan hands down instead of its cluster section (issue 41 point 2: nothing outside planning
reads `plan.cluster`), and how planning gets the strategies without loading them by name."""
from __future__ import annotations

import dataclasses

import pytest

import shoal
from layouts import LAYOUTS
from shoal.planning import strategy
from shoal.planning.cluster_facts import LAYOUT_FIELDS, AsyncBounds, Compression, Meetings
from shoal.planning.plan import plan_job
from shoal.strategies.registry import REGISTRY

JOB = "examples/mnist/job.conf"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layouts_facts_are_its_cluster_sections(name):
    """Each fact is the cluster section's value (typed, frozen): the strategies read the same numbers as before."""
    plan = plan_job(shoal.load_job(JOB, LAYOUTS[name].overrides()), cores=2)
    c = plan.cluster
    assert (plan.nworker_groups, plan.nworkers_per_group, plan.nserver_groups, plan.nservers_per_group, plan.sync_freq) == (
        c.nworker_groups, c.nworkers_per_group, c.nserver_groups, c.nservers_per_group, c.sync_freq)
    assert plan.server_worker_separate is bool(c.server_worker_separate)
    assert plan.compression == Compression(c.compression, c.topk_fraction)
    assert plan.asynchrony == AsyncBounds(c.max_staleness, c.warmup_steps, c.max_update_lag, bool(c.overlap_push))
    assert plan.meetings == Meetings(c.local_steps, c.local_warmup_steps, None)
    assert list(plan.layout_fields) == list(LAYOUT_FIELDS) and all(plan.layout_fields[k] == getattr(c, k) for k in LAYOUT_FIELDS)


def test_the_facts_of_compression_asynchrony_and_meetings():
    topk = plan_job(shoal.load_job(JOB, ["cluster.nworkers_per_group=2", "cluster.nworkers_per_procs=1",
                                         "cluster.compression=kTopK", "cluster.topk_fraction=0.25"]), cores=2)
    assert topk.compression.topk and not topk.compression.dense and topk.compression.topk_fraction == 0.25
    bounded = plan_job(shoal.load_job(JOB, ["cluster.nworker_groups=3", "cluster.nworkers_per_procs=3", "cluster.max_staleness=2",
                                            "cluster.warmup_steps=5"]), cores=2)
    assert bounded.asynchrony == AsyncBounds(max_staleness=2, warmup_steps=5, max_update_lag=-1, overlap_push=False)
    sparse = plan_job(shoal.load_job(JOB, ["cluster.nworker_groups=2", "cluster.local_steps=4", "cluster.nworkers_per_procs=1",
                                           "cluster.sparse_outer_step.chunk_size=64"]), cores=2)
    m = sparse.meetings
    assert m.sparse and m.local_steps == 4 and m.sparse_outer_step.chunk_size == 64
    m.sparse_outer_step.chunk_size = 1  # a fresh copy: the plan does not change
    assert sparse.meetings.sparse_outer_step.chunk_size == 64
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.local_steps = 1  # type: ignore[misc]


def test_meetings_per_step_count_the_warm_up_then_every_local_steps():
    """A run of 10 steps, 3 warm-up meetings then one every 4 steps (steps 7 of 7 left: 1): 4 meetings."""
    m = Meetings(local_steps=4, warmup_steps=3)
    assert m.count(10) == 3 + 7 // 4 and m.per_step(10) == pytest.approx(0.4)
    assert Meetings(local_steps=5).count(3) == 0 and Meetings(local_steps=2).per_step(0) == 0.0
    assert not Meetings().sparse and Meetings(sparse_outer_step_bytes=b"").sparse  # `sparse_outer_step {}` is set


def test_planning_plans_with_the_registry_it_is_given_or_the_installed_one(monkeypatch):
    """The launcher and the front ends pass the registry; without one planning takes the installed registry (which
    shoal.strategies.registry installs when imported) and, with none installed, says so in one line."""
    job = shoal.load_job(JOB, ["cluster.nworkers_per_group=2", "cluster.nworkers_per_procs=2"])
    assert plan_job(job, strategies=REGISTRY).strategy is REGISTRY[strategy.Framework.ALLREDUCE]
    assert strategy.installed_registry() is REGISTRY and plan_job(job).strategy is REGISTRY[strategy.Framework.ALLREDUCE]
    monkeypatch.setattr(strategy, "_installed", None)
    with pytest.raises(strategy.NoStrategiesError, match=r"^no framework strategies installed: pass plan_job\(\.\.\., strategies=REGISTRY\)"):
        plan_job(job)
    assert plan_job(job, strategies=REGISTRY).label == "in-memory Sandblaster"


@pytest.mark.parametrize("name, stubs", [
    ("Downpour, 2 groups x 2 workers + 2 servers, 6 processes", [0, 2]),  # groups over processes 0-1 and 2-3; 4, 5 serve
    ("Downpour, 2 groups + 1 server, 3 processes", [0, 1]),
    ("AllReduce, 2 processes", [0]),  # one group over both
    ("single worker", [0]),
])
def test_a_groups_stub_is_its_first_worker_process(name, stubs):
    """The processes that talk to the servers for their group and may take the chief's place (succession, rejoin)."""
    plan = plan_job(shoal.load_job(JOB, LAYOUTS[name].overrides()), cores=2)
    assert plan.nprocs == LAYOUTS[name].processes
    assert [r for r in range(plan.nprocs) if plan.is_group_stub(r)] == stubs
