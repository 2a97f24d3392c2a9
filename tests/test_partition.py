"""Partitioning a group's net (batch / feature / whole per layer): the plan, and exactness of training."""
from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

import pytest
from cli_in_process import run_cli
import torch

import shoal
from layouts import LAYOUTS, Layout, assert_ran, threads
from shoal.neuralnet import checkpoint as ckpt_io
from shoal.config import job_pb2
from shoal.planning.partition import BATCH, FEATURE, WHOLE, PartitionError, plan_partition
from shoal.planning.plan import UnsupportedClusterError, plan_job
from shoal.runtime.assemble import RunSpec, assemble
from shoal.runtime.partitioned import PartitionedGroup
from shoal.runtime.trainer import Trainer


def job_text(data_dir, *, net="", fc1="", relu="", fc2="", loss="", drop=None, steps=4, workers=2, batch="batchsize: 32",
             updater="type: kSGD momentum: 0.9 weight_decay: 0.001", hidden=32, layout: str | Layout | None = None, image=None) -> str:
    """The blobs MLP (16 -> hidden -> 4) with per-layer extras; disp_freq 1 so every step's loss is recorded.
    The cluster: `workers` threads of one process, or `layout` (a row of tests/layouts.py, or a Layout).
    image: the 16 features read as a 1×4×4 image, randomly cropped to 3×3 and mirrored before fc1."""
    layout = LAYOUTS[layout] if isinstance(layout, str) else layout or threads(workers)
    shape = "shape: 16" if image is None else "shape: 1 shape: 4 shape: 4"
    preprocess = (f'layer {{ name: "image" type: kImagePreprocess srclayers: "data" rgbimage_conf {{ cropsize: 3 mirror: true }} {image} }}'
                  if image is not None else "")
    bottom = "image" if image is not None else "data"
    dropout = f'layer {{ name: "drop" type: kDropout srclayers: "relu" dropout_conf {{ dropout_ratio: 0.3 }} {drop} }}' if drop is not None else ""
    top = "drop" if drop is not None else "relu"
    return f"""
name: "blobs-mlp" train_steps: {steps} disp_freq: 1 test_steps: 0 seed: 7
train_one_batch {{ alg: kBP }}
updater {{ {updater} learning_rate {{ type: kFixed base_lr: 0.05 }} }}
neuralnet {{ {net}
  layer {{ name: "data" type: kRecordInput include: kTrain
    store_conf {{ backend: "kvfile" path: "{data_dir / 'train.bin'}" {batch} {shape} random_skip: 20 }} }}
  {preprocess}
  layer {{ name: "fc1" type: kInnerProduct srclayers: "{bottom}" innerproduct_conf {{ num_output: {hidden} }} {fc1}
    param {{ name: "w1" init {{ type: kGaussian std: 0.1 }} }} param {{ name: "b1" init {{ type: kUniform low: -0.1 high: 0.1 }} }} }}
  layer {{ name: "relu" type: kReLU srclayers: "fc1" {relu} }}
  {dropout}
  layer {{ name: "fc2" type: kInnerProduct srclayers: "{top}" innerproduct_conf {{ num_output: 4 }} {fc2}
    param {{ name: "w2" init {{ type: kUniform low: -0.1 high: 0.1 }} }} param {{ name: "b2" init {{ type: kConstant value: 0.1 }} }} }}
  layer {{ name: "loss" type: kSoftmaxLoss srclayers: "fc2" srclayers: "data" {loss} }}
}}
{layout.section()}
"""


def load(text, tmp_path, name="job.conf"):
    path = tmp_path / name
    path.write_text(text)
    return shoal.load_job(path)


PARTITIONINGS = {
    "all batch (plain data parallel)": dict(),
    "all feature": dict(net="partition_dim: 1"),
    "all feature, 3 workers (32 = 11+11+10, 4 = 2+1+1)": dict(net="partition_dim: 1", workers=3),
    "hybrid: fc1 feature, rest batch": dict(fc1="partition_dim: 1", relu="partition_dim: 1"),
    "hybrid: fc1 batch, fc2 feature": dict(fc2="partition_dim: 1"),
    "location: fc1 and relu on worker 1, loss on worker 0": dict(fc1="location: 1", relu="location: 1", loss="location: 0"),
    "not partitioned (net partition_dim -1) on 3 workers": dict(net="partition_dim: -1", workers=3),
    "feature partitions, uneven batch shares 24 + 8": dict(net="partition_dim: 1", batch="batchsize: 24 batchsize: 8"),
    "feature fc1 with dropout on the batch dimension": dict(fc1="partition_dim: 1", relu="partition_dim: 1", drop=""),
    "dropout whole on worker 1 (the only worker drawing)": dict(drop="location: 1"),
    "random crops and mirrors, all batch (plain data parallel)": dict(image=""),
    "random crops and mirrors, 3 workers (uneven), fc1 on features": dict(image="", fc1="partition_dim: 1", relu="partition_dim: 1", workers=3),
}


def train(text, tmp_path, name, layout: str | Layout):
    """Train the job text into tmp_path/name, checked to have run on `layout`: (history, params at step 4)."""
    ws = tmp_path / name
    history = shoal.train(load(text, tmp_path, f"{name}.conf"), workspace=ws, log=lambda *a: None)
    assert_ran(ws, layout)
    return history, ckpt_io.load(ckpt_io.checkpoint_file(ws, 4)).params


@pytest.mark.parametrize("partitioning", PARTITIONINGS)
def test_every_partitioning_trains_exactly_like_one_worker(blobs_dir, tmp_path, partitioning):
    kw = PARTITIONINGS[partitioning]
    single_kw = {key: "" for key in ("drop", "image") if key in kw}
    single, single_params = train(job_text(blobs_dir, workers=1, **single_kw), tmp_path, "single", threads(1))
    group, params = train(job_text(blobs_dir, **kw), tmp_path, "group", threads(kw.get("workers", 2)))
    for a, b in zip(group.phase("train"), single.phase("train"), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["accuracy"] == pytest.approx(b["accuracy"])
    for name in single_params:
        torch.testing.assert_close(params[name], single_params[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("partitioning", [p for p in PARTITIONINGS if "batch (plain" not in p])
def test_forward_outputs_and_gradients_equal_the_unpartitioned_net(blobs_dir, tmp_path, partitioning):
    kw = PARTITIONINGS[partitioning]
    single_kw = {key: "" for key in ("drop", "image") if key in kw}
    one = Trainer(plan_job(load(job_text(blobs_dir, workers=1, **single_kw), tmp_path, "one.conf")), tmp_path / "a", [tmp_path], torch.device("cpu"))
    many = Trainer(plan_job(load(job_text(blobs_dir, **kw), tmp_path, "many.conf")), tmp_path / "b", [tmp_path], torch.device("cpu"))
    group = many.workers[0]
    assert isinstance(group, PartitionedGroup)
    for step in range(2):
        losses_one, losses_many = [], []
        expected = one.workers[0].compute(step, lambda name, value, count: losses_one.append((name, value, count)))
        got = group.compute(step, lambda name, value, count: losses_many.append((name, value, count)))
        for metric in ("loss", "accuracy"):
            mean = [sum(float(v) * c for n, v, c in reports if n == metric) / sum(c for n, v, c in reports if n == metric) for reports in (losses_one, losses_many)]
            assert mean[1] == pytest.approx(mean[0], rel=1e-5)
        for name, grad in expected.items():
            torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7)


def test_a_feature_partitioned_checkpoint_resumes_on_another_number_of_workers(blobs_dir, tmp_path):
    """Params live whole in the store: a run on 2 feature partitions continues on 3 and ends where one worker ends."""
    def job(workers, steps):
        job = load(job_text(blobs_dir, net="partition_dim: 1", steps=steps, workers=workers), tmp_path, f"{workers}.conf")
        job.checkpoint_freq = 4
        return job

    ws = tmp_path / "ws"
    shoal.train(job(2, 4), workspace=ws, log=lambda *a: None)
    assert_ran(ws, threads(2))
    shoal.train(job(3, 8), workspace=ws, resume=True, log=lambda *a: None)
    assert_ran(ws, threads(3))
    single_ws = tmp_path / "single"
    shoal.train(load(job_text(blobs_dir, workers=1, steps=8), tmp_path, "one.conf"), workspace=single_ws, log=lambda *a: None)
    resumed, single = (ckpt_io.load(ckpt_io.checkpoint_file(w, 8)).params for w in (ws, single_ws))
    for name in single:
        torch.testing.assert_close(resumed[name], single[name], rtol=1e-5, atol=1e-6)


# -- the plan -------------------------------------------------------------------------
def plan_of(blobs_dir, tmp_path, **kw):
    return plan_partition(load(job_text(blobs_dir, **kw), tmp_path))


@pytest.mark.parametrize("workers", [2, 3, 4, 5])
@pytest.mark.parametrize("hidden", [32, 7, 4096])
def test_feature_partitions_own_disjoint_slices_that_tile_each_param(blobs_dir, tmp_path, workers, hidden):
    plan = plan_of(blobs_dir, tmp_path, net="partition_dim: 1", workers=workers, hidden=hidden)
    covered: dict[str, list[tuple[int, int]]] = {}
    for node in plan.nodes:
        for view in node.params:
            assert (view.axis >= 0) == (plan.partitioning[node.origin][0] == FEATURE), f"{node.name}: {view}"
            if view.axis >= 0:
                covered.setdefault(view.name, []).append((view.start, view.start + view.size))
    # 4 outputs cannot be cut over 5 workers: fc2 then runs on the batch dimension, and says so
    assert (plan.partitioning["fc2"][0] == BATCH) == (workers > 4) and any("fc2" in note for note in plan.notes) == (workers > 4)
    sizes = {"w1": hidden, "b1": hidden, "w2": 4, "b2": 4}
    for name, spans in covered.items():
        spans.sort()
        assert spans[0][0] == 0 and spans[-1][1] == sizes[name] and all(a[1] == b[0] for a, b in zip(spans, spans[1:])), (name, spans)
        assert max(b - a for a, b in spans) - min(b - a for a, b in spans) <= 1  # near-equal, larger first
    assert [n.worker for n in plan.nodes if n.origin == "fc1" and not n.inserted] == list(range(workers))


@pytest.mark.parametrize("partitioning", PARTITIONINGS)
def test_views_computed_by_one_worker_alone_are_updated_there_and_replicas_are_not(blobs_dir, tmp_path, partitioning):
    """A feature slice or a placed layer's param is computed by one worker only: nothing to sum, so that worker
    updates it; a batch layer's param is replicated, and its parts must be summed first."""
    plan = plan_of(blobs_dir, tmp_path, **PARTITIONINGS[partitioning])
    owned = plan.updated_where_computed()
    for node in plan.nodes:
        for view in node.params:
            kind = plan.partitioning[node.origin][0]
            assert (view in owned) == (kind in (FEATURE, WHOLE)), (node.name, view)
            if view in owned:
                assert owned[view] == node.worker
    for name in {v.name for v in owned}:  # an owned param's views tile it: each element has one updater
        views = [v for v in owned if v.name == name]
        assert len(views) == 1 and views[0].axis < 0 or sorted((v.start, v.start + v.size) for v in views)[0][0] == 0


def test_a_worker_updates_its_own_slices_so_their_gradients_never_cross(blobs_dir, tmp_path):
    """All-feature fc layers: per step only the bridged blobs cross between the 2 workers, none of the params."""
    text = job_text(blobs_dir, net="partition_dim: 1")
    moved = {}
    for mode in ("updated by their worker", "sent to worker 0"):
        trainer = assemble(plan_job(load(text, tmp_path)), 0, RunSpec(tmp_path / mode, [tmp_path], log=lambda *a: None)).chief
        group = trainer.workers[0]
        if mode == "sent to worker 0":
            group.use_view_updater(None)
        trainer.train_step(0)
        bridges = sum(c.bytes for c in group.channels.values())
        moved[mode] = (group.bytes_per_step, bridges)
    slices_of_worker_1 = sum(v.size * (16 if v.name == "w1" else 32 if v.name == "w2" else 1) for v, k in
                             plan_of(blobs_dir, tmp_path, net="partition_dim: 1").updated_where_computed().items() if k == 1)
    assert moved["updated by their worker"][0] == moved["updated by their worker"][1]  # bridges only
    assert moved["sent to worker 0"][0] == moved["sent to worker 0"][1] + 2 * 4 * slices_of_worker_1


@pytest.mark.parametrize("partitioning", PARTITIONINGS)
def test_every_edge_stays_on_one_worker_or_crosses_through_a_bridge_pair(blobs_dir, tmp_path, partitioning):
    plan = plan_of(blobs_dir, tmp_path, **PARTITIONINGS[partitioning])
    by_name = {n.name: n for n in plan.nodes}
    position = {n.name: i for i, n in enumerate(plan.nodes)}
    for node in plan.nodes:
        for src in node.srcs:
            assert by_name[src].worker == node.worker and position[src] < position[node.name], (src, node.name)
        if node.type == "kBridgeDst":
            sender = by_name[node.peer]
            assert sender.type == "kBridgeSrc" and sender.peer == node.name and sender.worker != node.worker
            assert position[sender.name] < position[node.name] and sender.shape == node.shape
    readers = Counter(src for n in plan.nodes for src in n.srcs)
    fanned = [name for name, count in readers.items() if count > 1 and by_name[name].layer.category not in ("input", "connection")]
    assert not fanned, f"outputs read twice without a kSplit: {fanned}"


def test_the_partitioner_inserts_singas_connection_layers(blobs_dir, tmp_path):
    plan = plan_of(blobs_dir, tmp_path, net="partition_dim: 1")
    types = Counter(n.type for n in plan.nodes if n.inserted)
    # data (batch) -> fc1 (feature, one-to-all): each worker concatenates the batch parts (one bridge each way)
    assert [n.type for n in plan.nodes if n.srcs and n.origin == "data" and n.type == "kConcate"] == ["kConcate", "kConcate"]
    # fc2 (feature) -> loss (batch): slice rows, bridge, concatenate features
    assert plan.node("loss@0").srcs[0].startswith("concate1(fc2)")
    assert types["kBridgeSrc"] == types["kBridgeDst"] > 0 and types["kSplit"] > 0 and types["kSlice"] > 0
    assert plan.partitioning["fc1"] == (FEATURE, 0) and plan.partitioning["loss"] == (BATCH, 0)
    assert any("loss" in note and "kSoftmaxLoss" in note for note in plan.notes)


def test_location_places_a_whole_layer_on_one_worker(blobs_dir, tmp_path):
    plan = plan_of(blobs_dir, tmp_path, fc1="location: 1", relu="location: 1")
    assert [(n.name, n.worker) for n in plan.nodes if n.origin == "fc1" and not n.inserted] == [("fc1", 1)]
    assert plan.partitioning["fc1"] == (WHOLE, 1) and plan.partitioned
    assert not plan_of(blobs_dir, tmp_path).partitioned


@pytest.mark.parametrize("extra, field", [
    (dict(loss="partition_dim: 1"), "neuralnet.layer[3].partition_dim"),
    (dict(fc1="partition_dim: 1", hidden=1), "neuralnet.layer[1].partition_dim"),
])
def test_impossible_partitionings_name_the_layer(blobs_dir, tmp_path, extra, field):
    with pytest.raises(PartitionError) as err:
        plan_of(blobs_dir, tmp_path, **extra)
    assert err.value.field_path.split("[")[0] == field.split("[")[0] and "partition" in str(err.value)


def test_workers_drawing_different_random_numbers_are_refused(blobs_dir, tmp_path):
    """Each worker draws from the group's one stream: a dropout on worker 1 only, then one on every worker, would desynchronise them."""
    text = job_text(blobs_dir, drop="location: 1").replace('srclayers: "drop" innerproduct_conf', 'srclayers: "drop2" innerproduct_conf')
    text = text.replace('layer { name: "fc2"', 'layer { name: "drop2" type: kDropout srclayers: "drop" dropout_conf { dropout_ratio: 0.3 } }\n  layer { name: "fc2"')
    with pytest.raises(PartitionError, match="drawing random numbers"):
        plan_partition(load(text, tmp_path))


SPANNING = {  # a partitioning on a multi-process row of tests/layouts.py
    "AllReduce: 2 feature partitions in 2 processes": ("AllReduce, 2 processes, 2 server slices", dict(net="partition_dim: 1")),
    "Sandblaster: 3 hybrid workers, 3 processes, 2 server processes": (
        "Sandblaster, 3 workers + 2 servers, 5 processes", dict(fc1="partition_dim: 1", relu="partition_dim: 1")),
    "4 workers in 2 processes of 2 threads, location placement": ("AllReduce, 2 processes x 2 threads", dict(fc1="location: 3", relu="location: 3")),
}


@pytest.mark.parametrize("layout", SPANNING)
def test_a_partitioned_group_spanning_processes_trains_exactly_like_one_worker(blobs_dir, tmp_path, layout, monkeypatch):
    """Bridges between processes go through the comm layer (point to point); the group's gradient is summed over processes."""
    monkeypatch.setenv("SHOAL_COMM_TIMEOUT", "30")
    row, kw = SPANNING[layout]
    text = job_text(blobs_dir, layout=row, **kw)
    assert plan_partition(load(text, tmp_path)).partitioned
    single, single_params = train(job_text(blobs_dir, workers=1), tmp_path, "single", threads(1))
    group, params = train(text, tmp_path, "group", row)
    for a, b in zip(group.phase("train"), single.phase("train"), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    for name in single_params:
        torch.testing.assert_close(params[name], single_params[name], rtol=1e-5, atol=1e-6)


def _bridged_bytes_of_rank(rank: int, job: str, workspace: str, port: int) -> None:
    """One process of a partitioned group through the runtime's own assembly; it leaves the bytes its bridges to the
    other process moved in the last step (sent and received) behind."""
    from shoal.comm import dist as comm
    from shoal.runtime.partitioned import RemoteChannel
    from shoal.strategies.registry import REGISTRY  # a spawned process: no conftest installed it

    plan = plan_job(shoal.load_job(job), strategies=REGISTRY)
    comm.init(rank, plan.nprocs, "127.0.0.1", port)
    try:
        run = assemble(plan, rank, RunSpec(workspace=Path(workspace), log=lambda *a: None, progress=False))
        run.run(None, lambda *a: None)
        channels = run.chief.workers[0].channels.values()
        moved = sum(c.bytes for c in channels if isinstance(c, RemoteChannel))
        (Path(workspace) / f"bridged{rank}.json").write_text(json.dumps(moved))
    finally:
        comm.shutdown()


@pytest.mark.slow  # two spawned processes: ~5 s of CPU, past the default suite's budget
def test_the_bridges_between_processes_move_what_the_cost_model_says(blobs_dir, tmp_path):
    """Each rank's bridges to the other (activations forward, their gradients back) = AllReduce's bridge term."""
    import torch.multiprocessing as mp

    from shoal.comm.dist import free_port
    from shoal.planning.framework_costs.allreduce import bridges_between_processes

    job = tmp_path / "job.conf"
    job.write_text(job_text(blobs_dir, net="partition_dim: 1", steps=2, layout="AllReduce, 2 processes"))
    plan = plan_job(shoal.load_job(job))
    expected = [0, 0]

    def move(src: int, dst: int, nbytes: float) -> None:
        expected[src] += int(nbytes)
        expected[dst] += int(nbytes)

    bridges_between_processes(plan, move)
    mp.spawn(_bridged_bytes_of_rank, args=(str(job), str(tmp_path), free_port()), nprocs=2)
    got = [json.loads((tmp_path / f"bridged{rank}.json").read_text()) for rank in range(2)]
    assert got == expected and expected[0] > 0


def test_an_asynchronous_partitioned_group_split_over_processes_is_refused_in_one_line(blobs_dir, tmp_path):
    text = job_text(blobs_dir, net="partition_dim: 1", layout=Layout(dict(nworker_groups=2, nworkers_per_group=2, server_worker_separate=True)))
    with pytest.raises(UnsupportedClusterError, match="must share one process"):
        shoal.train(load(text, tmp_path), workspace=tmp_path / "ws", log=lambda *a: None)
    assert not (tmp_path / "ws").exists()


# -- inside every framework ----------------------------------------------------------
HYBRID_FRAMEWORKS = [  # rows of tests/layouts.py
    # servers in their own processes; a partitioned group over processes trains exactly (the SPANNING tests)
    pytest.param("Sandblaster, 2 threads + 2 servers, 3 processes", marks=pytest.mark.slow),
    "in-memory Hogwild, 2 groups x 2 threads",
    # the default suite's 5-minute budget: in-memory Hogwild's row above trains a hybrid group in it
    pytest.param("Downpour, 2 groups x 2 threads + 1 server, 3 processes", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("framework", HYBRID_FRAMEWORKS)
def test_hybrid_partitioned_groups_train_mnist_in_every_framework(mnist_dir, tmp_path, framework):
    sys.path.insert(0, os.path.dirname(__file__))
    from test_async_mnist import STEPS, mlp_job

    text = mlp_job(mnist_dir, framework)
    # SINGA's hybrid: the batch dimension below, the feature dimension for the wide fully connected layer
    text = text.replace('innerproduct_conf {{ num_output: 128 }}'.replace("{{", "{").replace("}}", "}"), "innerproduct_conf { num_output: 128 } partition_dim: 1", 1)
    text = text.replace('name: "relu" type: kReLU srclayers: "fc1"', 'name: "relu" type: kReLU srclayers: "fc1" partition_dim: 1')
    assert text.count("partition_dim: 1") == 2
    job = tmp_path / "job.conf"
    job.write_text(text)
    # in this process (the run's results are the point, not an interpreter's exit: no torch import to wait for)
    proc = run_cli("run", job, "--workspace", tmp_path / "ws", env={**os.environ, "SHOAL_COMM_TIMEOUT": "30"}, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert_ran(tmp_path / "ws", framework)
    records = [json.loads(line) for line in (tmp_path / "ws" / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in records if r["phase"] == "test"][-1]
    assert final["step"] == STEPS and final["accuracy"] >= 0.85, final


# -- convolutions: SINGA's cifar10 hybrid.conf -------------------------------------------
@pytest.fixture(scope="module")
def images(tmp_path_factory):
    import numpy as np

    from shoal.data.prepare import write_image_store

    rng = np.random.default_rng(3)
    path = tmp_path_factory.mktemp("images") / "train_data.bin"
    write_image_store(path, rng.integers(0, 256, (256, 3, 32, 32), dtype=np.uint8), rng.integers(0, 10, 256))
    return path


CONV_PARTITIONINGS = {  # (workers, overrides)
    "hybrid.conf as shipped (conv batch, ip1 feature)": (2, []),
    "every layer that can split features (conv, pool, relu; LRN stays on the batch)": (2, ["neuralnet.partition_dim=1"]),
    "3 workers, the last conv stage on the features too": (3, [f"neuralnet.layer[{i}].partition_dim=1" for i in (10, 11, 12)]),
}


@pytest.mark.parametrize("partitioning", CONV_PARTITIONINGS)
def test_the_cifar10_hybrid_convnet_trains_exactly_like_one_worker(images, tmp_path, partitioning):
    from pathlib import Path

    hybrid = Path(__file__).parents[1] / "examples" / "cifar10" / "hybrid.conf"
    common = ["train_steps=3", "test_steps=0", "disp_freq=1", f"neuralnet.layer[0].store_conf.path={images}", "neuralnet.layer[0].store_conf.batchsize=24"]
    results = []
    workers, overrides = CONV_PARTITIONINGS[partitioning]
    for name, layout, extra in (("single", threads(1), []), ("group", threads(workers), overrides)):
        job = shoal.load_job(hybrid, common + layout.overrides() + extra)
        job.neuralnet.layer[0].store_conf.ClearField("mean_file")
        assert plan_partition(job).partitioned == (name == "group")
        history = shoal.train(job, workspace=tmp_path / name, log=lambda *a: None)
        assert_ran(tmp_path / name, layout)
        results.append((history.phase("train"), ckpt_io.load(ckpt_io.checkpoint_file(tmp_path / name, 3)).params))
    (single, single_params), (group, params) = results
    assert [r["loss"] for r in group] == pytest.approx([r["loss"] for r in single], rel=1e-5)
    for name in single_params:
        torch.testing.assert_close(params[name], single_params[name], rtol=1e-4, atol=1e-6)


def test_location_and_a_partition_dim_on_one_layer_are_refused_with_the_position(blobs_dir, tmp_path):
    path = tmp_path / "job.conf"
    path.write_text(job_text(blobs_dir, fc1="location: 1 partition_dim: 1"))
    proc = run_cli("run", path, "--workspace", tmp_path / "ws", timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "job.conf:" in proc.stderr and "contradicts" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "ws").exists()
