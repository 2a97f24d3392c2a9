"""`shoal plan --recommend`: timeouts from the predicted step, driven through the CLI (issue 30, point 4)."""
from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from shoal.frontend.api import load_job
from shoal.planning import recommend
from shoal.planning.costs import Calibration
from shoal.planning.estimate import plan_kernels
from shoal.planning.plan import plan_job
from shoal.runtime import calibrate
from test_calibration import JOB  # the tiny job both files plan

ALLREDUCE = ["cluster.nworkers_per_group=2", "cluster.nservers_per_group=2"]
LOCAL_SGD = ["cluster.nworker_groups=2", "cluster.local_steps=10"]


def seeded_home(tmp_path: Path, job: Path, sets: list[str], kernel_s: float) -> Path:
    """A fresh, clean calibration of this machine in which each of the job's kernels takes `kernel_s`."""
    kernels = plan_kernels(plan_job(load_job(job, sets)))
    calib = Calibration(gemm_gflops={1: 10.0}, mem_gbps={1: 10.0}, load=0.2, **calibrate.this_machine(),
                        kernels={k.key: kernel_s for k in kernels})
    home = tmp_path / f"home-{kernel_s:g}"
    calibrate.save(calib, home / "calibration" / f"{socket.gethostname()}.json")
    return home


def plan(job: Path, sets: list[str], *args: str, home: Path) -> subprocess.CompletedProcess:
    env = {"SHOAL_HOME": str(home), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    command = [sys.executable, "-m", "shoal", "plan", str(job), "--recommend", *args, *sum((["--set", s] for s in sets), [])]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)


def test_cli_recommends_timeouts_from_the_predicted_step(tmp_path):
    job = tmp_path / "tiny.conf"
    job.write_text(JOB)
    # a fast step: the floors stand, and the text says so with the calibration's age beside it
    quick = plan(job, ALLREDUCE, home=seeded_home(tmp_path, job, ALLREDUCE, 1e-6))
    assert quick.returncode == 0, quick.stderr
    section = quick.stdout.split("recommended timeouts for AllReduce over 2 processes")[1]
    assert "\n  SHOAL_COMM_TIMEOUT=45  (the default) a collective waits for its slowest peer: 20 × the predicted step" in section
    assert "under the 45 s floor" in section and "\n  SHOAL_STALL_TIMEOUT=10  (the default)" in section
    assert "\n  SHOAL_JOIN_TIMEOUT=600  (the default) the nodes meet before the first step" in section
    assert "\n  calibrated " in section

    # each kernel 1.5 s: a step of seconds, and timeouts of 20 and 3 steps
    slow = plan(job, ALLREDUCE, "--json", home=seeded_home(tmp_path, job, ALLREDUCE, 1.5))
    assert slow.returncode == 0, slow.stderr
    result = json.loads(slow.stdout)
    step = result["estimate"]["step_s"]
    assert step > 3 and result["recommend"]["step_s"] == step
    got = {t["setting"]: t["value"] for t in result["recommend"]["timeouts"]}
    # whole seconds, up from the tenth; never under the floors (3 steps of 3 s: the stall's 10 s floor holds)
    assert got == {"SHOAL_COMM_TIMEOUT": max(45, math.ceil(round(20 * step, 1))), "SHOAL_STALL_TIMEOUT": max(10, math.ceil(round(3 * step, 1))),
                   "SHOAL_JOIN_TIMEOUT": 600}
    assert got["SHOAL_COMM_TIMEOUT"] > 45

    # Local SGD meets every 10 steps: the collective waits for a peer's 10 local steps
    local = plan(job, LOCAL_SGD, "--json", home=seeded_home(tmp_path, job, LOCAL_SGD, 1.5))
    assert local.returncode == 0, local.stderr
    result = json.loads(local.stdout)
    comm = result["recommend"]["timeouts"][0]
    stall = result["recommend"]["timeouts"][1]
    assert comm["value"] == math.ceil(round(20 * 10 * result["estimate"]["step_s"], 1))
    assert stall["value"] == math.ceil(round(3 * 10 * result["estimate"]["step_s"], 1)) > 10 and "10 local steps (a meeting)" in comm["reason"]


def test_one_process_needs_no_timeouts(tmp_path):
    job = tmp_path / "tiny.conf"
    job.write_text(JOB)
    out = plan(job, [], home=seeded_home(tmp_path, job, [], 1e-6))
    assert out.returncode == 0, out.stderr
    assert "recommended timeouts for single worker: none (one process: no heartbeat, collective or rendezvous)" in out.stdout


def test_the_floors_are_the_runtimes_defaults(monkeypatch):
    from shoal.comm import dist, heartbeat
    from shoal.launcher.launch import join_timeout_seconds

    for name in ("SHOAL_COMM_TIMEOUT", "SHOAL_STALL_TIMEOUT", "SHOAL_JOIN_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    assert (dist.timeout_seconds(), heartbeat.stall_timeout(), join_timeout_seconds()) == pytest.approx(
        (recommend.COMM_DEFAULT_S, recommend.STALL_DEFAULT_S, recommend.JOIN_DEFAULT_S))
