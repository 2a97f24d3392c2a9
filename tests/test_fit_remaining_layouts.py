"""shoal.fit's last layouts (issue 39 point 2): which layouts of tests/layouts.py's table, with restarts or compression
added, fit runs on the session and which keep its job path (and why), and the ones moved last, driven as a user would.

- AllReduce over processes with server slices under `cluster.compression` or `cluster.max_restarts`: the replicated
  update (every process the whole optimizer state), as a user's loop runs them (fit.fit_layout's "AllReduce over
  processes"); under compression each process's bf16 residual is its own, in its own checkpoint part.
- `cluster.auto_batch_shares` over a group's threads (measured batch shares, Caffe con Troll's split): the job path's
  Trainer re-splits the batch, the session has no balancer, so fit keeps the job path for it and a user's loop is
  refused in one line (on the session it had been silently dropped: fit ran an even split and said nothing)."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import shoal
from layouts import LAYOUTS, SINGLE, Layout, assert_ran
from shoal.config import job_pb2
from shoal.frontend import api
from shoal.frontend import fit as fitting
from shoal.frontend import fit_loop
from shoal.frontend.session_start import SessionError, check_layout, plan_session, session_job
from test_fit_on_session import BATCH, STEPS, UPDATER, problem, quiet  # noqa: F401 (problem: a fixture)

SLICES = "AllReduce, 2 processes, 2 server slices"
def fit_plan(cluster: job_pb2.ClusterProto):
    """The plan fit decides its path from (fit_loop.session_plan of fit's job for this cluster)."""
    model = torch.nn.Linear(3, 2)
    job = fitting.fit_job(model, "output", batch_size=8, steps=4, test_batch=8, test_steps=0, test_freq=0, val_batch=8,
                          val_steps=0, val_freq=0, disp_freq=1, cluster=cluster, updater=UPDATER, seed=0, checkpoint_freq=0)
    return fit_loop.session_plan(job)


def test_every_row_with_restarts_or_compression_is_on_the_session():
    """Every row of the shared table, as it is and with max_restarts 1 and/or bf16 compression: fit runs it on the
    session, and the session runs it; so do Local SGD / DiLoCo's groups in one process (not a row: their own tests are
    tests/test_session_local_sgd_threads.py)."""
    kept = []
    for name, layout in LAYOUTS.items():
        for extra in ({}, dict(max_restarts=1), dict(compression=job_pb2.kBF16),
                      dict(max_restarts=1, compression=job_pb2.kBF16)):
            plan = fit_plan(layout.fit_cluster(**extra))
            if fitting.on_session(plan):
                check_layout(plan)  # (the session takes what fit gives it)
            else:
                kept.append((name, extra))
    assert kept == []
    local_sgd_in_one_process = fit_plan(shoal.Cluster(nworker_groups=2, nworkers_per_procs=2, local_steps=2))
    assert fitting.fit_layout(local_sgd_in_one_process) == "Local SGD / DiLoCo groups in one process"
    assert fitting.on_session(local_sgd_in_one_process)
    check_layout(local_sgd_in_one_process)
    for slices in (dict(max_restarts=1), dict(compression=job_pb2.kBF16), dict(compression=job_pb2.kTopK)):
        assert fitting.fit_layout(fit_plan(LAYOUTS[SLICES].fit_cluster(**slices))) == "AllReduce over processes"


def fitted(model, problem, workspace, cluster):
    train, val, _ = problem
    return shoal.fit(model, F.cross_entropy, train, val_data=val, val_freq=3, val_batch=20, steps=STEPS, batch_size=BATCH,
                     disp_freq=3, updater=UPDATER, cluster=cluster, workspace=workspace, log=quiet)


@pytest.fixture(scope="module")
def one_worker(problem, tmp_path_factory):
    model = copy.deepcopy(problem[2])
    history = fitted(model, problem, tmp_path_factory.mktemp("one"), SINGLE.fit_cluster())
    return model, history


def on_the_session(problem, workspace, cluster):
    """fit over the layout's processes, through fit_on_session (the job path's run would fail here)."""
    calls = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fit_loop, "fit_on_session", lambda *a, _on=fit_loop.fit_on_session, **k: calls.append(1) or _on(*a, **k))
        patch.setattr(api, "train", lambda *a, **k: pytest.fail("fit took its job path"))
        model = copy.deepcopy(problem[2])
        history = fitted(model, problem, workspace, cluster)
    assert calls == [1]
    assert_ran(workspace, SLICES)
    return model, history


def test_fit_over_server_slices_compressed_runs_the_replicated_update_on_the_session(problem, tmp_path, one_worker):
    """bf16 compression over 2 processes with 2 server slices: each process encodes its gradient with its own residual
    (the replicated exchange's all-gather), every process holds the whole optimizer state (no slices' state in the
    checkpoint) and its own residual in its own part; one worker's validation losses to bf16's rounding, learning."""
    model, history = on_the_session(problem, tmp_path / "ws", LAYOUTS[SLICES].fit_cluster(compression=job_pb2.kBF16))
    written = tmp_path / "ws" / "checkpoint"
    chief = load_file(str(written / f"step{STEPS}-worker0.safetensors"))
    part = load_file(str(written / f"step{STEPS}-group0-rank1.safetensors"))
    assert not any("/slices/" in key or key.startswith("exchange/slices") for key in [*chief, *part]), sorted(chief)
    residuals = [key for key in part if "residual" in key]
    assert residuals and any(part[key].abs().sum() > 0 for key in residuals), sorted(part)
    alone, alone_history = one_worker
    got, want = history.phase("validate"), alone_history.phase("validate")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [0, 3, 6, 8]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=2e-2)
    assert got[-1]["loss"] < got[0]["loss"]
    for (name, a), b in zip(model.named_parameters(), alone.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-2, msg=name)


def test_fit_over_server_slices_under_restarts_is_one_worker_on_the_session(problem, tmp_path, one_worker):
    """max_restarts 1 over 2 processes with 2 server slices (no process dies): the replicated update, one worker's
    validation losses and values to float rounding."""
    model, history = on_the_session(problem, tmp_path / "ws", LAYOUTS[SLICES].fit_cluster(max_restarts=1))
    alone, alone_history = one_worker
    got, want = history.phase("validate"), alone_history.phase("validate")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [0, 3, 6, 8]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-5, abs=1e-6)
    for (name, a), b in zip(model.named_parameters(), alone.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.equal(model[0].weight, problem[2][0].weight)


def test_fit_with_measured_batch_shares_keeps_the_job_paths_balancer(problem, tmp_path, monkeypatch, one_worker):
    """auto_batch_shares over 2 threads, worker 1 made slower per row (SHOAL_SLOW_WORKER): fit re-splits the batch
    (a line says so, the train records carry the shares) and ends on one worker's values; it never reaches the session."""
    monkeypatch.setenv("SHOAL_SLOW_WORKER", "1:0.003")
    monkeypatch.setattr(fit_loop, "fit_on_session", lambda *a, **k: pytest.fail("measured shares on the session"))
    cluster = shoal.Cluster(nworkers_per_group=2, nworkers_per_procs=2, auto_batch_shares=True, auto_batch_freq=2)
    train, val, model = problem
    balanced, lines = copy.deepcopy(model), []
    history = shoal.fit(balanced, F.cross_entropy, train, val_data=val, val_freq=3, val_batch=20, steps=STEPS,
                        batch_size=BATCH, disp_freq=1, updater=UPDATER, cluster=cluster, workspace=tmp_path / "ws",
                        log=lines.append)
    assert_ran(tmp_path / "ws", "in-memory Sandblaster, 2 threads")
    assert any(line.startswith("Batch shares from step") for line in lines), lines
    shares = [tuple(r["batch_shares"]) for r in history.phase("train")]
    assert shares[0] == (8, 8) and all(sum(s) == BATCH for s in shares) and shares[-1][0] > 8, shares
    for (name, a), b in zip(balanced.named_parameters(), one_worker[0].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_a_users_loop_with_measured_batch_shares_is_refused_in_one_line():
    cluster = shoal.Cluster(nworkers_per_group=2, nworkers_per_procs=2, auto_batch_shares=True)
    with pytest.raises(SessionError, match=r"^shoal.session: cluster.auto_batch_shares \(measured batch shares\) is not "
                                           r"supported in your own loop yet") as refused:
        check_layout(plan_session(session_job(cluster, 10, 0, 10, 0, "loop"), 1))
    assert "\n" not in str(refused.value)
    # one worker a group has nothing to re-split: the session runs it as the job path does (no balancer either)
    check_layout(plan_session(session_job(shoal.Cluster(auto_batch_shares=True), 10, 0, 10, 0, "loop"), 1))


THREADS_RESTARTS = {
    "Downpour": Layout({**LAYOUTS["Downpour, 2 groups x 2 threads + 1 server, 3 processes"].cluster, "max_restarts": 1}, 3, 4,
                       "Downpour"),
    "Local SGD": Layout(dict(nworker_groups=2, nworkers_per_group=2, nworkers_per_procs=2, local_steps=2, max_restarts=1), 2, 4,
                        "Local SGD"),
    "Distributed Hogwild": Layout({**LAYOUTS["Distributed Hogwild, 2 groups x 2 threads"].cluster, "max_restarts": 1}, 2, 4,
                                  "Distributed Hogwild"),
    "Sandblaster": Layout(dict(nworkers_per_group=4, nworkers_per_procs=2, server_worker_separate=True, max_restarts=1), 3, 4,
                          "Sandblaster"),
}


@pytest.mark.parametrize("name", THREADS_RESTARTS)
def test_fit_runs_groups_of_threads_under_restarts_on_the_session(problem, tmp_path, monkeypatch, name):
    """Downpour's, Local SGD's, Distributed Hogwild's and Sandblaster's groups of 2 threads a process under
    --max-restarts (a kill and its rejoin: tests/test_session_threads_restarts.py): fit_on_session runs them, every
    process and worker ran, and it learns; Sandblaster's group ends on one worker's values to float rounding."""
    layout = THREADS_RESTARTS[name]
    assert fitting.fit_layout(fit_plan(layout.fit_cluster())) == f"{name} over processes".replace("Local SGD", "Local SGD / DiLoCo")
    calls = []
    monkeypatch.setattr(fit_loop, "fit_on_session", lambda *a, _on=fit_loop.fit_on_session, **k: calls.append(1) or _on(*a, **k))
    monkeypatch.setattr(api, "train", lambda *a, **k: pytest.fail("fit took its job path"))
    train, val, model = problem
    fit = functools.partial(shoal.fit, loss_fn=F.cross_entropy, train_data=train, val_data=val, val_freq=4, val_batch=20,
                            steps=12, batch_size=BATCH, disp_freq=4, optimizer=functools.partial(torch.optim.AdamW, lr=2e-2),
                            log=quiet)
    trained = copy.deepcopy(model)
    history = fit(trained, cluster=layout.fit_cluster(), workspace=tmp_path / "ws")
    assert calls == [1]
    if name == "Sandblaster":  # (synchronous: one worker's values, as without restarts)
        alone = copy.deepcopy(model)
        fit(alone, workspace=tmp_path / "one")
        for (param, a), b in zip(trained.named_parameters(), alone.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=param)
    assert_ran(tmp_path / "ws", layout)
    losses = [r["loss"] for r in history.phase("validate")]
    assert [r["step"] for r in history.phase("validate")] == [0, 4, 8, 12] and losses[-1] < losses[0], losses
    assert not torch.equal(trained[0].weight, model[0].weight)
