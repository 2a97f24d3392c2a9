"""Compressed exchange (cluster.compression) in every framework over processes: bf16/fp16 halve the bytes, top-k with
error feedback sends a few percent of them; in one process nothing moves and nothing is encoded."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmark_scripts import load_benchmark
from cli_in_process import run_cli
from layouts import LAYOUTS, Layout, assert_ran
from shoal.config import job_from_text, job_pb2, load_job
from shoal.planning.costs import Calibration
from shoal.planning.describe import describe, render
from shoal.planning.estimate import encoded_bytes, estimate
from shoal.planning.plan import plan_job
from shoal.runtime.exchanges.compression import TopKCodec, codec_for, wire_bytes

CALIB = Calibration(host="test", cores=2, gemm_gflops={1: 10.0, 2: 20.0}, mem_gbps={1: 10.0, 2: 10.0}, link_gbps=1.0, link_latency_s=0.0)
TOPK = {"compression": "kTopK", "topk_fraction": 0.05}
LOCAL_SGD = Layout(dict(nworker_groups=2, local_steps=5), 2, 2, "Local SGD")


@pytest.mark.parametrize("kind, ratio", [(job_pb2.kBF16, 2.0), (job_pb2.kFP16, 2.0), (job_pb2.kTopK, 4 / (0.01 * 6))])
def test_bytes_on_the_wire(kind, ratio):
    cluster = job_pb2.ClusterProto(compression=kind)
    flat = torch.randn(10_000)
    sent = codec_for(cluster.compression, cluster.topk_fraction).encode(flat)
    assert flat.numel() * 4 / wire_bytes(sent) == pytest.approx(ratio, rel=0.01)
    assert wire_bytes(sent) == encoded_bytes(cluster, flat.numel())  # what the planner predicts
    decoded = codec_for(cluster.compression, cluster.topk_fraction).decode(sent, flat.numel())
    assert decoded.shape == flat.shape and decoded.dtype == torch.float32


@pytest.mark.parametrize("kind", [job_pb2.kTopK, job_pb2.kBF16, job_pb2.kFP16])
def test_error_feedback_sends_everything_eventually(kind):
    """What is not sent stays in the residual: sent so far + residual == everything pushed so far (to float32
    rounding); for top-k the large entries went out, for casts the residual is their rounding."""
    codec, gen = codec_for(kind, 0.05), torch.Generator().manual_seed(0)
    pushed, sent = torch.zeros(400), torch.zeros(400)
    for _ in range(30):
        g = torch.randn(400, generator=gen)
        pushed += g
        sent += codec.decode(codec.encode(g), 400)
    assert torch.allclose(sent + codec.residual, pushed, atol=1e-4)
    assert codec.residual.abs().max() < pushed.abs().max()  # the large entries went out


def test_an_answer_tracked_by_what_the_receiver_holds_needs_no_residual():
    """Distributed Hogwild's masters send top-k of (value − what the requester holds): once the value stops moving,
    what the requester holds reaches it, with no residual kept."""
    codec, gen = TopKCodec(0.05, error_feedback=False), torch.Generator().manual_seed(1)
    value, known = torch.zeros(400), torch.zeros(400)
    for _ in range(10):
        value += torch.randn(400, generator=gen)
        known += codec.decode(codec.encode(value - known), 400)
    for _ in range(60):  # 20 entries an answer: the remaining difference goes out
        known += codec.decode(codec.encode(value - known), 400)
    assert codec.residual is None and torch.allclose(known, value, atol=0.05)


def run(job, ws, layout: Layout, **cluster):
    """`shoal run` in this process (its forkserver starts the ranks: no interpreter and torch start-up per run)."""
    proc = run_cli("run", job, "--workspace", ws, "--no-progress", *layout.cli(**cluster), timeout=300)
    assert proc.returncode == 0, proc.stderr
    return assert_ran(ws, layout)


def sent_per_step(ws: Path, key: str = "sent_bytes", after: int = 0) -> float:
    """Bytes the chief's process sent per step over the display windows ending after step `after`."""
    train = [json.loads(line) for line in (ws / "metrics.jsonl").read_text().splitlines() if '"phase": "train"' in line]
    windows = [r for r in train if r["step"] > after]
    start = max(r["step"] for r in train if r["step"] <= after)
    return sum(r[key] for r in windows) / (windows[-1]["step"] - start)


def predicted(job: Path, layout: Layout, **cluster) -> int:
    """The planner's bytes per step sent by process 0 (shoal plan --estimate)."""
    return estimate(plan_job(load_job(job, layout.overrides(**cluster)), cores=2), CALIB).processes[0].sent


def test_allreduce_sends_encoded_gradients_and_sums_as_the_planner_predicts(blobs_job, tmp_path):
    """Dense, the owner sends the new values back; compressed, the encoded sum: runtime counts equal the estimate's."""
    job, layout = blobs_job(train_steps=20, hidden=64), LAYOUTS["AllReduce, 2 processes"]
    run(job, tmp_path / "dense", layout)
    sparse = run(job, tmp_path / "sparse", layout, **TOPK)
    dense_bytes, sparse_bytes = sent_per_step(tmp_path / "dense"), sent_per_step(tmp_path / "sparse")
    assert dense_bytes == 1348 * 4  # 16·64 + 64 + 64·4 + 4 elements, all owned by rank 0: the values it broadcasts
    # rank 0 owns every slice: it sends no gradients, rank 1's come to it in a gather (strategies/allreduce.py)
    assert predicted(job, layout) == 1348 * 4
    assert sparse_bytes == predicted(job, layout, **TOPK) == 6 * 68 + 4  # k = ⌈0.05 · 1348⌉ entries and 4 flags
    assert dense_bytes / sparse_bytes > 13 and sparse["final_test"]["accuracy"] > 0.8


@pytest.mark.parametrize("name", ["Sandblaster, 2 workers + 1 server, 3 processes", "Local SGD"])
def test_sandblaster_and_local_sgd_exchange_compressed(blobs_job, tmp_path, name):
    """Each runs its layout with top-k 5 % (20 steps), learns, and its chief sends the bytes the planner predicts:
    Sandblaster's encoded gradients to the server (its sums come back encoded), Local SGD's pseudo-gradients."""
    layout = LOCAL_SGD if name == "Local SGD" else LAYOUTS[name]
    job = blobs_job(train_steps=20, hidden=64)
    got = run(job, tmp_path / "ws", layout, **TOPK)
    assert got["final_test"]["accuracy"] > 0.8
    sparse_bytes = sent_per_step(tmp_path / "ws")
    # the estimate is whole bytes per step (Local SGD: a meeting's bytes over local_steps, rounded down)
    assert sparse_bytes == pytest.approx(predicted(job, layout, **TOPK), abs=1)
    assert predicted(job, layout) / sparse_bytes > 8


def test_distributed_hogwild_syncs_compressed(blobs_job, tmp_path):
    """Every 2 updates group 0 sends the master of the other slices its encoded Δ (and an 8-byte header) and gets
    the encoded change since what group 0 holds back."""
    layout, cluster = LAYOUTS["Distributed Hogwild, 2 groups"], dict(TOPK, sync_freq=2)
    job = blobs_job(train_steps=20, hidden=64)
    got = run(job, tmp_path / "ws", layout, **cluster)
    assert got["final_test"]["accuracy"] > 0.8
    plan = plan_job(load_job(job, layout.overrides(**cluster)), cores=2)
    theirs = sum(s.size for s in plan.placement.slices if plan.placement.master_group_of_slice(s.index) == 1)

    def per_sync(c: job_pb2.ClusterProto) -> int:
        return 8 + 2 * encoded_bytes(c, theirs)

    # syncs after updates 2, 4, ... (steps 1, 3, ...): 5 in steps 6-15 (the windows of steps 6-10 and 11-15)
    assert sent_per_step(tmp_path / "ws", "sync_bytes", after=5) == per_sync(plan.cluster) / 2
    assert per_sync(job_pb2.ClusterProto()) / per_sync(plan.cluster) > 12


def test_downpour_pushes_top_k_in_fewer_bytes_and_still_learns(blobs_job, tmp_path):
    layout = LAYOUTS["Downpour, 2 groups + 1 server, 3 processes"]
    got = run(blobs_job(train_steps=30, hidden=64), tmp_path / "ws", layout, compression="kTopK", topk_fraction=0.02)
    # a push is 6 bytes for each of k = ⌈0.02 · 1348⌉ = 27 entries, where float32 takes 4 · 1348
    assert sent_per_step(tmp_path / "ws", "pushed_bytes") == 6 * 27
    assert got["final_test"]["accuracy"] > 0.8


def test_compression_is_noted_where_it_applies_and_where_nothing_moves(blobs_job):
    job = blobs_job()

    def plan(*sets):
        return run_cli("plan", job, *sum((["--set", s] for s in sets), []), timeout=60)

    allreduce = plan("cluster.nworkers_per_group=2", "cluster.compression=kBF16")
    assert allreduce.returncode == 0 and ("note: gradients (to the servers of their slices, and their sum back) compressed "
                                          "(BF16): the run does not compute what uncompressed AllReduce would (no longer "
                                          "bit-exact with one worker)") in allreduce.stdout
    refused = plan("cluster.nworkers_per_group=2", "cluster.compression=kTopK", "cluster.topk_fraction=0")
    assert refused.returncode == 2 and refused.stderr.strip() == "cluster.topk_fraction: 0 is not in (0, 1]"

    def notes(*sets):
        return render(plan_job(load_job(job, list(sets)), cores=2))

    assert "note: cluster.compression (top-0.01 with error feedback) not applied: in-memory Hogwild in one process moves " \
           "no bytes" in notes("cluster.nworker_groups=2", "cluster.nworkers_per_procs=2", "cluster.compression=kTopK")
    assert "note: pushes compressed (top-0.01 with error feedback)" in notes(
        "cluster.nworker_groups=2", "cluster.server_worker_separate=true", "cluster.compression=kTopK")


def test_shoal_plan_json_says_whether_the_run_stays_exact():
    job = job_from_text("""
name: "j" train_steps: 1
train_one_batch { alg: kBP }
updater { type: kSGD learning_rate { type: kFixed base_lr: 0.1 } }
neuralnet {
  layer { name: "data" type: kRecordInput store_conf { backend: "kvfile" path: "x.bin" batchsize: 4 shape: 8 } }
  layer { name: "fc" type: kInnerProduct srclayers: "data" innerproduct_conf { num_output: 3 } param { name: "w" } param { name: "b" } }
  layer { name: "loss" type: kSoftmaxLoss srclayers: "fc" srclayers: "data" }
}
cluster { nworkers_per_group: 2 compression: kFP16 }
""")
    assert describe(plan_job(job, cores=2))["compression"] == {"setting": "FP16", "applied": True, "bit_exact_with_one_worker": False}
    job.cluster.nworkers_per_procs = 2  # one process: nothing is encoded, the run stays exact
    assert describe(plan_job(job, cores=2))["compression"] == {"setting": "FP16", "applied": False, "bit_exact_with_one_worker": True}


MNIST_LAYOUTS = {  # layout, its bytes metric
    "AllReduce, 2 processes": (LAYOUTS["AllReduce, 2 processes"], "sent_bytes"),
    "Downpour": (LAYOUTS["Downpour, 2 groups + 1 server, 3 processes"], "pushed_bytes"),
    "Distributed Hogwild": (Layout(dict(nworker_groups=2, nserver_groups=2, sync_freq=10), 2, 2, "Distributed Hogwild"), "sync_bytes"),
    "Local SGD": (Layout(dict(nworker_groups=2, local_steps=10), 2, 2, "Local SGD"), "sent_bytes"),
}


def benchmark_mlp():
    """benchmarks/mnist_mlp.py's small_mlp: the MLP benchmarks/compression.py measures."""
    return load_benchmark("mnist_mlp").small_mlp


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MNIST_LAYOUTS))
def test_top_k_sends_50x_fewer_bytes_within_a_point_of_dense_on_mnist(mnist_dir, tmp_path, name):
    """The MLP 784-256-128-10 on real MNIST, 400 steps per group, whole test set: top-k 1 % against float32."""
    layout, key = MNIST_LAYOUTS[name]
    job = tmp_path / "mnist.conf"
    job.write_text(benchmark_mlp()(mnist_dir, name="mnist-mlp", disp_freq=50))
    dense = run(job, tmp_path / "dense", layout)
    sparse = run(job, tmp_path / "sparse", layout, compression="kTopK", topk_fraction=0.01)
    assert sent_per_step(tmp_path / "dense", key) / sent_per_step(tmp_path / "sparse", key) >= 50
    assert sparse["final_test"]["accuracy"] >= dense["final_test"]["accuracy"] - 0.01


def _train_rank(rank: int, job: str, overrides: list, workspace: str, port: int) -> None:
    """One process of a compressed AllReduce job through the runtime's own assembly; it leaves its values behind."""
    import numpy as np

    from shoal.comm import dist as comm
    from shoal.runtime.assemble import RunSpec, assemble
    from shoal.strategies.registry import REGISTRY  # a spawned process: no conftest installed it

    plan = plan_job(load_job(job, overrides), strategies=REGISTRY)
    comm.init(rank, plan.nprocs, "127.0.0.1", port)
    try:
        run = assemble(plan, rank, RunSpec(workspace=Path(workspace), log=lambda *a: None, progress=False))
        values = run.chief.store.values
        flat = lambda: torch.cat([values[n].reshape(-1) for n in sorted(values)]).numpy()  # noqa: E731
        np.save(Path(workspace) / f"initial{rank}.npy", flat())
        run.run(None, lambda *a: None)
        np.save(Path(workspace) / f"values{rank}.npy", flat())
    finally:
        comm.shutdown()


@pytest.mark.parametrize("compression", ["kTopK", "kBF16"])
def test_every_process_applies_the_same_decoded_sum(blobs_job, tmp_path, compression):
    """Compressed AllReduce sends no values back: each process updates its own replica from the decoded sum, and
    after training every replica holds the same values, bit for bit (2 processes, 2 server slices, 10 steps)."""
    import numpy as np
    import torch.multiprocessing as mp

    from shoal.comm import dist as comm
    from shoal.launcher import process_server

    layout = LAYOUTS["AllReduce, 2 processes, 2 server slices"]
    overrides = layout.overrides(compression=compression, topk_fraction=0.05) + ["train_steps=10"]
    # forked from the server shoal's launcher forks its ranks from (torch and shoal imported there once per test
    # process), not 2 fresh interpreters importing torch each
    process_server.prestart()
    mp.start_processes(_train_rank, args=(str(blobs_job(hidden=64)), overrides, str(tmp_path), comm.free_port()), nprocs=2,
                       start_method="forkserver")
    first, second = np.load(tmp_path / "values0.npy"), np.load(tmp_path / "values1.npy")
    assert first.size == 1348 and np.array_equal(first, second)
    assert not np.allclose(first, np.load(tmp_path / "initial0.npy"))  # they trained
