"""Asynchronous groups in a user's loop with several workers (threads) in a process. In-memory Downpour and Hogwild:
`run.each_worker(train)` runs each worker as a thread of one process, a group's workers' gradients meet in their
mean, and its workers' `opt.step()`s push it once to one in-process server that runs the user's optimizer (built from
its recipe, as Downpour's server processes build it): under Downpour each group computes on its own copy of the
params, which takes the server's answer; under Hogwild every group computes on the server's one copy, which the server
updates in place. Downpour over processes with groups of threads: each process pushes its threads' mean once a step
to the server process. Driven as a user would through `shoal run script.py --set cluster.…` (the rows of
tests/layouts.py): the layout really ran (its summary, one thread per worker, each its own rows), it learns as
`shoal.fit`'s same layout does, and a resume from a checkpoint restores the server's optimizer state and (Downpour)
values and every group's copy.
"""
from __future__ import annotations

import json
import shutil
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from layouts import LAYOUTS, assert_ran
from test_session_workers import LOOP, shoal_run, train_records
import shoal
from shoal.neuralnet import checkpoint as ckpt_io

DOWNPOUR = "in-memory Downpour, 2 groups"
HOGWILD = "in-memory Hogwild, 2 groups"
HOGWILD_THREADS = "in-memory Hogwild, 2 groups x 2 threads"
DOWNPOUR_THREADS = "Downpour, 2 groups x 2 threads + 1 server, 3 processes"
# asynchronous groups are not deterministic (the order of the groups' pushes): losses are compared within this much
# (relative; test_session_layouts.py's Downpour over processes: within 1.25x of the plain loop)
LOSS_TOLERANCE = 0.25


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = tmp_path_factory.mktemp("groups") / "loop.py"
    path.write_text(LOOP)
    return path


@pytest.fixture(scope="module", params=[DOWNPOUR, HOGWILD, HOGWILD_THREADS])
def groups_run(request, script, tmp_path_factory):
    """(the row, the output folder of LOOP's run under it)"""
    out = tmp_path_factory.mktemp("groups")
    proc = shoal_run(script, out, out / "ws", *LAYOUTS[request.param].cli())
    assert proc.returncode == 0, proc.stderr
    return request.param, out


def loop_data_and_model():
    """LOOP's data and initial model (the same seed, the same draws)."""
    torch.manual_seed(0)
    x = torch.randn(96, 8)
    y = (x[:, :4].sum(1, keepdim=True) > x[:, 4:].sum(1, keepdim=True)).float()
    return x, y, torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def whole_set_loss(model, x, y) -> float:
    with torch.no_grad():
        return torch.nn.functional.binary_cross_entropy_with_logits(model(x), y).item()


def replica_losses(out) -> list[float]:
    """Each group's final copy (the loop saves its worker's module) on the whole training set."""
    x, y, model = loop_data_and_model()
    losses = []
    for path in sorted(out.glob("rank0-worker*.safetensors")):
        model.load_state_dict(load_file(str(path)))
        losses.append(whole_set_loss(model, x, y))
    return losses


def fit_loss(workspace, row: str) -> tuple[float, float]:
    """shoal.fit of LOOP's model, data, AdamW and schedule under the same layout (each group's schedule on its own steps,
    as each worker's own scheduler steps in the loop): the model's loss on the whole training set before and after."""
    x, y, model = loop_data_and_model()
    before = whole_set_loss(model, x, y)
    shoal.fit(model, torch.nn.functional.binary_cross_entropy_with_logits, torch.utils.data.TensorDataset(x, y),
                        steps=20, batch_size=12, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
                        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + 0.1 * step)),
                        scheduler_steps="group", cluster=LAYOUTS[row].fit_cluster(), workspace=workspace,
                        log=lambda *a: None, disp_freq=5)
    return before, whole_set_loss(model, x, y)


def assert_each_processs_threads_share_a_copy_that_learned(out, label: str, within: float) -> None:
    """LOOP's run in `out` (2 processes, one group of 2 threads each, 6 rows a thread): each process's threads are
    threads, ended on one copy (equal to the bit), which learned: below 0.6 of the untrained loss on the whole
    training set, and at most `within` times the plain one-worker loop's (or below it)."""
    x, y, model = loop_data_and_model()
    before = whole_set_loss(model, x, y)
    model.load_state_dict(load_file(str(out / "plain.safetensors")))
    plain = whole_set_loss(model, x, y)
    for rank in (0, 1):
        said = json.loads((out / f"rank{rank}.json").read_text())
        assert said["label"] == label and [w["rows"] for w in said["workers"]] == [6, 6]
        assert len({w["thread"] for w in said["workers"]}) == 2 and not any(w["main"] for w in said["workers"])
        first, second = (load_file(str(out / f"rank{rank}-worker{w}.safetensors")) for w in (0, 1))
        assert all(torch.equal(first[k], second[k]) for k in first)
        model.load_state_dict(first)
        loss = whole_set_loss(model, x, y)
        assert loss < 0.6 * before and loss <= within * plain, (loss, plain, before)


def test_in_memory_groups_push_to_one_server_and_learn_as_fit_does(groups_run, tmp_path):
    """The row ran (summary.json: 1 process, 2 or 4 workers, in-memory Downpour / Hogwild), one thread per worker, each
    group reading the whole batch of 12 (the job's samples: both groups' rows, as they ran freely; 2 threads: 6 rows
    each); Hogwild's
    one copy; and each group's final values at least as good on the whole training set as shoal.fit's same layout's
    model, within LOSS_TOLERANCE."""
    row, downpour_run = groups_run
    layout = LAYOUTS[row]
    assert_ran(downpour_run / "ws", row)
    said = json.loads((downpour_run / "rank0.json").read_text())
    assert said["label"] == layout.framework
    assert [w["rows"] for w in said["workers"]] == [24 // layout.workers] * layout.workers
    assert len({w["thread"] for w in said["workers"]}) == layout.workers and not any(w["main"] for w in said["workers"])
    records = train_records(downpour_run / "ws")
    # the groups run freely (a job file's group threads too): a display counts the rows every group trained since the
    # last one, however far each got; the last, after every group's last step, the rest: every row of both groups
    assert [r["step"] for r in records] == [0, 5, 10, 15, 19]
    assert sum(r["samples"] for r in records) == 2 * 20 * 12 and records[0]["samples"] >= 12
    # as a job file's in-memory groups: each record the updates' staleness, summary.json every group's updates by lag
    assert all({"staleness", "staleness_max"} <= set(r) for r in records), records
    histogram = json.loads((downpour_run / "ws" / "summary.json").read_text())["staleness_histogram"]
    assert {g: (c["updates"], c["expected"]) for g, c in histogram["groups"].items()} == {"0": (20, 20), "1": (20, 20)}
    before, theirs = fit_loss(tmp_path / "fit", row)
    ours = replica_losses(downpour_run)
    # Hogwild's groups share one copy; Downpour's are apart, but both may have pulled the server's values after the last
    # push of the step when the threads' pushes and pulls interleave so (the checkpoint holds each: the resume test)
    assert len(ours) == layout.workers and (row == DOWNPOUR or len(set(ours)) == 1)
    for loss in ours:
        # (one-sided: two free-running runs differ either way; a loop that learns better than fit is no failure)
        assert loss < 0.6 * before and loss <= (1 + LOSS_TOLERANCE) * theirs, (ours, theirs, before)


def test_in_memory_groups_resume_the_servers_and_every_groups_state(script, groups_run, tmp_path):
    """The checkpoint after step 9 holds the server's AdamW moments and update count and, under Downpour, the server's
    values and group 1's own copy (Hogwild's one copy is the checkpoint's params); --resume starts both groups from it:
    under Downpour the first step's loss (each group's own copy, before its push) is the uninterrupted run's to the
    bit, and the run ends within LOSS_TOLERANCE of it (the groups' pushes interleave as they come)."""
    row, downpour_run = groups_run
    saved = ckpt_io.load(ckpt_io.checkpoint_file(downpour_run / "ws", 10), parts=True)
    assert int(saved.exchange["own/count/server_updates"]) == 20  # both groups' 10 pushes (2 threads: one each a step)
    copies = {"own/server/0.weight", "own/group1/replica/0.weight"}
    assert "updater/0.weight/exp_avg" in saved.exchange
    assert copies <= set(saved.exchange) if row == DOWNPOUR else not copies & set(saved.exchange)
    shutil.copytree(downpour_run / "ws", tmp_path / "ws")
    shutil.copy(downpour_run / "plain.safetensors", tmp_path)
    proc = shoal_run(script, tmp_path, tmp_path / "ws", "--resume", *LAYOUTS[row].cli())
    assert proc.returncode == 0, proc.stderr
    resumed = {r["step"]: r["loss"] for r in train_records(tmp_path / "ws")[-3:]}
    uninterrupted = {r["step"]: r["loss"] for r in train_records(downpour_run / "ws")}
    assert sorted(resumed) == [10, 15, 19]
    if row == DOWNPOUR:  # (Hogwild's groups compute on the one copy another group's push may already have changed)
        assert resumed[10] == uninterrupted[10]
    for again, before in zip(replica_losses(tmp_path), replica_losses(downpour_run)):
        assert abs(again - before) <= LOSS_TOLERANCE * before


@pytest.mark.xdist_group("session_runs")  # (with tests/test_session.py's runs: the launcher's forkserver is started)
def test_downpour_groups_of_two_threads_push_their_mean_once_a_step_and_learn(script, tmp_path):
    """Downpour over 3 processes, each group 2 threads of one process + 1 server process: the threads' gradients meet in
    their mean, which the process pushes once a step (the server applied 20 updates per group, not 40), the threads
    share the group's one copy that takes the server's answer (equal to the bit), each its 6 rows of the group's 12;
    every group's copy learned, ending within LOSS_TOLERANCE of the plain one-worker loop (LOOP's) or below it."""
    proc = shoal_run(script, tmp_path, tmp_path / "ws", *LAYOUTS[DOWNPOUR_THREADS].cli())
    assert proc.returncode == 0, proc.stderr
    assert_ran(tmp_path / "ws", DOWNPOUR_THREADS)  # 3 processes, 4 workers, Downpour, a log per process
    assert "server(group=0, id=0): version 40; updates applied: group 0: 20, group 1: 20" in \
        (tmp_path / "ws" / "logs" / "rank2.log").read_text()
    assert_each_processs_threads_share_a_copy_that_learned(tmp_path, "Downpour", 1 + LOSS_TOLERANCE)
    # the job's rows since the chief's last display, by the servers' count of every group's pushes (a job file's Downpour
    # records: DownpourExchange.metrics), with the chief's staleness: a push of group 1 after the chief's last display
    # is in no record
    records = train_records(tmp_path / "ws")
    assert [r["step"] for r in records] == [0, 5, 10, 15, 19]
    assert all(r["samples"] % 12 == 0 and "staleness" in r and "pushed_bytes" in r for r in records), records
    assert 20 * 12 <= sum(r["samples"] for r in records) <= 40 * 12


FREE = textwrap.dedent('''
    import json, sys, time
    from pathlib import Path
    import torch, shoal

    out = Path(sys.argv[1])
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(48, 8), torch.randn(48, 1))
    initial = torch.nn.Linear(8, 1)
    run = shoal.session(train_steps=20, disp_freq=5)

    def train(worker):
        model = worker.model(torch.nn.Linear(8, 1))
        opt = worker.optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
        reached = {}
        for step, (xb, yb) in worker.batches(data, batch_size=6):
            if worker.group == 1:
                time.sleep(0.1)  # a slow group
            torch.nn.functional.mse_loss(model(xb), yb).backward()
            opt.step(); opt.zero_grad()
            reached[step] = time.monotonic()
        (out / f"group{worker.group}.json").write_text(json.dumps(reached))

    run.each_worker(train)
''')


def test_in_memory_groups_run_freely_a_slow_group_holding_nobody_up(tmp_path):
    """SINGA's asynchronous groups: group 1 sleeps 0.1 s a step, group 0 does not wait for it: it ends its 20 steps
    before group 1 reaches its 10th (in step with it, it could not end before group 1's 19th), and every update of
    both groups is applied (summary.json's staleness histogram)."""
    script = tmp_path / "free.py"
    script.write_text(FREE)
    proc = shoal_run(script, tmp_path, tmp_path / "ws", *LAYOUTS[HOGWILD].cli())
    assert proc.returncode == 0, proc.stderr
    assert_ran(tmp_path / "ws", HOGWILD)
    fast, slow = (json.loads((tmp_path / f"group{g}.json").read_text()) for g in (0, 1))
    assert len(fast) == len(slow) == 20
    assert fast["19"] < slow["9"], (fast["19"], slow["9"])
    histogram = json.loads((tmp_path / "ws" / "summary.json").read_text())["staleness_histogram"]
    assert {g: c["updates"] for g, c in histogram["groups"].items()} == {"0": 20, "1": 20}


@pytest.mark.parametrize("row", [HOGWILD, DOWNPOUR])
def test_fit_runs_in_memory_groups_on_the_session_checkpointing_every_group_at_one_step(tmp_path, row, monkeypatch):
    """shoal.fit's in-memory groups run as fit's loop on the session (fit_loop.run_fit, 2 worker threads), and its
    interval checkpoints (checkpoint_interval_s) are meetings of both groups, set at a step neither has ended yet, however
    far apart they run: every checkpoint holds both groups' updates to its step, no more, no fewer."""
    from shoal.frontend import fit_loop

    ran = []
    monkeypatch.setattr(fit_loop, "run_fit", lambda run, spec, log=print, _run_fit=fit_loop.run_fit:
                        ran.append((run.label, run.local_workers)) or _run_fit(run, spec, log))
    x, y, model = loop_data_and_model()
    shoal.fit(model, torch.nn.functional.binary_cross_entropy_with_logits, torch.utils.data.TensorDataset(x, y),
              steps=30, batch_size=12, optimizer=lambda params: torch.optim.SGD(params, lr=0.05),
              cluster=LAYOUTS[row].fit_cluster(), workspace=tmp_path / "ws", log=lambda *a: None,
              checkpoint_interval_s=1e-6)
    assert ran == [(LAYOUTS[row].framework, 2)]
    written = ckpt_io.list_checkpoints(tmp_path / "ws")
    assert len(written) >= 5 and written[-1][0] == 30
    for step, _ in written:
        saved = ckpt_io.load(ckpt_io.checkpoint_file(tmp_path / "ws", step), parts=True)
        assert int(saved.exchange["own/count/server_updates"]) == 2 * step, step
