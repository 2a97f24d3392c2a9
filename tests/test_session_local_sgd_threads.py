"""Local SGD / DiLoCo's groups as threads of one process on the session (issue 39): `shoal.Cluster(nworker_groups=2,
nworkers_per_procs=..., local_steps=...)` with every group in one process runs a user's loop through `run.each_worker`
(one thread per worker of each group) and `shoal.fit` through its loop on the session (`fit.ON_SESSION`). Each group
trains its own replicas with its own optimizers and every local_steps steps the groups meet in memory (each group's
PeriodicExchange, the strategy's InMemoryMeeting: the mean change, then the outer step), as the same groups over
processes meet in an all-reduce. With 2 groups the sum of their changes is the same sum (a + b) either way, so the
threads end on the processes' values and validation losses to the bit, and on fit's job path's for the same call (whose
in-memory groups these semantics are). A checkpoint holds every group's state: the
chief's file group 0's (module, AdamW's moments, the anchor and the outer optimizer's momentum), and each other group's
part its own (its values, optimizer and anchor; the data position is the step's, each group reading its own shard),
so a resume mid-round ends where the uninterrupted run does, to the bit."""
from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import shoal
from layouts import Layout, assert_ran
from shoal.frontend import api
from shoal.frontend import fit as fitting
from shoal.frontend import fit_loop
from shoal.neuralnet import checkpoint as ckpt_io
from test_session_workers import LOOP, shoal_run, train_records

STEPS, BATCH = 8, 16  # fit's: meetings after steps 2, 5 (local_steps 3); 5 steps stop mid-round
IN_MEMORY = Layout(dict(nworker_groups=2, nworkers_per_procs=2, local_steps=3), 1, 2, "Local SGD")
OVER_PROCESSES = Layout(dict(nworker_groups=2, nworkers_per_procs=1, local_steps=3), 2, 2, "Local SGD")
# the user's loop (test_session_workers.LOOP: 20 steps, batch 12, a checkpoint after step 9): 2 groups x 2 threads,
# meetings after steps 3, 7, 11, 15, 19, so the checkpoint is mid-round and every replica is the anchor at the end
THREADS = Layout(dict(nworker_groups=2, nworkers_per_group=2, nworkers_per_procs=4, local_steps=4), 1, 4, "Local SGD")
PROCESSES_OF_THREADS = Layout(dict(THREADS.cluster, nworkers_per_procs=2), 2, 4, "Local SGD")


def adamw(params):
    return torch.optim.AdamW(params, lr=2e-2)


def nesterov(params):
    """DiLoCo's outer step (Douillard et al. 2023)."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


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


def diloco(problem, workspace, layout, steps=STEPS, resume=False):
    """fit with AdamW inside each group and Nesterov as the outer step, validating every 2 steps; (model, History)."""
    train, val, model = problem
    model = copy.deepcopy(model)
    history = shoal.fit(model, F.cross_entropy, train, val_data=val, val_freq=2, val_batch=20, steps=steps,
                        batch_size=BATCH, disp_freq=2, optimizer=adamw, outer_optimizer=nesterov,
                        cluster=layout.fit_cluster(), workspace=workspace, resume=resume, log=lambda _line: None)
    assert_ran(workspace, layout)
    return model, history


def on_the_session(monkeypatch):
    """fit may not take its job path (it would run there too, on module_path's layers)."""
    calls = []
    monkeypatch.setattr(fit_loop, "fit_on_session", lambda *a, _on=fit_loop.fit_on_session, **k: calls.append(1) or _on(*a, **k))
    monkeypatch.setattr(api, "train", lambda *a, **k: pytest.fail("fit took its job path"))
    return calls


def validation_losses(history):
    return [(r["step"], r["loss"]) for r in history.phase("validate")]


def test_fit_runs_diloco_groups_in_one_process_on_the_session_as_over_processes_and_resumes_exactly(problem, tmp_path,
                                                                                                    monkeypatch):
    calls = on_the_session(monkeypatch)
    assert fitting.fit_layout(fit_loop.session_plan(fitting.fit_job(
        problem[2], "output", batch_size=BATCH, steps=STEPS, test_batch=8, test_steps=0, test_freq=0, val_batch=8,
        val_steps=0, val_freq=0, disp_freq=1, cluster=IN_MEMORY.fit_cluster(), updater={}, seed=0,
        checkpoint_freq=0))) == "Local SGD / DiLoCo groups in one process"
    threads, threads_history = diloco(problem, tmp_path / "threads", IN_MEMORY)
    processes, processes_history = diloco(problem, tmp_path / "processes", OVER_PROCESSES)
    assert calls == [1, 1]
    assert validation_losses(threads_history) == validation_losses(processes_history)
    assert [r["step"] for r in threads_history.phase("validate")] == [0, 2, 4, 6, 8]
    assert [(r["step"], r["loss"], r["samples"]) for r in threads_history.phase("train")] == \
        [(r["step"], r["loss"], r["samples"]) for r in processes_history.phase("train")]  # group 0's losses, every row
    for (name, a), b in zip(threads.named_parameters(), processes.parameters()):
        assert torch.equal(a, b), name
    assert not torch.equal(threads[0].weight, problem[2][0].weight)
    # stopped after step 4 (mid-round: the groups apart since the meeting after step 2), resumed to 8
    diloco(problem, tmp_path / "parts", IN_MEMORY, steps=5)
    saved = ckpt_io.load(ckpt_io.checkpoint_file(tmp_path / "parts", 5), parts=True)
    group1 = saved.parts["step5-group1-rank0.safetensors"]
    assert saved.trainer["session"] and group1.trainer["next_step"] == 5
    assert any(not torch.equal(saved.params[k], group1.params[k]) for k in saved.params)  # each group its own values,
    assert any(not torch.equal(saved.updater_state["optimizer.0"][k], group1.updater_state["optimizer.0"][k])  # moments
               for k in saved.updater_state["optimizer.0"] if saved.updater_state["optimizer.0"][k].numel() > 1)
    assert all({"updater/0.weight/outer.anchor", "updater/0.weight/outer.momentum_buffer"} <= set(state.exchange)
               for state in (saved, group1))  # each group's anchor and outer momentum
    resumed, resumed_history = diloco(problem, tmp_path / "parts", IN_MEMORY, resume=True)
    for (name, a), b in zip(resumed.named_parameters(), threads.parameters()):
        assert torch.equal(a, b), name
    assert validation_losses(resumed_history) == validation_losses(threads_history)[-2:]  # steps 6 and 8


def test_fit_on_the_session_ends_where_its_job_path_does(problem, tmp_path, monkeypatch):
    """The semantics are the job path's for the same call (its groups as threads of one process, meeting in memory):
    the same validation losses and params, to the bit (the job path kept for it here by taking the name out of
    ON_SESSION, as until 2026-11-29)."""
    session, session_history = diloco(problem, tmp_path / "session", IN_MEMORY)
    monkeypatch.setattr(fitting, "ON_SESSION", fitting.ON_SESSION - {"Local SGD / DiLoCo groups in one process"})
    monkeypatch.setattr(fit_loop, "fit_on_session", lambda *a, **k: pytest.fail("fit took the session"))
    job_path, job_path_history = diloco(problem, tmp_path / "job", IN_MEMORY)
    assert validation_losses(session_history) == validation_losses(job_path_history)
    for (name, a), b in zip(session.named_parameters(), job_path.parameters()):
        assert torch.equal(a, b), name


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = tmp_path_factory.mktemp("local_sgd_threads") / "loop.py"
    path.write_text(LOOP)
    return path


@pytest.fixture(scope="module")
def threads_run(script, tmp_path_factory):
    out = tmp_path_factory.mktemp("threads")
    proc = shoal_run(script, out, out / "ws", *THREADS.cli())
    assert proc.returncode == 0, proc.stderr
    return out


def replicas(out, processes: int, workers: int) -> list[dict[str, torch.Tensor]]:
    return [load_file(str(out / f"rank{r}-worker{w}.safetensors")) for r in range(processes) for w in range(workers)]


@pytest.mark.xdist_group("session_runs")  # (with tests/test_session.py's runs: the launcher's forkserver is started)
def test_a_users_loop_runs_local_sgd_groups_as_threads_of_one_process(threads_run):
    """`shoal run loop.py` with 2 groups x 2 threads in one process: the layout ran (1 process, 4 workers), one thread
    per worker with its 6 rows of its group's batch of 12, the groups apart mid-round (the checkpoint's part of group
    1 holds other values than group 0's) and every replica equal to the bit after the last meeting, learning."""
    assert_ran(threads_run / "ws", THREADS)
    said = json.loads((threads_run / "rank0.json").read_text())
    assert said["label"] == "Local SGD" and [w["rows"] for w in said["workers"]] == [6, 6, 6, 6]
    assert len({w["thread"] for w in said["workers"]}) == 4 and not any(w["main"] for w in said["workers"])
    saved = ckpt_io.load(ckpt_io.checkpoint_file(threads_run / "ws", 10), parts=True)
    assert any(not torch.equal(saved.params[k], saved.parts["step10-group1-rank0.safetensors"].params[k])
               for k in saved.params)
    first, *others = replicas(threads_run, 1, 4)
    assert all(torch.equal(first[k], other[k]) for other in others for k in first)
    records = train_records(threads_run / "ws")
    assert [r["samples"] for r in records] == [24, 120, 120, 120, 96]  # every group's rows
    assert records[-1]["loss"] < records[0]["loss"]


@pytest.mark.xdist_group("session_runs")
def test_a_users_loop_of_local_sgd_threads_resumes_every_groups_state_exactly(script, threads_run, tmp_path):
    """The checkpoint after step 9 (mid-round: each group's replicas, AdamW moments, LambdaLR and anchor) resumed with
    --resume: every replica ends where the uninterrupted run did, to the bit, with the same last losses."""
    shutil.copytree(threads_run / "ws", tmp_path / "ws")
    shutil.copy(threads_run / "plain.safetensors", tmp_path)
    proc = shoal_run(script, tmp_path, tmp_path / "ws", "--resume", *THREADS.cli())
    assert proc.returncode == 0, proc.stderr
    uninterrupted = replicas(threads_run, 1, 4)
    for resumed, before in zip(replicas(tmp_path, 1, 4), uninterrupted):
        assert all(torch.equal(resumed[k], before[k]) for k in before)
    assert [r["loss"] for r in train_records(tmp_path / "ws")][-2:] == \
        [r["loss"] for r in train_records(threads_run / "ws")][-2:]


@pytest.mark.slow  # (a second launch of 2 processes; fit's test above compares threads with processes in the default suite)
@pytest.mark.xdist_group("session_runs")
def test_a_users_loop_of_local_sgd_threads_ends_where_its_groups_over_processes_do(script, threads_run, tmp_path):
    """The same loop with each group's 2 threads in a process of its own: every replica and train record to the bit."""
    proc = shoal_run(script, tmp_path, tmp_path / "ws", *PROCESSES_OF_THREADS.cli())
    assert proc.returncode == 0, proc.stderr
    assert_ran(tmp_path / "ws", PROCESSES_OF_THREADS)
    for threads, processes in zip(replicas(threads_run, 1, 4), replicas(tmp_path, 2, 2)):
        assert all(torch.equal(threads[k], processes[k]) for k in threads)
    assert [(r["loss"], r["samples"]) for r in train_records(threads_run / "ws")] == \
        [(r["loss"], r["samples"]) for r in train_records(tmp_path / "ws")]
