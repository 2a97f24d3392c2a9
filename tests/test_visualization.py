"""Seeing a run: train_net.json at run start, `shoal viz` pictures, and `debug: true` norm files."""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import numpy as np
import pytest
import torch

from conftest import write_store
from shoal.neuralnet import checkpoint as ckpt_io
from shoal.frontend.cli import main
from shoal.report.net_draw import node_lines, worker_colour
from shoal.report.net_layout import layout
from shoal.runtime.visualization import start_folder

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """64 known records of 16 features (no random_skip: step 0 reads records 0..31)."""
    rng = np.random.default_rng(3)
    x = rng.normal(0, 1, size=(64, 16)).astype(np.float32)
    y = rng.integers(0, 4, size=64)
    path = tmp_path_factory.mktemp("records") / "train.bin"
    write_store(path, x, y)
    return path, x


def job_file(tmp_path, store, *, workers=2, fc1="partition_dim: 1", relu="partition_dim: 1", fc2="location: 1", extra="") -> str:
    """A hybrid MLP 16 -> 8 -> 4: fc1 and relu cut on features, fc2 whole on worker 1, loss on the batch."""
    text = f"""
name: "viz-mlp" train_steps: 4 disp_freq: 2 test_steps: 0 seed: 7 {extra}
train_one_batch {{ alg: kBP }}
updater {{ type: kSGD learning_rate {{ type: kFixed base_lr: 0.05 }} }}
neuralnet {{
  layer {{ name: "data" type: kRecordInput store_conf {{ backend: "kvfile" path: "{store}" batchsize: 32 shape: 16 }} }}
  layer {{ name: "fc1" type: kInnerProduct srclayers: "data" innerproduct_conf {{ num_output: 8 }} {fc1}
    param {{ name: "w1" init {{ type: kGaussian std: 0.1 }} }} param {{ name: "b1" init {{ type: kUniform low: -0.1 high: 0.1 }} }} }}
  layer {{ name: "relu" type: kReLU srclayers: "fc1" {relu} }}
  layer {{ name: "fc2" type: kInnerProduct srclayers: "relu" innerproduct_conf {{ num_output: 4 }} {fc2}
    param {{ name: "w2" init {{ type: kUniform low: -0.1 high: 0.1 }} }} param {{ name: "b2" init {{ type: kConstant value: 0.1 }} }} }}
  layer {{ name: "loss" type: kSoftmaxLoss srclayers: "fc2" srclayers: "data" }}
}}
cluster {{ nworkers_per_group: {workers} nworkers_per_procs: {workers} }}
"""
    path = tmp_path / "job.conf"
    path.write_text(text)
    return str(path)


def run(*args) -> None:
    assert main(["run", *map(str, args), "--no-progress"]) == 0


def assert_one_line_error(code, capsys, *fragments):
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err


def test_a_run_writes_its_partitioned_net_as_shoal_plan_shows_it(tmp_path, records, capsys):
    job = job_file(tmp_path, records[0])
    run(job, "--workspace", tmp_path / "ws")
    net = json.loads((tmp_path / "ws" / "visualization" / "train_net.json").read_text())
    capsys.readouterr()
    assert main(["plan", job, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    workers = {w["id"]: w["layers"] for proc in plan["processes"] for w in proc["workers"]}
    for k in (0, 1):  # every worker computes, in order, the nodes `shoal plan` lists for it
        assert [n["id"] for n in net["nodes"] if n["worker"] == k] == workers[k]
    nodes = {n["id"]: n for n in net["nodes"]}
    assert nodes["fc2"]["worker"] == 1 and nodes["fc2"]["partition"] == "whole"
    assert nodes["fc1@0"]["partition"] == "feature" and nodes["fc1@0"]["shape"] == [4]
    assert nodes["fc1@0"]["params"][0] == {"name": "w1", "axis": 0, "start": 0, "size": 4}
    for link in net["links"]:  # an edge stays on its worker, or is a bridge pair
        source, target = nodes[link["source"]], nodes[link["target"]]
        crosses = source["worker"] != target["worker"]
        assert crosses == (source["type"] == "kBridgeSrc" and target["type"] == "kBridgeDst"), link
    assert {n["type"] for n in net["nodes"] if n["connection"]} == {"kBridgeSrc", "kBridgeDst", "kConcate", "kSlice", "kSplit"}


def test_test_only_mode_writes_the_test_net(tmp_path, records):
    job = job_file(tmp_path, records[0], workers=1, fc1="", relu="", fc2="", extra="")
    run(job, "--workspace", tmp_path / "ws")
    run(job, "--workspace", tmp_path / "ws", "--test", "--set", "test_steps=1")
    net = json.loads((tmp_path / "ws" / "visualization" / "test_net.json").read_text())
    assert [n["id"] for n in net["nodes"]] == ["data", "fc1", "relu", "fc2", "loss"]
    assert {n["worker"] for n in net["nodes"]} == {0}


def test_a_fresh_run_moves_an_earlier_runs_files_aside_and_a_resume_keeps_them(tmp_path):
    folder = tmp_path / "visualization"
    folder.mkdir()
    (folder / "fp-step0-loc0.json").write_text("{}")
    start_folder(tmp_path, fresh=False)
    assert (folder / "fp-step0-loc0.json").exists()
    start_folder(tmp_path, fresh=True)
    assert (tmp_path / "visualization.1" / "fp-step0-loc0.json").exists() and not any(folder.iterdir())


def test_viz_draws_png_and_svg_with_every_worker_and_label(tmp_path, records, capsys):
    job = job_file(tmp_path, records[0])
    assert main(["viz", job, "-o", str(tmp_path / "net.png")]) == 0
    assert (tmp_path / "net.png").read_bytes()[:8] == PNG_MAGIC
    assert main(["viz", job, "-o", str(tmp_path / "net.svg")]) == 0
    svg = (tmp_path / "net.svg").read_text()
    root = ET.fromstring(svg)
    assert root.tag.endswith("svg")
    text = "\n".join(root.itertext())
    run(job, "--workspace", tmp_path / "ws")
    net = json.loads((tmp_path / "ws" / "visualization" / "train_net.json").read_text())
    for node in net["nodes"]:
        for line in node_lines(node):
            assert line in text, line
    for k in (0, 1):
        assert worker_colour(k).lower() in svg.lower() and f"worker {k}" in text
    # a run's JSON draws the same picture
    assert main(["viz", str(tmp_path / "ws" / "visualization" / "train_net.json"), "-o", str(tmp_path / "again.png")]) == 0
    assert (tmp_path / "again.png").read_bytes()[:8] == PNG_MAGIC


def test_layout_gives_each_worker_a_column_and_bridges_cross_them(tmp_path, records):
    import shoal
    from shoal.runtime.visualization import train_net_graph

    from shoal.planning.plan import plan_job

    net = train_net_graph(plan_job(shoal.load_job(job_file(tmp_path, records[0]))))
    placed = layout(net)
    columns = {c.worker: c for c in placed.columns}
    for node in net["nodes"]:
        x, _ = placed.positions[node["id"]]
        assert columns[node["worker"]].left < x < columns[node["worker"]].right
    for edge in placed.edges:
        (_, ys), (_, yt) = placed.positions[edge.source], placed.positions[edge.target]
        assert yt > ys  # rows follow the data
        assert edge.crosses_workers == net["nodes"][[n["id"] for n in net["nodes"]].index(edge.source)]["type"].endswith("BridgeSrc")


def test_debug_writes_norms_at_display_steps_that_match_a_hand_computation(tmp_path, records):
    store, x = records
    job = job_file(tmp_path, store, workers=1, fc1="", relu="", fc2="", extra="debug: true checkpoint_freq: 100")
    run(job, "--workspace", tmp_path / "ws")
    vis = tmp_path / "ws" / "visualization"
    assert sorted(p.name for p in vis.glob("*-step*")) == [f"{kind}-step{s}-loc0.json" for kind in ("bp", "fp") for s in (0, 2)]
    fp = {n["id"]: n.get("norms") for n in json.loads((vis / "fp-step0-loc0.json").read_text())["nodes"]}
    bp = {n["id"]: n.get("norms") for n in json.loads((vis / "bp-step0-loc0.json").read_text())["nodes"]}
    # by hand: fc1's output on the first batch, from the initial params (the step-0 checkpoint)
    params = ckpt_io.load(ckpt_io.checkpoint_file(tmp_path / "ws", 0)).params
    w1, b1 = params["w1"], params["b1"]
    fc1 = torch.from_numpy(x[:32]) @ w1.T + b1
    assert fp["fc1@0"]["data_l1"] == pytest.approx(fc1.abs().sum().item(), rel=1e-5)
    assert fp["fc1@0"]["numel"] == 32 * 8
    assert fp["fc1@0"]["params"][0] == {"name": "w1", "value_l1": pytest.approx(w1.abs().sum().item(), rel=1e-6), "numel": 128}
    assert bp["loss@0"]["grad_l1"] == pytest.approx(1.0)  # d loss / d loss
    for node in ("fc1@0", "relu@0", "fc2@0"):
        norms = bp[node]
        assert np.isfinite(norms["grad_l1"]) and norms["grad_l1"] > 0
        assert all(np.isfinite(p["grad_l1"]) and p["grad_l1"] > 0 for p in norms.get("params", []))


def test_debug_in_a_partitioned_group_writes_every_workers_files(tmp_path, records):
    job = job_file(tmp_path, records[0], extra="debug: true")
    run(job, "--workspace", tmp_path / "ws")
    vis = tmp_path / "ws" / "visualization"
    for worker in (0, 1):
        fp = json.loads((vis / f"fp-step2-loc{worker}.json").read_text())
        labelled = [n for n in fp["nodes"] if n.get("norms")]
        assert labelled and all(n["worker"] == worker for n in labelled)
        assert fp["graph"] == {"nworkers": 2, "step": 2, "worker": worker, "pass": "fp"}
    bp = {n["id"]: n.get("norms") for n in json.loads((vis / "bp-step2-loc1.json").read_text())["nodes"]}
    assert bp["fc2"]["grad_l1"] > 0 and [p["name"] for p in bp["fc2"]["params"]] == ["w2", "b2"]
    assert main(["viz", str(vis / "bp-step2-loc1.json"), "-o", str(tmp_path / "bp.png")]) == 0


def test_a_group_over_processes_writes_the_net_once_and_every_workers_norms(tmp_path, records):
    """The chief process writes train_net.json; each process writes the norm files of its own worker."""
    job = job_file(tmp_path, records[0], extra="debug: true")
    run(job, "--workspace", tmp_path / "ws", "--set", "cluster.nworkers_per_procs=1")
    vis = tmp_path / "ws" / "visualization"
    in_one_process = tmp_path / "threads"
    run(job, "--workspace", in_one_process)
    assert (vis / "train_net.json").read_text() == (in_one_process / "visualization" / "train_net.json").read_text()
    for name in ("fp-step2-loc1.json", "bp-step2-loc0.json"):  # the same numbers as with threads
        ours, threads = (json.loads((d / name).read_text()) for d in (vis, in_one_process / "visualization"))
        assert output_norms(ours) == pytest.approx(output_norms(threads), rel=1e-5) and any(output_norms(ours))


def output_norms(graph: dict) -> list[float]:
    """Each node's output norm (data in fp, gradient in bp; 0 where none)."""
    return [n.get("norms", {}).get("data_l1", n.get("norms", {}).get("grad_l1", 0.0)) for n in graph["nodes"]]


@pytest.mark.parametrize(
    "content, fragments",
    [
        ('name: "x"\ntrain_stepz: 1\n', ["job.conf:2:1", "train_stepz"]),
        ('{"nodes": [{"id": "a", "worker": -1}], "links": []}', ["net.json", "nodes[0].worker"]),
        ('{"nodes": [{"id": "a"}], "links": [{"source": "a", "target": "b"}]}', ["net.json", "links[0].target", "'b'"]),
        ('{"nodes": [', ["net.json", "not JSON"]),
    ],
)
def test_viz_of_a_bad_file_is_a_one_line_error(tmp_path, capsys, content, fragments):
    path = tmp_path / ("net.json" if content.startswith("{") else "job.conf")
    path.write_text(content)
    assert_one_line_error(main(["viz", str(path), "-o", str(tmp_path / "x.png")]), capsys, *fragments)


def test_viz_refuses_an_unknown_picture_format(tmp_path, records, capsys):
    job = job_file(tmp_path, records[0])
    assert_one_line_error(main(["viz", job, "-o", str(tmp_path / "net.gif")]), capsys, "net.gif", ".png")
