"""Jobs started by a launcher: real torchrun (static rendezvous on loopback), srun's variables, --resume=auto.

Every launched test runs the real `shoal run` under the launcher, one process per rank, and checks the run
had the job's layout (summary.json, a log per rank) and, for synchronous layouts, the numbers.
"""
from __future__ import annotations

import json
import os
import random
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import shoal
from cli_in_process import run_cli
from layouts import LAYOUTS, assert_ran
from shoal.comm.dist import process_group_backend
from shoal.errors import ShoalError
from shoal.planning.plan import plan_job
from shoal.neuralnet import checkpoint as ckpt_io
from shoal.report.metrics import read_metrics
from shoal.launcher.launchers import LaunchedProcess, LauncherEnvError, detect, expand_nodelist

TORCHRUN = Path(sys.executable).with_name("torchrun")
quiet = lambda *a: None  # noqa: E731


def free_port(low: int = 1024, high: int = 65535) -> int:
    for port in random.sample(range(low, high), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port")


def torchrun(nprocs: int, job: Path, workspace: Path, *args: str, restarts: int = 0, env=None, stderr_file=None):
    """`torchrun --nnodes=1 --nproc-per-node=N -m shoal run JOB` on loopback (a free port: tests may run side by side)."""
    command = [str(TORCHRUN), "--nnodes=1", f"--nproc-per-node={nprocs}", "--master-addr=127.0.0.1",
               f"--master-port={free_port()}", f"--max-restarts={restarts}",
               f"--log-dir={workspace.parent / 'torchrun-logs'}",  # (not a folder of its own under /tmp, left there)
               "-m", "shoal", "run", str(job), "--workspace", str(workspace), *args]
    environment = {**os.environ, "PYTHONUNBUFFERED": "1", **job_secret(), **(env or {})}
    if stderr_file is not None:  # started, not waited for: stdout is the caller's to read, stderr goes to the file
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr_file, text=True, env=environment)
    return subprocess.run(command, capture_output=True, text=True, env=environment, timeout=180)


def job_secret() -> dict[str, str]:
    """The job's secret, as a user gives it to every process a launcher starts (shoal.comm.auth)."""
    return {"SHOAL_JOB_SECRET": secrets.token_hex(32)}


def final_params(workspace: Path, step: int) -> dict[str, torch.Tensor]:
    return ckpt_io.load(ckpt_io.checkpoint_file(workspace, step)).params


def numbers(workspace: Path) -> list[tuple]:
    """Every metrics record's step, phase, loss and accuracy (not its timings)."""
    return [(r["step"], r["phase"], r.get("loss"), r.get("accuracy")) for r in read_metrics(workspace / "metrics.jsonl")]


# -- torchrun ---------------------------------------------------------------------------------------
@pytest.mark.slow  # the default suite's 5-minute budget; covered in it by a cheaper test
def test_torchrun_runs_allreduce_as_shoal_run_does(blobs_job, tmp_path, job_registry):
    layout = "AllReduce, 2 processes"
    job = blobs_job(train_steps=6, layout=layout)
    # `shoal run JOB` with the same layout (it spawns the processes itself), side by side with torchrun's run
    reference = subprocess.Popen([sys.executable, "-m", "shoal", "run", str(job), "--workspace", str(tmp_path / "shoal-run")],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = torchrun(2, job, tmp_path / "torchrun")
    assert reference.wait(timeout=180) == 0, reference.stderr.read()[-3000:]
    assert run.returncode == 0, run.stderr[-3000:]
    assert "started by torchrun" in run.stdout and "Test @ step 6" in run.stdout
    assert run.stdout.count("Test @ step 6") == 1  # only the chief talks to the terminal
    assert_ran(tmp_path / "torchrun", layout)
    assert "Worker (group = 0, id = 1)" in (tmp_path / "torchrun" / "logs" / "rank1.log").read_text()
    records = [json.loads(p.read_text()) for p in job_registry.glob("*.json")]
    launched = [r for r in records if r["workspace"] == str((tmp_path / "torchrun").resolve())]
    assert launched[0]["status"] == "finished" and [p["rank"] for p in launched[0]["processes"]] == [0, 1]
    assert numbers(tmp_path / "torchrun") == numbers(tmp_path / "shoal-run")
    ours, theirs = final_params(tmp_path / "torchrun", 6), final_params(tmp_path / "shoal-run", 6)
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["Downpour, 2 groups + 1 server, 3 processes",
                                    pytest.param("Distributed Hogwild, 2 groups", marks=pytest.mark.slow)])
def test_torchrun_runs_asynchronous_layouts(blobs_job, tmp_path, layout):
    job = blobs_job(train_steps=8, layout=layout)
    run = torchrun(LAYOUTS[layout].processes, job, tmp_path / "ws")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Test @ step 8" in run.stdout
    summary = assert_ran(tmp_path / "ws", layout)
    assert summary["status"] == "finished" and summary["final_test"]["accuracy"] > 0.5


def test_torchrun_world_of_the_wrong_size_is_refused_in_one_line(blobs_job, tmp_path):
    """torchrun started 1 process for a 2-process layout: one line naming WORLD_SIZE and the layout's count, exit 2,
    nothing started. In the test process, with the environment torchrun gives its one process (what shoal reads of
    torchrun: tests/test_launchers.py's test_torchrun_environment_is_read); a real torchrun starting shoal's processes
    stays checked by test_torchrun_runs_asynchronous_layouts and test_killed_rank_restarts_and_resumes_to_the_uninterrupted_result."""
    from cli_in_process import one_line_error
    from shoal.comm.dist import free_port

    job = blobs_job(train_steps=4, layout="AllReduce, 2 processes")
    world = dict(TORCHELASTIC_RUN_ID="none", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                 GROUP_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), TORCHELASTIC_RESTART_COUNT="0",
                 TORCHELASTIC_MAX_RESTARTS="0")
    run = run_cli("run", job, "--workspace", tmp_path / "ws", env={**os.environ, **job_secret(), **world}, timeout=60)
    refusal = one_line_error(run)
    assert "torchrun started 1 process (WORLD_SIZE=1)" in refusal and "has 2 processes" in refusal, refusal
    assert not (tmp_path / "ws" / "logs" / "rank0.log").exists()


# -- elastic restart -------------------------------------------------------------------------------
def test_killed_rank_restarts_and_resumes_to_the_uninterrupted_result(blobs_job, tmp_path, job_registry):
    """torchrun --max-restarts=1: SIGKILL one rank after a checkpoint; torchrun restarts the processes, --resume=auto
    continues from the newest checkpoint and the job ends as an uninterrupted run would (to float tolerance)."""
    steps, layout = 40, "AllReduce, 2 processes"  # the step-8 checkpoint, then 1.9 s of steps or more to kill a rank in
    job = blobs_job(train_steps=steps, layout=layout, extra="checkpoint_freq: 8")
    workspace = tmp_path / "ws"
    # each step takes 60 ms more, so that the test can kill the run mid-way
    errors = open(tmp_path / "stderr.txt", "w")
    proc = torchrun(2, job, workspace, "--resume=auto", restarts=1, env={"SHOAL_SLOW_WORKER": "0:0+0.06"}, stderr_file=errors)
    stderr = lambda: (tmp_path / "stderr.txt").read_text()[-3000:]  # noqa: E731
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), line) for line in proc.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    # mid-run, once the step-8 checkpoint is whole (rank 1's part written too: a part missing makes the resume fall
    # back to the checkpoint before, step 0)
    rank1_part = ckpt_io.checkpoint_dir(workspace) / "step8-group0-rank1.safetensors"
    while not (ckpt_io.list_checkpoints(workspace)[-1:] >= [(8,)] and rank1_part.exists() and list(job_registry.glob("*.json"))):
        assert proc.poll() is None and time.monotonic() < deadline, stderr()
        time.sleep(0.05)
    rank1 = json.loads(next(job_registry.glob("*.json")).read_text())["processes"][1]["pid"]
    os.kill(rank1, signal.SIGKILL)
    killed_at = time.monotonic()
    proc.wait(timeout=180)
    reader.join(5)
    assert proc.returncode == 0, stderr()
    resumed = [(t, line) for t, line in lines if line.startswith("Resume from checkpoint file")]
    assert resumed, "".join(line for _, line in lines)
    # rank 0, stopped by torchrun to be restarted, says so (not "interrupted; continue with --resume"): its SIGTERM, or
    # the failed collective that came first; the restarted attempt says which restart it is and where it resumes
    said = [line for line in (tmp_path / "stderr.txt").read_text().splitlines() if line.startswith(("shoal: ", "process 0 "))]
    assert said and all("restart 1 of 1" in line and "interrupted" not in line for line in said), said
    assert any(re.match(r"Job \d+: .*started by torchrun, restart 1 of 1; .*; resuming from step\d+-", line) for _, line in lines)
    trained = [t for t, line in lines if t > resumed[0][0] and line.startswith("Train @ step")]
    resumed_step = int(re.search(r"at step (\d+)", resumed[0][1]).group(1))
    assert 0 < resumed_step < steps and resumed_step % 8 == 0 and resumed_step >= 8
    print(f"\nkill -> resumed from the step-{resumed_step} checkpoint: {resumed[0][0] - killed_at:.1f} s; "
          f"kill -> first training display: {trained[0] - killed_at:.1f} s")
    assert_ran(workspace, layout)
    single = tmp_path / "single"
    shoal.train(blobs_job(train_steps=steps, extra="checkpoint_freq: 8"), workspace=single, log=quiet)
    ours, uninterrupted = final_params(workspace, steps), final_params(single, steps)
    for name in uninterrupted:
        torch.testing.assert_close(ours[name], uninterrupted[name], rtol=1e-5, atol=1e-6)


def test_resume_auto_starts_fresh_then_continues_this_job_only(blobs_job, tmp_path):
    job, workspace = blobs_job(train_steps=6), tmp_path / "ws"
    shoal.train(job, workspace=workspace, resume="auto", log=quiet)  # nothing to resume: a fresh start
    assert ckpt_io.latest(workspace).name == "step6-worker0.safetensors"
    said: list[str] = []
    longer = blobs_job(train_steps=10)  # the same job, run further: continues
    shoal.train(longer, workspace=workspace, resume="auto", log=said.append)
    assert any(line.startswith("Resume from checkpoint file") and line.endswith("at step 6") for line in said), said
    other = blobs_job(train_steps=12, hidden=16)  # a different net in the same workspace: refused
    with pytest.raises(ShoalError, match="--resume=auto found checkpoints of a job 'blobs-mlp' whose neuralnet differs"):
        shoal.train(other, workspace=workspace, resume="auto", log=quiet)
    renamed = tmp_path / "renamed.conf"
    renamed.write_text(blobs_job(train_steps=12).read_text().replace('name: "blobs-mlp"', 'name: "another"'))
    with pytest.raises(ShoalError, match="checkpoints of job 'blobs-mlp'"):
        shoal.train(renamed, workspace=workspace, resume="auto", log=quiet)


def test_resume_auto_from_the_command_line_refuses_another_jobs_workspace_in_one_line(blobs_job, tmp_path):
    workspace = tmp_path / "ws"
    shoal.train(blobs_job(train_steps=4), workspace=workspace, log=quiet)
    copy = workspace / ".shoal" / "job.conf"  # the job as the workspace's run was started
    copy.write_text(copy.read_text().replace('name: "blobs-mlp"', 'name: "someone-else"'))
    # in this process (the file's real interpreters are torchrun's ranks and srun's tasks)
    run = run_cli("run", blobs_job(train_steps=8), "--workspace", workspace, "--resume=auto", timeout=120)
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert "checkpoints of job 'someone-else'" in run.stderr and "Traceback" not in run.stderr


# -- Slurm -----------------------------------------------------------------------------------------
def slurm_env(rank: int, ntasks: int, nodelist: str, job_id: int, secret: dict[str, str]) -> dict[str, str]:
    """What srun sets for task `rank` of a step (the variables shoal reads, and a few it must ignore), and the job's
    secret the sbatch script exported."""
    env = {**secret}
    env.update({k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")})
    env.update(SLURM_JOB_ID=str(job_id), SLURM_STEP_ID="0", SLURM_PROCID=str(rank), SLURM_NTASKS=str(ntasks),
               SLURM_LOCALID=str(rank), SLURM_NODELIST=nodelist, SLURM_STEP_NODELIST=nodelist, SLURM_NNODES="1",
               SLURM_JOB_NAME="shoal", PYTHONUNBUFFERED="1")
    return env


def test_processes_with_srun_variables_run_the_job(blobs_job, tmp_path):
    """Two tasks as `srun --ntasks=2 shoal run JOB` starts them; the master is the node list's first node, on the
    port derived from SLURM_JOB_ID (no MASTER_PORT)."""
    layout = "AllReduce, 2 processes"
    job = blobs_job(train_steps=6, layout=layout)
    port, secret = free_port(10000, 30000), job_secret()
    tasks = [subprocess.Popen([sys.executable, "-m", "shoal", "run", str(job), "--workspace", str(tmp_path / "ws")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=slurm_env(rank, 2, "localhost", job_id=port - 10000, secret=secret))
             for rank in range(2)]
    outs = [task.communicate(timeout=180) for task in tasks]
    assert [t.returncode for t in tasks] == [0, 0], [o[1][-2000:] for o in outs]
    assert "started by slurm" in outs[0][0] and "Test @ step 6" in outs[0][0] and "Test @ step" not in outs[1][0]
    assert_ran(tmp_path / "ws", layout)
    shoal.train(blobs_job(train_steps=6), workspace=tmp_path / "single", log=quiet)
    ours, single = final_params(tmp_path / "ws", 6), final_params(tmp_path / "single", 6)
    for name in single:
        torch.testing.assert_close(ours[name], single[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("nodelist, hosts", [
    ("node01", ["node01"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("gpu[8-10],login1", ["gpu8", "gpu9", "gpu10", "login1"]),
    ("r[1-2]n[09-10]", ["r1n09", "r1n10", "r2n09", "r2n10"]),
    ("a,b[1],c-[002-003]-x", ["a", "b1", "c-002-x", "c-003-x"]),
])
def test_slurm_node_lists_expand_as_slurm_writes_them(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist, complaint", [
    ("node[01-03", "unbalanced brackets"), ("node]1", "unbalanced brackets"), ("node[3-1]", "runs backwards"),
    ("node[a-b]", "is not a number or a range"), ("node[[1]]", "nested brackets"), ("a,,b", "an empty host name"),
])
def test_bad_slurm_node_lists_are_named(nodelist, complaint):
    with pytest.raises(LauncherEnvError, match=rf"SLURM_NODELIST='{re.escape(nodelist)}': .*{complaint}"):
        expand_nodelist(nodelist)


# -- reading the launchers' environments ------------------------------------------------------------
TORCHRUN_ENV = dict(TORCHELASTIC_RUN_ID="none", RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
                    GROUP_WORLD_SIZE="2", MASTER_ADDR="10.0.0.1", MASTER_PORT="29500", TORCHELASTIC_USE_AGENT_STORE="True",
                    TORCHELASTIC_RESTART_COUNT="1", TORCHELASTIC_MAX_RESTARTS="3")


def test_torchrun_environment_is_read():
    assert detect(TORCHRUN_ENV) == LaunchedProcess("torchrun", rank=3, world_size=4, local_rank=1, local_world_size=2, nnodes=2,
                                                   master_addr="10.0.0.1", master_port=29500, agent_store=True, restart=1,
                                                   max_restarts=3)


def test_env_rendezvous_and_slurm_environments_are_read():
    plain = dict(RANK="1", WORLD_SIZE="2", MASTER_ADDR="trainer-master-0", MASTER_PORT="23456")  # a PyTorchJob pod, no torchrun
    assert detect(plain) == LaunchedProcess("env", 1, 2, 0, 1, 2, "trainer-master-0", 23456)
    srun = dict(SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_PROCID="5", SLURM_NTASKS="8", SLURM_LOCALID="1",
                SLURM_STEP_NODELIST="node[07-10]")
    assert detect(srun) == LaunchedProcess("slurm", 5, 8, 1, 2, 4, "node07", 10000 + 4242)
    assert detect({**srun, "MASTER_PORT": "29400", "MASTER_ADDR": "head"}).master_port == 29400
    # an sbatch script itself (the batch step) or a plain shell: no launcher, shoal starts the processes itself
    assert detect({**srun, "SLURM_STEP_ID": "4294967294"}) is None
    assert detect({k: v for k, v in srun.items() if k != "SLURM_STEP_ID"}) is None
    assert detect({}) is None and detect({"RANK": "0"}) is None


@pytest.mark.parametrize("env, complaint", [
    ({**TORCHRUN_ENV, "RANK": "x"}, "RANK='x': expected a whole number"),
    ({**TORCHRUN_ENV, "RANK": "4"}, "RANK=4 is not below WORLD_SIZE=4"),
    ({**TORCHRUN_ENV, "WORLD_SIZE": "0"}, "WORLD_SIZE='0': expected a whole number >= 1"),
    ({**TORCHRUN_ENV, "MASTER_PORT": "70000"}, "master port 70000"),
    (dict(SLURM_STEP_ID="0", SLURM_PROCID="2", SLURM_NTASKS="2", SLURM_NODELIST="n1"), "SLURM_PROCID=2 is not below SLURM_NTASKS=2"),
    (dict(SLURM_STEP_ID="0", SLURM_PROCID="0", SLURM_NTASKS="2"), "SLURM_NODELIST is not set"),
])
def test_inconsistent_launcher_environments_are_named(env, complaint):
    with pytest.raises(LauncherEnvError, match=re.escape(complaint)):
        detect(env)


# -- NCCL or gloo ----------------------------------------------------------------------------------
NCCL = "cpu:gloo,cuda:nccl"


@pytest.mark.parametrize("devices, nodes, backend", [
    ([["cuda:0"], ["cuda:1"]], [0, 0], NCCL),  # one GPU each on one host
    ([["cuda:0"], ["cuda:0"]], [0, 1], NCCL),  # the same index on two hosts: two GPUs
    ([["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]], [0, 0], NCCL),  # two workers (threads) per process
    ([["cuda:0"], ["cuda:0"]], [0, 0], "gloo"),  # two processes on one GPU: NCCL refuses that
    ([["cuda:0"], ["cpu"]], [0, 0], "gloo"),  # a CPU worker anywhere
    ([["cuda:0", "cpu:1"], ["cuda:1"]], [0, 0], "gloo"),
    ([["cuda:0"], ["cuda:1"], []], [0, 0, 0], "gloo"),  # a separate server process (no workers)
    ([["cpu"], ["cpu"]], [0, 0], "gloo"),
])
def test_nccl_only_where_every_process_computes_on_gpus_of_its_own(devices, nodes, backend):
    assert process_group_backend(devices, nodes, nccl_usable=True) == backend
    assert process_group_backend(devices, nodes, nccl_usable=False) == "gloo"  # a build or host without NCCL/CUDA


@pytest.mark.gpu
def test_a_world_on_one_gpu_joins_with_nccl_and_reduces_cuda_tensors(tmp_path):
    """One process on cuda:0 (NCCL forbids two ranks on one GPU, so more needs more GPUs): the group is made
    with NCCL for CUDA tensors, and an all-reduce of a CUDA tensor goes through it."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    script = (
        "import torch; from shoal.comm import collectives, dist as comm\n"
        "from shoal.planning.process_groups import job_group\n"
        "backend = comm.process_group_backend([['cuda:0']], [0], comm.nccl_usable())\n"
        f"comm.init(0, 1, '127.0.0.1', {free_port()}, backend=backend)\n"
        "job = collectives.whole_job([job_group([['cuda:0']])])\n"
        "t = torch.ones(3, device='cuda:0'); comm.all_reduce_sum(t, job); c = torch.ones(2); comm.all_reduce_sum(c, job)\n"
        "print(comm.backend_name(), t.sum().item(), c.sum().item()); comm.shutdown()\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "nccl" in run.stdout and "3.0 2.0" in run.stdout


# -- two "nodes" under torchrun's c10d rendezvous ---------------------------------------------------
from test_multihost import two_hosts  # noqa: E402,F401  (the fixture: two network namespaces joined by a veth pair)


@pytest.mark.slow  # minutes on a loaded 2-core machine
@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_torchrun_over_two_hosts_made_of_network_namespaces(two_hosts, blobs_job, tmp_path, rendezvous):
    """torchrun on both "hosts"; ranks run on both, the workspace is shared (one filesystem, as a cluster's shared
    one) and the result is the single worker's."""
    (ns_a, ip_a), (ns_b, ip_b) = two_hosts
    layout = "AllReduce, 2 processes x 2 threads"
    job = blobs_job(train_steps=6, layout=layout)
    port = free_port()
    if rendezvous == "static":  # torchrun's default: node ranks given, the agent of node 0 hosts the store at ip_a
        where = lambda node, ip: [f"--node-rank={node}", f"--master-addr={ip_a}", f"--master-port={port}"]
    else:  # node ranks handed out; both namespaces share one host name, so each agent says its address (--local-addr)
        where = lambda node, ip: ["--rdzv-backend=c10d", f"--rdzv-endpoint={ip_a}:{port}", "--rdzv-id=two-hosts",
                                  f"--local-addr={ip}", f"--rdzv-conf=is_host={int(node == 0)}"]
    command = lambda ns, node, ip: ["ip", "netns", "exec", ns, str(TORCHRUN), "--nnodes=2", "--nproc-per-node=1",
                                    *where(node, ip), f"--log-dir={tmp_path / f'torchrun{node}'}", "-m", "shoal", "run", str(job), "--workspace", str(tmp_path / "ws")]
    environment = {**os.environ, **job_secret()}  # the same on both nodes
    nodes = [subprocess.Popen(command(ns, node, ip), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment)
             for node, (ns, ip) in enumerate(((ns_a, ip_a), (ns_b, ip_b)))]
    outs = [node.communicate(timeout=240) for node in nodes]
    assert [n.returncode for n in nodes] == [0, 0], [o[1][-2000:] for o in outs]
    assert sum("Test @ step 6" in out for out, _ in outs) == 1  # one chief (with c10d, on whichever node became node 0)
    assert_ran(tmp_path / "ws", layout)
    shoal.train(blobs_job(train_steps=6), workspace=tmp_path / "single", log=quiet)
    ours, single = final_params(tmp_path / "ws", 6), final_params(tmp_path / "single", 6)
    for name in single:
        torch.testing.assert_close(ours[name], single[name], rtol=1e-5, atol=1e-6)


# -- the documented cluster examples start as many processes as their job's layout has --------------------
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def example_layout_processes(args: list[str]) -> int:
    sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    job = next(a for a in args if a.endswith("job.conf"))
    return plan_job(shoal.load_job(EXAMPLES.parent / job.replace("/jobs/", "examples/"), sets)).nprocs


@pytest.mark.parametrize("script", ["srun.sbatch", "torchrun.sbatch"])
def test_slurm_examples_start_the_layouts_processes(script):
    text = (EXAMPLES / "slurm" / script).read_text()
    option = lambda name: int(re.search(rf"#SBATCH --{name}=(\d+)", text).group(1))
    command = " ".join(line.strip().rstrip("\\") for line in text.split("\nsrun ", 1)[1].splitlines()).split()
    per_node = option("ntasks-per-node") if script == "srun.sbatch" else int(re.search(r"--nproc-per-node=(\d+)", text).group(1))
    assert option("nodes") * per_node == example_layout_processes(command)
    assert "--resume=auto" in command


@pytest.mark.parametrize("manifest", ["pytorchjob.yaml", "indexed-job.yaml"])
def test_kubernetes_examples_start_the_layouts_processes(manifest):
    import yaml

    docs = list(yaml.safe_load_all((EXAMPLES / "kubernetes" / manifest).read_text()))
    if manifest == "pytorchjob.yaml":
        spec = docs[0]["spec"]
        pods = sum(r["replicas"] for r in spec["pytorchReplicaSpecs"].values())
        command = spec["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"]
        per_pod = int(spec["nprocPerNode"])
    else:
        job = next(d for d in docs if d["kind"] == "Job")
        pods = job["spec"]["completions"]
        command = job["spec"]["template"]["spec"]["containers"][0]["args"][0].split()
        per_pod = int(next(a for a in command if a.startswith("--nproc-per-node=")).split("=")[1])
        assert f"--nnodes={pods}" in command
    assert pods * per_pod == example_layout_processes(command)
    assert "--resume=auto" in command
