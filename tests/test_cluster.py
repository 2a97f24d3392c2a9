"""Placement (pure): SINGA's process formulas, group mapping and param slicing; `shoal plan`."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from cli_in_process import run_cli
from google.protobuf import text_format

from shoal.planning.placement import PlacementError, ServerId, place, slice_params
from shoal.config import job_pb2

from conftest import REPO


def cluster(text: str) -> job_pb2.ClusterProto:
    return text_format.Parse(text, job_pb2.ClusterProto())


# (cluster, framework, processes as [(workers, servers)])
FRAMEWORKS = [
    ("", "single worker", [([(0, 0)], [(0, 0)])]),
    (
        "nworkers_per_group: 3 nservers_per_group: 2 server_worker_separate: true",
        "Sandblaster",
        [([(0, 0)], []), ([(0, 1)], []), ([(0, 2)], []), ([], [(0, 0)]), ([], [(0, 1)])],
    ),
    ("nworkers_per_group: 3 nservers_per_group: 3", "AllReduce", [([(0, i)], [(0, i)]) for i in range(3)]),
    (
        "nworker_groups: 2 nworkers_per_group: 2 nservers_per_group: 2 server_worker_separate: true",
        "Downpour",
        [([(0, 0)], []), ([(0, 1)], []), ([(1, 0)], []), ([(1, 1)], []), ([], [(0, 0)]), ([], [(0, 1)])],
    ),
    ("nworker_groups: 3 nserver_groups: 3", "Distributed Hogwild", [([(g, 0)], [(g, 0)]) for g in range(3)]),
    ("nworker_groups: 2 nworkers_per_procs: 2", "in-memory Hogwild", [([(0, 0), (1, 0)], [(0, 0)])]),
    ("nworkers_per_group: 2 nworkers_per_procs: 2", "AllReduce", [([(0, 0), (0, 1)], [(0, 0)])]),
]


TINY_NET = """
neuralnet {
  layer { name: "data" type: kRecordInput store_conf { backend: "kvfile" path: "unused.bin" batchsize: 12 shape: 4 } }
  layer { name: "fc" type: kInnerProduct srclayers: "data" innerproduct_conf { num_output: 3 } param { name: "w" } param { name: "b" } }
  layer { name: "loss" type: kSoftmaxLoss srclayers: "fc" srclayers: "data" }
}
"""


@pytest.mark.parametrize("text, framework, expected", FRAMEWORKS, ids=[f[1] + ":" + f[0] for f in FRAMEWORKS])
def test_frameworks_table_of_the_seed_docs(text, framework, expected):
    from shoal.planning.plan import plan_job

    plan = plan_job(text_format.Parse(f"name: 'tiny' {TINY_NET} cluster {{ {text} }}", job_pb2.JobProto()))
    assert plan.framework.value == framework
    p = plan.placement
    got = [([(w.group, w.id) for w in proc.workers], [(s.group, s.id) for s in proc.servers]) for proc in p.processes]
    assert got == expected


def test_worker_group_to_server_group():
    p = place(cluster("nworker_groups: 6 nserver_groups: 3"))
    assert [p.server_group_of(g) for g in range(6)] == [0, 0, 1, 1, 2, 2]


def test_invalid_combination_shows_the_arithmetic():
    with pytest.raises(PlacementError, match=r"nworker_groups\(3\) must be a multiple of nserver_groups\(2\)"):
        place(cluster("nworker_groups: 3 nserver_groups: 2"))
    with pytest.raises(PlacementError, match=r"nworkers_per_procs\(2\) must divide nworkers_per_group\(3\)"):
        place(cluster("nworkers_per_group: 3 nworkers_per_procs: 2"))


@pytest.mark.parametrize("sizes, n", [({"w1": 100, "b1": 10, "w2": 50}, 4), ({"a": 7}, 3), ({"a": 1, "b": 1, "c": 9}, 6), ({"big": 1000, "small": 3}, 2)])
def test_slices_cover_every_element_once_and_balance_the_load(sizes, n):
    slices = slice_params(sizes, n)
    for name, size in sizes.items():
        mine = sorted((s.start, s.stop) for s in slices if s.param == name)
        assert mine[0][0] == 0 and mine[-1][1] == size
        assert all(a[1] == b[0] for a, b in zip(mine, mine[1:]))
    load = [sum(s.size for s in slices if s.index == i) for i in range(n)]
    total = sum(sizes.values())
    assert max(load) - min(load) <= -(-total // n)  # within one bucket's rounding
    assert max(load) <= -(-total // n)


def test_slices_are_spread_over_the_servers_of_each_group():
    p = place(cluster("nserver_groups: 2 nworker_groups: 2 nservers_per_group: 3"), {"w": 600})
    assert p.nslices == 6
    for group in range(2):
        owned = [sum(s.size for s in p.slices_of(ServerId(group, i))) for i in range(3)]
        assert owned == [200, 200, 200]
    assert [p.master_group_of_slice(i) for i in range(6)] == [0, 1, 0, 1, 0, 1]


def test_placement_is_deterministic():
    c = cluster("nworker_groups: 2 nworkers_per_group: 2 nservers_per_group: 2 server_worker_separate: true")
    assert place(c, {"a": 10, "b": 7}) == place(c, {"a": 10, "b": 7})


def test_shoal_plan_prints_processes_workers_servers_and_slices(tmp_path):
    args = [sys.executable, "-m", "shoal", "plan", str(REPO / "examples/mnist/job.conf"), "--set",
            "cluster.nworkers_per_group=3", "--set", "cluster.nservers_per_group=2", "--set", "cluster.server_worker_separate=true"]
    text = subprocess.run(args, capture_output=True, text=True, check=True).stdout  # a real process; --json below in this one
    assert "Sandblaster, 5 process(es)" in text and "server (group 0, id 1)" in text and "fc1, tanh1" in text
    plan = json.loads(run_cli(*args[3:], "--json").stdout)
    assert plan["nprocs"] == 5 and plan["param_elements"] == 784 * 2500 + 2500 + 2500 * 2000 + 2000 + 2000 * 1500 + 1500 + 1500 * 1000 + 1000 + 1000 * 500 + 500 + 500 * 10 + 10
    servers = [s for p in plan["processes"] for s in p["servers"]]
    assert sum(x["stop"] - x["start"] for s in servers for x in s["slices"]) == plan["param_elements"]


def test_shoal_plan_rejects_bad_clusters_in_one_line(tmp_path):
    proc = run_cli("plan", REPO / "examples/mnist/job.conf", "--set", "cluster.nworker_groups=3", "--set", "cluster.nserver_groups=2")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "nworker_groups(3)" in proc.stderr


@pytest.mark.parametrize("sets,env,expected", [
    (["cluster.stall_timeout_s=0"], {}, "stall_timeout_s must be > 0 (seconds), got 0"),
    (["cluster.comm_timeout_s=-1"], {}, "comm_timeout_s must be > 0 (seconds), got -1"),
    ([], {"SHOAL_JOIN_TIMEOUT": "later"}, "SHOAL_JOIN_TIMEOUT='later': expected seconds > 0 (overrides cluster.join_timeout_s)"),
])
def test_shoal_plan_refuses_a_timeout_that_is_not_seconds_in_one_line(sets, env, expected):
    import os

    args = [a for s in ["cluster.nworkers_per_group=2", *sets] for a in ("--set", s)]
    proc = run_cli("plan", REPO / "examples/mnist/job.conf", *args, env={**os.environ, **env})
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and expected in proc.stderr, proc.stderr


def test_shoal_plan_prints_the_timeouts_it_decided():
    import os

    args = ["plan", REPO / "examples/mnist/job.conf", "--set", "cluster.nworkers_per_group=2", "--set", "cluster.stall_timeout_s=3"]
    env = {**os.environ, "SHOAL_COMM_TIMEOUT": "90"}
    text = run_cli(*args, env=env).stdout
    assert "timeouts: cluster.comm_timeout_s 90 s, cluster.stall_timeout_s 3 s, cluster.join_timeout_s 600 s" in text.splitlines()
    plan = json.loads(run_cli(*args, "--json", env=env).stdout)
    assert plan["timeouts"] == {"comm_timeout_s": 90.0, "stall_timeout_s": 3.0, "join_timeout_s": 600.0}
