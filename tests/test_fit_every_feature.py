"""shoal.fit's module path under the features each framework brings: a torch optimizer under Distributed Hogwild,
clipping by the global norm with compression over processes, rejoin, bounded lag and torchrun.

The model is test_fit_module's tiny GPT (1 layer, 32 wide, block 16) on its tiny corpus.
"""
from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fault_runs import LayoutRun as Run, runs  # noqa: F401 - the fixture that stops what a failed test left running
from layouts import LAYOUTS, assert_ran, summary
from shoal.config import job_pb2
from shoal.errors import ShoalError
from shoal.neuralnet import checkpoint
from shoal.report.metrics import read_metrics
from test_fit_module import adamw, fit, tiny_gpt, train_losses, windows
from test_fit_optim import plain_sgd, untrained_loss
from test_launchers import torchrun

HOGWILD = "Distributed Hogwild, 2 groups"
ALLREDUCE = "AllReduce, 2 processes, 2 server slices"  # both processes own slices of params


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def adamw_state(workspace, step: int) -> dict:
    """The chief's torch AdamW state in the checkpoint of `step` (fit's loop on the session saves torch's state_dict):
    each param's slots by its index."""
    from shoal.frontend.session_state import saved_optimizer_state

    return saved_optimizer_state(checkpoint.load(checkpoint.checkpoint_file(workspace, step)), 0)["state"]


def test_distributed_hogwild_groups_train_with_adamw(tmp_path):
    """Each group's process runs AdamW over its whole replica (fit's loop on the session: the group's own optimizer,
    its syncs moving values, not optimizer state); the chief's checkpoint holds group 0's moments and count."""
    data = windows()
    model, history = fit(tmp_path, "hogwild", steps=16, updater=None, optimizer=adamw, test_data=data,
                         cluster=LAYOUTS[HOGWILD].fit_cluster())
    assert_ran(tmp_path / "hogwild", HOGWILD)
    assert history.final_test["loss"] < 0.85 * untrained_loss(data)
    state = adamw_state(tmp_path / "hogwild", 16)
    assert len(state) == len(list(model.parameters()))
    for index, slots in state.items():
        assert set(slots) == {"step", "exp_avg", "exp_avg_sq"} and float(slots["step"]) == 16, index


@pytest.mark.slow  # two runs over processes: the default suite's 5-minute budget
def test_distributed_hogwild_with_adamw_resumes_with_its_state(tmp_path):
    data = windows()
    run = dict(updater=None, optimizer=adamw, cluster=LAYOUTS[HOGWILD].fit_cluster(), test_data=data)
    fit(tmp_path, "hogwild", steps=12, checkpoint_freq=12, **run)
    _, history = fit(tmp_path, "hogwild", steps=24, resume=True, **run)
    assert_ran(tmp_path / "hogwild", HOGWILD)
    assert [r["step"] for r in history.phase("train")] == list(range(12, 24))  # the History: the resumed run's own steps
    records = [json.loads(line) for line in (tmp_path / "hogwild" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("phase") == "train"] == list(range(24))  # the workspace: 12.. once, after 0..11
    assert history.final_test["loss"] < 0.8 * untrained_loss(data)
    saved, final = adamw_state(tmp_path / "hogwild", 12), adamw_state(tmp_path / "hogwild", 24)
    for name, slots in final.items():
        assert set(slots) == {"step", "exp_avg", "exp_avg_sq"}, name
        assert float(saved[name]["step"]) == 12 and float(slots["step"]) == 24, name  # the resume went on from 12
        assert slots["exp_avg_sq"].abs().sum() > 0, name


@pytest.mark.slow  # two more runs over processes: the default suite's 5-minute budget
def test_a_distributed_hogwild_group_clips_its_own_update(tmp_path):
    """Plain SGD moves a replica by lr·‖clipped g‖ ≤ 0.1 · 0.01 per update (plus what syncs bring from the other)."""
    before = flat(tiny_gpt())
    run = dict(steps=10, updater=None, optimizer=plain_sgd, cluster=LAYOUTS[HOGWILD].fit_cluster())
    clipped, _ = fit(tmp_path, "clipped", clip_grad_norm=0.01, **run)
    free, _ = fit(tmp_path, "free", **run)
    assert_ran(tmp_path / "clipped", HOGWILD)
    assert float((flat(clipped) - before).norm()) <= 2 * 10 * 0.1 * 0.01 * (1 + 1e-4)  # both groups' 10 updates
    assert float((flat(free) - before).norm()) > 20 * 10 * 0.1 * 0.01


def compressed(kind, **extra):
    cluster = LAYOUTS[ALLREDUCE].fit_cluster(**extra)
    cluster.compression = kind
    return cluster


def test_clipping_over_a_compressed_allreduce_bounds_every_applied_update(tmp_path):
    """bf16 sums: each owner scales its dense sums by the global norm's scale before encoding them, so every process
    applies one clipped step: plain SGD moves the params by at most lr · 0.01 per step (bf16 rounds by 2^-8)."""
    before = flat(tiny_gpt())
    clipped, history = fit(tmp_path, "bf16", steps=10, updater=None, optimizer=plain_sgd, clip_grad_norm=0.01,
                           cluster=compressed(job_pb2.kBF16))
    assert_ran(tmp_path / "bf16", ALLREDUCE)
    moved = float((flat(clipped) - before).norm())
    assert 0 < moved <= 10 * 0.1 * 0.01 * (1 + 2 ** -7)  # unclipped, ‖g‖ is about 1: a hundred times more


def huge_sgd(params):
    return torch.optim.SGD(params, lr=50.0)


@pytest.mark.slow  # two more runs over processes: the default suite's 5-minute budget
def test_clipping_keeps_a_top_k_allreduce_at_a_huge_learning_rate_finite(tmp_path):
    """Top-k 10 % with error feedback at lr 50: clipped to norm 0.02 it stays finite and learns; unclipped it diverges."""
    data = windows()
    run = dict(steps=20, updater=None, optimizer=huge_sgd, test_data=data, cluster=compressed(job_pb2.kTopK, topk_fraction=0.1))
    clipped, history = fit(tmp_path, "clipped", clip_grad_norm=0.02, **run)
    assert_ran(tmp_path / "clipped", ALLREDUCE)
    assert torch.isfinite(flat(clipped)).all() and history.final_test["loss"] < untrained_loss(data)
    with pytest.raises(ShoalError, match=r"Diverged: step \d+: loss is (nan|inf)"):  # unclipped: stopped as it blows up
        fit(tmp_path, "free", **run)


# -- the module path under the launcher's features: `shoal run script.py`, torchrun, rejoin ------------------------
SCRIPT = Path(__file__).with_name("module_script.py")
DOWNPOUR = "Downpour, 2 groups + 1 server, 3 processes"


def lags_of(workspace) -> tuple[dict, dict]:
    histogram = summary(workspace)["staleness_histogram"]
    return {int(lag): n for lag, n in histogram["updates_per_lag"].items()}, histogram["groups"]


def test_in_memory_module_groups_hold_updates_to_the_lag_bound(tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_SLOW_WORKER", "1.0:0+0.01")  # group 1 computes slowly: the others run ahead to the bound
    name = "in-memory Hogwild, 3 groups"
    fit(tmp_path, "lag", steps=20, updater={"type": "kSGD", "learning_rate": {"base_lr": 0.1}},
        cluster=LAYOUTS[name].fit_cluster(max_update_lag=2))
    assert_ran(tmp_path / "lag", name)
    lags, groups = lags_of(tmp_path / "lag")
    assert max(lags) <= 2 and sum(lags.values()) == 3 * 20 and groups["1"]["max"] >= 1


@pytest.mark.slow  # three processes under torchrun: the default suite's 5-minute budget
def test_torchrun_runs_a_module_script_under_downpour_with_its_lag_bounded(tmp_path):
    """torchrun starts `shoal run module_script.py` 3 times (fit's loop on the session); group 1 computes slowly (its
    loss, in process 1), and the server holds every update to max_update_lag 2 (summary.json's staleness histogram)."""
    steps = 20
    run = torchrun(3, SCRIPT, tmp_path / "ws", *LAYOUTS[DOWNPOUR].cli(max_update_lag=2), "--", "--steps", str(steps),
                   "--slow", "0.04", "--slow-rank", "1")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "started by torchrun" in run.stdout
    assert run.stdout.count(f"Trained {steps} steps in ") == 1  # rank 0 closes; the others end without a checkpoint to read
    got = assert_ran(tmp_path / "ws", DOWNPOUR)
    lags, groups = lags_of(tmp_path / "ws")
    assert max(lags) <= 2 and sum(lags.values()) == 2 * steps and groups["1"]["max"] >= 1  # the bound was reached and held
    assert got["status"] == "finished" and got["final_test"]["loss"] < 0.9 * math.log(16)


@pytest.mark.slow  # two launches: the default suite's 5-minute budget
def test_torchrun_runs_a_module_script_under_allreduce_as_one_worker(tmp_path):
    run = torchrun(2, SCRIPT, tmp_path / "torchrun", *LAYOUTS["AllReduce, 2 processes"].cli(), "--", "--steps", "8")
    assert run.returncode == 0, run.stderr[-3000:]
    assert_ran(tmp_path / "torchrun", "AllReduce, 2 processes")
    single = subprocess.run([sys.executable, "-m", "shoal", "run", str(SCRIPT), "--workspace", str(tmp_path / "single"),
                             "--", "--steps", "8"], capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    losses = lambda ws: [r["loss"] for r in read_metrics(ws / "metrics.jsonl") if r["phase"] == "train"]
    assert losses(tmp_path / "torchrun") == pytest.approx(losses(tmp_path / "single"), rel=1e-5)


@pytest.mark.slow  # 150 slowed steps, a kill and a restart: the default suite's 5-minute budget
def test_a_killed_module_group_is_restarted_and_rejoins(tmp_path, runs):
    """--max-restarts 1 under Downpour: group 1's process, killed mid-run, comes back from the server's live params."""
    run = Run(SCRIPT, tmp_path, DOWNPOUR, "--max-restarts", "1", "--", "--steps", "150", "--lr", "0.1", "--slow", "0.01")
    runs.append(run)
    os.kill(run.pid_of(1), signal.SIGKILL)
    assert run.wait(timeout=240) == 0, run.stderr()
    assert re.search(r"process 1 \(worker\(group=1, id=0\).*\) exited with code -9; restarting it", run.stderr()), run.stderr()
    assert [line for line in run.out.read_text().splitlines() if line.startswith("Worker group 1 rejoined at step ")]
    got = assert_ran(run.ws, DOWNPOUR)
    assert got["status"] == "finished" and got["final_test"]["loss"] < 0.9 * math.log(16)


def test_a_script_passes_max_restarts_to_its_jobs_and_refuses_rejoin(tmp_path, capsys):
    """--max-restarts reaches every job a script trains, as the job field its launcher reads (it was silently dropped);
    --rejoin is a job file's."""
    from shoal.frontend.cli import main

    script = tmp_path / "script.py"
    script.write_text("import torch, shoal\nx, y = torch.randn(8, 4), torch.randint(0, 2, (8,))\n"
                      "shoal.fit(torch.nn.Linear(4, 2), torch.nn.functional.cross_entropy, (x, y), batch_size=8, steps=1)\n")
    assert main(["run", str(script), "--max-restarts", "2", "--workspace", str(tmp_path / "ws")]) == 0
    assert "max_restarts: 2" in (tmp_path / "ws" / ".shoal" / "job.conf").read_text()  # the job as it ran
    assert main(["run", str(script), "--rejoin", "1"]) == 2
    err = capsys.readouterr().err
    assert "--rejoin only for job files" in err and len(err.strip().splitlines()) == 1
