"""`shoal plan --estimate/--compare/--suggest/--hosts`: FLOPs and bytes against hand-computed values, and the CLI.

The small net: data (8 features, batch 5) → fc1 (8→4) → relu → fc2 (4→3) → softmax loss; its params
w1 (4×8), b1 (4), w2 (3×4), b2 (3): 51 elements, 204 bytes of float32.
"""
from __future__ import annotations

from dataclasses import replace

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from shoal.config import job_from_text
from shoal.planning.alternatives import blocks, compare, scaling, stops_scaling, suggest
from shoal.planning.costs import Calibration, Kernel, worker_costs
from shoal.planning.estimate import Hosts, estimate
from shoal.planning.plan import Framework, plan_job
from shoal.runtime import calibrate

SMALL = """
name: "small" train_steps: 10
train_one_batch {{ alg: kBP }}
updater {{ type: kSGD momentum: 0.9 learning_rate {{ type: kFixed base_lr: 0.1 }} }}
neuralnet {{
  layer {{ name: "data" type: kRecordInput store_conf {{ backend: "kvfile" path: "nowhere.bin" batchsize: 5 shape: 8 }} }}
  layer {{ name: "fc1" type: kInnerProduct srclayers: "data" innerproduct_conf {{ num_output: 4 }} param {{ name: "w1" }} param {{ name: "b1" }} }}
  layer {{ name: "relu" type: kReLU srclayers: "fc1" }}
  layer {{ name: "fc2" type: kInnerProduct srclayers: "relu" innerproduct_conf {{ num_output: 3 }} param {{ name: "w2" }} param {{ name: "b2" }} }}
  layer {{ name: "loss" type: kSoftmaxLoss srclayers: "fc2" srclayers: "data" }}
}}
cluster {{ {cluster} }}
"""
# a machine with round numbers: every kernel at its FLOPs / 10 GFLOP/s, 10 GB/s of memory, a 1 GB/s link
CALIB = Calibration(host="test", cores=2, gemm_gflops={1: 10.0, 2: 20.0}, mem_gbps={1: 10.0, 2: 10.0}, link_gbps=1.0, link_latency_s=0.0)


def small(cluster: str = ""):
    return plan_job(job_from_text(SMALL.format(cluster=cluster)), cores=2)


def by_layer(plan, worker: int = 0) -> dict:
    costs = worker_costs(plan.partition, plan.batch_shares[0], plan.threads_per_worker)
    return {c.layer: c for c in costs[worker]}


def test_flops_of_inner_products_by_hand():
    costs = by_layer(small())
    # forward: 2·rows·in·out for x·Wᵀ, plus rows·out for the bias
    assert costs["fc1"].fwd_flops == 2 * 5 * 8 * 4 + 5 * 4
    assert costs["fc2"].fwd_flops == 2 * 5 * 4 * 3 + 5 * 3
    # backward: dW (2·rows·in·out) + db; fc1's input is data, which needs no gradient
    assert costs["fc1"].bwd_flops == 2 * 5 * 8 * 4 + 5 * 4
    assert costs["fc2"].bwd_flops == 2 * (2 * 5 * 4 * 3) + 5 * 3
    assert [k.dims for k in costs["fc2"].kernels_bwd] == [(3, 5, 4), (5, 3, 4)]


def test_flops_follow_the_batch_share():
    costs = by_layer(small("nworkers_per_group: 2 nworkers_per_procs: 2"), worker=1)
    assert costs["fc1"].rows == 2  # 5 rows: 3 to worker 0, 2 to worker 1
    assert costs["fc1"].fwd_flops == 2 * 2 * 8 * 4 + 2 * 4


def test_convolution_flops_by_hand():
    text = SMALL.format(cluster="").replace('batchsize: 5 shape: 8', 'batchsize: 2 shape: 3 shape: 4 shape: 4').replace(
        'type: kInnerProduct srclayers: "data" innerproduct_conf { num_output: 4 }',
        'type: kConvolution srclayers: "data" convolution_conf { num_filters: 2 kernel: 3 pad: 1 }')
    costs = by_layer(plan_job(job_from_text(text), cores=2))
    # output 2×4×4 per image; each output: 3 channels × 3×3 multiply-adds
    assert costs["fc1"].fwd_flops == 2 * (2 * 2 * 4 * 4) * (3 * 3 * 3) + 2 * 2 * 4 * 4
    assert costs["fc1"].kernels_bwd[0].dims[-1] == 0  # no input gradient into the data layer


def test_kernel_time_is_flops_at_the_gemm_rate_or_its_bytes_at_the_bandwidth():
    big = Kernel("mm", (100, 1000, 1000), threads=1)
    assert CALIB.seconds(big) == pytest.approx(2e8 / 10e9)
    thin = Kernel("mm", (1, 1000, 1000), threads=1)  # reads 4 MB for 2 MFLOP: memory-bound
    assert CALIB.seconds(thin) == pytest.approx(4 * (1000 + 1000 * 1000 + 1000) / 10e9)
    measured = Calibration(**{**CALIB.__dict__, "kernels": {big.key: 0.5}})
    assert measured.seconds(big) == 0.5


def test_allreduce_bytes_by_hand():
    e = estimate(small("nworkers_per_group: 2 nservers_per_group: 2"), CALIB)
    assert e.framework == Framework.ALLREDUCE.value
    # 51 elements in 2 slices of ⌈51/2⌉ = 26: rank 0 owns w1[0:26] (104 B); rank 1 w1[26:32], b1, w2, b2 (25 elements, 100 B).
    # each bucket's gradients gathered at its owner (the direct bytes), with a float per param of that owner in its
    # last bucket (whether the sender had a gradient); then the owner broadcasts the bucket's new values.
    p0, p1 = e.processes
    assert p0.sent == 4 * (25 + 4) + 104  # rank 1's bucket and its 4 flags (b2, w2, b1, w1); the values of its own
    assert p0.received == 4 * (26 + 1) + 100
    assert (p1.sent, p1.received) == (p0.received, p0.sent)
    assert p0.links == {1: [220, 208]} and p1.links == {0: [208, 220]}


def test_sandblaster_workers_send_everything():
    e = estimate(small("nworkers_per_group: 2 nservers_per_group: 2 server_worker_separate: true"), CALIB)
    workers = [p for p in e.processes if p.rank < 2]
    # every slice lives elsewhere: each worker's gradients (and flags) gathered at each owner, the values broadcast back
    assert all(p.sent == 4 * (26 + 1) + 4 * (25 + 4) for p in workers)
    assert all(p.received == 104 + 100 for p in workers)
    assert sum(p.received for p in e.processes[2:]) == 2 * (4 * (26 + 1) + 4 * (25 + 4))


def test_downpour_bytes_by_hand():
    e = estimate(small("nworker_groups: 2 server_worker_separate: true"), CALIB)
    stub = e.processes[0]
    # one group's step: its gradient (204 B), a flag byte per slice (4 params, 1 slice each), a 24 B header;
    # back: the values and 16 B of version and staleness
    assert (stub.sent, stub.received) == (204 + 4 + 24, 204 + 16)
    assert e.staleness.startswith("≈ 1 update")


def test_distributed_hogwild_syncs_every_sync_freq_steps():
    e = estimate(small("nworker_groups: 2 nserver_groups: 2 sync_freq: 2"), CALIB)
    # group 0 masters slice 0 (26 elements), group 1 slice 1 (25): every 2 steps group 0 sends Δ of slice 1 (+8 B)
    # and gets its values: one group's step, as Downpour's bytes are (benchmarks/shaped_links.py measures them)
    g0 = e.processes[0]
    assert g0.sent == int((25 * 4 + 8) / 2)
    assert g0.received == int(25 * 4 / 2)
    # its link also carries group 1's syncs of slice 0 (served the same way): that is in the step's time
    serving_too = int((25 * 4 + 8) / 2) + int(26 * 4 / 2)
    fixed = sum(f["seconds"] for f in e.fixed_costs)  # its messages' fixed costs (tests/test_fixed_costs.py)
    assert e.phases["exchange"] == pytest.approx(serving_too / (CALIB.link_gbps * 1e9) + fixed, rel=0.02)


def test_memory_of_a_single_worker_with_momentum():
    e = estimate(small(), CALIB)
    p = e.processes[0]
    assert (p.params, p.gradients, p.updater_state) == (204, 204, 204)  # values, gradients, one momentum slot
    assert e.samples_per_s == pytest.approx(5 / e.step_s)


def test_single_worker_step_is_compute_plus_update():
    e = estimate(small(), CALIB)
    update = 4 * 51 * (3 + 2 * 1) / 10e9  # reads value, gradient, history; writes value and history
    assert e.phases["update"] == pytest.approx(update)
    assert e.step_s == pytest.approx(e.phases["compute"] + update)
    assert e.bottleneck in ("compute", "the updater's memory traffic")


def test_compare_ranks_every_framework():
    rows = compare(job_from_text(SMALL.format(cluster="")), lambda kernels: CALIB, workers=2, cores=2)
    assert len(rows) == 7 and all(r.estimate for r in rows)
    rates = [r.estimate.samples_per_s for r in rows]
    assert rates == sorted(rates, reverse=True)
    assert {r.estimate.label for r in rows} >= {"single worker", "in-memory Sandblaster", "AllReduce", "Downpour"}


FC_HEAVY = """
name: "fc-heavy" train_steps: 10
train_one_batch { alg: kBP }
updater { type: kSGD momentum: 0.9 learning_rate { type: kFixed base_lr: 0.01 } }
neuralnet {
  layer { name: "data" type: kRecordInput store_conf { backend: "kvfile" path: "x.bin" batchsize: 64 shape: 3 shape: 16 shape: 16 } }
  layer { name: "conv1" type: kConvolution srclayers: "data" convolution_conf { num_filters: 16 kernel: 3 pad: 1 } param { name: "w1" } param { name: "b1" } }
  layer { name: "relu1" type: kReLU srclayers: "conv1" }
  layer { name: "conv2" type: kConvolution srclayers: "relu1" convolution_conf { num_filters: 16 kernel: 3 pad: 1 } param { name: "w5" } param { name: "b5" } }
  layer { name: "relu4" type: kReLU srclayers: "conv2" }
  layer { name: "fc1" type: kInnerProduct srclayers: "relu4" innerproduct_conf { num_output: 1024 } param { name: "w2" } param { name: "b2" } }
  layer { name: "relu2" type: kReLU srclayers: "fc1" }
  layer { name: "fc2" type: kInnerProduct srclayers: "relu2" innerproduct_conf { num_output: 1024 } param { name: "w3" } param { name: "b3" } }
  layer { name: "relu3" type: kReLU srclayers: "fc2" }
  layer { name: "fc3" type: kInnerProduct srclayers: "relu3" innerproduct_conf { num_output: 10 } param { name: "w4" } param { name: "b4" } }
  layer { name: "loss" type: kSoftmaxLoss srclayers: "fc3" srclayers: "data" }
}
cluster { nworkers_per_group: 2 nworkers_per_procs: 2 }
"""


def test_suggestion_cuts_big_fc_layers_on_features_and_keeps_convolutions_on_the_batch():
    """The "one weird trick" falls out of the costs: the fc weights (5 M) dwarf the activations they would bridge."""
    job = job_from_text(FC_HEAVY)
    assert blocks(plan_job(job, cores=2)) == [["conv1", "relu1"], ["conv2", "relu4"], ["fc1", "relu2"], ["fc2", "relu3"], ["fc3"]]
    s = suggest(job, lambda kernels: CALIB, workers=2, cores=2)
    assert s.dims.get("fc1") == 1 and s.dims.get("fc2") == 1
    assert s.dims["conv1"] == 0 and s.dims["conv2"] == 0
    assert s.best.step_s < s.batch_split.step_s and s.bytes_best < s.bytes_batch


def test_scaling_names_where_downpour_stops():
    """One server's 10 Gbit/s link carries every group's 21 MB of gradients and values: Downpour saturates it."""
    hosts = Hosts(count=12, cores=4, link_gbps=10 / 8, latency_s=50e-6)
    # memory so fast that the protocol's copies on each host (10 passes over 5.3 M elements a step) do not decide
    points = scaling(job_from_text(FC_HEAVY), replace(CALIB, mem_gbps={1: 1000.0, 2: 1000.0}), hosts)
    assert {p.hosts for p in points} == set(range(1, 13))
    downpour = [p.samples_per_s for p in points if p.framework == "Downpour"]
    at, why, stopped = stops_scaling(points)["Downpour"]
    assert stopped and why == "the server's link" and 1 < at < 12
    assert downpour[-1] == pytest.approx(64 * 10e9 / 8 / (4 * 5_258_000), rel=0.05)  # batch × link / bytes per request


def test_calibration_json_round_trip_and_a_corrupt_cache_is_measured_again(tmp_path):
    path = tmp_path / "host.json"
    calib = Calibration(**{**CALIB.__dict__, **calibrate.this_machine(), "kernels": {"mm 1x2x3 cpu t1": 1e-6}, "collective_s": 1e-4})
    calibrate.save(calib, path)
    assert calibrate.load(path) == calib
    path.write_text("{not json")
    assert calibrate.load(path) is None


def run_cli(*args, home: Path) -> subprocess.CompletedProcess:
    env = {"SHOAL_HOME": str(home), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    return subprocess.run([sys.executable, "-m", "shoal", "plan", *args], capture_output=True, text=True, env=env, timeout=120)


@pytest.fixture
def home(tmp_path) -> Path:
    """A SHOAL_HOME whose calibration of this host is already cached (nothing to measure but tiny kernels)."""
    calibrate.save(Calibration(**{**CALIB.__dict__, **calibrate.this_machine()}), tmp_path / "calibration" / f"{socket.gethostname()}.json")
    return tmp_path


@pytest.mark.slow  # the default suite's 5-minute budget; covered in it by a cheaper test
def test_cli_estimate_json_and_text(tmp_path, home):
    job = tmp_path / "small.conf"
    job.write_text(SMALL.format(cluster=""))
    out = run_cli(str(job), "--estimate", "--json", "--set", "cluster.nworkers_per_group=2", "--set", "cluster.nservers_per_group=2", home=home)
    assert out.returncode == 0, out.stderr
    e = json.loads(out.stdout)["estimate"]
    # each process's bytes as test_allreduce_bytes_by_hand counts them: the other owner's bucket and flags, its own values
    assert e["label"] == "AllReduce" and [p["sent"] for p in e["processes"]] == [4 * (25 + 4) + 104, 4 * (26 + 1) + 100]
    assert e["samples_per_s"] > 0 and e["bottleneck"]
    text = run_cli(str(job), "--compare", "--suggest", home=home)
    assert text.returncode == 0, text.stderr
    assert "layouts ranked by predicted samples/s" in text.stdout and "suggested partitioning" in text.stdout
    ranked = text.stdout.split("layouts ranked by predicted samples/s:")[1].split("suggested partitioning")[0]
    assert len([l for l in ranked.splitlines() if l.strip()[:1].isdigit()]) == 7


@pytest.mark.slow  # the default suite's 5-minute budget; covered in it by a cheaper test
def test_cli_scaling_plot_and_a_bad_cluster_file(tmp_path, home):
    job = tmp_path / "small.conf"
    job.write_text(SMALL.format(cluster=""))
    picture = tmp_path / "scaling.png"
    out = run_cli(str(job), "--hosts", "3", "--cores", "4", "--bandwidth", "10", "-o", str(picture), home=home)
    assert out.returncode == 0, out.stderr
    assert picture.stat().st_size > 1000 and "hosts of 4 cores" in out.stdout
    assert len([l for l in out.stdout.splitlines() if l.strip()[:1] in "123"]) >= 3
    bad = tmp_path / "cluster.yaml"
    bad.write_text("hosts: 4\nbandwith: 10\n")
    out = run_cli(str(job), "--cluster", str(bad), home=home)
    assert out.returncode == 2 and out.stderr.strip() == f"{bad}: bandwith: unknown field (known: hosts, cores, gpus, bandwidth, latency)"


@pytest.mark.slow  # minutes on a loaded 2-core machine
def test_calibration_measures_the_machine_and_the_jobs_kernels_once(tmp_path):
    path = tmp_path / "calibration.json"
    kernel = Kernel("mm", (5, 8, 4), threads=1)
    calib = calibrate.calibration([kernel], path=path)
    assert calib.cores == calibrate._cores() and calib.link_gbps > 0 and calib.link_latency_s > 0
    assert all(v > 0 for v in calib.gemm_gflops.values()) and all(v > 0 for v in calib.mem_gbps.values())
    assert 0 < calib.kernels[kernel.key] < 1
    assert json.loads(path.read_text())["kernels"] == {kernel.key: calib.kernels[kernel.key]}
    assert calibrate.calibration([kernel], path=path) == calib  # cached: nothing measured again


@pytest.mark.slow
def test_cli_recalibrate_measures_this_machine_and_the_next_plan_reads_the_cache(tmp_path):
    """`--recalibrate` really measures (GEMM, memory, two processes over gloo on loopback, the job's kernels).

    An empty home: a clean seeded cache would be kept over a measurement this busy machine marks contended."""
    home = tmp_path / "home"
    job = tmp_path / "small.conf"
    job.write_text(SMALL.format(cluster=""))
    fresh = run_cli(str(job), "--estimate", "--recalibrate", "--json", home=home)
    assert fresh.returncode == 0, fresh.stderr
    calib = json.loads(fresh.stdout)["calibration"]
    assert calib["took_s"] > 0 and calib["host"] == socket.gethostname()
    assert calib["link_gbps"] > 0 and calib["link_latency_s"] > 0 and all(v > 0 for v in calib["gemm_gflops"].values())
    cached = json.loads((home / "calibration" / f"{socket.gethostname()}.json").read_text())
    assert any(key.startswith("mm 5x8x4 cpu") for key in cached["kernels"])  # fc1's forward, measured for this job
    again = run_cli(str(job), "--estimate", "--json", home=home)
    assert json.loads(again.stdout)["calibration"]["taken_at"] == calib["taken_at"]


def test_a_prediction_over_hosts_places_ranks_as_the_launcher_does():
    """`shoal run --nnodes` starts consecutive blocks of ranks per node; the cost model and the thread budget use the
    same rule (planning/nodes.py), so Sandblaster's 2 worker processes on 2 hosts share host 0, as they run."""
    from shoal.launcher.launch import Nodes
    from shoal.planning.estimate import host_of
    from shoal.planning.nodes import node_of_rank

    for world, nnodes in [(4, 2), (3, 2), (5, 2), (7, 3), (2, 2), (1, 1)]:
        launcher = [next(k for k in range(nnodes) if r in Nodes(nnodes=nnodes).ranks(world, k)) for r in range(world)]
        assert node_of_rank(world, nnodes) == launcher
    plan = plan_job(job_from_text(SMALL.format(cluster="nworkers_per_group: 2 nservers_per_group: 2 server_worker_separate: true")),
                    cores=4, nnodes=2)
    assert host_of(plan, Hosts(count=2)) == [0, 0, 1, 1]
    assert [len(p.workers) for p in plan.placement.processes] == [1, 1, 0, 0]
    assert plan.threads_per_worker == 2  # two workers on host 0's 4 cores
