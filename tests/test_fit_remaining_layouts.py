"""shoal.fit's last layouts (issue 39 point 2): which layouts of tests/layouts.py's table, with restarts or compression
added, fit runs on the session and which keep its job path (and why), and the ones moved last, driven as a user would.

- AllReduce over processes with server slices under `cluster.compression` or `cluster.max_restarts`: the replicated
  update (every process the whole optimizer state), as a user's loop runs them (fit.fit_layout's "AllReduce over
  processes"); under compression each process's bf16 residual is its own, in its own checkpoint part.
- `cluster.auto_batch_shares` over a group's threads (measured batch shares, Caffe con Troll's split) and a device list
  (`device=["cpu:0", "cpu:1"]`: each worker on its device): fit runs them on the session, run.batches re-splitting the
  group's batch by the job path's balancer (frontend/session_shares.py), and records what the job path's run of the same
  call records (its validation losses, its values, the "Batch shares" line and the records' `batch_shares`); a user's
  loop's slowed worker gets a smaller share."""
from __future__ import annotations

import copy
import functools
import json
import re
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import shoal
from layouts import LAYOUTS, SINGLE, Layout, assert_no_process_restarted, assert_ran
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


def fit_of(problem, workspace, cluster, log=quiet, loss=F.cross_entropy, **keywords):
    """fit's call of these tests on a copy of the problem's model: the model trained and fit's History."""
    train, val, model = problem
    trained = copy.deepcopy(model)
    history = shoal.fit(trained, loss, train, val_data=val, val_freq=3, val_batch=20, steps=STEPS,
                        batch_size=BATCH, disp_freq=1, updater=UPDATER, cluster=cluster, workspace=workspace, log=log,
                        **keywords)
    return trained, history


def through_the_session(problem, workspace, cluster, **keywords):
    """fit's call through fit_on_session (its job path would fail the test)."""
    calls = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fit_loop, "fit_on_session", lambda *a, _on=fit_loop.fit_on_session, **k: calls.append(1) or _on(*a, **k))
        patch.setattr(api, "train", lambda *a, **k: pytest.fail("fit took its job path"))
        ran = fit_of(problem, workspace, cluster, **keywords)
    assert calls == [1]
    return ran


def on_the_job_path(problem, workspace, cluster, **keywords):
    """The same call on fit's job path (module_path's layers and the Trainer), which ran these layouts before they moved:
    the numbers the session's run must record."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fitting, "on_session", lambda plan: False)
        patch.setattr(fit_loop, "fit_on_session", lambda *a, **k: pytest.fail("not the job path"))
        return fit_of(problem, workspace, cluster, **keywords)


def assert_same_run(got, want):
    """Two runs of one fit call: the same validation losses at the same steps and the same values, to float rounding
    (the split of a batch changes only the order its rows' gradients are summed in)."""
    (model, history), (other, other_history) = got, want
    losses, wanted = history.phase("validate"), other_history.phase("validate")
    assert [r["step"] for r in losses] == [r["step"] for r in wanted] == [0, 3, 6, 8]
    assert [r["loss"] for r in losses] == pytest.approx([r["loss"] for r in wanted], rel=1e-5, abs=1e-6)
    for (name, a), b in zip(model.named_parameters(), other.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def slower_on_worker_1(output, target):
    """fit's loss, 3 ms a row slower in the session's worker 1 (run.each_worker's thread): a slower device, as
    SHOAL_SLOW_WORKER makes the job path's worker 1 (a fault hook a user's loop does not take)."""
    if threading.current_thread().name == "shoal worker 1":
        time.sleep(0.003 * len(target))
    return F.cross_entropy(output, target)


def test_fit_with_measured_batch_shares_runs_the_balancer_on_the_session(problem, tmp_path, monkeypatch, one_worker):
    """auto_batch_shares over 2 threads, worker 1 made slower per row: fit runs on the session, which re-splits the batch
    as the job path did (its line, the train records' shares, worker 0 the larger share), and ends on the job path's
    run's validation losses and values, and on one worker's."""
    cluster = shoal.Cluster(nworkers_per_group=2, nworkers_per_procs=2, auto_batch_shares=True, auto_batch_freq=2)
    assert fitting.fit_layout(fit_plan(cluster)) == "one synchronous group in one process"
    runs, lines = {}, {"session": [], "job path": []}
    runs["session"] = through_the_session(problem, tmp_path / "session", cluster, log=lines["session"].append,
                                          loss=slower_on_worker_1)
    monkeypatch.setenv("SHOAL_SLOW_WORKER", "1:0.003")
    runs["job path"] = on_the_job_path(problem, tmp_path / "job", cluster, log=lines["job path"].append)
    for path, workspace in (("session", "session"), ("job path", "job")):
        assert_ran(tmp_path / workspace, "in-memory Sandblaster, 2 threads")
        said = [line for line in lines[path] if line.startswith("Batch shares from step")]
        assert said and all(re.fullmatch(r"Batch shares from step \d+: \d+ on cpu, \d+ on cpu \(measured step time per "
                                         r"worker: [\d.]+ ms \+ [\d.]+ ms/row, [\d.]+ ms \+ [\d.]+ ms/row\)", line)
                            for line in said), (path, said)
        shares = [tuple(r["batch_shares"]) for r in runs[path][1].phase("train")]
        assert len(shares) == STEPS and shares[0] == (8, 8), (path, shares)
        assert all(sum(s) == BATCH for s in shares) and shares[-1][0] > 8, (path, shares)
        # (the job path's Trainer may leave the slow worker out of a step; the session's keeps a row for its loop's body)
        assert path != "session" or all(min(s) >= 1 for s in shares), shares
    assert_same_run(runs["session"], runs["job path"])
    assert_same_run(runs["session"], one_worker)


def test_fit_on_a_cpu_device_list_runs_on_the_session(problem, tmp_path, one_worker):
    """device=["cpu:0", "cpu:1"] over a group of 2 threads (Caffe con Troll's split, each worker on its device: two CPU
    replicas here): fit runs it on the session, each worker on its device as summary.json says, and records the job
    path's run's validation losses and values, one worker's too; its train records carry the split, as the job path's."""
    cluster = shoal.Cluster(nworkers_per_group=2, nworkers_per_procs=2)
    devices = ["cpu:0", "cpu:1"]
    session = through_the_session(problem, tmp_path / "session", cluster, device=devices)
    job = on_the_job_path(problem, tmp_path / "job", cluster, device=devices)
    for workspace in ("session", "job"):
        assert assert_ran(tmp_path / workspace, "in-memory Sandblaster, 2 threads")["devices"] == devices
    assert [r["batch_shares"] for r in session[1].phase("train")] == [[8, 8]] * STEPS == \
        [r["batch_shares"] for r in job[1].phase("train")]
    assert_same_run(session, job)
    assert_same_run(session, one_worker)


def test_a_slowed_worker_gets_a_smaller_measured_share_in_a_users_loop(tmp_path):
    """A user's loop over 2 threads with auto_batch_shares, worker 1 slower per row (its loop sleeps, as a slower device
    would compute): the balancer hands worker 0 the larger share, each worker reads the rows its share says, the records
    and the line say so, and the group's steps are one worker's on the whole batch (float rounding); a resume goes on
    with the split the checkpoint holds."""
    torch.manual_seed(0)
    x = torch.randn(64, 6)
    y = (x[:, 0] > x[:, 1]).float()[:, None]
    initial = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    steps, batch, lines = 12, 16, []
    cluster = shoal.Cluster(nworkers_per_group=2, nworkers_per_procs=2, auto_batch_shares=True, auto_batch_freq=2)
    devices = ["cpu:0", "cpu:1"]  # (each worker on its device: a CPU replica of its own, as a GPU's)
    run = shoal.session(cluster, train_steps=steps, disp_freq=4, workspace=tmp_path / "ws", device=devices, log=lines.append)

    def train(worker):
        model = worker.model(copy.deepcopy(initial))
        opt = worker.optimizer(torch.optim.SGD(model.parameters(), lr=0.5))
        rows = []
        for step, (xb, yb) in worker.batches(torch.utils.data.TensorDataset(x, y), batch_size=batch, shuffle=False):
            rows.append(len(xb))
            if worker.index == 1:
                time.sleep(0.004 * len(xb))
            loss = F.binary_cross_entropy_with_logits(model(xb), yb)
            loss.backward()
            opt.step()
            opt.zero_grad()
            worker.log(step, loss=loss)
            if step + 1 == steps:
                worker.checkpoint()
        return rows, model

    (rows0, model), (rows1, _) = run.each_worker(train)
    run.close()
    assert assert_ran(tmp_path / "ws", "in-memory Sandblaster, 2 threads")["devices"] == devices
    assert [a + b for a, b in zip(rows0, rows1)] == [batch] * steps
    assert rows0[:4] == rows1[:4] == [8] * 4 and rows0[-1] > rows1[-1] >= 1, (rows0, rows1)
    assert any(re.fullmatch(r"Batch shares from step \d+: \d+ on cpu:0, \d+ on cpu:1 \(.*\)", line) for line in lines), lines
    records = [json.loads(line) for line in (tmp_path / "ws" / "metrics.jsonl").read_text().splitlines()]
    shares = [r["batch_shares"] for r in records if r["phase"] == "train"]
    assert shares[-1] == [rows0[-1], rows1[-1]], shares
    plain = copy.deepcopy(initial)
    opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    for step in range(steps):
        at = step * batch % len(x)
        F.binary_cross_entropy_with_logits(plain(x[at:at + batch]), y[at:at + batch]).backward()
        opt.step()
        opt.zero_grad()
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    resumed = shoal.session(cluster, train_steps=steps + 2, workspace=tmp_path / "ws", resume=True, device=devices, log=quiet)
    (again0, _), (again1, _) = resumed.each_worker(train)
    resumed.close()
    assert [again0[0], again1[0]] == shares[-1], (again0, again1, shares)


def test_a_users_loop_splits_its_groups_batch_as_its_list_of_shares_says(tmp_path):
    """run.batches' batch_size as one share per worker of the group (Caffe con Troll's 200 + 56 by hand: 12 + 4 here,
    each worker on a device of its own): each worker reads its share's rows, the records carry the split, the group's
    steps are one worker's on the whole batch (float rounding); a list of the wrong length is refused in one line."""
    torch.manual_seed(1)
    x = torch.randn(48, 5)
    y = (x[:, 0] - x[:, 2]).unsqueeze(1)
    initial = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
    steps, shares = 6, [12, 4]
    run = shoal.session(shoal.Cluster(nworkers_per_group=2, nworkers_per_procs=2), train_steps=steps, disp_freq=2,
                        workspace=tmp_path / "ws", device=["cpu:0", "cpu:1"], log=quiet)

    def train(worker):
        model = worker.model(copy.deepcopy(initial))
        opt = worker.optimizer(torch.optim.AdamW(model.parameters(), lr=0.05))
        rows = []
        for step, (xb, yb) in worker.batches(torch.utils.data.TensorDataset(x, y), batch_size=shares, shuffle=False):
            rows.append(len(xb))
            F.mse_loss(model(xb), yb).backward()
            opt.step()
            opt.zero_grad()
        return rows, model

    (rows0, model), (rows1, _) = run.each_worker(train)
    run.close()
    assert (rows0, rows1) == ([12] * steps, [4] * steps)
    records = [json.loads(line) for line in (tmp_path / "ws" / "metrics.jsonl").read_text().splitlines()]
    split = [r["batch_shares"] for r in records if r["phase"] == "train"]
    assert split and all(s == shares for s in split), split
    plain = copy.deepcopy(initial)
    opt = torch.optim.AdamW(plain.parameters(), lr=0.05)
    for step in range(steps):
        at = step * 16 % len(x)
        F.mse_loss(plain(x[at:at + 16]), y[at:at + 16]).backward()
        opt.step()
        opt.zero_grad()
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    wrong = shoal.session(shoal.Cluster(nworkers_per_group=2, nworkers_per_procs=2), train_steps=2,
                          workspace=tmp_path / "wrong", log=quiet)

    def three(worker):
        worker.model(torch.nn.Linear(5, 1))
        for _ in worker.batches(torch.utils.data.TensorDataset(x, y), batch_size=[8, 4, 4]):
            pass

    with pytest.raises(SessionError, match=r"^worker.batches: a batch_size list is one share per worker of the group: 2 "
                                           r"whole numbers from 1, got \[8, 4, 4\]$"):
        wrong.each_worker(three)
    wrong.close()


def test_measured_shares_refuse_a_users_loop_reading_its_own_rows_in_one_line(tmp_path):
    """worker.steps() reads rows the loop draws itself, which no balancer can re-split: refused in one line (where
    worker.batches re-splits); a group of one worker has nothing to split, and runs as without auto_batch_shares. A
    device shoal does not know is refused in one line too."""
    check_layout(plan_session(session_job(shoal.Cluster(auto_batch_shares=True), 10, 0, 10, 0, "loop"), 1))
    run = shoal.session(shoal.Cluster(nworkers_per_group=2, nworkers_per_procs=2, auto_batch_shares=True), train_steps=2,
                        workspace=tmp_path / "ws", log=quiet)

    def train(worker):
        worker.model(torch.nn.Linear(2, 1))
        for _ in worker.steps(4):
            pass

    with pytest.raises(SessionError, match=r"^worker.steps: cluster.auto_batch_shares re-splits the group's batch that "
                                           r"worker.batches reads") as refused:
        run.each_worker(train)
    assert "\n" not in str(refused.value)
    run.close()
    with pytest.raises(SessionError, match=r"^shoal.session: device 'gpu0' is not a device: give \"cpu\", \"cpu:N\" or "
                                           r"\"cuda:N\"$"):
        shoal.session(device=["cpu:0", "gpu0"], workspace=tmp_path / "bad", log=quiet)


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
        assert_no_process_restarted(tmp_path / "ws")  # (a death would make its steps the mean of the rows that came)
        alone = copy.deepcopy(model)
        fit(alone, workspace=tmp_path / "one")
        for (param, a), b in zip(trained.named_parameters(), alone.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=param)
    assert_ran(tmp_path / "ws", layout)
    losses = [r["loss"] for r in history.phase("validate")]
    assert [r["step"] for r in history.phase("validate")] == [0, 4, 8, 12] and losses[-1] < losses[0], losses
    assert not torch.equal(trained[0].weight, model[0].weight)
