"""shoal.fit as a loop of the session's calls (frontend/fit_loop.py, issue 39 point 2): which layouts go there (one list,
frontend/fit.ON_SESSION), and, on such a layout, fit's records and trained values equal to the bit those of the same loop
written by hand with shoal.session() and those of fit's job path (module_path's layers and the Trainer)."""
from __future__ import annotations

import copy
import functools
import json
import time
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import shoal
from shoal.config import job_pb2
from shoal.errors import ShoalError
from shoal.frontend import fit as fitting
from shoal.frontend import fit_loop
from shoal.neuralnet.torch_optimizer import OUTER_OPTIMIZER_UPDATER

STEPS, BATCH = 8, 16
UPDATER = {"type": "kSGD", "momentum": 0.9, "learning_rate": {"base_lr": 0.05}}


def quiet(_line: str) -> None:
    pass


@pytest.fixture(scope="module")
def problem():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(80, 6, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 0.5).long()
    xv = torch.randn(40, 6, generator=g)
    yv = (xv[:, 0] + xv[:, 1] > 0).long()
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))
    return (x, y), (xv, yv), model


def planned_by_fit(**cluster):
    """The layout as fit plans it (a layout the session refuses: fit keeps the job path for it)."""
    from shoal.frontend.session_start import session_job
    from shoal.planning.plan import plan_job

    return plan_job(session_job(shoal.Cluster(**cluster), 10, 0, 10, 0, "fit"))


def tensor_parallel_plan():
    """fit's plan of `partition_dim=1` over one synchronous group's 2 processes (the module cut on its features)."""
    from shoal.frontend.session_start import plan_session, session_job

    return plan_session(session_job(shoal.Cluster(nworkers_per_group=2, nworkers_per_procs=1), 10, 0, 10, 0, "fit",
                                    partition_dim=1), 1)


def plan_of(**cluster):
    from shoal.frontend.session_start import plan_session, session_job

    return plan_session(session_job(shoal.Cluster(**cluster), 10, 0, 10, 0, "fit"), 1)


def test_the_layouts_fit_runs_on_the_session_are_exactly_the_list():
    """One place says which layouts fit runs as fit_loop's loop: ON_SESSION, by fit_layout's names; every other layout
    keeps the job path. The names fit_loop runs: one worker in one process on the CPU, one synchronous group's workers
    in one process (threads: tests/test_fit_threads_on_session.py), AllReduce, Local SGD / DiLoCo and Distributed
    Hogwild over processes (one worker each), Downpour's groups over processes (one worker each, server processes of
    their own: tests/test_fit_downpour_on_session.py), Sandblaster's group over processes (one worker each, server
    processes of their own: below), the same with several threads of the process's group in each process (AllReduce,
    under restarts too: tests/test_session_threads_rejoin.py; Local SGD, Downpour, Sandblaster:
    tests/test_fit_threads_on_session.py), in-memory Hogwild's and
    Downpour's asynchronous groups (threads of one process, running freely, a warm-up too: tests/test_session_groups.py,
    tests/test_session_warmup.py), AllReduce over processes with server slices (one worker or a few threads each, no
    restarts: each process's slices' optimizer state alone, tests/test_fit_slices_on_session.py; under compression or
    restarts: "AllReduce over processes", the replicated update, tests/test_fit_remaining_layouts.py); Distributed
    Hogwild's groups of threads run there (tests/test_session_hogwild_threads.py), and Local SGD / DiLoCo's groups as
    threads of one process (tests/test_session_local_sgd_threads.py). A device list (each worker on its device) and
    measured batch shares (cluster.auto_batch_shares over a group's threads) run there too
    (tests/test_fit_remaining_layouts.py); on a GPU the layouts whose session path is the CPU's alone (Distributed
    Hogwild, Downpour's and Sandblaster's server processes, in-memory groups, Local SGD / DiLoCo's groups in one
    process) keep the job path."""
    ready = {"one worker", "one synchronous group in one process", "AllReduce over processes",
             "AllReduce over processes with server slices", "Local SGD / DiLoCo over processes",
             "Distributed Hogwild over processes", "Downpour over processes", "Sandblaster over processes",
             "in-memory Hogwild / Downpour", "a module cut on its features over processes",
             "Local SGD / DiLoCo groups in one process"}
    assert fitting.ON_SESSION == ready
    on_a_gpu = SimpleNamespace(in_one_process=True, nworkers=1, job=SimpleNamespace(device=["cuda:0"]), label="single worker",
                               tensor_parallel=False, balance_freq=0)
    named = {"one worker": plan_of(),
             "one synchronous group in one process": plan_of(nworkers_per_group=2, nworkers_per_procs=2),  # (threads)
             "AllReduce over processes": plan_of(nworkers_per_group=2, nworkers_per_procs=1),
             "AllReduce over processes with server slices": plan_of(nworkers_per_group=2, nworkers_per_procs=1,
                                                                    nservers_per_group=2),
             "Local SGD / DiLoCo over processes": plan_of(nworker_groups=2, nworkers_per_procs=1, local_steps=2),
             "Distributed Hogwild over processes": plan_of(nworker_groups=2, nserver_groups=2),
             "Downpour over processes": plan_of(nworker_groups=2, server_worker_separate=True),
             "Sandblaster over processes": plan_of(nworkers_per_group=2, nworkers_per_procs=1, server_worker_separate=True),
             "in-memory Hogwild / Downpour": plan_of(nworker_groups=2, nworkers_per_procs=2),
             # (each group's workers as threads, the groups meeting in memory: tests/test_session_local_sgd_threads.py)
             "Local SGD / DiLoCo groups in one process": plan_of(nworker_groups=2, nworkers_per_procs=2, local_steps=2),
             "a module cut on its features over processes": tensor_parallel_plan()}  # (tests/test_fit_tensor_parallel.py)
    with_torch_outer = SimpleNamespace(in_one_process=False, nworkers=2, nprocs=2, label="DiLoCo", tensor_parallel=False,
                                       balance_freq=0,
                                       placement=SimpleNamespace(processes=[SimpleNamespace(workers=[k]) for k in range(2)]),
                                       strategy=SimpleNamespace(synchronous=False, meets=True, syncs_with_peers=False,
                                                                  servers_hold_trainers=True),
                                       job=SimpleNamespace(device=[], cluster=SimpleNamespace(
                                           outer_updater=SimpleNamespace(user_type=OUTER_OPTIMIZER_UPDATER))))
    def on_gpus(**cluster):  # (fit's device="cuda:0": worker 0 of each process on the GPU)
        from shoal.frontend.session_start import session_job
        from shoal.planning.plan import plan_job

        return plan_job(session_job(shoal.Cluster(**cluster), 10, 0, 10, 0, "fit", device="cuda:0"))

    # the session's Distributed Hogwild, server pushes and groups in one process run on the CPU: on a GPU, the job path
    others = [on_gpus(nworker_groups=2, nserver_groups=2), on_gpus(nworker_groups=2, server_worker_separate=True),
              on_gpus(nworker_groups=2, nworkers_per_procs=2), on_gpus(nworker_groups=2, nworkers_per_procs=2, local_steps=2)]
    # a device list and measured shares (tests/test_fit_remaining_layouts.py), on a GPU too where the session runs it
    assert fitting.fit_layout(on_a_gpu) == fitting.fit_layout(on_gpus()) == "one worker"
    for plan in (planned_by_fit(nworkers_per_group=2, nworkers_per_procs=2, auto_batch_shares=True),
                 on_gpus(nworkers_per_group=2, nworkers_per_procs=2)):
        assert fitting.fit_layout(plan) == "one synchronous group in one process"
    assert fitting.fit_layout(on_gpus(nworkers_per_group=2)) == "AllReduce over processes"
    for slices in (dict(compression=job_pb2.kBF16), dict(max_restarts=1)):  # server slices: the replicated update
        assert fitting.fit_layout(plan_of(nworkers_per_group=2, nworkers_per_procs=1, nservers_per_group=2, **slices)) == \
            "AllReduce over processes"
    assert {fitting.fit_layout(plan): name for name, plan in named.items()} == {name: name for name in named}
    assert fitting.fit_layout(planned_by_fit(nworker_groups=2, nworkers_per_procs=2, warmup_steps=2)) == \
        "in-memory Hogwild / Downpour"  # (a warm-up: group 0 alone first, the others after it)
    # DiLoCo with fit's outer_optimizer= (a torch optimizer: shoal.session's outer_optimizer=)
    assert fitting.fit_layout(with_torch_outer) == "Local SGD / DiLoCo over processes"
    # Distributed Hogwild's groups of 2 threads, one group a process (run.each_worker)
    assert fitting.fit_layout(planned_by_fit(nworker_groups=2, nserver_groups=2, nworkers_per_group=2,
                                             nworkers_per_procs=2)) == "Distributed Hogwild over processes"
    assert fitting.fit_layout(planned_by_fit(nworkers_per_group=4, nworkers_per_procs=2, max_restarts=1)) == \
        "AllReduce over processes"  # (threads under restarts: a restarted process's workers take the chief's state)
    assert all(fitting.fit_layout(plan) not in ready for plan in others)
    for plan in [*named.values(), *others]:
        assert fitting.on_session(plan) == (fitting.fit_layout(plan) in fitting.ON_SESSION)


def by_hand(model, train, val, test, workspace):
    """fit's loop written by hand with shoal.session(): what fit(..., val_freq=3, test_freq=4) does."""
    run = shoal.session(train_steps=STEPS, workspace=workspace, disp_freq=3, log=quiet)
    model = run.model(model)
    opt = run.optimizer(shoal.SingaOptimizer(model.parameters(), UPDATER))
    for step, (xb, yb) in run.batches(train, batch_size=BATCH):
        if step % 3 == 0:
            run.evaluate(val, F.cross_entropy, batch_size=20)
        if step % 4 == 0:
            run.evaluate(test, F.cross_entropy, batch_size=20, phase="test")
        output = model(xb)
        loss = F.cross_entropy(output, yb)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        run.log(step, loss=loss.detach(), accuracy=(output.argmax(1) == yb).float().mean())
    run.evaluate(val, F.cross_entropy, batch_size=20)
    run.evaluate(test, F.cross_entropy, batch_size=20, phase="test")
    run.checkpoint()
    run.close()
    return model


def evaluations(records):
    return [(r["phase"], r["step"], r["samples"], r["loss"], r["accuracy"]) for r in records
            if r["phase"] in ("validate", "test")]


def test_fit_on_a_moved_layout_runs_the_session_loop_equal_to_the_hand_written_loop_and_the_job_path(tmp_path, problem,
                                                                                                      monkeypatch):
    train, val, model = problem
    ran = []
    monkeypatch.setattr(fit_loop, "run_fit", lambda run, spec, log=print, _run_fit=fit_loop.run_fit: ran.append(run.job.name)
                        or _run_fit(run, spec, log))
    keywords = dict(val_data=val, test_data=val, val_freq=3, test_freq=4, val_batch=20, test_batch=20, steps=STEPS,
                    batch_size=BATCH, disp_freq=3, updater=UPDATER, log=quiet)

    monkeypatch.setattr(fitting, "ON_SESSION", frozenset({"one worker"}))
    on_session = copy.deepcopy(model)
    history = shoal.fit(on_session, F.cross_entropy, train, workspace=tmp_path / "session", **keywords)
    assert ran == ["fit"]  # fit went through fit_loop's loop on a session

    monkeypatch.setattr(fitting, "ON_SESSION", frozenset())
    on_the_job_path = copy.deepcopy(model)
    job_history = shoal.fit(on_the_job_path, F.cross_entropy, train, workspace=tmp_path / "job", **keywords)
    assert ran == ["fit"]

    hand = by_hand(copy.deepcopy(model), train, val, val, tmp_path / "hand")
    hand_records = fit_loop.history(tmp_path / "hand", 0).records

    mine = evaluations(history.records)
    assert [(p, s) for p, s, *_ in mine] == [("validate", 0), ("test", 0), ("validate", 3), ("test", 4), ("validate", 6),
                                            ("validate", 8), ("test", 8)]
    assert mine == evaluations(hand_records) == evaluations(job_history.records)  # to the bit
    # the session also closes the display window at the last step (the job path's Trainer does not)
    assert [r["step"] for r in history.phase("train")] == [r["step"] for r in hand_records if r["phase"] == "train"] == [0, 3, 6, 7]
    assert [r["step"] for r in job_history.phase("train")] == [0, 3, 6]
    for (name, a), b, c in zip(on_session.named_parameters(), hand.parameters(), on_the_job_path.parameters()):
        assert torch.equal(a, b) and torch.equal(a, c), name
    assert not torch.equal(on_session[0].weight, model[0].weight)  # trained
    assert (history.workspace / "checkpoint").is_dir() and (history.workspace / ".shoal" / "job.conf").is_file()


def test_fit_on_the_session_resumes_where_it_stopped_with_fits_validation_cursor(tmp_path, problem, monkeypatch):
    """val_steps reads the next batches at each validation (fit's cursor): a resumed run reads where the stopped one
    would have, and ends where the uninterrupted run does, to the bit."""
    train, val, model = problem
    monkeypatch.setattr(fitting, "ON_SESSION", frozenset({"one worker"}))
    keywords = dict(val_data=val, val_freq=2, val_batch=10, val_steps=1, batch_size=BATCH, checkpoint_freq=2,
                    optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2), clip_grad_norm=0.5, log=quiet)
    whole = copy.deepcopy(model)
    uninterrupted = shoal.fit(whole, F.cross_entropy, train, steps=STEPS, workspace=tmp_path / "whole", **keywords)
    shoal.fit(copy.deepcopy(model), F.cross_entropy, train, steps=4, workspace=tmp_path / "parts", **keywords)
    resumed_model = copy.deepcopy(model)
    resumed = shoal.fit(resumed_model, F.cross_entropy, train, steps=STEPS, workspace=tmp_path / "parts", resume=True,
                        **keywords)
    assert resumed.phase("train")[0]["step"] >= 4  # this run's records only
    later = [(r["step"], r["loss"]) for r in uninterrupted.phase("validate") if r["step"] >= 4]
    assert [(r["step"], r["loss"]) for r in resumed.phase("validate")] == later
    assert len({loss for _, loss in later}) > 1  # the cursor moved: different rows at each validation
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), resumed_model.parameters()))


def _fit_over_processes(model, train, val, workspace, cluster):
    return shoal.fit(model, F.cross_entropy, train, val_data=val, val_freq=3, val_batch=20, steps=STEPS, batch_size=BATCH,
                     disp_freq=3, updater=UPDATER, cluster=cluster, workspace=workspace, log=quiet)


@pytest.mark.slow
def test_fit_over_processes_runs_the_loop_in_each_rank(tmp_path, problem, monkeypatch):
    """AllReduce over 2 processes through fit_loop's loop (each rank runs it: RunOptions.rank_main) records one worker's
    validation losses and ends on its values, to float rounding (the mean of two halves); DiLoCo over 2
    processes ends where fit's job path does, to the bit."""
    train, val, model = problem
    monkeypatch.setattr(fitting, "ON_SESSION", frozenset({"one worker", "AllReduce over processes",
                                                          "Local SGD / DiLoCo over processes"}))
    one = copy.deepcopy(model)
    alone = _fit_over_processes(one, train, val, tmp_path / "one", shoal.Cluster())
    two = copy.deepcopy(model)
    together = _fit_over_processes(two, train, val, tmp_path / "two", shoal.Cluster(nworkers_per_group=2, nworkers_per_procs=1))
    assert [r["step"] for r in together.phase("validate")] == [r["step"] for r in alone.phase("validate")] == [0, 3, 6, 8]
    assert [r["loss"] for r in together.phase("validate")] == pytest.approx([r["loss"] for r in alone.phase("validate")],
                                                                           rel=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(one.parameters(), two.parameters()))
    assert (tmp_path / "two" / "logs" / "rank1.log").is_file()  # it ran over 2 processes

    diloco = shoal.Cluster(nworker_groups=2, nworkers_per_procs=1, local_steps=2,
                           outer_updater={"type": "kNesterov", "momentum": 0.9, "learning_rate": {"type": "kFixed", "base_lr": 0.7}})
    on_session = copy.deepcopy(model)
    loop = _fit_over_processes(on_session, train, val, tmp_path / "diloco", diloco)
    monkeypatch.setattr(fitting, "ON_SESSION", frozenset())
    on_the_job_path = copy.deepcopy(model)
    job = _fit_over_processes(on_the_job_path, train, val, tmp_path / "diloco-job", diloco)
    assert [(r["step"], r["loss"]) for r in loop.phase("validate")] == [(r["step"], r["loss"]) for r in job.phase("validate")]
    assert all(torch.equal(a, b) for a, b in zip(on_session.parameters(), on_the_job_path.parameters()))
    assert not torch.equal(on_session[0].weight, model[0].weight)


def test_a_checkpoint_of_the_other_path_is_refused_in_one_line(tmp_path, problem, monkeypatch):
    """A loop on the session and fit's job path keep different state in a checkpoint (the loop's optimizers by index and
    its position; the trainer's updater slots and cursors): a resume across them is refused in one line naming the file,
    either way, and nothing of the stopped run is touched (before, the job path resumed a loop's checkpoint with the
    optimizer's state lost, and the session said only that the checkpoint held 0 optimizers)."""
    train, _, model = problem
    keywords = dict(batch_size=BATCH, updater=None, optimizer=functools.partial(torch.optim.AdamW, lr=1e-2), log=quiet)
    for first, then in ((frozenset(), frozenset({"one worker"})), (frozenset({"one worker"}), frozenset())):
        workspace = tmp_path / ("job-then-loop" if not first else "loop-then-job")
        monkeypatch.setattr(fitting, "ON_SESSION", first)
        shoal.fit(copy.deepcopy(model), F.cross_entropy, train, steps=2, checkpoint_freq=2, workspace=workspace, **keywords)
        written = sorted((workspace / "checkpoint").iterdir())
        monkeypatch.setattr(fitting, "ON_SESSION", then)
        with pytest.raises(ShoalError) as refused:
            shoal.fit(copy.deepcopy(model), F.cross_entropy, train, steps=4, workspace=workspace, resume=True, **keywords)
        line = str(refused.value)
        assert "\n" not in line and line.startswith(f"--resume: {written[-1]} was written by "), line
        assert line.endswith("resume it with the layout that wrote it"), line
        assert sorted((workspace / "checkpoint").iterdir()) == written


def test_the_chief_ranks_lines_reach_fits_log_in_this_process(tmp_path):
    """Over processes the chief rank writes its lines to logs/rank0.log only, and fit hands each whole line to its
    log= here (a lambda too, which could not be sent to the ranks), a resumed run's earlier lines not again."""
    path = tmp_path / "rank0.log"
    path.write_text("an earlier run's line\n")
    said = []
    with fit_loop._relayed(path, said.append, every_s=0.01):
        with open(path, "a") as f:
            f.write("Train @ step 0  Loss = 1\nTrain @ st")
            f.flush()
            time.sleep(0.05)
            f.write("ep 5  Loss = 0.5\n")
    assert said == ["Train @ step 0  Loss = 1", "Train @ step 5  Loss = 0.5"]


def test_fit_runs_sandblaster_over_processes_on_the_session_as_one_worker(tmp_path, problem, monkeypatch):
    """Sandblaster's one group, a worker in each of 2 processes, its server in a third (the servers run fit's updater):
    fit runs it through its loop on the session, and it records one worker's validation losses and ends on its values,
    to float rounding (the group's mean, whole: a synchronous layout)."""
    train, val, model = problem
    ran = []
    monkeypatch.setattr(fit_loop, "fit_on_session", lambda *a, _on=fit_loop.fit_on_session, **k: ran.append(1) or _on(*a, **k))
    one, sandblaster = copy.deepcopy(model), copy.deepcopy(model)
    alone = _fit_over_processes(one, train, val, tmp_path / "one", shoal.Cluster())
    cluster = shoal.Cluster(nworkers_per_group=2, nworkers_per_procs=1, nservers_per_group=1, server_worker_separate=True)
    both = _fit_over_processes(sandblaster, train, val, tmp_path / "sandblaster", cluster)
    assert ran == [1, 1]
    ended = json.loads((tmp_path / "sandblaster" / "summary.json").read_text())
    assert (ended["framework"], ended["processes"], ended["workers"], ended["servers"]) == ("Sandblaster", 3, 2, 1), ended
    server = (tmp_path / "sandblaster" / "logs" / "rank2.log").read_text()  # (the server process applied every step's mean)
    assert f"server(group=0, id=0): version {STEPS}; updates applied: group 0: {STEPS}" in server, server
    got, want = both.phase("validate"), alone.phase("validate")
    assert [r["step"] for r in got] == [r["step"] for r in want] and len(got) > 1
    for a, b in zip(got, want):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)
    for a, b in zip(sandblaster.parameters(), one.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_fit_on_the_job_path_over_processes_hands_the_chiefs_lines_to_its_log(tmp_path, problem, capfd, monkeypatch):
    """fit's job path over processes (AllReduce, 2 processes of 2 threads, a device list; fit runs this layout on the
    session now, so the test takes the job path's branch itself, as long as fit has one): its chief rank's lines
    (Train, Validate, the checkpoint) reach fit's log= in this process, a lambda too, and not the terminal."""
    train, val, model = problem
    lines = []
    cluster = shoal.Cluster(nworkers_per_group=4, nworkers_per_procs=2)
    monkeypatch.setattr(fitting, "on_session", lambda plan: False)
    monkeypatch.setattr(fit_loop, "fit_on_session", lambda *a, **k: pytest.fail("not the job path"))
    shoal.fit(model, F.cross_entropy, train, val_data=val, val_freq=3, val_batch=20, steps=STEPS, batch_size=BATCH,
              disp_freq=3, updater=UPDATER, cluster=cluster, device=["cpu:0", "cpu:1"], workspace=tmp_path / "ws",
              log=lambda line: lines.append(line))
    said = "\n".join(lines)
    assert "Train @ step 6 " in said and "Validate @ step 3 " in said and "Checkpoint written to " in said, said
    assert "AllReduce" in said  # (the launcher's own line, as before)
    out = capfd.readouterr().out
    assert "Train @" not in out and "Validate @" not in out, out


_calls = 0


def loss_killing_the_chief(output, target, marker, at):
    """fit's loss; the chief rank's process SIGKILLs itself at its `at`-th call, once per job, and the other waits for
    its restarted process's first step (a module-level function: fit sends it to the ranks)."""
    import os
    import signal

    import torch.distributed as dist

    global _calls
    _calls += 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    killed, back = os.path.exists(marker), os.path.exists(marker + ".back")
    if _calls == at and rank == 0 and not killed:
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0 and killed and not back:  # the restarted process's first step
        open(marker + ".back", "w").close()
    if rank != 0 and killed and not back:  # the survivor goes on slowly until it is back, so that it rejoins mid-run
        time.sleep(0.2)
    return F.cross_entropy(output, target)


@pytest.mark.slow  # (about 5 s: two processes, a kill and a restart)
@pytest.mark.parametrize("name, cluster", [
    ("AllReduce", dict(nworkers_per_group=2, nworkers_per_procs=1)),
    ("DiLoCo", dict(nworker_groups=2, nworkers_per_procs=1, local_steps=3,
                    outer_updater={"type": "kNesterov", "momentum": 0.9, "learning_rate": {"type": "kFixed", "base_lr": 0.7}})),
    ("Downpour", dict(nworker_groups=2, nworkers_per_procs=1, nserver_groups=1, server_worker_separate=True)),
    ("Distributed Hogwild", dict(nworker_groups=2, nserver_groups=2)),
])
def test_fit_over_processes_survives_its_chiefs_death(tmp_path, capfd, problem, name, cluster):
    """fit's loop is a user's loop on the session: its chief rank SIGKILLed at step 5 is dropped like any other
    process, the lowest living one writes the run log and the checkpoints, the restarted process rejoins, and fit
    returns the trained module (the successor's final checkpoint) with its History, no exception. Its log= is quiet:
    no rank (the successor, the restarted one) writes to the caller's stdout."""
    train, val, model = problem
    before = copy.deepcopy(model)
    history = shoal.fit(model, functools.partial(loss_killing_the_chief, marker=str(tmp_path / "killed"), at=6), train,
                        val_data=val, val_freq=6, val_batch=20, steps=24, batch_size=BATCH, disp_freq=3, updater=UPDATER,
                        cluster=shoal.Cluster(max_restarts=1, **cluster), workspace=tmp_path / "ws", log=quiet,
                        loss_takes="output")
    assert (tmp_path / "killed").exists()
    summary = json.loads((tmp_path / "ws" / "summary.json").read_text())
    last = summary["steps"]  # (Distributed Hogwild's groups re-train the steps the rejoined group skipped, past 24)
    assert summary["status"] == "finished" and (last == 24 or name == "Distributed Hogwild" and last > 24), summary
    assert [r["rank"] for r in summary["rejoins"]] == [0]
    assert summary["chief_succession"][0]["process"] == 1 and "job_restarts" not in summary, summary
    assert "took the chief's place" in (tmp_path / "ws" / "logs" / "rank1.log").read_text()
    steps = [r["step"] for r in history.phase("train")]
    assert steps == sorted(set(steps)) and steps[0] == 0 and steps[-1] >= 23 and (steps[-1] == 23 or last > 24), steps
    assert [r["step"] for r in history.phase("validate")][-1] == last  # the final validation, by the successor
    assert not torch.equal(model[0].weight, before[0].weight)  # the successor's final values, loaded into the module
    out = capfd.readouterr().out
    assert "rejoined" not in out and "chief's place" not in out, out
