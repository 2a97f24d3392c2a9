"""The cost model's measured terms of a worker's step (issue 30): the whole train net timed forward and backward on
random rows, its ratio to its kernels timed one at a time scaling each worker's compute; and a kernel timed under
contention timed again once the machine is quiet. Pure where the model is (hand-built calibrations); the timings
themselves run the real net, once, on a few rows."""
from __future__ import annotations

import socket
from dataclasses import replace

import pytest

from shoal.config import job_from_text
from shoal.planning.costs import Calibration, in_net_factor, worker_costs
from shoal.planning.estimate import estimate, plan_kernels
from shoal.planning.plan import plan_job
from shoal.runtime import calibrate

from test_estimate import CALIB, SMALL, small


def nets(plan) -> list:
    return sorted((k for k in plan_kernels(plan, cores=2) if k.op == "net"), key=lambda k: k.dims)


def test_the_net_timed_whole_scales_the_workers_compute_by_its_ratio_to_the_kernels():
    plan = small()
    [net] = nets(plan)
    assert net.dims == (5, 1) and net.threads == plan.threads_per_worker  # the worker's rows, at its threads, alone
    alone = estimate(plan, CALIB)
    assert alone.step_terms == []  # not timed: the kernels' sum stands
    kernels_s = alone.phases["compute"]
    timed = estimate(plan, replace(CALIB, kernels={net.key: 3 * kernels_s}))
    assert timed.phases["compute"] == pytest.approx(3 * kernels_s)
    [term] = timed.step_terms
    assert term["kind"] == "in-net" and term["rows"] == 5 and term["factor"] == pytest.approx(3.0)
    assert term["alone_s"] == pytest.approx(kernels_s) and term["seconds"] == pytest.approx(2 * kernels_s)
    # a net timed faster than its kernels' sum leaves the sum standing (a floor, as the bytes floor a kernel)
    faster = estimate(plan, replace(CALIB, kernels={net.key: kernels_s / 2}))
    assert faster.phases["compute"] == pytest.approx(kernels_s) and faster.step_terms[0]["factor"] == 1.0
    w = timed.workers[0]
    assert w.fwd_s / w.bwd_s == pytest.approx(alone.workers[0].fwd_s / alone.workers[0].bwd_s)  # forward and backward alike


def test_each_batch_share_is_its_own_net_timing_and_a_feature_cut_has_none():
    threads = small("nworkers_per_group: 2 nworkers_per_procs: 2")
    # 5 rows split 3 + 2: one timing per share, each while the other worker computes (2 workers at 1 thread, 2 cores)
    assert [k.dims for k in nets(threads)] == [(2, 2), (3, 2)] and threads.threads_per_worker == 1
    share3, share2 = (worker_costs(threads.partition, threads.batch_shares[0], 1)[w] for w in (0, 1))
    calib = replace(CALIB, kernels={nets(threads)[1].key: 1.0})  # only the 3-row share timed
    assert in_net_factor(share3, calib, nets(threads)[1])[0] == 1.0 and in_net_factor(share2, calib, nets(threads)[0]) is None
    feature = plan_job(job_from_text(SMALL.format(cluster="nworkers_per_group: 2 nworkers_per_procs: 2")
                                     .replace("neuralnet {", "neuralnet { partition_dim: 1")), cores=2)
    assert nets(feature) == []  # cut on features, a worker runs part of the net: its kernels' sum stands


def test_the_calibration_runs_the_real_net_forward_and_backward():
    [net] = nets(small())
    seconds = calibrate.time_kernel(net)
    assert seconds is not None and 0 < seconds < 1  # built from its NetProto, fed random rows and labels 0
    together = calibrate.time_kernel(replace(net, dims=(5, 2)))  # two copies at once, the slowest of each round
    assert together is not None and 0 < together < 1
    garbage = replace(net, spec=b"\x08\x01\x12\x03xyz")  # a NetProto that builds no trainable net: the kernels' sum stands
    assert calibrate.time_kernel(garbage) is None


def test_plan_estimate_prints_the_in_net_term_in_one_line(tmp_path, monkeypatch, capsys):
    from shoal.frontend import cli

    text = SMALL.format(cluster="")
    plan = plan_job(job_from_text(text))
    kernels = {k.key: 1e-6 for k in plan_kernels(plan, cores=2) if k.op != "net"}
    calib = Calibration(gemm_gflops={1: 10.0, 2: 20.0}, mem_gbps={1: 10.0, 2: 10.0}, load=0.2, collective_s=2e-4,
                        link_latency_s=5e-5, kernels=kernels, **calibrate.this_machine())
    [net] = nets(plan)
    alone = estimate(plan, calib).phases["compute"]
    calib = replace(calib, kernels={**kernels, net.key: 2 * alone})
    calibrate.save(calib, tmp_path / "calibration" / f"{socket.gethostname()}.json")
    job = tmp_path / "job.conf"
    job.write_text(text)
    monkeypatch.setenv("SHOAL_HOME", str(tmp_path))
    assert cli.main(["plan", str(job), "--estimate"]) == 0
    lines = [line.strip() for line in capsys.readouterr().out.splitlines() if line.strip().startswith("in-net:")]
    assert len(lines) == 1 and lines[0].startswith("in-net: ×2.00 on the kernels'") and "for 5 rows" in lines[0]


@pytest.mark.parametrize("load, retaken", [(0.0, True), (50.0, False)])
def test_a_kernel_timed_under_contention_is_timed_again_once_the_machine_is_quiet(tmp_path, monkeypatch, load, retaken):
    [relu] = [k for k in plan_kernels(small()) if k.op == "layer"]
    path = tmp_path / "calib.json"
    calibrate.save(Calibration(gemm_gflops={1: 10.0}, mem_gbps={1: 10.0}, collective_s=1e-4, load=0.1,
                               kernels={relu.key: 5.0}, contended_kernels=(relu.key,), **calibrate.this_machine()), path)
    monkeypatch.setattr(calibrate, "_load", lambda: load)
    # the probe's verdict as the load says (the real probe would also read the suite's other tests' load)
    monkeypatch.setattr(calibrate, "busy_now", lambda cores: None if load < 1 else f"load {load:.1f} on {cores} cores")
    after = calibrate.calibration([relu], path=path)
    if retaken:  # quiet now: timed again (a ReLU on 5 rows takes microseconds, not the 5 s of the disturbed timing)
        assert after.kernels[relu.key] < 5.0 and calibrate.read(path).kernels[relu.key] < 5.0
    else:  # still busy: the disturbed timing stays until a quiet moment
        assert after.kernels[relu.key] == 5.0 and relu.key in after.contended_kernels


def copies(e) -> dict:
    [term] = [t for t in e.step_terms if t["kind"] == "copies"]
    return term


def test_downpour_charges_its_protocols_copies_on_the_host():
    # 51 trained elements: the stub moves 10 passes' worth, the server 3, at the copy bandwidth shared by the host's 2
    # workers (10 GB/s over 2); in the update phase, and the server's share in the server's bound
    e = estimate(small("nworker_groups: 2 server_worker_separate: true"), CALIB)
    assert copies(e)["seconds"] == pytest.approx(4 * (10 + 3) * 51 / 5e9)
    assert e.phases["update"] > copies(e)["seconds"]  # the updater's pass, then the copies
    assert "510 elements moved by the group's stub, 153 by each server" in copies(e)["what"]


def test_distributed_hogwild_charges_its_syncs_copies_every_sync():
    every = estimate(small("nworker_groups: 2 nserver_groups: 2"), CALIB)
    mastered = sum(s.size for s in small("nworker_groups: 2 nserver_groups: 2").placement.slices
                   if small("nworker_groups: 2 nserver_groups: 2").placement.master_group_of_slice(s.index) == 0)
    assert copies(every)["seconds"] == pytest.approx(4 * (8 * (51 - mastered) + 5 * mastered) / 5e9)
    fourth = estimate(small("nworker_groups: 2 nserver_groups: 2 sync_freq: 4"), CALIB)
    assert copies(fourth)["seconds"] == pytest.approx(copies(every)["seconds"] / 4)


def test_an_in_memory_groups_sum_and_update_run_at_the_process_thread_count():
    # the workers are threads of one process at 1 intra-op thread each; the sum and the update run after them on the main
    # thread, at that same 1 thread (torch's count is the process's): a faster 2-thread bandwidth changes nothing
    plan = small("nworkers_per_group: 2 nworkers_per_procs: 2")
    assert plan.threads_per_worker == 1
    one = estimate(plan, CALIB)
    wider = estimate(plan, replace(CALIB, mem_gbps={1: 10.0, 2: 1000.0}))
    assert (wider.phases["reduce"], wider.phases["update"]) == pytest.approx((one.phases["reduce"], one.phases["update"]))


@pytest.mark.parametrize("workers, adds, scaled", [(2, 1, 1), (3, 2, 1), (4, 3, 2)])
def test_an_in_memory_groups_sum_counts_each_add_and_each_scaling_of_the_tree(workers, adds, scaled):
    # runtime/replicas.py tree_reduce: an add reads two gradients and writes one; a node taking its first add is
    # scaled by its share in place first (read + write); 51 trained elements at CALIB's 1-thread 10 GB/s
    plan = small(f"nworkers_per_group: {workers} nworkers_per_procs: {workers}")
    assert estimate(plan, CALIB).phases["reduce"] == pytest.approx((3 * adds + 2 * scaled) * 4 * 51 / 10e9)


def between_two_hosts(cluster: str, **link) -> float:
    """The exchange's seconds without its fixed costs, over 2 hosts of 1 core joined by `link`."""
    from shoal.planning.estimate import Hosts

    plan = plan_job(job_from_text(SMALL.format(cluster=cluster)), cores=1, nnodes=2)
    e = estimate(plan, CALIB, Hosts(2, cores=1, latency_s=1e-9, **link))
    return e.phases["exchange"] - sum(f["seconds"] for f in e.fixed_costs)


def test_between_hosts_an_owners_broadcasts_travel_while_the_next_owners_gathers_arrive_and_crossing_bytes_take_the_duplex_rate():
    allreduce = "nworkers_per_group: 2 nservers_per_group: 2"
    sandblaster = "nworkers_per_group: 2 nservers_per_group: {} server_worker_separate: true"
    # AllReduce: each host owns half; its gathers and its broadcasts each go both ways at once
    full = between_two_hosts(allreduce, link_gbps=1.0)
    halved = between_two_hosts(allreduce, link_gbps=1.0, duplex_gbps=0.5)  # nearly all at the duplex rate (the halves
    assert 1.9 * full < halved <= 2 * full * (1 + 1e-9)  # differ by a few elements and the flags)
    # Sandblaster: both workers on host 0, its servers on host 1 (as `shoal run --nnodes` places them). One server: the
    # values go back once every gradient is in, one way then the other, never crossing (no duplex rate)
    one_server = between_two_hosts(sandblaster.format(1), link_gbps=1.0)
    assert one_server >= 2 * (2 * 4 * 51) / 1e9  # both workers' gradients (204 B each) one way, then their values back
    assert between_two_hosts(sandblaster.format(1), link_gbps=1.0, duplex_gbps=0.5) == pytest.approx(one_server, rel=1e-9)
    # two servers: the first's values go back while the second's gradients still arrive: 3 halves' time, not 4, and
    # only that crossing half takes the duplex rate
    two_servers = between_two_hosts(sandblaster.format(2), link_gbps=1.0)
    assert 0.7 * one_server < two_servers < 0.8 * one_server
    crossing = between_two_hosts(sandblaster.format(2), link_gbps=1.0, duplex_gbps=0.5) - two_servers
    assert 0.2 * one_server < crossing < 0.3 * one_server
