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
