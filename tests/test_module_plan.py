"""`shoal plan script.py` for a shoal.fit module (issue 28, point 4): the estimate counts the module's FLOPs and bytes,
and per-layer partitioning of the opaque module is refused in one line."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_in_process import run_cli
from shoal.config import job_pb2
from shoal.frontend.module_measure import measure_module
from shoal.planning.costs import Calibration, compute_seconds
from shoal.planning.module_costs import ModuleCosts
from shoal.runtime import calibrate

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "examples" / "gpt"
CONFIG = dict(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=16)
BATCH = 4

SCRIPT = f'''
import argparse, functools, sys
import torch
import torch.nn.functional as F
sys.path.insert(0, {str(GPT)!r})
from model import GPT, GPTConfig
import shoal


def next_token_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def optimizer(params, kind):
    params = list(params)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--optimizer", default="adamw")
    args = p.parse_args()
    print("the script's own output")  # stays out of the plan
    torch.manual_seed(0)
    tokens = torch.randint(0, 16, (40, 9))
    model = GPT(GPTConfig(**{CONFIG!r}))
    shoal.fit(model, next_token_loss, (tokens[:, :-1], tokens[:, 1:]), steps=3, batch_size={BATCH},
              optimizer=functools.partial(optimizer, kind=args.optimizer))
    raise SystemExit("not reached under shoal plan")
'''


def tiny_gpt() -> torch.nn.Module:
    sys.path.insert(0, str(GPT))
    try:
        from model import GPT as Model, GPTConfig
    finally:
        sys.path.remove(str(GPT))
    return Model(GPTConfig(**CONFIG))


@pytest.fixture
def script(tmp_path) -> Path:
    path = tmp_path / "tiny_gpt.py"
    path.write_text(SCRIPT)
    return path


@pytest.fixture
def home(tmp_path) -> Path:
    """A clean calibration of this machine, so that nothing is measured (the module has no kernels to time)."""
    home = tmp_path / "home"
    calib = Calibration(gemm_gflops={1: 10.0}, mem_gbps={1: 10.0}, load=0.2, collective_s=2e-4, **calibrate.this_machine())
    calibrate.save(calib, home / "calibration" / f"{socket.gethostname()}.json")
    return home


def env(home: Path) -> dict:
    return {"SHOAL_HOME": str(home), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "src")}


def test_measured_costs_are_the_independent_counts():
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
    data = {job_pb2.kTrain: torch.utils.data.TensorDataset(torch.randn(5, 8), torch.randint(0, 3, (5,)))}
    costs = measure_module(model, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]), data)
    assert costs.fwd_flops == 2 * 8 * 4 + 2 * 4 * 3  # two matrix products (the bias adds are not counted)
    assert costs.bwd_flops == 2 * 8 * 4 + 2 * 2 * 4 * 3  # no dx into the data; dW and dx of the second
    assert costs.param_elements == costs.trained_elements == 8 * 4 + 4 + 4 * 3 + 3
    assert costs.activation_bytes >= 4 * (8 + 4)  # at least the input and the hidden layer kept for backward
    assert all(p.grad is None for p in model.parameters())  # counted on a copy


def test_module_time_is_its_flops_at_the_gemm_rate_with_its_bytes_as_floor():
    from shoal.planning.costs import module_cost
    from types import SimpleNamespace

    costs = ModuleCosts(fwd_flops=10**6, bwd_flops=2 * 10**6, activation_bytes=1000, param_elements=250, trained_elements=250, basis="")
    node = SimpleNamespace(name="model", origin="model", worker=0)
    layer = module_cost(node, 8, costs)
    assert (layer.fwd_flops, layer.bwd_flops, layer.activation_bytes) == (8 * 10**6, 16 * 10**6, 2 * 8 * 1000)
    calib = Calibration(gemm_gflops={1: 1.0}, mem_gbps={1: 1.0})
    fwd, bwd, memory = compute_seconds([layer], calib, threads=1)
    assert (fwd, bwd, memory) == pytest.approx((8e-3, 16e-3, 0.0))
    slow_memory = Calibration(gemm_gflops={1: 1.0}, mem_gbps={1: 1e-6})  # 1 kB/s: the bytes decide
    fwd, _, memory = compute_seconds([layer], slow_memory, threads=1)
    assert fwd == pytest.approx((4 * 250 + 8 * 1000) / 1e3) and memory > 0


def check_adamw_estimate(out: subprocess.CompletedProcess) -> None:
    assert out.returncode == 0, out.stderr
    assert "the script's own output" in out.stderr
    e = json.loads(out.stdout)["estimate"]
    assert (e["framework"], e["nprocs"], e["nworkers"], e["global_batch"]) == ("single worker", 1, 1, BATCH)
    n = sum(p.numel() for p in tiny_gpt().parameters())
    process, worker = e["processes"][0], e["workers"][0]
    assert process["params"] == process["gradients"] == 4 * n  # float32 params and their gradients
    assert process["updater_state"] == 2 * 4 * n  # AdamW: exp_avg and exp_avg_sq, as SINGA's two slots
    tokens = BATCH * CONFIG["block_size"]
    counted = worker["fwd_flops"] + worker["bwd_flops"]
    assert 0.5 < counted / (6 * n * tokens) < 2  # Kaplan's 6·N·tokens, with attention and the tied head
    assert worker["bwd_flops"] == pytest.approx(2 * worker["fwd_flops"], rel=0.2)
    assert process["activations"] > 0 and e["samples_per_s"] > 0
    assert any(note.startswith("module costs counted by torch.utils.flop_counter") and "AdamW keeps 2 slot(s)" in note
               for note in e["notes"])


@pytest.mark.slow  # a real process: 3 s of CPU for torch's import and the flop counter's first use
def test_cli_estimates_a_module_script_in_a_real_process(script, home):
    check_adamw_estimate(subprocess.run([sys.executable, "-m", "shoal", "plan", str(script), "--estimate", "--json"],
                                        capture_output=True, text=True, env=env(home), timeout=120))


def test_cli_estimates_a_module_script_with_its_counted_costs(script, home):
    check_adamw_estimate(run_cli("plan", script, "--estimate", "--json", env=env(home)))
    # SGD with momentum: one slot; two workers in one process, each on half the batch
    out = run_cli("plan", script, "--estimate", "--json", "--set", "cluster.nworkers_per_group=2",
                  "--set", "cluster.nworkers_per_procs=2", "--", "--optimizer", "sgd", env=env(home))
    assert out.returncode == 0, out.stderr
    e = json.loads(out.stdout)["estimate"]
    n = sum(p.numel() for p in tiny_gpt().parameters())
    assert (e["nprocs"], e["nworkers"]) == (1, 2) and [w["rows"] for w in e["workers"]] == [BATCH // 2] * 2
    assert e["processes"][0]["updater_state"] == 4 * n  # momentum: one slot
    assert any("SGD keeps 1 slot(s)" in note for note in e["notes"])


@pytest.mark.parametrize("setting, field", [
    ("neuralnet.layer[name=loss].partition_dim=1", "neuralnet.layer[1].partition_dim: partition_dim 1"),
    ("neuralnet.layer[name=loss].location=1", "neuralnet.layer[1].location: location 1"),
])
def test_per_layer_partitioning_of_a_module_is_refused_in_one_line(script, home, setting, field):
    out = run_cli("plan", script, "--set", "cluster.nworkers_per_group=2", "--set", setting, env=env(home))
    assert out.returncode == 2 and out.stdout == ""
    # the script's own line, then the refusal's one
    assert out.stderr.strip().splitlines() == ["the script's own output", out.stderr.strip().splitlines()[-1]]
    assert out.stderr.splitlines()[-1].startswith(field) and "whole torch module (shoal.fit)" in out.stderr


def test_shoal_run_refuses_it_too_before_training(script, home, tmp_path):
    out = run_cli("run", script, "--workspace", tmp_path / "ws", "--set", "cluster.nworkers_per_group=2",
                  "--set", "neuralnet.layer[name=loss].partition_dim=1", env=env(home))
    assert out.returncode == 2 and out.stderr.splitlines()[-1].startswith("neuralnet.layer[1].partition_dim: partition_dim 1")
    assert not (tmp_path / "ws" / "metrics.jsonl").exists()


def test_a_module_cut_on_its_features_is_planned_as_fit_runs_it(script, home):
    """neuralnet.partition_dim 1 for the whole net: fit cuts the module on its features over the group's processes
    (torch's tensor parallelism on the session: tests/test_fit_tensor_parallel.py), and `shoal plan` shows that layout;
    --estimate has no net of shoal's to count (the module's inside is cut by run.model), and says so in one line."""
    cut = ["--set", "cluster.nworkers_per_group=2", "--set", "neuralnet.partition_dim=1"]
    out = run_cli("plan", script, *cut, env=env(home))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("job 'fit': AllReduce, tensor-parallel, 2 process(es)") and "tensor-parallel over 2" in out.stdout
    estimate = run_cli("plan", script, "--estimate", *cut, env=env(home))
    assert estimate.returncode == 2 and estimate.stderr.strip().splitlines()[-1].startswith(
        "shoal plan: a shoal.session()'s job has no net to estimate"), estimate.stderr


def test_a_script_that_trains_nothing_says_so(tmp_path, home):
    quiet = tmp_path / "quiet.py"
    quiet.write_text("print('hello')\n")
    out = run_cli("plan", quiet, env=env(home))
    assert out.returncode == 2 and "without training a job to plan" in out.stderr


def test_plan_of_a_script_prints_the_layout_of_its_fit_call(script, home):
    out = run_cli("plan", script, "--set", "cluster.nworkers_per_group=2", "--set", "cluster.nworkers_per_procs=2", env=env(home))
    assert out.returncode == 0, out.stderr
    n = sum(p.numel() for p in tiny_gpt().parameters())
    assert out.stdout.startswith(f"job 'fit': in-memory Sandblaster, 1 process(es), {n:,} param elements")
    assert out.stdout.count("  worker (group 0, id ") == 2 and "not reached" not in out.stdout + out.stderr


def test_plan_of_a_fit_call_over_processes_is_the_sessions_that_runs_it(script, home):
    """fit over 2 processes runs as its loop on the session (the replicated update: one all-reduce of the gradients a
    step), so `shoal plan` shows that plan, not the job path's (SINGA's sliced exchange), with the module's params cut
    into its slices as the loop cuts them; --estimate still counts the module."""
    out = run_cli("plan", script, "--set", "cluster.nworkers_per_group=2", "--json", env=env(home))
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    n = sum(p.numel() for p in tiny_gpt().parameters())
    assert (got["label"], got["nprocs"], got["param_elements"]) == ("AllReduce", 2, n), got
    assert got["process_groups"] == [] and [p["rank"] for p in got["processes"]] == [0, 1], got  # (no sliced/owner group)
    assert [n.split(":")[0] for n in got["partition_notes"]] == ["replicated over 2 processes (a loop on the session"]
    assert sum(s["stop"] - s["start"] for p in got["processes"] for server in p["servers"] for s in server["slices"]) == n
    text = run_cli("plan", script, "--set", "cluster.nworkers_per_group=2", env=env(home)).stdout
    assert text.startswith(f"job 'fit': AllReduce, 2 process(es), {n:,} param elements in 1 slice(s)\n"), text
    assert text.count("server group 0: the module\n") == 2, text
    estimate = run_cli("plan", script, "--estimate", "--set", "cluster.nworkers_per_group=2", env=env(home))
    assert estimate.returncode == 0 and "module costs counted by torch.utils.flop_counter" in estimate.stdout, estimate.stderr
