"""The cost model's measured terms (issue 30, point 2): a fixed cost per collective and per message, counted per step
from each strategy's exchange; the job's updater timed; a torch module's forward and backward timed. Pure: hand-built
calibrations, counts by hand from runtime/exchanges/."""
from __future__ import annotations

import socket
from dataclasses import replace

import pytest

from shoal.config import job_from_text
from shoal.planning.costs import Calibration, LayerCost, compute_seconds, module_kernels
from shoal.planning.estimate import Hosts, estimate, plan_kernels, update_kernel
from shoal.planning.module_costs import ModuleCosts
from shoal.planning.plan import plan_job
from shoal.runtime import calibrate

from test_estimate import CALIB, SMALL, small


COLLECTIVE = 1e-4  # one small collective between two processes
MESSAGE = 3e-5  # one point-to-point message, one way
TIMED = replace(CALIB, collective_s=COLLECTIVE, link_latency_s=MESSAGE)


def counts(e) -> float:
    return sum(f["count"] for f in e.fixed_costs)


def bytes_only(e) -> float:
    return e.phases["exchange"] - sum(f["seconds"] for f in e.fixed_costs)


def test_allreduce_pays_each_collective_it_issues():
    # the small net's 51 elements: 2 owners, one bucket each; per bucket a gather at the owner and a broadcast back (the
    # has-gradient flags ride in the owner's last bucket: no collective of their own)
    e = estimate(small("nworkers_per_group: 2 nservers_per_group: 2"), TIMED)
    assert counts(e) == 2 * 2
    assert all(f["kind"] == "collective" and f["ranks"] == 2 and f["each_s"] == pytest.approx(COLLECTIVE) for f in e.fixed_costs)
    bandwidth_only = estimate(small("nworkers_per_group: 2 nservers_per_group: 2"), replace(TIMED, collective_s=1e-12))
    assert e.phases["exchange"] == pytest.approx(bandwidth_only.phases["exchange"] + 4 * COLLECTIVE, rel=1e-6)
    assert e.samples_per_s < bandwidth_only.samples_per_s


def test_a_partitioned_group_over_processes_pays_each_bridges_broadcasts():
    # cut on features over 2 processes: per bridge crossing them a header, the blob and its labels, and back a header and
    # the gradient where params lie below (runtime/partitioned.py's RemoteChannel); the data's bridges carry no gradient
    text = SMALL.format(cluster="nworkers_per_group: 2 nservers_per_group: 2").replace("neuralnet {", "neuralnet { partition_dim: 1")
    e = estimate(plan_job(job_from_text(text), cores=2), TIMED)
    bridges = [f for f in e.fixed_costs if f["what"].startswith("bridge")]
    assert sorted(f["count"] for f in bridges) == [3, 3, 5, 5, 5, 5] and all(f["ranks"] == 2 for f in bridges)


def test_compressed_allreduce_gathers_and_broadcasts_each_encoded_part():
    # top-k: indices and values, each gathered and broadcast per bucket; the flags reduced and broadcast back
    e = estimate(small("nworkers_per_group: 2 nservers_per_group: 2 compression: kTopK"), TIMED)
    assert counts(e) == 2 * (2 * 2 + 2)
    bf16 = estimate(small("nworkers_per_group: 2 nservers_per_group: 2 compression: kBF16"), TIMED)
    assert counts(bf16) == 2 * (2 + 2)


def test_sandblaster_collectives_span_three_processes():
    # each owner's group: both workers and the owner, so a collective takes two hops
    e = estimate(small("nworkers_per_group: 2 nservers_per_group: 2 server_worker_separate: true"), TIMED)
    assert counts(e) == 4 and all(f["ranks"] == 3 and f["each_s"] == pytest.approx(2 * COLLECTIVE) for f in e.fixed_costs)


def test_local_sgd_pays_one_all_reduce_per_meeting():
    e = estimate(small("nworker_groups: 2 local_steps: 5"), TIMED)
    [meeting] = e.fixed_costs
    assert meeting["count"] == pytest.approx(1 / 5) and meeting["seconds"] == pytest.approx(COLLECTIVE / 5)


def test_downpour_and_distributed_hogwild_pay_each_message():
    down = estimate(small("nworker_groups: 2 server_worker_separate: true"), TIMED)
    [push] = down.fixed_costs  # header, gradient, flags out; values and reply back
    assert (push["kind"], push["count"], push["seconds"]) == ("message", 5, pytest.approx(5 * MESSAGE))
    hog = estimate(small("nworker_groups: 2 nserver_groups: 2 sync_freq: 2"), TIMED)
    [sync] = hog.fixed_costs  # header and Δ out, the master's values back, every 2 steps
    assert sync["count"] == pytest.approx(3 / 2) and sync["seconds"] == pytest.approx(1.5 * MESSAGE)


def test_between_hosts_each_hop_adds_the_links_latency():
    hosts = Hosts(2, cores=2, link_gbps=1.0, latency_s=1e-3)
    e = estimate(small("nworkers_per_group: 2 nservers_per_group: 2"), TIMED, hosts)
    assert all(f["each_s"] == pytest.approx(COLLECTIVE + 1e-3) for f in e.fixed_costs)
    assert e.phases["exchange"] == pytest.approx(bytes_only(e) + 4 * (COLLECTIVE + 1e-3))


def test_an_older_calibration_without_a_collective_cost_charges_a_ping_pong():
    e = estimate(small("nworkers_per_group: 2 nservers_per_group: 2"), replace(TIMED, collective_s=0.0))
    assert e.fixed_costs[0]["each_s"] == pytest.approx(2 * MESSAGE)


def test_the_updater_is_charged_its_calibrated_time_per_element():
    plan = small()
    timed = update_kernel(plan, plan.threads_per_worker)
    assert timed in plan_kernels(plan) and timed.dims == (51,)  # every trained element, measured for this job
    streamed = estimate(plan, TIMED).phases["update"]
    slow = estimate(plan, replace(TIMED, kernels={timed.key: 1e-3})).phases["update"]
    assert slow == pytest.approx(1e-3) and streamed < 1e-3
    # a faster measurement than the bytes allow changes nothing: the memory traffic is the floor
    assert estimate(plan, replace(TIMED, kernels={timed.key: 1e-12})).phases["update"] == pytest.approx(streamed)
    # another updater (or another thread count) is another timing
    other = plan_job(job_from_text(SMALL.format(cluster="").replace("momentum: 0.9", "momentum: 0.5")), cores=2)
    assert len({timed.key, update_kernel(other, timed.threads).key, update_kernel(plan, timed.threads + 1).key}) == 3


def test_a_modules_calibrated_batches_give_a_fixed_cost_per_call_and_a_cost_per_row():
    calls = []
    costs = ModuleCosts(10, 20, 0, 0, 0, "", digest="abc123", probe=calls.append)
    small_batch, large_batch = module_kernels(costs, threads=1)
    assert (small_batch.dims, large_batch.dims) == ((1,), (16,)) and "abc123" in small_batch.key
    layer = LayerCost("m", "m", 0, 8, 10 * 8, 20 * 8, [], [], 0, 0, 0, counted=True, module=costs)
    timed = replace(TIMED, kernels={small_batch.key: 0.005, large_batch.key: 0.050})
    fwd, bwd, _ = compute_seconds([layer], timed, threads=1)
    assert fwd + bwd == pytest.approx(0.005 + 0.045 * 7 / 15) and bwd == pytest.approx(2 * fwd)  # split as the FLOPs
    assert compute_seconds([layer], TIMED, threads=1)[:2] == pytest.approx((80 / 10e9, 160 / 10e9))  # not timed: FLOPs
    # the calibration times it through the probe, at the kernel's thread count and batch size
    assert calibrate.time_kernel(large_batch) > 0 and set(calls) == {16}


def test_plan_estimate_prints_one_line_per_fixed_cost_term(tmp_path, monkeypatch, capsys):
    from shoal.frontend import cli

    text = SMALL.format(cluster="nworkers_per_group: 2 nservers_per_group: 2")
    kernels = {k.key: 1e-6 for k in plan_kernels(plan_job(job_from_text(text)))}  # all timed already: nothing to measure
    calib = Calibration(gemm_gflops={1: 10.0}, mem_gbps={1: 10.0}, load=0.2, collective_s=2e-4, link_latency_s=5e-5,
                        kernels=kernels, **calibrate.this_machine())
    calibrate.save(calib, tmp_path / "calibration" / f"{socket.gethostname()}.json")
    job = tmp_path / "job.conf"
    job.write_text(text)
    monkeypatch.setenv("SHOAL_HOME", str(tmp_path))
    assert cli.main(["plan", str(job), "--estimate"]) == 0  # `shoal plan job.conf --estimate`, in this process
    out = capsys.readouterr()
    lines = [line.strip() for line in out.out.splitlines() if line.strip().startswith("collectives:")]
    assert lines == ["collectives: 2 per step × 200 µs = 400 µs (gather + broadcast per bucket of rank 0 (1 bucket(s)))",
                     "collectives: 2 per step × 200 µs = 400 µs (gather + broadcast per bucket of rank 1 (1 bucket(s)))"]


def test_a_paramless_layer_is_charged_its_calibrated_forward_and_backward():
    plan = small()
    [relu] = [k for k in plan_kernels(plan) if k.op == "layer"]  # the ReLU (the loss needs labels; fc layers are GEMMs)
    assert relu.dims == (5, 1) and relu.params == ((4,),)
    streamed = estimate(plan, TIMED).phases["compute"]
    slow = estimate(plan, replace(TIMED, kernels={relu.key: 1e-3})).phases["compute"]
    assert slow == pytest.approx(streamed + 1e-3, rel=1e-3)  # its bytes were nanoseconds: the timing replaces them
    assert calibrate.time_kernel(relu) > 0  # built from its conf, run on random inputs of its shape, forward and backward
