"""Local SGD / DiLoCo with a torch optimizer as the outer step in a user's loop (`shoal.session(outer_optimizer=...)`,
the form of shoal.fit's `outer_optimizer=`) and shoal.fit's `outer_optimizer=` on the session: at each meeting the
groups' mean change is the outer gradient of that optimizer over the anchor, as on fit's job path. Driven as a user
would: `shoal run script.py --set cluster.…` (2 processes, one group each) and shoal.fit; both end on the job path's
params to float rounding.
"""
from __future__ import annotations

import textwrap

import pytest
import torch
from safetensors.torch import load_file

import shoal
from cli_in_process import one_line_error, run_cli
from layouts import Layout, assert_ran
from test_session_workers import shoal_run
from shoal.frontend import fit as fitting
from shoal.neuralnet import checkpoint as ckpt_io

DILOCO = Layout(dict(nworker_groups=2, local_steps=4), 2, 2, "Local SGD")  # meetings after steps 3, 7, 11
STEPS, BATCH = 12, 12


def inner(params):
    return torch.optim.AdamW(params, lr=1e-2)


def nesterov(params):
    """DiLoCo's outer optimizer (Douillard et al. 2023), on the groups' mean pseudo-gradient."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


LOOP = textwrap.dedent(f'''
    import sys
    from pathlib import Path
    import torch, shoal
    from safetensors.torch import save_file

    out = Path(sys.argv[1])
    torch.manual_seed(0)
    x = torch.randn(96, 8)
    y = (x[:, :4].sum(1, keepdim=True) > x[:, 4:].sum(1, keepdim=True)).float()
    data = torch.utils.data.TensorDataset(x, y)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    run = shoal.session(train_steps={STEPS}, disp_freq=4,
                        outer_optimizer=lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True))
    model = run.model(model)
    opt = run.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    for step, (xb, yb) in run.batches(data, batch_size={BATCH}):
        torch.nn.functional.binary_cross_entropy_with_logits(model(xb), yb).backward()
        opt.step(); opt.zero_grad(set_to_none=True)
    save_file({{k: v.contiguous() for k, v in model.state_dict().items()}}, str(out / f"rank{{run.rank}}.safetensors"))
''')


def data_and_model():
    """LOOP's data and initial model (the same seed, the same draws)."""
    torch.manual_seed(0)
    x = torch.randn(96, 8)
    y = (x[:, :4].sum(1, keepdim=True) > x[:, 4:].sum(1, keepdim=True)).float()
    return torch.utils.data.TensorDataset(x, y), torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def fitted(workspace, outer=nesterov, **options) -> torch.nn.Module:
    data, model = data_and_model()
    shoal.fit(model, torch.nn.functional.binary_cross_entropy_with_logits, data, steps=STEPS, batch_size=BATCH,
              optimizer=inner, outer_optimizer=outer, cluster=DILOCO.fit_cluster(), workspace=workspace,
              log=lambda *a: None, **options)
    return model


def on_the_job_path(monkeypatch) -> None:
    monkeypatch.setattr(fitting, "ON_SESSION", fitting.ON_SESSION - {"Local SGD / DiLoCo over processes"})


def assert_close_params(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def job_path_values(tmp_path_factory) -> dict:
    """fit's job path (its layers and Trainer) under the same layout: the values both session runs must end on."""
    mp = pytest.MonkeyPatch()
    try:
        on_the_job_path(mp)
        workspace = tmp_path_factory.mktemp("job") / "ws"
        model = fitted(workspace)
        assert not ckpt_io.load(ckpt_io.checkpoint_file(workspace, STEPS)).trainer.get("session")
    finally:
        mp.undo()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_fit_runs_diloco_with_a_torch_outer_optimizer_on_the_session_as_on_its_job_path(tmp_path, monkeypatch, job_path_values):
    """fit's outer_optimizer= runs as fit's loop on the session (fit_on_session; "Local SGD / DiLoCo over processes"),
    2 processes, and ends on the job path's params; the outer step acted (plain averaging ends elsewhere), and its
    momentum is in the checkpoint (the exchange's outer state, by param)."""
    from shoal.frontend import fit_loop

    ran = []
    monkeypatch.setattr(fit_loop, "fit_on_session", lambda *a, _on=fit_loop.fit_on_session, **k: ran.append(1) or _on(*a, **k))
    model = fitted(tmp_path / "ws")
    assert ran == [1]
    assert_ran(tmp_path / "ws", DILOCO)
    saved = ckpt_io.load(ckpt_io.checkpoint_file(tmp_path / "ws", STEPS), parts=True)
    assert saved.trainer["session"] and "updater/0.weight/outer.momentum_buffer" in saved.exchange, sorted(saved.exchange)
    assert_close_params(model.state_dict(), job_path_values)
    averaged = fitted(tmp_path / "average", outer=None)
    assert any(not torch.allclose(a, b) for a, b in zip(averaged.parameters(), model.parameters()))


def test_a_users_loop_takes_a_torch_outer_optimizer_and_ends_as_fits_job_path(tmp_path, job_path_values):
    """shoal.session(outer_optimizer=...) under `shoal run script.py --set cluster.nworker_groups=2 --set
    cluster.local_steps=4`: 2 processes ran, and each group's module (equal after the last meeting) ends on fit's job
    path's params with the same optimizers, rows and seed."""
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    proc = shoal_run(script, tmp_path, tmp_path / "ws", *DILOCO.cli())
    assert proc.returncode == 0, proc.stderr
    assert_ran(tmp_path / "ws", DILOCO)
    for rank in (0, 1):
        assert_close_params(load_file(str(tmp_path / f"rank{rank}.safetensors")), job_path_values)


def test_an_outer_optimizer_outside_local_sgd_or_beside_a_singa_one_is_refused_in_one_line(tmp_path):
    script = tmp_path / "one.py"
    script.write_text("import torch, shoal\nshoal.session(outer_optimizer=lambda p: torch.optim.SGD(p, lr=0.7))\n")
    line = one_line_error(run_cli("run", script, "--workspace", tmp_path / "ws", "--set", "cluster.nworkers_per_group=2",
                                  "--set", "cluster.nworkers_per_procs=1", cwd=tmp_path))
    assert line == "shoal.session: outer_optimizer= is Local SGD / DiLoCo's (cluster.nworker_groups > 1 with " \
                   "cluster.local_steps), not AllReduce's", line
    line = one_line_error(run_cli("run", script, "--workspace", tmp_path / "ws", *DILOCO.cli(),
                                  "--set", "cluster.outer_updater.momentum=0.9", cwd=tmp_path))
    assert "give cluster.outer_updater (SINGA's) or outer_optimizer (a torch.optim factory), not both" in line, line
