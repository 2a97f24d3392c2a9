"""In-memory Downpour and Hogwild with a warm-up (`cluster.warmup_steps N`, SINGA's) in a user's loop and in shoal.fit
on the session: group 0 trains alone for N steps, then the other groups start there (their schedulers at step N, and
under Downpour from the values group 0's warm-up reached), as a job file's in-memory groups do; a checkpoint the loop
asks for during the warm-up is group 0's alone (nobody waits for a group that has not started), one after it a meeting
of every group; a resume from either goes on exactly. Driven as a user would: `shoal run script.py --set cluster.…`
(the rows of tests/layouts.py) and shoal.fit.
"""
from __future__ import annotations

import json
import shutil
import textwrap

import pytest
import torch

import shoal
from layouts import LAYOUTS, assert_ran
from test_session_workers import shoal_run
from shoal.neuralnet import checkpoint as ckpt_io

DOWNPOUR = "in-memory Downpour, 2 groups"
HOGWILD = "in-memory Hogwild, 2 groups"
STEPS, WARMUP = 12, 5
LR = 1e-2

# each worker's loss and learning rate at each step it trained; checkpoints at step 2 (inside the warm-up: group 0
# alone calls it) and step 7 (after it: every group)
LOOP = textwrap.dedent(f'''
    import copy, json, sys
    from pathlib import Path
    import torch, shoal

    out = Path(sys.argv[1])
    torch.manual_seed(0)
    x = torch.randn(96, 8)
    y = (x[:, :4].sum(1, keepdim=True) > x[:, 4:].sum(1, keepdim=True)).float()
    data = torch.utils.data.TensorDataset(x, y)
    initial = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    run = shoal.session(train_steps={STEPS}, disp_freq=3)

    def train(worker):
        model = worker.model(copy.deepcopy(initial))
        opt = worker.optimizer(torch.optim.AdamW(model.parameters(), lr={LR}))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + 0.1 * step))
        seen = {{}}
        for step, (xb, yb) in worker.batches(data, batch_size=12, shuffle=False):
            seen[step] = [None, opt.param_groups[0]["lr"]]
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(xb), yb)
            loss.backward()
            opt.step(); opt.zero_grad(); sched.step()
            seen[step][0] = loss.item()
            worker.log(step, loss=loss)
            if step in (2, 7):
                worker.checkpoint()
        (out / f"group{{worker.group}}.json").write_text(json.dumps(seen))

    run.each_worker(train)
''')


def seen(out, group: int) -> dict[int, list[float]]:
    return {int(step): value for step, value in json.loads((out / f"group{group}.json").read_text()).items()}


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = tmp_path_factory.mktemp("warmup") / "loop.py"
    path.write_text(LOOP)
    return path


@pytest.fixture(scope="module")
def warm_run(script, tmp_path_factory):
    out = tmp_path_factory.mktemp("warm")
    proc = shoal_run(script, out, out / "ws", *LAYOUTS[DOWNPOUR].cli(warmup_steps=WARMUP))
    assert proc.returncode == 0, proc.stderr
    return out


def test_a_warm_up_trains_group_0_alone_then_the_others_from_its_values(warm_run):
    """The row ran; group 0 trained every step, group 1 steps 5..11 only, its schedule starting at step 5 (its lr then is
    the schedule's at 5, as a job file's group's); the checkpoint inside the warm-up (step 2) holds group 0's 3 pushes,
    the one after it (step 7) every group's 8 + 3; summary.json: group 1 was to apply 7 updates and did."""
    assert_ran(warm_run / "ws", DOWNPOUR)
    first, second = seen(warm_run, 0), seen(warm_run, 1)
    assert sorted(first) == list(range(STEPS)) and sorted(second) == list(range(WARMUP, STEPS))
    assert second[WARMUP][1] == pytest.approx(LR / (1 + 0.1 * WARMUP), rel=1e-6)
    assert first[WARMUP][1] == second[WARMUP][1]
    for step, pushes in ((3, 3), (8, 8 + 3)):
        saved = ckpt_io.load(ckpt_io.checkpoint_file(warm_run / "ws", step), parts=True)
        assert int(saved.exchange["own/count/server_updates"]) == pushes, step
    histogram = json.loads((warm_run / "ws" / "summary.json").read_text())["staleness_histogram"]
    assert {g: (c["updates"], c["expected"]) for g, c in histogram["groups"].items()} == {"0": (12, 12), "1": (7, 7)}


@pytest.mark.parametrize("at", [3, 8])
def test_a_warm_up_resumes_exactly_from_a_checkpoint_inside_it_and_after_it(script, warm_run, tmp_path, at):
    """--resume from step 3 (inside the warm-up: group 0 alone wrote it) trains group 0's steps 3..5 to the bit as the
    uninterrupted run did (its step 5 on its own copy, before group 1's pushes can reach it) and starts group 1 at step 5
    again; from step 8 (after it, a meeting of both) both groups' step 8 to the bit (each on its own copy)."""
    for name in ("ws",):
        shutil.copytree(warm_run / name, tmp_path / name)
    for step, _ in ckpt_io.list_checkpoints(tmp_path / "ws"):
        if step > at:
            ckpt_io.checkpoint_file(tmp_path / "ws", step).unlink()
    proc = shoal_run(script, tmp_path, tmp_path / "ws", "--resume", *LAYOUTS[DOWNPOUR].cli(warmup_steps=WARMUP))
    assert proc.returncode == 0, proc.stderr
    again = [seen(tmp_path, g) for g in (0, 1)]
    before = [seen(warm_run, g) for g in (0, 1)]
    assert min(again[0]) == at and min(again[1]) == max(at, WARMUP)
    exact = [(0, step) for step in range(at, WARMUP + 1)] if at < WARMUP else [(0, at), (1, at)]
    for group, step in exact:
        assert again[group][step] == before[group][step], (group, step)


def test_hogwild_with_a_warm_up_runs_in_a_users_loop(script, warm_run, tmp_path):
    """In-memory Hogwild (one copy, which the server updates in place): the same warm-up, group 0's warm-up steps to the
    bit as Downpour's (one group alone: the same pushes to the same optimizer), group 1 from step 5."""
    proc = shoal_run(script, tmp_path, tmp_path / "ws", *LAYOUTS[HOGWILD].cli(warmup_steps=WARMUP))
    assert proc.returncode == 0, proc.stderr
    assert_ran(tmp_path / "ws", HOGWILD)
    assert sorted(seen(tmp_path, 1)) == list(range(WARMUP, STEPS))
    assert [seen(tmp_path, 0)[step] for step in range(WARMUP)] == [seen(warm_run, 0)[step] for step in range(WARMUP)]
    histogram = json.loads((tmp_path / "ws" / "summary.json").read_text())["staleness_histogram"]
    assert {g: c["updates"] for g, c in histogram["groups"].items()} == {"0": 12, "1": 7}


def fitted(workspace, cluster, steps: int = STEPS, **options) -> torch.nn.Module:
    """shoal.fit of LOOP's model and data under `cluster`, AdamW with LOOP's schedule on each group's own steps."""
    torch.manual_seed(0)
    x = torch.randn(96, 8)
    y = (x[:, :4].sum(1, keepdim=True) > x[:, 4:].sum(1, keepdim=True)).float()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    shoal.fit(model, torch.nn.functional.binary_cross_entropy_with_logits, torch.utils.data.TensorDataset(x, y),
              steps=steps, batch_size=12, shuffle=False, optimizer=lambda params: torch.optim.AdamW(params, lr=LR),
              scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + 0.1 * step)),
              scheduler_steps="group", cluster=cluster, workspace=workspace, log=lambda *a: None, **options)
    return model


@pytest.mark.parametrize("row", [DOWNPOUR, HOGWILD])
def test_fit_runs_a_warm_up_on_the_session_checkpointing_during_and_after_it(tmp_path, monkeypatch, row):
    """fit's in-memory groups with a warm-up run as fit's loop on the session (fit_on_session), and its interval
    checkpoints (checkpoint_interval_s, a tiny one: one at nearly every step) never wait for a group that has not
    started: each holds the updates of its step, group 0's alone inside the warm-up, both groups' after it."""
    from shoal.frontend import fit_loop

    ran = []
    monkeypatch.setattr(fit_loop, "fit_on_session", lambda *a, _on=fit_loop.fit_on_session, **k: ran.append(1) or _on(*a, **k))
    fitted(tmp_path / "ws", LAYOUTS[row].fit_cluster(warmup_steps=WARMUP), checkpoint_interval_s=1e-6)
    assert ran == [1]
    assert_ran(tmp_path / "ws", row)
    written = [step for step, _ in ckpt_io.list_checkpoints(tmp_path / "ws")]
    assert written[-1] == STEPS and any(step < WARMUP for step in written) and len(written) >= 5, written
    for step in written:
        saved = ckpt_io.load(ckpt_io.checkpoint_file(tmp_path / "ws", step), parts=True)
        assert int(saved.exchange["own/count/server_updates"]) == step + max(0, step - WARMUP), step
    histogram = json.loads((tmp_path / "ws" / "summary.json").read_text())["staleness_histogram"]
    assert {g: (c["updates"], c["expected"]) for g, c in histogram["groups"].items()} == {"0": (12, 12), "1": (7, 7)}


def test_fit_with_a_warm_up_of_the_whole_run_ends_where_one_worker_and_the_job_path_do(tmp_path, monkeypatch):
    """A warm-up as long as the run: group 0 trains alone, so in-memory Downpour on the session ends on one worker's
    params (to float rounding: the server's AdamW from the loop's recipe), and on the job path's same layout."""
    from shoal.frontend import fit as fitting

    cluster = LAYOUTS[DOWNPOUR].fit_cluster(warmup_steps=STEPS)
    session = fitted(tmp_path / "session", cluster)
    one = fitted(tmp_path / "one", None)
    monkeypatch.setattr(fitting, "ON_SESSION", frozenset())
    job_path = fitted(tmp_path / "job", cluster)
    assert not ckpt_io.load(ckpt_io.checkpoint_file(tmp_path / "job", STEPS)).trainer.get("session")
    for theirs in (one, job_path):
        for mine, other in zip(session.parameters(), theirs.parameters()):
            torch.testing.assert_close(mine, other, rtol=1e-5, atol=1e-6)
