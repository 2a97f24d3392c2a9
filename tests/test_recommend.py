"""`shoal plan --recommend`: timeouts from the predicted step, driven through the CLI (issue 30, point 4)."""
from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from cli_in_process import run_cli

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
    kernels = all_kernels(load_job(job, sets))
    calib = Calibration(gemm_gflops={1: 10.0}, mem_gbps={1: 10.0}, load=0.2, collective_s=2e-4, **calibrate.this_machine(),
                        kernels={k: kernel_s for k in kernels})
    home = tmp_path / f"home-{kernel_s:g}"
    calibrate.save(calib, home / "calibration" / f"{socket.gethostname()}.json")
    return home


def all_kernels(proto, workers=(2,)) -> set[str]:
    """The kernels of the job and of every layout --recommend compares (so that the test measures none)."""
    return {k.key for w in workers for fields in recommend.candidate_layouts(w).values()
            for k in plan_kernels(plan_job(recommend.variant(proto, fields)))} | {k.key for k in plan_kernels(plan_job(proto))}


def plan(job: Path, sets: list[str], *args: str, home: Path, process: bool = False) -> subprocess.CompletedProcess:
    """`shoal plan JOB --recommend ARGS`: in this process (tests/cli_in_process.py), or in a real one (process=True:
    one case of the file, which proves the interpreter-level behaviour; each costs a torch import)."""
    env = {"SHOAL_HOME": str(home), "PATH": "/usr/bin:/bin"}
    args = ["plan", str(job), "--recommend", *args, *sum((["--set", s] for s in sets), [])]
    if not process:
        return run_cli(*args, env=env)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1] / "src")
    return subprocess.run([sys.executable, "-m", "shoal", *args], capture_output=True, text=True, env=env, timeout=120)


def test_cli_recommends_timeouts_from_the_predicted_step(tmp_path):
    job = tmp_path / "tiny.conf"
    job.write_text(JOB)
    # a fast step: the floors stand, and the text says so with the calibration's age beside it
    quick = plan(job, ALLREDUCE, home=seeded_home(tmp_path, job, ALLREDUCE, 1e-6), process=True)
    assert quick.returncode == 0, quick.stderr
    section = quick.stdout.split("recommended timeouts for AllReduce over 2 processes")[1]
    assert "paste into `shoal run`" in section.splitlines()[0]
    assert "\n  --set cluster.comm_timeout_s=45  (the default) a collective waits for its slowest peer: 20 × the predicted step" in section
    assert "under the 45 s floor" in section and "\n  --set cluster.stall_timeout_s=10  (the default)" in section
    assert "\n  --set cluster.join_timeout_s=600  (the default) the nodes meet before the first step" in section
    assert "\n  calibrated " in section

    # each kernel 1.5 s: a step of seconds, and timeouts of 20 and 3 steps
    slow = plan(job, ALLREDUCE, "--json", home=seeded_home(tmp_path, job, ALLREDUCE, 1.5))
    assert slow.returncode == 0, slow.stderr
    result = json.loads(slow.stdout)
    step = result["estimate"]["step_s"]
    assert step > 3 and result["recommend"]["step_s"] == step
    got = {t["setting"]: t["value"] for t in result["recommend"]["timeouts"]}
    # whole seconds, up from the tenth; never under the floors (3 steps of 3 s: the stall's 10 s floor holds)
    assert got == {"cluster.comm_timeout_s": max(45, math.ceil(round(20 * step, 1))),
                   "cluster.stall_timeout_s": max(10, math.ceil(round(3 * step, 1))), "cluster.join_timeout_s": 600}
    assert got["cluster.comm_timeout_s"] > 45
    assert [t["variable"] for t in result["recommend"]["timeouts"]] == ["SHOAL_COMM_TIMEOUT", "SHOAL_STALL_TIMEOUT", "SHOAL_JOIN_TIMEOUT"]
    # what it recommends is what a run with those --set lines plans
    pasted = load_job(job, ALLREDUCE + [f"{name}={value}" for name, value in got.items()])
    planned = plan_job(pasted, environ={})
    assert (planned.comm_timeout_s, planned.stall_timeout_s, planned.join_timeout_s) == tuple(got.values())

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


def test_the_floors_are_the_runtimes_defaults(tmp_path):
    """recommend's defaults are what a default job plans (no override in its environment), what a JobPlan built by
    hand holds, and comm's fallback for a world joined outside a job."""
    from shoal.comm import dist
    from shoal.planning.plan import JobPlan

    defaults = (recommend.COMM_DEFAULT_S, recommend.STALL_DEFAULT_S, recommend.JOIN_DEFAULT_S)
    assert defaults == (45, 10, 600)  # the values shoal always had (SHOAL_*_TIMEOUT's defaults)
    (tmp_path / "tiny.conf").write_text(JOB)
    planned = plan_job(load_job(tmp_path / "tiny.conf"), environ={})
    assert (planned.comm_timeout_s, planned.stall_timeout_s, planned.join_timeout_s) == defaults
    fields = JobPlan.__dataclass_fields__
    assert (fields["comm_timeout_s"].default, fields["stall_timeout_s"].default, fields["join_timeout_s"].default) == defaults
    assert dist.DEFAULT_TIMEOUT_S == recommend.COMM_DEFAULT_S


# -- settings: the framework, H, compression and max_update_lag (issue 30, point 4) -----------------------------------
from shoal.planning import measured_tradeoffs  # noqa: E402
from shoal.planning.estimate import Estimate, ProcessEstimate  # noqa: E402


def predicted(framework: str, samples_per_s: float, exchange_share: float, sent: int = 1000, groups: int = 1) -> Estimate:
    """An estimate of 2 processes whose step spends `exchange_share` of its time exchanging."""
    step = 64 / samples_per_s * groups
    procs = [ProcessEstimate(r, 0, sent, sent, {1 - r: [sent, sent]}, 0, 0, 0, 0) for r in range(2)]
    return Estimate(framework, framework, 2, 2, groups, 64, step, samples_per_s, "compute",
                    {"compute": step * (1 - exchange_share), "reduce": 0.0, "exchange": step * exchange_share, "update": 0.0}, [], procs)


def candidates(sync=(100, 0.05), local10=(100, 0.02), local50=(100, 0.01), downpour=(80, 0.3), **codecs) -> dict:
    est = {"sync": predicted("AllReduce", *sync), "local10": predicted("Local SGD", *local10, groups=2),
           "local50": predicted("Local SGD", *local50, groups=2), "downpour": predicted("Downpour", *downpour)}
    for key in list(est):
        for codec in ("bf16", "topk"):
            rate = codecs.get(f"{key}_{codec}", est[key].samples_per_s)
            est[f"{key}+{codec}"] = predicted(est[key].framework, rate, 0.05, groups=est[key].ngroups)
    return est


def by_setting(settings) -> dict:
    return {s.setting: s for s in settings}


def test_a_compute_bound_job_stays_synchronous_and_uncompressed():
    got = by_setting(recommend.settings(candidates(), workers=2, module=False))
    assert got["framework"].value == "AllReduce" and "cluster.nservers_per_group=2" in got["framework"].sets
    assert "the exchange is 5% of the predicted step" in got["framework"].reason and got["framework"].samples_per_s == 100
    assert got["cluster.local_steps"].value.startswith("10 ")  # H=10 already spends under 10 % exchanging
    assert got["cluster.compression"].value == "none" and got["cluster.max_update_lag"].value == "none (-1)"


def test_a_communication_bound_job_moves_to_local_sgd_at_the_smallest_measured_h_that_hides_the_exchange():
    est = candidates(sync=(100, 0.6), local10=(140, 0.3), local50=(180, 0.05))
    got = by_setting(recommend.settings(est, workers=2, module=False))
    assert got["framework"].value == "Local SGD / DiLoCo, 2 groups meeting every 50 steps"
    assert got["framework"].sets == ("cluster.nworker_groups=2", "cluster.local_steps=50", "cluster.nworkers_per_procs=1")
    assert "1.8x synchronous training's 100 samples/s" in got["framework"].reason
    assert measured_tradeoffs.LOCAL_SGD_H50.cite() in got["framework"].measured  # the accuracy side, cited
    assert got["cluster.local_steps"].value.startswith("50 ") and "H=10 spends 30%" in got["cluster.local_steps"].reason
    assert got["cluster.compression"].value == "none"  # Local SGD at H=50 spends 5 % exchanging


def test_downpour_only_when_it_is_worth_its_staleness_over_local_sgd_too():
    est = candidates(sync=(100, 0.6), local10=(140, 0.3), local50=(180, 0.05), downpour=(200, 0.1))
    assert by_setting(recommend.settings(est, workers=2, module=False))["framework"].value.startswith("Local SGD")
    est = candidates(sync=(100, 0.6), local10=(140, 0.3), local50=(180, 0.05), downpour=(230, 0.1))
    chosen = by_setting(recommend.settings(est, workers=2, module=False))
    assert chosen["framework"].value == "Downpour" and "cluster.server_worker_separate=true" in chosen["framework"].sets
    assert chosen["cluster.max_update_lag"].value == "2"  # its 2 groups: the least they allow, plus one


def test_compression_when_no_framework_is_worth_its_drift_and_never_top_k_for_a_module():
    est = candidates(sync=(100, 0.6), local10=(110, 0.3), local50=(115, 0.2), sync_topk=150, sync_bf16=120)
    net = by_setting(recommend.settings(est, workers=2, module=False))
    assert net["framework"].value == "AllReduce" and "compress instead" in net["framework"].reason
    assert net["cluster.compression"].sets == ("cluster.compression=kTopK", "cluster.topk_fraction=0.01")
    assert net["cluster.compression"].samples_per_s == 150
    assert net["cluster.compression"].measured == (measured_tradeoffs.TOPK_ALLREDUCE_MLP.cite(),)
    module = by_setting(recommend.settings(est, workers=2, module=True))["cluster.compression"]
    assert module.value == "bf16" and "not top-k: the one transformer measured lost loss" in module.reason
    assert measured_tradeoffs.TOPK_ALLREDUCE_GPT.cite() in module.measured


def test_max_update_lag_for_asynchronous_groups_is_the_least_they_allow_plus_one():
    job = predicted("Downpour", 80, 0.3, groups=3)
    lag = by_setting(recommend.settings(candidates(), workers=2, module=False, job=job))["cluster.max_update_lag"]
    assert lag.value == "3" and lag.sets == ("cluster.max_update_lag=3",) and lag.measured == (measured_tradeoffs.LAG_DOWNPOUR.cite(),)
    overlapped = recommend.settings(candidates(), workers=2, module=False, job=job, overlap_push=True)
    assert by_setting(overlapped)["cluster.max_update_lag"].value == "6"  # 2·3 − 1 outstanding, plus one


def test_the_measured_rows_are_the_benchmark_pages_figures():
    """Every figure of four decimals a recommendation cites is in docs/benchmarks.md (the issue's is in its text)."""
    import re

    page = (Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md").read_text()
    rows = [v for v in vars(measured_tradeoffs).values() if isinstance(v, measured_tradeoffs.Measured)]
    assert len(rows) >= 8
    for row in rows:
        assert re.search(r"(benchmarks/\w+\.py, 20\d\d-\d\d-\d\d|issue \d+)", row.source), row
        if row.source.startswith("benchmarks/"):
            assert row.source.split(",")[0] in page
            for figure in re.findall(r"\d\.\d{4}", row.result):
                assert figure in page, (figure, row)


def test_cli_recommends_settings_for_the_job_and_the_links(tmp_path):
    job = tmp_path / "tiny.conf"
    job.write_text(JOB)
    sets = ["--set", "train_steps=1000"]  # Local SGD's meetings are counted over the run

    def home(kernel_s: float) -> dict:
        calib = Calibration(gemm_gflops={1: 10.0}, mem_gbps={1: 10.0}, load=0.2, collective_s=2e-4, **calibrate.this_machine(),
                            kernels={k: kernel_s for k in all_kernels(load_job(job, []), workers=(2, 4))})
        calibrate.save(calib, tmp_path / f"home{kernel_s:g}" / "calibration" / f"{socket.gethostname()}.json")
        return {"SHOAL_HOME": str(tmp_path / f"home{kernel_s:g}"), "PATH": "/usr/bin:/bin"}

    # a second a kernel on this host: compute-bound, synchronous and uncompressed
    out = run_cli("plan", job, "--recommend", "--json", *sets, env=home(1.0))
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)["recommend"]
    assert r["workers"] == 2 and r["links"].startswith("this host (loopback")
    got = {s["setting"]: s for s in r["settings"]}
    assert list(got) == ["framework", "cluster.local_steps", "cluster.compression", "cluster.max_update_lag"]
    assert got["framework"]["value"] == "AllReduce" and got["framework"]["samples_per_s"] > 0
    assert got["cluster.compression"]["value"] == "none" and all(s["reason"] for s in r["settings"])
    # a microsecond a kernel, 4 hosts on slow far links: the exchange is the step, and Local SGD at the largest measured H
    far = run_cli("plan", job, "--recommend", "--hosts", "4", "--bandwidth", "0.001", "--latency", "50000", *sets, env=home(1e-6))
    assert far.returncode == 0, far.stderr
    section = far.stdout.split("recommended settings for 4 workers on 4 hosts joined by 0.001 Gbit/s, 50000 µs links:")[1]
    assert "\n  framework: Local SGD / DiLoCo, 4 groups meeting every 50 steps  (--set cluster.nworker_groups=4" in section
    assert "no larger H was measured here" in section
    assert f"\n    measured: {measured_tradeoffs.LOCAL_SGD_H50.cite()}" in section
