"""shoal.fit over server slices on the session (issue 39 point 2): AllReduce over processes with
cluster.nservers_per_group K > 1 (one worker or a few threads in each process) runs fit's loop on the session, each process holding its slices' optimizer state alone
(runtime/session_slices.py), as the job path's owners do; its validation losses and trained values are the job
path's to float rounding. In one process (in-memory Sandblaster's threads, 2 nominal slices: the job path's one
in-process server holds them all) fit's loop is the session's threads'."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import shoal
from layouts import LAYOUTS, assert_ran
from shoal.frontend import fit as fitting
from shoal.frontend import fit_loop
from test_fit_on_session import BATCH, STEPS, problem, quiet  # noqa: F401 (problem: a fixture)


def fitted(model, problem, workspace, row):
    train, val, _ = problem
    return shoal.fit(model, F.cross_entropy, train, val_data=val, val_freq=3, val_batch=20, steps=STEPS, batch_size=BATCH,
                     disp_freq=3, optimizer=functools.partial(torch.optim.AdamW, lr=2e-2), clip_grad_norm=0.5,
                     cluster=LAYOUTS[row].fit_cluster(), workspace=workspace, log=quiet)


def same_as_the_job_path(problem, tmp_path, monkeypatch, row) -> tuple[torch.nn.Module, object]:
    """fit of `row` on the session (through fit_on_session where it spans processes), then on the job path: the same
    validation losses and values to float rounding. Returns the session's module and History."""
    _, _, model = problem
    ran = []
    monkeypatch.setattr(fit_loop, "run_fit", lambda run, spec, log=print, _run_fit=fit_loop.run_fit: ran.append(1)
                        or _run_fit(run, spec, log))
    on_session = copy.deepcopy(model)
    history = fitted(on_session, problem, tmp_path / "session", row)
    assert_ran(tmp_path / "session", row)
    assert ran or LAYOUTS[row].launched  # (over processes each rank runs the loop: the ranks' calls are not seen here)
    monkeypatch.setattr(fitting, "ON_SESSION", frozenset())
    monkeypatch.setattr(fit_loop, "fit_on_session", lambda *a, **k: pytest.fail("not the job path"))
    on_the_job_path = copy.deepcopy(model)
    job = fitted(on_the_job_path, problem, tmp_path / "job", row)
    got, want = history.phase("validate"), job.phase("validate")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [0, 3, 6, 8]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-5, abs=1e-6)
    for (name, a), b in zip(on_session.named_parameters(), on_the_job_path.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.equal(on_session[0].weight, model[0].weight)
    return on_session, history


def test_fit_over_server_slices_shards_adamw_on_the_session_as_the_job_path(problem, tmp_path, monkeypatch):
    """AllReduce, 2 processes, 2 server slices: fit_on_session runs it; the final checkpoint holds each process's
    AdamW state of its own slices alone (the chief's file its slices', process 1's part the others'), every trained
    element's state exactly once; validation and values are the job path's to float rounding."""
    row = "AllReduce, 2 processes, 2 server slices"
    assert fitting.fit_layout(_plan(row)) == "AllReduce over processes with server slices"
    calls = []
    monkeypatch.setattr(fit_loop, "fit_on_session", lambda *a, _on=fit_loop.fit_on_session, **k: calls.append(1) or _on(*a, **k))
    _, history = same_as_the_job_path(problem, tmp_path, monkeypatch, row)
    assert calls == [1]
    written = history.workspace / "checkpoint"
    held = {}
    for rank, name in ((0, f"step{STEPS}-worker0.safetensors"), (1, f"step{STEPS}-group0-rank1.safetensors")):
        for key, value in load_file(str(written / name)).items():
            if key.startswith("exchange/slices/0/") and key.endswith("/exp_avg"):
                param, span = key.split("/")[3:5]
                start, stop = map(int, span.split(":"))
                held.setdefault(param, []).append((start, stop, rank))
                assert value.numel() == stop - start
    sizes = {"0.weight": 60, "0.bias": 10, "2.weight": 30, "2.bias": 3}
    for param, size in sizes.items():  # every element's state once, over the two processes
        spans = sorted(held[param])
        assert spans[0][0] == 0 and spans[-1][1] == size and all(a[1] == b[0] for a, b in zip(spans, spans[1:])), spans
    assert {rank for spans in held.values() for *_, rank in spans} == {0, 1}


@pytest.mark.slow  # (about 6 s each: both paths over processes)
@pytest.mark.parametrize("row", ["AllReduce, 3 processes", "AllReduce, 2 processes x 2 threads"])
def test_fit_over_more_slices_or_threads_is_the_job_paths(problem, tmp_path, monkeypatch, row):
    """3 processes and 3 slices; 2 processes of 2 threads, each process's threads sharing its one update of its slices."""
    assert fitting.fit_layout(_plan(row)) == "AllReduce over processes with server slices"
    same_as_the_job_path(problem, tmp_path, monkeypatch, row)


def test_fit_over_threads_with_two_slices_in_one_process_is_the_job_paths(problem, tmp_path, monkeypatch):
    row = "in-memory Sandblaster, 2 threads, 2 server slices"
    assert fitting.fit_layout(_plan(row)) == "one synchronous group in one process"
    same_as_the_job_path(problem, tmp_path, monkeypatch, row)


def _plan(row):
    from shoal.frontend.session_start import plan_session, session_job

    return plan_session(session_job(LAYOUTS[row].fit_cluster(), 10, 0, 10, 0, "fit"), 1)
