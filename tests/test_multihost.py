"""Two hosts made of network namespaces on this machine: a Sandblaster job spread over both.

Skipped where namespaces cannot be made (not root, no iproute2). Traffic stays on a private
veth pair between the two namespaces.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys

import pytest
import torch

import shoal
from layouts import assert_ran
from shoal.neuralnet import checkpoint as ckpt_io

SUBNET = "10.231.{}.{}"


def with_job_secret(**extra: str) -> dict[str, str]:
    """The environment of every node of one job: the same secret, as the user gives it (shoal.comm.auth)."""
    return dict(os.environ, SHOAL_JOB_SECRET=SECRET, **extra)


SECRET = secrets.token_hex(32)


def sh(*args):
    return subprocess.run(args, capture_output=True, text=True)


@pytest.fixture
def two_hosts():
    if not shutil.which("ip") or os.geteuid() != 0:
        pytest.skip("needs root and iproute2 to make network namespaces")
    tag = os.getpid() % 200 + 20
    a, b = f"shoal-a{tag}", f"shoal-b{tag}"
    va, vb = f"sva{tag}", f"svb{tag}"
    if sh("ip", "netns", "add", a).returncode != 0:
        pytest.skip("cannot make network namespaces here")
    try:
        steps = [
            ("ip", "netns", "add", b),
            ("ip", "link", "add", va, "type", "veth", "peer", "name", vb),
            ("ip", "link", "set", va, "netns", a),
            ("ip", "link", "set", vb, "netns", b),
            ("ip", "-n", a, "addr", "add", SUBNET.format(tag, 1) + "/24", "dev", va),
            ("ip", "-n", b, "addr", "add", SUBNET.format(tag, 2) + "/24", "dev", vb),
            ("ip", "-n", a, "link", "set", va, "up"),
            ("ip", "-n", b, "link", "set", vb, "up"),
            ("ip", "-n", a, "link", "set", "lo", "up"),
            ("ip", "-n", b, "link", "set", "lo", "up"),
        ]
        for step in steps:
            result = sh(*step)
            if result.returncode != 0:
                pytest.skip(f"cannot set up namespaces: {' '.join(step)}: {result.stderr.strip()}")
        yield (a, SUBNET.format(tag, 1)), (b, SUBNET.format(tag, 2))
    finally:
        sh("ip", "netns", "del", a)
        sh("ip", "netns", "del", b)


# the hostfile resolves to the same node rank and master as the flags: the flags' run is under -m slow
@pytest.mark.parametrize("hosts_given_by", [pytest.param("--nnodes/--node-rank/--master", marks=pytest.mark.slow), "--hostfile alone"])
def test_sandblaster_over_two_hosts_equals_the_single_worker_run(two_hosts, blobs_job, tmp_path, hosts_given_by):
    (ns_a, ip_a), (ns_b, ip_b) = two_hosts
    single = tmp_path / "single"
    shoal.train(blobs_job(train_steps=8), workspace=single, log=lambda *a: None)
    layout = "Sandblaster, 2 workers + 2 servers, 4 processes"
    job = blobs_job(train_steps=8, layout=layout, cluster_extra=dict(start_port=29517))
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"# SINGA conf/hostfile\n{ip_a}\n{ip_b}\n")
    # with a hostfile, the same command runs on both hosts: each finds its own line
    where = lambda rank: ["--hostfile", str(hostfile)] if hosts_given_by == "--hostfile alone" else ["--nnodes", "2", "--node-rank", str(rank), "--master", f"{ip_a}:29517"]
    run = lambda ns, rank, ws: subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-m", "shoal", "run", str(job), *where(rank), "--workspace", str(ws)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=with_job_secret(),
    )
    node0, node1 = run(ns_a, 0, tmp_path / "node0"), run(ns_b, 1, tmp_path / "node1")
    out1 = node1.communicate(timeout=180)
    out0 = node0.communicate(timeout=180)
    assert node0.returncode == 0, out0[1]
    assert node1.returncode == 0, out1[1]
    assert "Test @ step 8" in out0[0]
    assert_ran(tmp_path / "node0", layout, ranks_here=2)
    a = ckpt_io.load(ckpt_io.checkpoint_file(single, 8)).params
    b = ckpt_io.load(ckpt_io.checkpoint_file(tmp_path / "node0", 8)).params
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6)
    # node 1 hosted ranks 2 and 3 (the servers): its logs are its own, and its launcher's (the rendezvous's)
    assert sorted(p.name for p in (tmp_path / "node1" / "logs").iterdir()) == ["launcher.log", "rank2.log", "rank3.log"]


@pytest.mark.slow  # the default suite's 5-minute budget
def test_without_node_ranks_torchs_c10d_rendezvous_numbers_the_nodes(two_hosts, blobs_job, tmp_path):
    """`shoal run --nnodes 2 --master HOST:PORT` on both hosts, no --node-rank: torch's c10d rendezvous hands the node
    ranks out (whichever node becomes node 0 hosts the chief) and the job is the single worker's, exactly."""
    (ns_a, ip_a), (ns_b, _) = two_hosts
    single = tmp_path / "single"
    shoal.train(blobs_job(train_steps=8), workspace=single, log=lambda *a: None)
    layout = "Sandblaster, 2 workers + 2 servers, 4 processes"
    job = blobs_job(train_steps=8, layout=layout)
    run = lambda ns, ws: subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-m", "shoal", "run", str(job), "--nnodes", "2",
         "--master", f"{ip_a}:29519", "--workspace", str(ws)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=with_job_secret(),
    )
    nodes = {"a": run(ns_a, tmp_path / "a"), "b": run(ns_b, tmp_path / "b")}
    outs = {name: proc.communicate(timeout=180) for name, proc in nodes.items()}
    for name, proc in nodes.items():
        assert proc.returncode == 0, outs[name][1]
    chief = [name for name in nodes if "Test @ step 8" in outs[name][0]]
    assert len(chief) == 1, outs
    other = "b" if chief == ["a"] else "a"
    assert_ran(tmp_path / chief[0], layout, ranks_here=2)
    assert sorted(p.name for p in (tmp_path / other / "logs").iterdir()) == ["launcher.log", "rank2.log", "rank3.log"]
    a = ckpt_io.load(ckpt_io.checkpoint_file(single, 8)).params
    b = ckpt_io.load(ckpt_io.checkpoint_file(tmp_path / chief[0], 8)).params
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("node_rank,sets,extra_env", [
    (["--node-rank", "1"], [], {"SHOAL_JOIN_TIMEOUT": "1"}),  # the documented override, over the job's 600 s
    ([], ["--set", "cluster.join_timeout_s=1"], {}),  # the job field
], ids=["static", "c10d"])
def test_nodes_that_never_meet_fail_in_one_line(blobs_job, tmp_path, capfd, node_rank, sets, extra_env):
    """The other node never comes: after the join timeout (cluster.join_timeout_s, or SHOAL_JOIN_TIMEOUT), one line
    naming the master and the rendezvous; torch's retry warnings go to the launcher's log, not the terminal. In the
    test process (`shoal run` as the CLI runs it, without an interpreter's start): capfd holds what reached file
    descriptors 1 and 2 from C++ (c10d's retries) besides the CLI's own lines; that a real `python -m shoal run`
    fails with no traceback stays checked by test_a_node_without_the_job_secret_is_refused_in_one_line."""
    from cli_in_process import run_cli
    from shoal.comm.dist import free_port

    job = blobs_job(train_steps=4, layout="AllReduce, 2 processes")
    port = free_port()
    env = with_job_secret(**extra_env)
    if not extra_env:
        env.pop("SHOAL_JOIN_TIMEOUT", None)
    capfd.readouterr()
    run = run_cli("run", job, "--nnodes", "2", *node_rank, *sets, "--master", f"127.0.0.1:{port}", "--workspace",
                  tmp_path / "ws", env=env, timeout=60)  # 600 s of waiting would time out here
    native = capfd.readouterr()
    assert run.returncode == 2, run.stderr
    how = "static rendezvous as node 1" if node_rank else "c10d rendezvous"
    assert run.stderr.splitlines() == [run.stderr.strip()] and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.startswith(f"--master 127.0.0.1:{port}: cannot meet the job's other 1 node(s) ({how}): "), run.stderr
    assert native.out == native.err == "", native  # nothing from torch's C++ on the terminal
    assert not (tmp_path / "ws" / "logs" / "rank0.log").exists()  # no rank was started


def test_two_nodes_on_one_host_meet_through_c10d(blobs_job, tmp_path):
    """A try-out on one machine: `shoal run --nnodes 2 --master 127.0.0.1:PORT` twice. The first node serves torch's
    c10d rendezvous store, the second finds the port taken and joins it; both finish, one of them as the chief."""
    from shoal.comm.dist import free_port

    layout = "AllReduce, 2 processes"
    job = blobs_job(train_steps=6, layout=layout)
    port = free_port()
    run = lambda ws: subprocess.Popen([sys.executable, "-m", "shoal", "run", str(job), "--nnodes", "2", "--master",
                                       f"127.0.0.1:{port}", "--workspace", str(ws)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=with_job_secret())
    nodes = {"a": run(tmp_path / "a"), "b": run(tmp_path / "b")}
    outs = {name: proc.communicate(timeout=180) for name, proc in nodes.items()}
    assert [proc.returncode for proc in nodes.values()] == [0, 0], outs
    chief = [name for name in nodes if "Test @ step 6" in outs[name][0]]
    assert len(chief) == 1, outs
    other = "b" if chief == ["a"] else "a"
    assert_ran(tmp_path / chief[0], layout, ranks_here=1)
    assert outs[other][0].strip().splitlines()[-1].startswith("This node's processes finished; the chief's node")


def test_a_node_without_the_job_secret_is_refused_in_one_line(blobs_job, tmp_path):
    """Across hosts nobody can make the secret for the others: a node given none says how to give it, and starts nothing.
    In the test process (a refusal before any process starts; the two-node test keeps real interpreters)."""
    from cli_in_process import run_cli

    job = blobs_job(train_steps=4, layout="AllReduce, 2 processes")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_JOB_SECRET")}
    run = run_cli("run", job, "--nnodes", "2", "--node-rank", "1", "--master", "127.0.0.1:29999", "--workspace",
                  tmp_path / "ws", env=env, timeout=120)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.startswith("a job over 2 nodes needs the job's secret on every node: set SHOAL_JOB_SECRET"), run.stderr
    assert not (tmp_path / "ws" / "logs" / "rank0.log").exists()


@pytest.mark.slow  # the default suite's 5-minute budget
def test_nodes_given_different_secrets_are_refused_in_one_line_each(blobs_job, tmp_path):
    """Two nodes of one job meet, but one was given another secret: each refuses the other's processes, in one line
    saying the secrets differ, and no training starts."""
    from shoal.comm.dist import free_port

    job = blobs_job(train_steps=6, layout="AllReduce, 2 processes")
    port = free_port()
    run = lambda ws, secret: subprocess.Popen([sys.executable, "-m", "shoal", "run", str(job), "--nnodes", "2", "--master",
                                               f"127.0.0.1:{port}", "--workspace", str(ws)], stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True, env=dict(os.environ, SHOAL_JOB_SECRET=secret))
    nodes = [run(tmp_path / "a", secrets.token_hex(32)), run(tmp_path / "b", secrets.token_hex(32))]
    outs = [proc.communicate(timeout=180) for proc in nodes]
    for proc, (out, err) in zip(nodes, outs):
        assert proc.returncode == 2 and err.count("\n") == 1 and "Traceback" not in err, err
        assert re.fullmatch(r"process \d's job secret differs from process \d's: give every node the same SHOAL_JOB_SECRET "
                            r"\(or SHOAL_JOB_SECRET_FILE\)\n", err), err
        assert "Train @" not in out
