"""Asynchronous worker groups: in-memory Hogwild (groups of one process sharing params and updater slots)."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
from cli_in_process import run_cli as shoal_in_process
from safetensors.torch import load_file

import shoal
from layouts import assert_ran, summary
from shoal.runtime.exchanges.groups import GroupBoard

quiet = lambda *a: None


def hogwild_layout(groups: int) -> str:
    return f"in-memory Hogwild, {groups} groups"


def hogwild_job(blobs_job, groups=2, steps=40, layout=None, **kw):
    """The blobs job as in-memory Hogwild of `groups` groups (or another row of tests/layouts.py); kw: blobs_job's."""
    return blobs_job(train_steps=steps, layout=layout or hogwild_layout(groups), **kw)


def train_records(workspace):
    lines = (workspace / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["phase"] == "train"]


@pytest.mark.parametrize("groups", [2, 3])
@pytest.mark.parametrize("updater", ["type: kSGD momentum: 0.9", "type: kAdaGrad", "type: kAdam"])
def test_in_memory_hogwild_learns_and_reports_staleness(blobs_job, tmp_path, groups, updater):
    history = shoal.train(hogwild_job(blobs_job, groups, updater=updater), workspace=tmp_path / "ws", log=quiet)
    assert_ran(tmp_path / "ws", hogwild_layout(groups))
    assert history.final_test["accuracy"] >= 0.9
    records = train_records(tmp_path / "ws")
    assert all("staleness" in r and "staleness_max" in r for r in records)
    assert all(0 <= r["staleness"] <= r["staleness_max"] for r in records)
    # samples/s counts every group: global batch 32 per group step
    assert all(r["samples_per_sec"] > 0 for r in records)


def test_updater_slots_are_shared_by_the_groups(blobs_job, tmp_path):
    """One server, so one velocity per param for the one shared set of params (PyTorch's
    mnist_hogwild keeps an optimizer, and so a velocity, per process)."""
    from shoal.frontend.api import load_job
    from shoal.planning.plan import plan_job
    from shoal.runtime.assemble import RunSpec, assemble

    trainers = assemble(plan_job(load_job(hogwild_job(blobs_job, 3))), 0, RunSpec(tmp_path / "ws", log=quiet)).trainers
    servers = {id(t.exchange.server) for t in trainers}
    stores = {id(t.store) for t in trainers}
    assert len(servers) == 1 and len(stores) == 1
    for t in trainers:  # every group's net computes on the shared values themselves
        for name, leaf in t.workers[0].net._leaves.items():
            assert leaf.data_ptr() == t.store.values[name].data_ptr()
    shoal.train(hogwild_job(blobs_job, 2, steps=10), workspace=tmp_path / "run", log=quiet)
    assert_ran(tmp_path / "run", hogwild_layout(2))
    tensors = load_file(str(tmp_path / "run" / "checkpoint" / "step10-worker0.safetensors"))
    assert sorted(k for k in tensors if k.startswith("state/")) == [f"state/{p}/history" for p in ("b1", "b2", "w1", "w2")]


@pytest.mark.parametrize("bound", [0, 2])
def test_bounded_staleness_bounds_the_version_lag(blobs_job, tmp_path, bound):
    groups = 3
    shoal.train(hogwild_job(blobs_job, groups, steps=30, cluster_extra=dict(max_staleness=bound)), workspace=tmp_path / "ws", log=quiet)
    assert_ran(tmp_path / "ws", hogwild_layout(groups))
    # no group starts a step more than `bound` steps after the slowest has finished, so while a
    # group does step a, another (at least at a - bound) can finish steps up to a + bound
    assert max(r["staleness_max"] for r in train_records(tmp_path / "ws")) <= (groups - 1) * (2 * bound + 1)


def test_board_holds_a_group_that_runs_too_far_ahead():
    board = GroupBoard(2, max_staleness=1)
    board.step_done(0, 0, 32, 0)
    board.step_done(0, 1, 32, 0)  # group 0 has done 2 steps, group 1 none
    started = threading.Event()

    def group0_step2():
        board.wait_turn(0, 2)
        started.set()

    thread = threading.Thread(target=group0_step2)
    thread.start()
    assert not started.wait(0.3), "group 0 ran 2 steps ahead of group 1 with max_staleness 1"
    board.step_done(1, 0, 32, 0)
    assert started.wait(2.0)
    thread.join()


def test_warm_up_holds_the_other_groups_until_group_0_has_trained():
    board = GroupBoard(2, warmup_steps=3)
    started = threading.Event()
    thread = threading.Thread(target=lambda: (board.wait_turn(1, 0), started.set()))
    thread.start()
    for step in range(3):
        assert not started.wait(0.1)
        board.step_done(0, step, 32, 0)
    assert started.wait(2.0)
    thread.join()


def test_the_version_a_group_reads_is_taken_where_the_bound_counts_it():
    """A group's read and the others' updates are ordered: a version taken outside the board's lock could be several
    updates old when it counted, leaving a budget below what max_update_lag's safety assumes (in-memory Hogwild with
    max_update_lag 2 over 3 groups once hung the suite with every group waiting for the others)."""
    bound, updates, lags = 2, [0], []
    board = GroupBoard(3, max_update_lag=bound)

    def slow_version():  # the version is taken, then the reading thread is held up before it counts
        version = updates[0]
        time.sleep(0.3)
        return version

    def bump():
        updates[0] += 1

    def group(g, steps, version):
        for step in range(steps):
            board.read(g, version if step == 0 else (lambda: updates[0]))
            time.sleep(0.01)
            lags.append(board.apply(g, lambda: updates[0], bump))
            board.step_done(g, step, 1, lags[-1])
        board.stop(g)

    threads = [threading.Thread(target=group, args=(0, 3, slow_version), daemon=True)]
    threads += [threading.Thread(target=group, args=(g, 6, lambda: updates[0]), daemon=True) for g in (1, 2)]
    threads[0].start()
    time.sleep(0.05)
    for thread in threads[1:]:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert not any(thread.is_alive() for thread in threads), "the groups wait for each other for ever"
    assert len(lags) == 15 and max(lags) <= bound


def test_a_finished_or_dead_group_never_holds_the_others():
    board = GroupBoard(2, max_staleness=0)
    board.stop(1)
    start = time.perf_counter()
    for step in range(5):
        board.wait_turn(0, step)
        board.step_done(0, step, 32, 0)
    assert time.perf_counter() - start < 1.0


def test_a_dead_group_is_dropped_with_a_warning_and_the_job_finishes(blobs_job, tmp_path):
    job = hogwild_job(blobs_job, 3, steps=30)
    env = {**__import__("os").environ, "SHOAL_INJECT_GROUP_ERROR": "1:5"}
    proc = shoal_in_process("run", job, "--workspace", tmp_path / "ws", env=env, timeout=120)  # (one process: its threads)
    assert proc.returncode == 0, proc.stderr
    assert_ran(tmp_path / "ws", hogwild_layout(3))
    warnings = [line for line in proc.stderr.splitlines() if "WARNING" in line]
    assert "WARNING" not in proc.stdout  # warnings go to stderr
    assert len(warnings) == 1 and "worker group 1 died at step 5" in warnings[0] and "injected failure" in warnings[0]
    assert "Test @ step 30" in proc.stdout
    assert (tmp_path / "ws" / "checkpoint" / "step30-worker0.safetensors").exists()


def test_plan_names_in_memory_hogwild(blobs_job, tmp_path):
    job = hogwild_job(blobs_job, 2)
    proc = shoal_in_process("plan", job, "--json", timeout=60)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["framework"] == "in-memory Hogwild" and plan["nprocs"] == 1


def test_resume_of_an_in_memory_hogwild_run_continues_to_the_end(blobs_job, tmp_path):
    job = hogwild_job(blobs_job, 2, steps=20, extra="checkpoint_freq: 10")
    env = {**__import__("os").environ, "SHOAL_INJECT_GROUP_ERROR": "0:15"}
    with pytest.raises(RuntimeError, match="injected failure"):  # (in this process: the failure comes as raised)
        shoal_in_process("run", job, "--workspace", tmp_path / "ws", env=env, timeout=120)
    history = shoal.train(job, workspace=tmp_path / "ws", resume=True, log=quiet)
    assert_ran(tmp_path / "ws", hogwild_layout(2))
    assert history.final_test["step"] == 20 and history.final_test["accuracy"] >= 0.9


# -- Downpour over processes -------------------------------------------------------------
DOWNPOUR = "Downpour, 2 groups + 1 server, 3 processes"


def downpour_job(blobs_job, layout=DOWNPOUR, steps=40, **kw):
    """The blobs job on a multi-process asynchronous row of tests/layouts.py; kw: blobs_job's."""
    return blobs_job(train_steps=steps, layout=layout, **kw)


def run_cli(job, workspace, *extra, env=None, timeout=240, process=False):
    """`shoal run JOB --workspace WORKSPACE EXTRA` in this process (its forkserver starts the ranks: no interpreter and
    torch import per run), or in a real one (process=True: where the test reads the chief's lines, which a rank
    prints to its launcher's stdout)."""
    env = {**__import__("os").environ, "SHOAL_COMM_TIMEOUT": "20", **(env or {})}
    if not process:
        return shoal_in_process("run", job, "--workspace", workspace, *extra, env=env, timeout=timeout)
    return subprocess.run([sys.executable, "-m", "shoal", "run", str(job), "--workspace", str(workspace), *map(str, extra)],
                          capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.parametrize("layout", [
    DOWNPOUR,
    # the seed docs' Downpour: 2 groups x 2 workers, 2 separate servers (6 processes)
    pytest.param("Downpour, 2 groups x 2 workers + 2 servers, 6 processes", marks=pytest.mark.slow),
])
def test_downpour_over_processes_learns_with_stale_updates(blobs_job, tmp_path, layout):
    proc = run_cli(downpour_job(blobs_job, layout), tmp_path / "ws")
    assert proc.returncode == 0, proc.stderr
    assert_ran(tmp_path / "ws", layout)
    assert "Downpour" in proc.stdout
    records = [json.loads(line) for line in (tmp_path / "ws" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["phase"] == "test" and records[-1]["step"] == 40 and records[-1]["accuracy"] >= 0.9
    train = [r for r in records if r["phase"] == "train"]
    assert max(r["staleness_max"] for r in train) > 0  # the other group's updates land between pull and push
    assert (tmp_path / "ws" / "checkpoint" / "step40-worker0.safetensors").exists()


def test_downpour_survives_a_dead_worker_group(blobs_job, tmp_path, monkeypatch, capfd):
    """Through the Python API (in this process: its forkserver starts the ranks): the job goes on, and the History it
    returns names the group that died. The chief's lines are read from its log (rank0.log, what it prints): that a
    rank's lines reach the launcher's terminal is tests/test_multihost.py's and tests/test_stalls.py's."""
    monkeypatch.setenv("SHOAL_COMM_TIMEOUT", "20")
    monkeypatch.setenv("SHOAL_INJECT_EXIT", "1:10")
    history = shoal.train(downpour_job(blobs_job), workspace=tmp_path / "ws")
    assert history.failed_groups == ["worker group 1"]
    assert_ran(tmp_path / "ws", DOWNPOUR)
    assert "process 1 (worker(group=1, id=0)) exited with code 3; the other worker groups go on" in capfd.readouterr().err
    assert "Test @ step 40" in (tmp_path / "ws" / "logs" / "rank0.log").read_text()


@pytest.mark.slow  # the default suite's 5-minute budget; covered in it by a cheaper test
def test_downpour_fails_cleanly_when_a_server_dies_and_resumes_with_more_servers(blobs_job, tmp_path):
    job = downpour_job(blobs_job, steps=30, extra="checkpoint_freq: 10")
    start = time.perf_counter()
    proc = run_cli(job, tmp_path / "ws", env={"SHOAL_INJECT_EXIT": "2:30"})  # server version 30: about step 15
    assert proc.returncode != 0 and time.perf_counter() - start < 90
    error = proc.stderr.strip().splitlines()
    assert len(error) == 1 and "server(group=0, id=0)" in error[0], proc.stderr
    # resume from the last checkpoint with the params re-sliced over two servers
    proc = run_cli(job, tmp_path / "ws", "--resume", "--set", "cluster.nservers_per_group=2", process=True)  # reads the chief's lines
    assert proc.returncode == 0, proc.stderr
    assert (summary(tmp_path / "ws")["framework"], summary(tmp_path / "ws")["servers"]) == ("Downpour", 2)
    assert "Resume from checkpoint" in proc.stdout and "Test @ step 30" in proc.stdout


def test_server_state_reslices_to_any_server_count(blobs_job):
    """A whole-model updater state loaded by the servers of one slicing and gathered back is unchanged."""
    import torch

    from shoal.frontend.api import load_job
    from shoal.planning.placement import ServerId, place
    from shoal.runtime.exchanges.downpour_server import DownpourServer
    from shoal.runtime.exchanges.requests import server_segments
    from shoal.planning.plan import plan_job
    from shoal.runtime.trainer import Trainer
    from shoal.neuralnet.updaters import make_updater

    job = load_job(downpour_job(blobs_job, updater="type: kAdam"))
    store = Trainer(plan_job(job), blobs_job(), [], torch.device("cpu"), train=False).store
    updater = make_updater(job.updater)
    gen = torch.Generator().manual_seed(0)
    state = {n: {slot: torch.randn(store.info[n].shape, generator=gen) for slot in updater.init_state(torch.zeros(1))} for n in store.trainable_names()}
    for nservers in (1, 2, 3, 5):
        job.cluster.nservers_per_group = nservers
        placement = place(job.cluster, {n: i.numel for n, i in store.info.items()})
        rebuilt = {n: {slot: torch.zeros_like(v) for slot, v in slots.items()} for n, slots in state.items()}
        for i in range(nservers):
            server = DownpourServer(store, updater, placement, ServerId(0, i), {})
            server.load_state(state)
            flat, offset = server.state_flat(), 0
            for seg, slot, size in server.layout:
                rebuilt[seg.param][slot].view(-1)[seg.start : seg.stop] = flat[offset : offset + size]
                offset += size
        for n in state:
            for slot in state[n]:
                assert torch.equal(rebuilt[n][slot], state[n][slot]), (nservers, n, slot)
    assert server_segments([])[1] == 0


# -- Distributed Hogwild over processes ----------------------------------------------------
@pytest.mark.parametrize("groups", [pytest.param(2, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)])  # 3: the seed docs' Distributed Hogwild
def test_distributed_hogwild_syncs_replicas_and_learns(blobs_job, tmp_path, groups):
    layout = f"Distributed Hogwild, {groups} groups"  # each process a whole worker group and server group
    proc = run_cli(downpour_job(blobs_job, layout, cluster_extra=dict(sync_freq=2)), tmp_path / "ws")
    assert proc.returncode == 0, proc.stderr
    assert_ran(tmp_path / "ws", layout)
    assert "Distributed Hogwild" in proc.stdout and "WARNING" not in proc.stdout
    records = [json.loads(line) for line in (tmp_path / "ws" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["phase"] == "train"]
    # group 0 syncs with the masters of its foreign slices (one per other group) every 2 updates
    updates = train[-1]["step"] + 1
    assert sum(r["syncs"] for r in train) == (groups - 1) * (updates // 2)
    assert records[-1]["phase"] == "test" and records[-1]["accuracy"] >= 0.9


def test_distributed_hogwild_survives_a_dead_group(blobs_job, tmp_path):
    proc = run_cli(downpour_job(blobs_job, "Distributed Hogwild, 2 groups"), tmp_path / "ws", env={"SHOAL_INJECT_EXIT": "1:10"})
    assert proc.returncode == 0, proc.stderr
    assert_ran(tmp_path / "ws", "Distributed Hogwild, 2 groups")
    assert "process 1 (worker(group=1, id=0), server(group=1, id=0)) exited with code 3" in proc.stderr
    assert "Test @ step 40" in (tmp_path / "ws" / "logs" / "rank0.log").read_text()  # the chief's line (its log: see above)


@pytest.mark.parametrize("groups, bound", [(2, 0), pytest.param(3, 0, marks=pytest.mark.slow), pytest.param(3, 2, marks=pytest.mark.slow)])
def test_downpour_servers_bound_staleness(blobs_job, tmp_path, groups, bound):
    layout = {2: DOWNPOUR, 3: "Downpour, 3 groups + 1 server, 4 processes"}[groups]
    proc = run_cli(downpour_job(blobs_job, layout, steps=30, cluster_extra=dict(max_staleness=bound, warmup_steps=5)), tmp_path / "ws")
    assert proc.returncode == 0, proc.stderr
    assert_ran(tmp_path / "ws", layout)
    train = train_records(tmp_path / "ws")
    # servers hold a push that is too far ahead after it was computed, so the group's read is one step older
    # than in memory (where the wait comes before the read)
    assert max(r["staleness_max"] for r in train) <= (groups - 1) * (2 * bound + 2)
    # warm-up: group 0 trained alone for 5 steps, so its first window saw no other group's update
    assert train[0]["step"] == 0 and train[0]["staleness_max"] == 0


def test_in_memory_warm_up_with_bounded_staleness_never_deadlocks(blobs_job, tmp_path):
    job = hogwild_job(blobs_job, 3, steps=20, cluster_extra=dict(max_staleness=0, warmup_steps=5))
    history = shoal.train(job, workspace=tmp_path / "ws", log=quiet)
    assert_ran(tmp_path / "ws", hogwild_layout(3))
    train = train_records(tmp_path / "ws")
    assert history.final_test["step"] == 20 and train[0]["staleness_max"] == 0
    assert max(r["staleness_max"] for r in train) <= 2


def test_in_memory_downpour_without_shared_memory_keeps_one_copy_per_group(blobs_job, tmp_path):
    from shoal.frontend.api import load_job
    from shoal.planning.plan import plan_job
    from shoal.runtime.assemble import RunSpec, assemble

    job = hogwild_job(blobs_job, layout="in-memory Downpour, 2 groups")
    trainers = assemble(plan_job(load_job(job)), 0, RunSpec(tmp_path / "plan", log=quiet)).trainers
    stores = {id(t.store) for t in trainers} | {id(trainers[0].exchange.server.store)}
    assert len(stores) == 3  # each group's copy, and the server's
    history = shoal.train(job, workspace=tmp_path / "ws", log=quiet)
    assert_ran(tmp_path / "ws", "in-memory Downpour, 2 groups")
    assert history.final_test["accuracy"] >= 0.9
