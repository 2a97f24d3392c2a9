"""shoal.SingaOptimizer: a job file's updater in a user's own loop, equal to the same updater under shoal.fit."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import shoal
from shoal.neuralnet.singa_optimizer import SingaOptimizerError

STEPS, BATCH = 12, 16
SCHEDULE = {"type": "kStep", "base_lr": 0.05, "step_conf": {"gamma": 0.5, "change_freq": 5}}
UPDATERS = {  # every built-in formula, with what SINGA prepares a gradient with: clipping, weight decay, a schedule
    "kSGD": {"type": "kSGD", "momentum": 0.9, "weight_decay": 0.01, "clip_low": -0.05, "clip_high": 0.05, "learning_rate": SCHEDULE},
    "kNesterov": {"type": "kNesterov", "momentum": 0.9, "learning_rate": SCHEDULE},
    "kAdaGrad": {"type": "kAdaGrad", "delta": 1e-6, "weight_decay": 0.01, "learning_rate": SCHEDULE},
    "kRMSProp": {"type": "kRMSProp", "delta": 1e-6, "rmsprop_conf": {"rho": 0.9}, "learning_rate": {"base_lr": 0.01}},
    "kAdaDelta": {"type": "kAdaDelta", "delta": 1e-6, "adadelta_conf": {"rho": 0.9}, "learning_rate": {"base_lr": 1.0}},
    "kAdam": {"type": "kAdam", "delta": 1e-8, "adam_conf": {"beta1": 0.9, "beta2": 0.999}, "learning_rate": SCHEDULE},
    "kAdamMax": {"type": "kAdamMax", "delta": 1e-8, "adammax_conf": {"beta1": 0.9, "beta2": 0.999}, "learning_rate": SCHEDULE},
}


def quiet(_line: str) -> None:
    pass


@pytest.fixture(scope="module")
def problem():
    torch.manual_seed(3)
    x = torch.randn(80, 6)
    y = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 0.5).long()
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))
    return x, y, model


@pytest.mark.parametrize("name", list(UPDATERS))
def test_a_users_loop_with_singas_updater_is_fit_with_it_bit_for_bit(tmp_path, problem, name):
    x, y, model = problem
    by_fit = copy.deepcopy(model)
    shoal.fit(by_fit, F.cross_entropy, (x, y), updater=UPDATERS[name], steps=STEPS, batch_size=BATCH, shuffle=False,
              workspace=tmp_path / "fit", log=quiet)

    run = shoal.session(train_steps=STEPS, workspace=tmp_path / "loop", log=quiet)
    mine = run.model(copy.deepcopy(model))
    opt = run.optimizer(shoal.SingaOptimizer(mine.parameters(), UPDATERS[name]))
    for _step, (xb, yb) in run.batches((x, y), batch_size=BATCH, shuffle=False):
        F.cross_entropy(mine(xb), yb).backward()
        opt.step()
        opt.zero_grad()
    run.close()
    for (param, a), b in zip(by_fit.named_parameters(), mine.parameters()):
        assert torch.equal(a, b), f"{name}: {param} differs from fit's by {(a - b).abs().max().item():.3g}"
    assert not torch.equal(by_fit[0].weight, model[0].weight)  # both trained


def test_its_state_dict_resumes_the_schedule_and_the_slots_exactly(problem):
    x, y, model = problem

    def steps(opt, net, count):
        for step in range(count):
            start = step * BATCH % len(x)
            F.cross_entropy(net(x[start:start + BATCH]), y[start:start + BATCH]).backward()
            opt.step()
            opt.zero_grad()

    whole = copy.deepcopy(model)
    steps(shoal.SingaOptimizer(whole.parameters(), UPDATERS["kSGD"]), whole, 8)
    part = copy.deepcopy(model)
    first = shoal.SingaOptimizer(part.parameters(), UPDATERS["kSGD"])
    steps(first, part, 4)  # the schedule's step changes at 5: the count must survive the reload
    again = shoal.SingaOptimizer(part.parameters(), UPDATERS["kSGD"])
    again.load_state_dict(first.state_dict())
    assert again.param_groups[0]["updates"] == 4
    for step in range(4, 8):
        start = step * BATCH % len(x)
        F.cross_entropy(part(x[start:start + BATCH]), y[start:start + BATCH]).backward()
        again.step()
        again.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), part.parameters()))


def test_param_groups_scale_the_learning_rate_and_the_decay():
    w, v = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = shoal.SingaOptimizer([{"params": [w]}, {"params": [v], "lr_scale": 2.0, "wd_scale": 0.0}],
                               {"type": "kSGD", "weight_decay": 0.5, "learning_rate": {"base_lr": 0.1}})
    w.grad, v.grad = torch.ones(2), torch.ones(2)
    opt.step()
    assert torch.allclose(w, torch.full((2,), 1 - 0.1 * (1 + 0.5))) and torch.allclose(v, torch.full((2,), 1 - 0.2))


@pytest.mark.parametrize("updater, says", [
    ({"type": "kSGDD"}, "updater: "),
    ({"type": "kSGD", "momentun": 0.9}, "momentun"),
    ({"type": "kAdam", "adam_conf": {"beta1": 1.5}}, "updater.adam_conf.beta1"),
    ([("type", "kSGD")], "must be a dict"),
])
def test_a_bad_updater_is_one_line_naming_the_field(updater, says):
    with pytest.raises(SingaOptimizerError, match="^shoal.SingaOptimizer: ") as caught:
        shoal.SingaOptimizer([torch.nn.Parameter(torch.ones(1))], updater)
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_a_users_loop_checkpoints_and_resumes_it_exactly(tmp_path, problem):
    """run.checkpoint() holds the slots and the update count (a param without a gradient has no state yet: the session
    makes it one); a resumed loop ends where the uninterrupted one did."""
    x, y, model = problem

    def loop(workspace, steps, resume=False, checkpoint_at=None):
        run = shoal.session(train_steps=steps, workspace=workspace, resume=resume, log=quiet)
        net = copy.deepcopy(model)
        net.register_parameter("unused", torch.nn.Parameter(torch.ones(2)))
        net = run.model(net)
        opt = run.optimizer(shoal.SingaOptimizer(net.parameters(), UPDATERS["kAdam"]))
        for step, (xb, yb) in run.batches((x, y), batch_size=BATCH):
            F.cross_entropy(net(xb), yb).backward()
            opt.step()
            opt.zero_grad()
            if step + 1 == checkpoint_at:
                run.checkpoint()
        run.close()
        return net, opt

    whole, _ = loop(tmp_path / "whole", 10)
    loop(tmp_path / "parts", 4, checkpoint_at=4)
    resumed, opt = loop(tmp_path / "parts", 10, resume=True)
    assert opt.param_groups[0]["updates"] == 10  # 4 restored from the checkpoint, then 6 more: the schedule's step
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), resumed.parameters()))


def test_servers_rebuild_it_from_its_recipe_and_each_push_carries_the_groups_update_count():
    """Downpour's and Sandblaster's servers build the user's optimizer from a JSON recipe: shoal.SingaOptimizer's updater
    travels as its fields, and its update count (what its schedule reads) in each push's hyper-parameter vector, so the
    server's schedule follows the pushing group's steps."""
    import json

    from shoal.runtime.session_exchange import (hyper_vector, optimizer_from_recipe, optimizer_recipe, recipe_layout,
                                                set_hyper)

    model = torch.nn.Linear(3, 2)
    named = list(model.named_parameters())
    mine = shoal.SingaOptimizer(model.parameters(), UPDATERS["kSGD"])
    recipe = json.loads(json.dumps(optimizer_recipe(mine, named)))  # as it travels: JSON
    shards = [(n, torch.zeros_like(p)) for n, p in named]
    theirs = optimizer_from_recipe(recipe, shards)
    assert type(theirs) is shoal.SingaOptimizer and theirs.conf == mine.conf
    for _ in range(6):  # the group's steps: its schedule halves its rate at 5
        mine.param_groups[0]["updates"] += 1
    layout = recipe_layout(recipe)
    set_hyper(theirs, hyper_vector(mine, layout), layout)
    assert theirs.param_groups[0]["updates"] == 6
    for (_, shard), (_, p) in zip(shards, named):
        shard.grad = torch.ones_like(p)
    theirs.step()  # momentum's first step: -lr x clipped gradient, at the group's step 6 (the rate halved)
    assert torch.allclose(shards[0][1], torch.full_like(shards[0][1], -0.025 * 0.05))
    recipe["updater"] = {"type": "kNoSuchUpdater"}
    with pytest.raises(ValueError, match="^Downpour server: shoal.SingaOptimizer refused the chief.s recipe: .*kNoSuchUpdater"):
        optimizer_from_recipe(recipe, shards)


SYNCHRONOUS_LOOP = """
import sys
from pathlib import Path
import torch, torch.nn.functional as F, shoal
from safetensors.torch import save_file

torch.manual_seed(3)
x = torch.randn(96, 6)
y = (x[:, 0] + x[:, 1] > 0).long()
run = shoal.session(train_steps=16)
model = run.model(torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 2)))
opt = run.optimizer(shoal.SingaOptimizer(model.parameters(), UPDATER))
for step, (xb, yb) in run.batches((x, y), batch_size=12, shuffle=False):
    F.cross_entropy(model(xb), yb).backward()
    opt.step()
    opt.zero_grad()
save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(Path(sys.argv[1]) / f"rank{run.rank}.safetensors"))
"""


@pytest.mark.slow
def test_sandblasters_servers_run_it_and_the_group_trains_as_one_worker(tmp_path):
    """`shoal run loop.py` with Sandblaster (2 workers + a server process): the server builds the SINGA updater from the
    chief's recipe, its schedule follows the group's steps, and both workers end where one worker does."""
    from safetensors.torch import load_file

    from cli_in_process import run_cli
    from layouts import LAYOUTS, assert_ran

    script = tmp_path / "loop.py"
    script.write_text(f"UPDATER = {UPDATERS['kSGD']!r}\n" + SYNCHRONOUS_LOOP)
    ended = {}
    for name in ("single worker", "Sandblaster, 2 workers + 1 server, 3 processes"):
        out, workspace = tmp_path / name.split(",")[0], tmp_path / f"ws-{name.split(',')[0]}"
        out.mkdir()
        proc = run_cli("run", str(script), "--workspace", str(workspace), *LAYOUTS[name].cli(), "--", str(out), cwd=out,
                       timeout=240)
        assert proc.returncode == 0, proc.stderr
        assert_ran(workspace, name)
        ended[name] = [load_file(str(p)) for p in sorted(out.glob("rank*.safetensors"))]
    (one,), workers = ended.values()
    assert len(workers) == 2
    for values in workers:
        for key, value in one.items():
            torch.testing.assert_close(values[key], value, rtol=1e-5, atol=1e-6)
