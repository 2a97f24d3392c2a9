"""Distributed Hogwild's groups of threads in a user's loop and in shoal.fit on the session: each process one group of
2 worker threads (`nworker_groups 2, nserver_groups 2, nworkers_per_group 2, nworkers_per_procs 2`): `run.each_worker`
runs the loop's body once per thread, the group's threads compute on its one copy of the params (the one its masters
and syncs reach), their gradients meet in the group's mean (each `.grad` the mean, so clip_grad_norm_ clips the
group's norm) and worker 0's optimizer updates the copy once a step; the syncs with the other group come as for one
worker a process. Driven as a user would (`shoal run script.py --set cluster.…`, the row of tests/layouts.py) and
through shoal.fit; a group of 2 threads ends where a group of one worker with the whole batch does, to float rounding
(without syncs: each group then trains alone, deterministically).
"""
from __future__ import annotations


import pytest
import torch
from safetensors.torch import load_file

import shoal
from layouts import LAYOUTS, assert_ran
from test_session_groups import assert_each_processs_threads_share_a_copy_that_learned, loop_data_and_model
from test_session_workers import LOOP, shoal_run

THREADS = "Distributed Hogwild, 2 groups x 2 threads"
ONE_EACH = "Distributed Hogwild, 2 groups"
NO_SYNC = ["--set", "cluster.sync_freq=1000"]  # (LOOP's 20 steps: each group trains alone)
SYNC_EVERY_5 = ["--set", "cluster.sync_freq=5"]


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = tmp_path_factory.mktemp("hogwild") / "loop.py"
    path.write_text(LOOP)
    return path


def test_a_groups_threads_share_its_copy_sync_and_learn(script, tmp_path):
    """The row ran (2 processes, 4 workers), one thread per worker, each its 6 rows of the group's 12; both threads of
    a process end on the group's one copy (equal to the bit), and every group learned with syncs every 5 steps, within
    20 % of the plain one-worker loop (LOOP's) or below it."""
    proc = shoal_run(script, tmp_path, tmp_path / "ws", *LAYOUTS[THREADS].cli(), *SYNC_EVERY_5)
    assert proc.returncode == 0, proc.stderr
    assert_ran(tmp_path / "ws", THREADS)
    assert_each_processs_threads_share_a_copy_that_learned(tmp_path, "Distributed Hogwild", 1.2)


def test_a_group_of_two_threads_ends_where_a_group_of_one_worker_does(script, tmp_path):
    """Without syncs each group trains alone: the 2 threads' mean (6 + 6 rows) is one worker's gradient of the 12 rows,
    so each group's copy ends on the one-worker-a-process row's, to float rounding."""
    for row in (THREADS, ONE_EACH):
        proc = shoal_run(script, tmp_path / row, tmp_path / row / "ws", *LAYOUTS[row].cli(), *NO_SYNC)
        assert proc.returncode == 0, proc.stderr
        assert_ran(tmp_path / row / "ws", row)
    for rank in (0, 1):
        threads = load_file(str(tmp_path / THREADS / f"rank{rank}-worker0.safetensors"))
        one = load_file(str(tmp_path / ONE_EACH / f"rank{rank}-worker0.safetensors"))
        for name in one:
            torch.testing.assert_close(threads[name], one[name], rtol=1e-5, atol=1e-6, msg=name)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def fitted(workspace, row: str) -> torch.nn.Module:
    """shoal.fit of LOOP's model and data, AdamW, no syncs (each group alone: deterministic)."""
    x, y, model = loop_data_and_model()
    shoal.fit(model, torch.nn.functional.binary_cross_entropy_with_logits, torch.utils.data.TensorDataset(x, y),
              steps=20, batch_size=12, optimizer=adamw,
              cluster=LAYOUTS[row].fit_cluster(sync_freq=1000), workspace=workspace, log=lambda *a: None)
    return model


def test_fit_runs_a_groups_threads_on_the_session_as_its_job_path(tmp_path, monkeypatch):
    """fit's Distributed Hogwild with groups of 2 threads runs as fit's loop on the session (fit_on_session, 2
    processes, 4 workers: "Distributed Hogwild over processes") and ends on the job path's params for the same layout,
    to float rounding (that a group's threads end where one worker a process does: the test above, in a loop)."""
    from shoal.frontend import fit as fitting
    from shoal.frontend import fit_loop

    ran = []
    monkeypatch.setattr(fit_loop, "fit_on_session", lambda *a, _on=fit_loop.fit_on_session, **k: ran.append(1) or _on(*a, **k))
    session = fitted(tmp_path / "session", THREADS)
    assert ran == [1]
    assert_ran(tmp_path / "session", THREADS)
    monkeypatch.setattr(fitting, "ON_SESSION", fitting.ON_SESSION - {"Distributed Hogwild over processes"})
    job_path = fitted(tmp_path / "job", THREADS)
    assert ran == [1]  # (the job path's run did not come here)
    for mine, other in zip(session.parameters(), job_path.parameters()):
        torch.testing.assert_close(mine, other, rtol=1e-5, atol=1e-6)
