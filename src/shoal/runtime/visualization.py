"""WORKSPACE/visualization: the net a run computes, as node-link JSON (SINGA's train_net.json / test_net.json).

Written by the chief at the start of a run: the partitioned train net (every node of
every worker of a group, with its connection layers), or in test-only mode the test
net, which runs whole on worker 0. `shoal viz` draws either file.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from shoal.config import job_pb2
from shoal.neuralnet.net import NeuralNet
from shoal.neuralnet.params import ParamStore
from shoal.planning.partition import WHOLE
from shoal.planning.plan import JobPlan
from shoal.report.node_link import write_json
from shoal.report.writes import own_folder

FOLDER = "visualization"


def train_net_graph(plan: JobPlan) -> dict:
    """The partitioned train net of one group, as node-link (what the group's workers compute)."""
    return plan.partition.to_node_link()


def test_net_graph(job: job_pb2.JobProto) -> dict:
    """The test net, whole on worker 0 (as the chief tests), in the train net's node-link schema."""
    net = NeuralNet(job.neuralnet, job_pb2.kTest, ParamStore(allocate=False), torch.Generator())
    nodes = [
        {
            "id": n.name, "layer": n.name, "type": job_pb2.LayerType.Name(n.layer.conf.type), "shape": list(n.layer.shape),
            "worker": 0, "partition": WHOLE, "part": 0, "connection": False, "params": [{"name": p} for p in n.params],
        }
        for n in net.nodes
    ]
    links = [{"source": src, "target": n.name} for n in net.nodes for src in n.srcs]
    return {"directed": True, "multigraph": False, "graph": {"nworkers": 1}, "nodes": nodes, "links": links}


def start_folder(workspace: Path, fresh: bool) -> Path:
    """WORKSPACE/visualization, made; on a fresh start, an earlier run's files are moved aside, never mixed in.

    (The workspace holds an earlier run's visualization only when that run died before
    its first checkpoint; its metrics are kept the same way, as metrics.jsonl.N.)
    """
    folder = Path(workspace) / FOLDER
    if fresh and folder.is_dir() and any(folder.iterdir()):
        n = 1
        while folder.with_name(f"{FOLDER}.{n}").exists():
            n += 1
        folder.rename(folder.with_name(f"{FOLDER}.{n}"))
    own_folder(folder)  # a link planted there is refused, never written through
    return folder


def write_train_net(plan: JobPlan, workspace: Path, fresh: bool) -> Path:
    """WORKSPACE/visualization/train_net.json at the start of a training run (the chief only)."""
    return write_json(start_folder(workspace, fresh) / "train_net.json", train_net_graph(plan))


def write_test_net(job: job_pb2.JobProto, workspace: Path) -> Optional[Path]:
    """WORKSPACE/visualization/test_net.json at the start of a test-only run, when that workspace exists.

    A test of a checkpoint given by path needs no workspace: none is created just for this file. Whether
    WORKSPACE/visualization is the user's, the caller asks the workspace (shoal.launcher.run_job.test_job).
    """
    if not Path(workspace).is_dir():
        return None
    return write_json(start_folder(workspace, fresh=False) / "test_net.json", test_net_graph(job))
