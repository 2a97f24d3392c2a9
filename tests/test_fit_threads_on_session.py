"""shoal.fit with several workers of one synchronous group in one process (`nworkers_per_group=2, nworkers_per_procs=2`,
the CPU) runs as fit_loop's loop on the session (issue 39, point 2): `run.each_worker` runs the loop's body once per
worker, each in a thread. The layout really ran 2 workers (summary.json, the threads the loss ran in, their rows), it
records the validation and test losses and ends with the params of one worker with the whole batch and of fit's job
path for the same call, to float rounding, with every fit feature on (grad_accum_steps, clip_grad_norm, a scheduler,
metrics callables, checkpoint_interval_s), and a run stopped mid-way resumes from its checkpoint exactly."""
from __future__ import annotations

import copy
import functools
import json
import threading

import pytest
import torch
import torch.nn.functional as F

import shoal
from shoal.frontend import fit as fitting
from shoal.frontend import fit_loop
from shoal.neuralnet import checkpoint as ckpt_io
from shoal.neuralnet.checkpoint import list_checkpoints

STEPS, BATCH = 8, 16
THREADS = dict(nworkers_per_group=2, nworkers_per_procs=2)


@pytest.fixture(scope="module")
def problem():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(80, 6, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 0.5).long()
    xv = torch.randn(40, 6, generator=g)
    yv = (xv[:, 0] + xv[:, 1] > 0).long()
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))
    return (x, y), (xv, yv), model


def wrong(output, target):
    """A metric callable: the batch's share of wrong answers."""
    return (output.argmax(1) != target).float().mean()


def features(val, lines):
    return dict(val_data=val, test_data=val, val_freq=3, test_freq=4, val_batch=20, test_batch=20, steps=STEPS,
                batch_size=BATCH, disp_freq=3, optimizer=lambda params: torch.optim.AdamW(params, lr=2e-2),
                scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (1 + 0.2 * step)),
                clip_grad_norm=0.3, grad_accum_steps=2, metrics={"wrong": wrong}, log=lines.append)


def evaluations(history):
    return [(r["phase"], r["step"], r["samples"]) for r in history.records if r["phase"] in ("validate", "test")]


def values(history, phase, *names):
    return [r[name] for r in history.phase(phase) for name in names]


def test_fit_on_two_threads_runs_the_session_loop_as_one_worker_and_as_the_job_path(tmp_path, problem, monkeypatch):
    train, val, model = problem
    ran, calls = [], []
    monkeypatch.setattr(fit_loop, "run_fit", lambda run, spec, log=print, _run_fit=fit_loop.run_fit:
                        ran.append((run.label, run.local_workers)) or _run_fit(run, spec, log))

    def loss(output, target):  # (one process: a closure is fine) which thread trained on how many rows
        if torch.is_grad_enabled():
            calls.append((threading.current_thread().name, len(target)))
        return F.cross_entropy(output, target)

    threads_lines = []
    threads = copy.deepcopy(model)
    history = shoal.fit(threads, loss, train, cluster=shoal.Cluster(**THREADS), workspace=tmp_path / "threads",
                        checkpoint_interval_s=1e-6, **features(val, threads_lines))
    assert ran == [("in-memory Sandblaster", 2)]  # fit went through fit_loop's loop, on a session of 2 local workers
    summary = json.loads((tmp_path / "threads" / "summary.json").read_text())
    assert (summary["status"], summary["processes"], summary["workers"]) == ("finished", 1, 2)
    # 2 worker threads (not the main one), each its 8 rows of a step as 2 micro-batches of 4 (grad_accum_steps=2)
    assert sorted({name for name, _ in calls}) == ["shoal worker 0", "shoal worker 1"]
    assert {rows for _, rows in calls} == {4} and len(calls) == STEPS * 2 * 2
    assert [r["samples"] for r in history.phase("train")] == [16, 48, 48, 16]  # both workers' rows counted
    # checkpoint_interval_s: every worker agreed at every step (a checkpoint is a meeting of them all), said once
    assert [step for step, _ in list_checkpoints(tmp_path / "threads")] == list(range(1, STEPS + 1))
    assert sum("Checkpoint written" in line for line in threads_lines) == STEPS

    one = copy.deepcopy(model)
    alone = shoal.fit(one, F.cross_entropy, train, workspace=tmp_path / "one", **features(val, []))
    assert ran[-1] == ("single worker", 1)

    monkeypatch.setattr(fitting, "ON_SESSION", frozenset())
    on_the_job_path = copy.deepcopy(model)
    job = shoal.fit(on_the_job_path, F.cross_entropy, train, cluster=shoal.Cluster(**THREADS), workspace=tmp_path / "job",
                    **features(val, []))
    assert len(ran) == 2  # (the job path: not fit_loop)

    assert evaluations(history) == evaluations(alone) == evaluations(job) == [
        ("validate", 0, 40), ("test", 0, 40), ("validate", 3, 40), ("test", 4, 40), ("validate", 6, 40),
        ("validate", 8, 40), ("test", 8, 40)]
    for phase in ("validate", "test"):  # the group's mean gradient is one worker's, to float rounding
        mine = values(history, phase, "loss", "wrong")
        assert mine == pytest.approx(values(alone, phase, "loss", "wrong"), rel=1e-5, abs=1e-6)
        assert mine == pytest.approx(values(job, phase, "loss", "wrong"), rel=1e-5, abs=1e-6)
    assert values(history, "train", "loss") == pytest.approx(values(alone, "train", "loss"), rel=1e-5)
    for (name, a), b, c in zip(threads.named_parameters(), one.parameters(), on_the_job_path.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6) and torch.allclose(a, c, rtol=1e-5, atol=1e-6), name
    assert not torch.equal(threads[0].weight, model[0].weight)  # trained, in place


class Stop(RuntimeError):
    pass


def test_fit_on_two_threads_resumes_a_stopped_run_exactly(tmp_path, problem):
    """Worker 1 fails in step 5 (its 11th loss): fit raises its error; resumed from the checkpoint after step 3
    (worker 0's replica, AdamW's moments, the LambdaLR, the data position, fit's val_steps cursor), both workers go on
    and the run ends where the uninterrupted one did, to the bit: the same validations and params."""
    train, val, model = problem
    keywords = dict(val_data=val, val_freq=2, val_batch=10, val_steps=1, steps=STEPS, batch_size=BATCH, checkpoint_freq=4,
                    optimizer=lambda params: torch.optim.AdamW(params, lr=2e-2), clip_grad_norm=0.3, grad_accum_steps=2,
                    scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (1 + 0.2 * step)),
                    cluster=shoal.Cluster(**THREADS), log=lambda _line: None)
    whole = copy.deepcopy(model)
    uninterrupted = shoal.fit(whole, F.cross_entropy, train, workspace=tmp_path / "whole", **keywords)

    seen = []

    def failing(output, target):
        if threading.current_thread().name == "shoal worker 1":
            seen.append(1)
            if len(seen) == 11:
                raise Stop("worker 1 stops in step 5")
        return F.cross_entropy(output, target)

    with pytest.raises(Stop):
        shoal.fit(copy.deepcopy(model), failing, train, workspace=tmp_path / "parts", **keywords)
    assert [step for step, _ in list_checkpoints(tmp_path / "parts")] == [4]  # (the stopped run's: after step 3)
    resumed_model = copy.deepcopy(model)
    resumed = shoal.fit(resumed_model, F.cross_entropy, train, workspace=tmp_path / "parts", resume=True, **keywords)
    assert resumed.phase("train")[0]["step"] >= 4  # this run's records only
    later = [(r["step"], r["loss"]) for r in uninterrupted.phase("validate") if r["step"] >= 4]
    assert [(r["step"], r["loss"]) for r in resumed.phase("validate")] == later
    assert len({loss for _, loss in later}) > 1  # the cursor moved: different rows at each validation
    assert [r["loss"] for r in resumed.phase("train")][-1] == [r["loss"] for r in uninterrupted.phase("train")][-1]
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), resumed_model.parameters()))
    assert json.loads((tmp_path / "parts" / "summary.json").read_text())["workers"] == 2


# threads of one group in each of several processes: (cluster, the reference fit of the same group with one worker per
# group, or None where the groups are asynchronous and the pushes' order is the machine's)
OVER_PROCESSES = {
    "AllReduce, 2 processes x 2 threads": (dict(nworkers_per_group=4, nworkers_per_procs=2), {}),
    "Sandblaster, 2 threads + 1 server process": (dict(nworkers_per_group=2, nworkers_per_procs=2, nservers_per_procs=1,
                                                       server_worker_separate=True), {}),
    "Local SGD, 2 groups x 2 threads, 2 processes": (dict(nworker_groups=2, nworkers_per_group=2, nworkers_per_procs=2,
                                                          local_steps=3),
                                                     dict(nworker_groups=2, nworkers_per_procs=1, local_steps=3)),
    "Downpour, 2 groups x 2 threads + 1 server, 3 processes": (dict(nworker_groups=2, nworkers_per_group=2,
                                                                    nworkers_per_procs=2, server_worker_separate=True), None),
}


@pytest.mark.parametrize("name", list(OVER_PROCESSES))
def test_fit_runs_threads_over_processes_on_the_session(tmp_path, problem, name):
    """fit with several threads of one group in each process runs its loop on the session (its checkpoint is the
    session's), the layout ran (processes and workers), and a synchronous group ends where one worker of the group with
    the whole batch does (a Local SGD group of 2 threads where its group of one worker does), to float rounding; the
    asynchronous groups learn."""
    train, val, model = problem
    cluster, reference = OVER_PROCESSES[name]
    keywords = dict(steps=STEPS, batch_size=BATCH, optimizer=functools.partial(torch.optim.SGD, lr=0.2),
                    log=lambda _line: None)
    threads = copy.deepcopy(model)
    shoal.fit(threads, F.cross_entropy, train, cluster=shoal.Cluster(**cluster), workspace=tmp_path / "threads", **keywords)
    summary = json.loads((tmp_path / "threads" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["processes"] >= 2
    assert summary["workers"] == cluster.get("nworker_groups", 1) * cluster["nworkers_per_group"]
    final = list_checkpoints(tmp_path / "threads")[-1][1]
    assert ckpt_io.load(final).trainer.get("session")  # (fit's loop on the session wrote it)
    if reference is None:
        with torch.no_grad():
            assert F.cross_entropy(threads(train[0]), train[1]) < F.cross_entropy(model(train[0]), train[1])
        return
    one = copy.deepcopy(model)
    shoal.fit(one, F.cross_entropy, train, cluster=shoal.Cluster(**reference) if reference else None,
              workspace=tmp_path / "one", **keywords)
    for (param, a), b in zip(threads.named_parameters(), one.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), param
