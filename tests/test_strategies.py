"""One strategy per framework (shoal/strategies/): every layout is exactly one strategy's, the plan carries it, and
planning takes the registry as an argument (pure: a test registry changes what is planned, nothing else does)."""
from __future__ import annotations

import pytest
from google.protobuf import text_format
from layouts import LAYOUTS

from shoal.config import job_pb2
from shoal.planning.plan import UnsupportedClusterError, plan_job
from shoal.planning.strategy import Framework, Layout, make_registry, recognise
from shoal.strategies.allreduce import AllReduce
from shoal.strategies.registry import REGISTRY

TINY = """name: 'tiny' train_steps: 10
neuralnet {
  layer { name: "data" type: kRecordInput store_conf { backend: "kvfile" path: "unused.bin" batchsize: 12 shape: 4 } }
  layer { name: "fc" type: kInnerProduct srclayers: "data" innerproduct_conf { num_output: 3 } param { name: "w" } param { name: "b" } }
  layer { name: "loss" type: kSoftmaxLoss srclayers: "fc" srclayers: "data" }
}
updater { type: kSGD learning_rate { type: kFixed base_lr: 0.1 } }
"""
EXTRA = {  # layouts the end-to-end table has no row for
    "Local SGD in one process": (dict(nworker_groups=2, nworkers_per_procs=2, local_steps=4), "Local SGD"),
    "Local SGD, 2 processes": (dict(nworker_groups=2, local_steps=4), "Local SGD"),
}


def job_of(cluster: dict) -> job_pb2.JobProto:
    fields = " ".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in cluster.items())
    return text_format.Parse(f"{TINY} cluster {{ {fields} }}", job_pb2.JobProto())


ROWS = {name: (row.cluster, row.framework) for name, row in LAYOUTS.items()} | EXTRA


@pytest.mark.parametrize("name", list(ROWS))
def test_every_layout_is_exactly_one_strategys(name):
    cluster, label = ROWS[name]
    plan = plan_job(job_of(cluster))
    layout = Layout(plan.job, plan.placement, plan.partition)
    assert [s.framework for s in REGISTRY.values() if s.recognises(layout)] == [plan.framework]
    assert plan.strategy is REGISTRY[plan.framework] and plan.label == label


def test_the_registry_lists_every_framework_once():
    assert list(REGISTRY) == list(Framework)
    assert all(REGISTRY[f].framework is f for f in Framework)
    with pytest.raises(TypeError):
        REGISTRY[Framework.DOWNPOUR] = REGISTRY[Framework.ALLREDUCE]  # read-only


def test_planning_takes_the_registry_as_an_argument():
    """A registry given to plan_job decides the framework, its label and notes: planning reads no other."""

    class NotedAllReduce(AllReduce):
        def label(self, plan) -> str:
            return "AllReduce (test)"

        def notes(self, plan) -> list[str]:
            return ["a test strategy planned this"]

    registry = make_registry(*[NotedAllReduce() if f is Framework.ALLREDUCE else s for f, s in REGISTRY.items()])
    plan = plan_job(job_of(dict(nworkers_per_group=2)), strategies=registry)
    assert isinstance(plan.strategy, NotedAllReduce) and plan.label == "AllReduce (test)"
    assert "a test strategy planned this" in plan.notes
    assert plan_job(job_of(dict(nworkers_per_group=2))).label == "AllReduce"  # the installed registry is untouched


def test_two_strategies_claiming_a_layout_is_a_registry_bug():
    job = job_of(dict(nworkers_per_group=2))
    plan = plan_job(job)
    twice = make_registry(AllReduce(), type("Again", (AllReduce,), {"framework": Framework.SANDBLASTER, "separate_servers": False})())
    with pytest.raises(AssertionError, match="exactly one strategy"):
        recognise(Layout(job, plan.placement, plan.partition), twice)


def test_a_strategys_refusal_is_one_line():
    with pytest.raises(UnsupportedClusterError, match=r"^cluster: asynchronous groups in one process need nserver_groups: 1"):
        plan_job(job_of(dict(nworker_groups=2, nworkers_per_procs=2, nserver_groups=2, nservers_per_procs=2)))
    with pytest.raises(UnsupportedClusterError, match=r"^cluster.local_warmup_steps: applies to Local SGD only"):
        plan_job(job_of(dict(nworker_groups=2, nworkers_per_procs=2, local_warmup_steps=2)))


def test_the_plan_is_frozen_all_the_way_down():
    """Nothing reachable from a JobPlan's data can be changed: protos come back as fresh copies, members as tuples."""
    job = job_of(dict(nworker_groups=2, local_steps=4, nworkers_per_procs=2))
    plan = plan_job(job)
    job.cluster.local_steps = 99  # the caller's job is not the plan's
    plan.job.cluster.local_steps = 98
    plan.cluster.local_steps = 97
    plan.updater.learning_rate.base_lr = 5.0
    plan.outer_updater.momentum = 0.5
    plan.placement.cluster.nworker_groups = 7
    assert (plan.cluster.local_steps, plan.job.cluster.local_steps, plan.updater.learning_rate.base_lr) == (4, 4, pytest.approx(0.1))
    assert (plan.outer_updater.momentum, plan.placement.nworker_groups, plan.label) == (0, 2, "Local SGD")
    for value in (plan.batch_shares, plan.devices, plan.notes, plan.placement.processes, plan.placement.slices,
                  plan.placement.processes[0].workers, *plan.batch_shares, *plan.devices):
        assert isinstance(value, tuple)
    with pytest.raises(TypeError):
        plan.params["w"] = (1,)
    with pytest.raises(AttributeError):
        plan.placement.processes[0].workers = ()  # frozen dataclasses
    parts = plan.partition  # the partitioned net: frozen but for its nodes' layer objects (they compute)
    for value in (parts.nodes, parts.notes, *(n.srcs for n in parts.nodes), *(n.params for n in parts.nodes)):
        assert isinstance(value, tuple)
    with pytest.raises(TypeError):
        parts.partitioning["fc"] = ("whole", 0)
    with pytest.raises(AttributeError):
        parts.nodes[0].worker = 1
    with pytest.raises(AttributeError):
        parts.nworkers = 3


def test_bucket_size_and_restarts_are_plan_fields_the_environment_overrides():
    """cluster.bucket_mb / cluster.max_restarts decide; SHOAL_BUCKET_MB / SHOAL_MAX_RESTARTS override them, and the
    cost model's buckets are the run's."""
    from shoal.planning.buckets import BucketSizeError

    job = job_of(dict(nworkers_per_group=2, bucket_mb=100 * 4 / 2**20, max_restarts=2, nworker_groups=1))
    plan = plan_job(job, environ={})
    assert (plan.bucket_elements, plan.max_restarts) == (100, 2)
    overridden = plan_job(job, environ={"SHOAL_BUCKET_MB": str(10 * 4 / 2**20), "SHOAL_MAX_RESTARTS": "5"})
    assert (overridden.bucket_elements, overridden.max_restarts) == (10, 5)
    assert plan_job(job_of(dict(nworkers_per_group=2)), environ={}).bucket_elements == 1 << 20  # 4 MB, DDP's default is 25
    with pytest.raises(BucketSizeError, match=r"^SHOAL_BUCKET_MB='lots': not a number of megabytes$"):
        plan_job(job, environ={"SHOAL_BUCKET_MB": "lots"})
    with pytest.raises(UnsupportedClusterError, match=r"^SHOAL_MAX_RESTARTS='-1': expected 0 or more"):
        plan_job(job, environ={"SHOAL_MAX_RESTARTS": "-1"})


def timeouts(plan) -> tuple[float, float, float]:
    return plan.comm_timeout_s, plan.stall_timeout_s, plan.join_timeout_s


def test_timeouts_are_plan_fields_the_environment_overrides():
    """cluster.comm_timeout_s / stall_timeout_s / join_timeout_s decide (45, 10 and 600 s by default, as before);
    SHOAL_COMM_TIMEOUT / SHOAL_STALL_TIMEOUT / SHOAL_JOIN_TIMEOUT override them, read once by plan_job."""
    assert timeouts(plan_job(job_of(dict(nworkers_per_group=2)), environ={})) == (45, 10, 600)
    job = job_of(dict(nworkers_per_group=2, comm_timeout_s=30, stall_timeout_s=2.5, join_timeout_s=90))
    assert timeouts(plan_job(job, environ={})) == (30, 2.5, 90)
    overridden = plan_job(job, environ={"SHOAL_COMM_TIMEOUT": "8", "SHOAL_STALL_TIMEOUT": "0.5", "SHOAL_JOIN_TIMEOUT": "2"})
    assert timeouts(overridden) == (8, 0.5, 2)
    assert timeouts(plan_job(job, environ={"SHOAL_STALL_TIMEOUT": ""})) == (30, 2.5, 90)  # empty: not set
    for bad in ("soon", "0", "-3", "inf", "nan"):
        with pytest.raises(UnsupportedClusterError,
                           match=rf"^SHOAL_STALL_TIMEOUT='{bad}': expected seconds > 0 \(overrides cluster.stall_timeout_s\)$"):
            plan_job(job, environ={"SHOAL_STALL_TIMEOUT": bad})
