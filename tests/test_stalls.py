"""A stalled process (SIGSTOP), found by heartbeat: named within the stall timeout, nothing left behind.

Real runs through the CLI; the stalled process's pid comes from the job registry, as `shoal jobs view`
shows it. Synchronous layouts fail with one line naming the stalled rank; asynchronous ones drop a
stalled group other than 0 and finish. The timeout is the job's cluster.stall_timeout_s (`--set`), or
SHOAL_STALL_TIMEOUT, its documented override. Also: a run started with SIGINT ignored, and SIGTERM.
"""
from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest
from fault_runs import SLOW, LayoutRun, assert_one_line, runs, wait_for  # noqa: F401 (runs: a fixture)
from layouts import assert_ran
from test_cli import leftover_processes

STALL_TIMEOUT = 3.0
Run = LayoutRun  # (tests that import test_stalls' Run: the same run, from tests/fault_runs.py)
SLACK = 20.0  # a loaded 2-core machine: beats every 0.75 s may be late, the launcher must reap and kill


@pytest.mark.parametrize("layout,rank", [
    ("AllReduce, 2 processes", 0),  # the chief, which hosts the store: its peers find the store silent
    pytest.param("AllReduce, 3 processes", 2, marks=pytest.mark.slow),
])
def test_a_stopped_process_of_a_synchronous_job_is_named_within_the_timeout(blobs_job, tmp_path, runs, layout, rank):
    # (slowed steps: the processes sleep, rather than spin the machine's cores, through the beats and the timeout)
    run = runs.start_layout(blobs_job(train_steps=100000), tmp_path, layout, env=SLOW, stall_timeout_s=STALL_TIMEOUT)
    pid = run.registered_pid(rank)
    time.sleep(1)  # a beat or more (every 0.75 s) after step 10: the peers know its step
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    code = run.wait(timeout=STALL_TIMEOUT + SLACK + 30)
    took = time.monotonic() - stopped
    print(f"{layout}: process {rank} stopped; the job ended {took:.1f} s later")
    assert code == 2, run.stderr()
    hosted = {0: "worker(group=0, id=0), server(group=0, id=0)", 2: "worker(group=0, id=2), server(group=0, id=2)"}[rank]
    line = assert_one_line(run.stderr(), f"process {rank} ({hosted}) stopped answering (no heartbeat for ", ", the last at step ")
    assert STALL_TIMEOUT <= took + 1.0 < STALL_TIMEOUT + SLACK, (took, line)  # silence counts from its last beat
    summary = json.loads((run.ws / "summary.json").read_text())
    assert summary["status"] == "failed" and f"process {rank}" in summary["reason"]
    assert leftover_processes(tmp_path) == []  # the stopped one too: SIGTERM waits for SIGCONT, SIGKILL does not


ASYNC_STALLS = {
    # layout: (the stalled process, the group it hosts, the log of a process that drops it)
    "Downpour, 2 groups + 1 server, 3 processes": (1, 1, "rank2.log"),
    "Distributed Hogwild, 2 groups": (1, 1, None),  # the chief: its warning is the word
}


@pytest.mark.parametrize("wakes", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["wakes later", "stays stopped"])
@pytest.mark.parametrize("layout", [next(iter(ASYNC_STALLS)), *[pytest.param(name, marks=pytest.mark.slow) for name in list(ASYNC_STALLS)[1:]]])
def test_a_stopped_group_of_an_asynchronous_job_is_dropped_and_the_job_finishes(blobs_job, tmp_path, runs, layout, wakes):
    rank, group, dropper = ASYNC_STALLS[layout]
    # group 0's steps take 30 ms or more until the woken process has seen its own stop (SHOAL_SLOW_UNTIL): the run
    # outlasts the stall, the drop and the wake-up (about step 200 of 600 when idle) with 18 s to spare under load,
    # then trains its last steps at full speed
    steps = 600
    release = tmp_path / "woken"
    run = runs.start_layout(blobs_job(train_steps=steps), tmp_path, layout, "--set", f"test_freq={steps // 2}",
                            env={"SHOAL_SLOW_WORKER": "0:0+0.03", "SHOAL_SLOW_UNTIL": str(release)},
                            stall_timeout_s=STALL_TIMEOUT, timeout_from_environment=True)
    pid = run.registered_pid(rank)
    time.sleep(1)  # a beat or more after step 10
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    took = wait_for(lambda: "WARNING" in run.stderr(), STALL_TIMEOUT + SLACK, "no warning: " + run.stderr())
    print(f"{layout}: process {rank} stopped; the chief warned {took:.1f} s later")
    assert STALL_TIMEOUT <= took + 1.0 < STALL_TIMEOUT + SLACK, took  # silence counts from the group's last beat, up to one beat before the stop
    logs = run.ws / "logs"
    if wakes:  # once every process that drops the group did (the chief's warning may come first), and stopped
        # longer than the stall timeout: what the woken process must see of its own stop
        if dropper is not None:
            wait_for(lambda: "drops worker group 1" in (logs / dropper).read_text(), SLACK, "the group was never dropped")
        time.sleep(max(0.5, stopped + STALL_TIMEOUT + 1.0 - time.monotonic()))
        os.kill(pid, signal.SIGCONT)
        wait_for(lambda: _saw_its_stop(logs / f"rank{rank}.log") or run.proc.poll() is not None, SLACK,
                 "the woken process never saw it was stopped")
    release.touch()
    assert run.wait(timeout=180) == 0, run.stderr()
    warnings = [line for line in run.stderr().splitlines() if line.strip()]
    assert len(warnings) == 1, warnings  # one line, from the chief; nothing from the launcher
    assert warnings[0].startswith(f"WARNING: worker group {group} dropped: process {rank} (worker(group={group}, id=0)")
    assert "stopped answering (no heartbeat for " in warnings[0]
    summary = assert_ran(run.ws, layout)
    assert summary["status"] == "finished"
    final = [line for line in run.out.read_text().splitlines() if line.startswith(f"Test @ step {steps}")]
    loss = float(re.search(r"Loss = ([0-9.e+-]+)", final[0])[1])
    assert loss < 0.5, final  # group 0 trained on, on params the dropped group did not spoil
    assert dropper is None or "drops worker group 1" in (logs / dropper).read_text()
    if wakes:  # it found it had been dropped: its push refused, or the gap in its own heartbeat
        assert _saw_its_stop(logs / f"rank{rank}.log")
    assert leftover_processes(tmp_path) == []


def _saw_its_stop(log) -> bool:
    return bool(re.search(r"refused its push|was stopped for \d+ s", log.read_text()))


def displayed_step(stdout: str) -> int:
    """The step of the chief's latest training display."""
    return max(map(int, re.findall(r"^Train @ step (\d+) ", stdout, re.M)), default=-1)


@pytest.mark.parametrize("layout", ["single worker", "AllReduce, 2 processes"])
def test_started_with_sigint_ignored_ctrl_c_is_ignored_and_sigterm_stops_it(blobs_job, tmp_path, runs, layout):
    """nohup or `shoal run ... &` in a script starts shoal with SIGINT ignored: it keeps ignoring the terminal's
    Ctrl-C (as POSIX asks of such programs); SIGTERM (`shoal jobs kill`) always stops every process."""
    run = runs.start_layout(blobs_job(train_steps=100000), tmp_path, layout, env=SLOW, ignore_sigint=True)
    run.registered_pid(0)
    os.killpg(run.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C would do
    # ignored: the job trains on, 50 steps past the signal (an obeyed Ctrl-C stops it within a step)
    signalled = displayed_step(run.stdout())

    def trained_on() -> bool:
        assert run.proc.poll() is None and "interrupted" not in run.stderr(), run.stderr()
        return displayed_step(run.stdout()) >= signalled + 50

    wait_for(trained_on, 60, f"it did not train on past the Ctrl-C: {run.stderr()}")
    os.kill(run.proc.pid, signal.SIGTERM)
    assert run.wait(timeout=60) == 130
    assert run.stderr().strip().splitlines()[-1].startswith("shoal: interrupted")
    assert assert_ran(run.ws, layout)["status"] == "killed"
    assert leftover_processes(tmp_path) == []


def test_a_foreign_heartbeat_value_is_ignored_with_one_warning(capfd):
    """Any local process may write the store's keys: a heartbeat that does not parse is not a beat (the peer
    is still judged by its silence), and it costs one warning, never a traceback."""
    import datetime

    import torch.distributed as dist

    from shoal.comm.heartbeat import Watch

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
    store.set("shoal/heartbeat/1", "\x00not a heartbeat")
    stalls = []
    watch = Watch(store, rank=0, world=2, on_stall=stalls.append, timeout_s=1.0).start()
    try:
        wait_for(lambda: stalls, 10, "the silent peer was never judged")
        time.sleep(0.5)
    finally:
        watch.stop()
    assert [(s.rank, s.step) for s in stalls] == [(1, -1)]
    err = capfd.readouterr().err
    assert err.count("WARNING: ignoring heartbeat key shoal/heartbeat/1") == 1, err
    assert "Traceback" not in err
    assert store.get("shoal/heartbeat/0").decode().startswith("done ")  # it said it ended
