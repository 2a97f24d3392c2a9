"""shoal.fit's Downpour over processes (2 groups, one worker per process, a server process: 3 processes) as fit's loop on
the session (frontend/fit_loop.py, issue 39 point 2): the layout goes there, its records and summary.json (the staleness
histogram too) have the job path's shape, scheduler_steps="group" and "update" apply the job path's learning rates
(run.scheduler(s, steps=...): each group's own steps, or the servers' update count), and a resume goes on exactly.

The loss is the sum of the params: its gradient is 1 for every element whatever the batch and the values, so every
update of plain SGD moves every element by exactly its learning rate (SGD with momentum: by it times the momentum
buffer), and the trained values say which learning rates the servers applied, however the groups interleaved.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import shoal
from layouts import LAYOUTS, assert_ran, summary
from shoal.frontend import fit as fitting
from shoal.frontend import fit_loop
from shoal.neuralnet import checkpoint as ckpt_io
from shoal.report.metrics import read_metrics

LAYOUT = "Downpour, 2 groups + 1 server, 3 processes"
STEPS, BATCH, LR = 6, 8, 0.01


def data(n=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def summed(model, batch):
    """Every param's sum: a gradient of 1 for every element, whatever the batch and the values."""
    return sum(p.sum() for p in model.parameters())


def rising(position: int) -> float:
    return 1.0 + position


def rising_schedule(optimizer):
    """A LambdaLR at LR·(1 + position): the learning rate an update had says the position it was applied at."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, rising)


def plain_sgd(params):
    return torch.optim.SGD(params, lr=LR)


def momentum_sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def module():
    torch.manual_seed(0)
    return nn.Linear(4, 3)


def fitted(tmp_path, name, *, steps=STEPS, scheduler_steps="update", optimizer=plain_sgd, loss=summed, **keywords):
    model, lines = module(), []
    history = shoal.fit(model, loss, data(), steps=steps, batch_size=BATCH, optimizer=optimizer, scheduler=rising_schedule,
                        scheduler_steps=scheduler_steps, cluster=LAYOUTS[LAYOUT].fit_cluster(), workspace=tmp_path / name,
                        log=lines.append, **keywords)
    return model, history, lines


def on_the_job_path(monkeypatch):
    monkeypatch.setattr(fitting, "ON_SESSION", fitting.ON_SESSION - {"Downpour over processes"})


def moved(model) -> torch.Tensor:
    """How far every element went from the module's initial values (they all move alike)."""
    return torch.cat([(p.detach() - q.detach()).reshape(-1) for p, q in zip(module().parameters(), model.parameters())])


def test_fit_names_downpour_over_processes_for_the_session():
    """One worker (or several threads of its group) in each group's process and servers in processes of their own, on
    the CPU: the session's (2 server slices too)."""
    from test_fit_on_session import plan_of

    assert "Downpour over processes" in fitting.ON_SESSION
    assert fitting.fit_layout(plan_of(**LAYOUTS[LAYOUT].cluster)) == "Downpour over processes"
    assert fitting.fit_layout(plan_of(**LAYOUTS[LAYOUT].cluster, nservers_per_group=2)) == "Downpour over processes"
    threads = LAYOUTS["Downpour, 2 groups x 2 threads + 1 server, 3 processes"].cluster
    assert fitting.fit_layout(plan_of(**threads)) == "Downpour over processes"
    sandblaster = LAYOUTS["Sandblaster, 2 workers + 1 server, 3 processes"].cluster  # (its own name: one group)
    assert fitting.fit_layout(plan_of(**sandblaster)) == "Sandblaster over processes"


def test_fit_trains_downpour_through_its_loop_with_the_job_paths_records_and_staleness(tmp_path, monkeypatch):
    """fit_on_session ran the layout (3 processes: 2 groups and the server, which applied each group's STEPS pushes);
    the train records have the job path's fields (the job's samples, staleness, pushed bytes; not the Trainer's
    worker_compute_sec), summary.json the job path's keys and a staleness histogram of its shape (every group's
    updates, as many as it was to apply), and fit's log= the chief's staleness line."""
    ran = []
    monkeypatch.setattr(fit_loop, "fit_on_session", lambda *a, _on=fit_loop.fit_on_session, **k: ran.append(1) or _on(*a, **k))
    test = dict(test_data=data(32, seed=2), test_batch=16, disp_freq=2)
    _, history, lines = fitted(tmp_path, "session", **test)
    assert ran == [1]
    assert_ran(tmp_path / "session", LAYOUT)
    assert ckpt_io.load(ckpt_io.checkpoint_file(tmp_path / "session", STEPS)).trainer["session"]  # the loop's checkpoint
    server = (tmp_path / "session" / "logs" / "rank2.log").read_text()
    assert f"version {2 * STEPS}; updates applied: group 0: {STEPS}, group 1: {STEPS}" in server, server
    assert any(line.startswith(f"Staleness: {2 * STEPS} updates, lag at most ") for line in lines), lines
    assert history.final_test is not None

    on_the_job_path(monkeypatch)
    fitted(tmp_path, "job", **test)
    assert ran == [1]
    records = {path: read_metrics(tmp_path / path / "metrics.jsonl") for path in ("session", "job")}
    keys = {path: {k for r in rs if r["phase"] == "train" for k in r} for path, rs in records.items()}
    assert keys["session"] == keys["job"] - {"worker_compute_sec"}, keys
    assert {"samples", "staleness", "staleness_max", "pushed_bytes"} <= keys["session"]
    for path in ("session", "job"):  # every group's rows: the job's samples over the run are both groups' steps'
        assert sum(r["samples"] for r in records[path] if r["phase"] == "train") <= 2 * STEPS * BATCH
    got = {path: summary(tmp_path / path) for path in ("session", "job")}
    assert set(got["session"]) == set(got["job"])
    for path, one in got.items():
        histogram = one["staleness_histogram"]
        assert sum(histogram["updates_per_lag"].values()) == 2 * STEPS, (path, histogram)
        assert set(histogram["groups"]) == {"0", "1"}
        for counts in histogram["groups"].values():
            assert set(counts) == {"updates", "mean", "max", "updates_per_lag", "expected"}
            assert counts["updates"] == counts["expected"] == STEPS
        assert "missed_updates" not in one


def test_a_singa_updaters_momentum_is_compensated_at_the_servers_as_a_job_files(tmp_path, monkeypatch):
    """A SINGA updater with momentum 0.5 under Downpour's 2 groups: the servers run it with momentum 1 - 2·(1 - 0.5) = 0,
    as a job file's servers do (cluster.async_momentum), and the chief says so in the job file's line. With a loss whose
    gradient is 1 everywhere, plain SGD moves every value by LR at each of the 2·STEPS updates: momentum would move it
    further (the session's servers had run the updater uncompensated, silently)."""
    ran = []
    monkeypatch.setattr(fit_loop, "fit_on_session", lambda *a, _on=fit_loop.fit_on_session, **k: ran.append(1) or _on(*a, **k))
    lines, model = [], module()
    shoal.fit(model, summed, data(), steps=STEPS, batch_size=BATCH, cluster=LAYOUTS[LAYOUT].fit_cluster(),
              updater={"type": "kSGD", "momentum": 0.5, "learning_rate": {"base_lr": LR}}, workspace=tmp_path / "ws",
              log=lines.append)
    assert ran == [1]
    assert [line for line in lines if line.startswith("updater.momentum")] == [
        "updater.momentum 0.5 -> 0 at the servers: 2 asynchronous groups add momentum of their own "
        "(cluster.async_momentum: kAsConfigured keeps the job's)"]
    torch.testing.assert_close(moved(model), torch.full_like(moved(model), LR * 2 * STEPS), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("steps_by, positions", [("group", [s for s in range(STEPS) for _ in range(2)]),
                                                 ("update", list(range(2 * STEPS)))])
def test_a_schedule_follows_each_groups_steps_or_the_servers_updates_as_asked(tmp_path, steps_by, positions):
    """scheduler_steps="group": each group's pushes have the learning rates of its own steps 0 .. STEPS-1 (its
    scheduler, read back from its part of the checkpoint, ends at its STEPS steps); "update" (fit's default): the
    servers' updates 0 .. 2·STEPS-1, so the values move further (LR · 78 against LR · 42 here)."""
    model, _, _ = fitted(tmp_path, steps_by, scheduler_steps=steps_by)
    expected = LR * sum(rising(p) for p in positions)
    torch.testing.assert_close(moved(model), torch.full_like(moved(model), expected), rtol=1e-5, atol=1e-6)
    final = ckpt_io.load(ckpt_io.checkpoint_file(tmp_path / steps_by, STEPS), parts=True)
    for state in [final, *final.parts.values()]:  # group 0's (the chief's file) and group 1's (its part)
        (scheduler,) = state.trainer["schedulers"]
        assert scheduler["last_epoch"] == STEPS and scheduler["_last_lr"] == [pytest.approx(LR * rising(STEPS))]
    assert len(final.parts) == 1


@pytest.mark.slow  # two more runs of 3 processes
@pytest.mark.parametrize("steps_by, positions", [("group", [s for s in range(STEPS) for _ in range(2)]),
                                                 ("update", list(range(2 * STEPS)))])
def test_the_job_path_applies_the_same_learning_rates(tmp_path, monkeypatch, steps_by, positions):
    on_the_job_path(monkeypatch)
    model, _, _ = fitted(tmp_path, steps_by, scheduler_steps=steps_by)
    assert summary(tmp_path / steps_by)["staleness_histogram"]  # (the job path's run)
    expected = LR * sum(rising(p) for p in positions)
    torch.testing.assert_close(moved(model), torch.full_like(moved(model), expected), rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # three runs of 3 processes (26 s on a loaded machine: the suite's budget)
def test_a_resumed_run_goes_on_from_the_servers_state_and_update_count(tmp_path):
    """SGD with momentum under a schedule by update: STEPS steps, then resumed to 2·STEPS, ends where 2·STEPS steps
    in one run do (every update's learning rate and momentum buffer the same: the servers' state and their update
    count, 2·STEPS at the checkpoint, restored as the job path restores them)."""
    whole, _, _ = fitted(tmp_path, "whole", steps=2 * STEPS, optimizer=momentum_sgd)
    fitted(tmp_path, "parts", steps=STEPS, optimizer=momentum_sgd)
    saved = ckpt_io.load(ckpt_io.checkpoint_file(tmp_path / "parts", STEPS))
    assert saved.exchange["updater/weight/momentum_buffer"].shape == (3, 4)  # the servers' state, in the loop's file
    resumed, history, _ = fitted(tmp_path, "parts", steps=2 * STEPS, optimizer=momentum_sgd, resume=True)
    assert history.phase("train")[0]["step"] >= STEPS
    torch.testing.assert_close(moved(resumed), moved(whole), rtol=1e-6, atol=1e-7)
    buffer = 0.0  # the momentum buffer of every element after each of the 4·STEPS updates, at LR·(1 + update count)
    expected = 0.0
    for version in range(4 * STEPS):
        buffer = 0.9 * buffer + 1.0 if version else 1.0
        expected += LR * rising(version) * buffer
    torch.testing.assert_close(moved(whole), torch.full_like(moved(whole), expected), rtol=1e-5, atol=1e-6)
    histogram = summary(tmp_path / "parts")["staleness_histogram"]
    assert {g: c["updates"] for g, c in histogram["groups"].items()} == {"0": STEPS, "1": STEPS}  # this run's
    assert {g: c["expected"] for g, c in histogram["groups"].items()} == {"0": STEPS, "1": STEPS}


def test_run_scheduler_steps_is_checked_in_one_line(tmp_path):
    from shoal.frontend.session_start import SessionError

    run = shoal.session(train_steps=2, workspace=tmp_path / "ws", log=lambda line: None)
    model = run.model(nn.Linear(4, 3))
    opt = run.optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(SessionError, match="run.scheduler: steps is 'group' .* or 'update' .*, got 'epoch'"):
        run.scheduler(rising_schedule(opt), steps="epoch")
    assert run.scheduler(rising_schedule(opt), steps="update")  # one worker: every update is the group's step
    run.close()


IN_MEMORY = "in-memory Downpour, 2 groups"


@pytest.mark.parametrize("steps_by, positions", [("group", [s for s in range(STEPS) for _ in range(2)]),
                                                 ("update", list(range(2 * STEPS)))])
def test_in_memory_groups_follow_the_schedule_as_asked(tmp_path, steps_by, positions):
    """The loop's own calls under in-memory Downpour (2 groups as threads, one in-process server): run.scheduler's
    steps= picks which learning rates the server applies, as over processes."""
    initial = module()

    def train(worker):
        import copy

        model = worker.model(copy.deepcopy(initial))
        opt = worker.optimizer(torch.optim.SGD(model.parameters(), lr=LR))
        sched = worker.scheduler(rising_schedule(opt), steps=steps_by)
        for step, batch in worker.batches(torch.utils.data.TensorDataset(*data()), batch_size=BATCH):
            summed(model, batch).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
        return model

    run = shoal.session(LAYOUTS[IN_MEMORY].fit_cluster(), train_steps=STEPS, workspace=tmp_path / "ws", log=lambda line: None)
    models = run.each_worker(train)
    run.close()
    expected = LR * sum(rising(p) for p in positions)
    last = max(models, key=lambda model: float(moved(model).mean()))  # (the copy of the group that pushed last)
    torch.testing.assert_close(moved(last), torch.full_like(moved(last), expected), rtol=1e-5, atol=1e-6)


def test_a_schedule_by_update_is_refused_after_the_loop_began_or_over_another_optimizer(tmp_path):
    from shoal.frontend.session_start import SessionError

    def train(worker):
        model = worker.model(nn.Linear(4, 3) if worker.index else module())
        opt = worker.optimizer(torch.optim.SGD(model.parameters(), lr=LR))
        if worker.index == 0:
            other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=LR)
            with pytest.raises(SessionError, match="steps='update' schedules the optimizer given to run.optimizer"):
                worker.scheduler(rising_schedule(other), steps="update")
        sched = rising_schedule(opt)
        for step, batch in worker.batches(torch.utils.data.TensorDataset(*data()), batch_size=BATCH):
            if step == 1 and worker.index == 0:
                with pytest.raises(SessionError, match="takes the scheduler as made .*, before the loop"):
                    worker.scheduler(sched, steps="update")
            summed(model, batch).backward()
            opt.step()
            opt.zero_grad()
            sched.step()

    run = shoal.session(LAYOUTS[IN_MEMORY].fit_cluster(), train_steps=2, workspace=tmp_path / "ws", log=lambda line: None)
    run.each_worker(train)
    run.close()


def test_a_schedule_by_update_is_worked_out_put_back_and_travels_as_plain_json():
    """The chief's rows: the columns the scheduler moves (lr of both param groups here, not the momentum), one row per
    position; the scheduler and its optimizer are put back as they were (position 0, the lr, the scheduler's state);
    the rows cross as JSON and a server refuses, in one line, rows that do not fit its pushes."""
    from shoal.runtime import session_exchange as se

    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1))
    opt = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.5}], lr=LR,
                          momentum=0.9)
    layout = se.hyper_layout(opt)
    sched = rising_schedule(opt)
    before = (sched.state_dict(), [dict((k, v) for k, v in g.items() if k != "params") for g in opt.param_groups])
    schedule = se.update_schedule(sched, layout, 5)
    assert (sched.state_dict(), [dict((k, v) for k, v in g.items() if k != "params") for g in opt.param_groups]) == before
    assert [layout[c][:2] for c in schedule.columns] == [(0, "lr"), (1, "lr")]
    assert schedule.rows.tolist() == [[LR * rising(p), 0.5 * rising(p)] for p in range(5)]
    vector = se.hyper_vector(opt, layout)
    received = se.UpdateSchedule.from_text(schedule.as_text(), len(vector))
    assert torch.equal(received.rows, schedule.rows) and received.columns == schedule.columns
    assert received.at(vector, 3)[schedule.columns].tolist() == [LR * 4, 0.5 * 4]
    assert received.at(vector, 99)[schedule.columns].tolist() == [LR * 5, 0.5 * 5]  # (past the last: the last)
    with pytest.raises(se.RecipeError, match="does not fit its pushes"):
        se.UpdateSchedule.from_text(schedule.as_text(), 1)
    with pytest.raises(se.RecipeError, match="not readable"):
        se.UpdateSchedule.from_text('{"columns": [0]}', len(vector))
