"""A Downpour server's death under `shoal run --max-restarts N` (issue 38, point 1): the launcher restarts the server
process into the running job, it heals from the chief's mirror (the chief's newest values of its slices and its
mirror of the updater state), and the worker groups go on with it: no whole-job restart, no checkpoint read.

Real processes, real kills: the server's pid from the job registry (as `shoal jobs view` shows it), SIGKILLed (or
SIGSTOPped past the stall timeout) mid-run; the other processes keep their pids to the end.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import signal
from pathlib import Path

import pytest
from cli_in_process import run_cli
from fault_runs import SLOW, Run, pids, runs, wait_for  # noqa: F401 (runs: the fixture that stops what a failed test left running)
from layouts import assert_ran
from test_cli import leftover_processes

DOWNPOUR = "Downpour, 2 groups + 1 server, 3 processes"
SERVER = "process 2 (server(group=0, id=0))"
RAW = ("gloo", "c10d", ".cpp", "GLHF", "Traceback")


def worker_pids(ws: Path) -> dict[int, list[int]]:
    """Each worker process's pids, in order, from the start lines of its log (a server's log names none)."""
    return {rank: pids(ws, rank) for rank in (0, 1)}


def assert_healed(run: Run, steps: int, how: str) -> dict:
    """One line for the death, one for the heal; the job finished as one run; the server ran as two processes, the
    others as one each; the heal's record in summary.json's rejoins."""
    err, out = run.stderr(), run.out.read_text()
    deaths = re.findall(rf"^WARNING: {re.escape(SERVER)} {how}; restarting it \(restart 1 of 1\); it heals from worker "
                        r"group 0's mirror of its state, the other processes wait for it$", err, re.M)
    assert len(deaths) == 1, err
    heals = re.findall(r"^server\(group=0, id=0\) \(process restart 1\) healed from worker group 0's mirror: its values of "
                       r"version (\d+) \(digest [0-9a-f]{16}\) and the updater state of version (\d+), [0-9.]+ s after its "
                       r"process started; updates applied after version \d+ by the dead server, and pushes in flight, are lost$",
                       out, re.M)
    assert len(heals) == 1, out
    assert "restarting the whole job" not in err and "ServerLost" not in err, err
    for mark in RAW:
        assert mark.lower() not in err.lower(), err
    summary = assert_ran(run.ws, DOWNPOUR)
    assert summary["status"] == "finished" and summary["steps"] == steps, summary
    assert "job_restarts" not in summary  # no whole-job restart: nothing was resumed from a checkpoint
    (record,) = [r for r in summary["rejoins"] if r.get("server") is not None]
    assert (record["server"], record["rank"], record["incarnation"], record["healed_from_group"]) == (0, 2, 1, 0), record
    assert record["version"] == int(heals[0][0]) > 0
    records = [json.loads(line) for line in (run.ws / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert not any(r["phase"] == "resume" for r in records)
    assert summary["final_test"]["accuracy"] >= 0.9  # as unfaulted on this data
    return summary


def held_links(pid: int) -> list[int]:
    """Copies in this process of process `pid`'s sockets (pidfd_getfd, Linux 5.6+; [] where it is refused): once `pid`
    is killed, its connections stay open, as a dead server's links now and then look to gloo under load (issue 38),
    so its peers learn of the death only from the launcher's word."""
    libc, fds = ctypes.CDLL(None, use_errno=True), []
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        return fds
    try:
        for entry in os.scandir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(entry.path).startswith("socket:"):
                    fd = libc.syscall(438, pidfd, int(entry.name), 0)  # SYS_pidfd_getfd (438 on every architecture)
                    if fd >= 0:
                        fds.append(fd)
            except OSError:
                continue
    finally:
        os.close(pidfd)
    return fds


def test_a_killed_downpour_server_is_restarted_and_heals_from_the_chiefs_mirror(blobs_job, tmp_path, runs):
    """Its connections held open past its death (`held_links`): before, the chief's call on the dead server's channel
    waited out the comm timeout (45 s) before the heal; now every stub gives up on the launcher's word."""
    steps = 150
    run = runs.start_layout(blobs_job(train_steps=steps), tmp_path, DOWNPOUR, "--max-restarts", "1", "--set",
                            "test_freq=150", "--set", "updater.momentum=0.9", env=SLOW)  # momentum: an updater state to mirror
    server, chief, group1 = run.pid_of(2), run.pid_of(0), run.pid_of(1)
    held = held_links(server)
    try:
        os.kill(server, signal.SIGKILL)
        assert run.wait(timeout=120) == 0, run.stderr()
    finally:
        for fd in held:
            os.close(fd)
    summary = assert_healed(run, steps, r"died \(SIGKILL\)")
    (record,) = [r for r in summary["rejoins"] if r.get("server") is not None]
    assert record["pid"] != server  # the server ran as two processes
    assert record["process_start_to_heal_s"] < 10, record  # (before, with its links held: 45 s, the comm timeout)
    assert worker_pids(run.ws) == {0: [chief], 1: [group1]}  # the others kept theirs to the end
    assert leftover_processes(tmp_path) == []


@pytest.mark.slow  # a stall timeout (3 s) to wait out
def test_a_stopped_downpour_server_is_ended_restarted_and_heals(blobs_job, tmp_path, runs):
    steps = 300
    run = runs.start_layout(blobs_job(train_steps=steps), tmp_path, DOWNPOUR, "--max-restarts", "1", "--set", "test_freq=300",
                            env=SLOW)
    server, chief, group1 = run.pid_of(2), run.pid_of(0), run.pid_of(1)
    os.kill(server, signal.SIGSTOP)
    assert run.wait(timeout=120) == 0, run.stderr()
    summary = assert_healed(run, steps, r"was stopped past the stall timeout \(3 s\); the launcher ended it \(SIGKILL\)")
    (record,) = [r for r in summary["rejoins"] if r.get("server") is not None]
    assert record["pid"] != server
    assert worker_pids(run.ws) == {0: [chief], 1: [group1]}
    assert leftover_processes(tmp_path) == []


@pytest.mark.slow  # ~5 s: a run of its own (plain SGD, whose mirror is the stalest), over the default suite's budget
def test_a_group_killed_after_the_heal_rejoins_at_the_step_it_reached_not_the_mirrors(blobs_job, tmp_path, runs):
    """The healed server's counters are as old as the chief's mirror (plain SGD: counters only, every 50 steps; this
    one from step 0); group 1's pull of the healed values says the step it reached, so its process killed after that
    pull rejoins there, not at the mirror's step 1. max_staleness makes it count twice: held by its own stale step,
    group 1 could not push, and the chief would wait on it past the comm timeout (a whole-job restart).
    Beside 3 busy processes it used to fail about 1 run in 10: a stub's call on the dead server's channel waited out
    the comm timeout (45 s), so the heal came late; now each call gives up on the launcher's word (issue 38)."""
    steps = 150
    run = runs.start_layout(blobs_job(train_steps=steps, updater="type: kSGD"), tmp_path, DOWNPOUR, "--max-restarts", "1",
                            "--set", "test_freq=150", "--set", "cluster.max_staleness=2", env=SLOW)
    server, chief, group1 = run.pid_of(2), run.pid_of(0), run.pid_of(1)
    os.kill(server, signal.SIGKILL)
    log1 = run.ws / "logs" / "rank1.log"
    dropped = r"^worker group 1: server\(group=0, id=0\) was restarted \(restart 1\); the push of step (\d+) was dropped"
    wait_for(lambda: log1.exists() and re.search(dropped, log1.read_text(), re.M), 90,
             f"group 1 never took the healed values: {run.stderr()}", interval=0.02)
    reached = int(re.search(dropped, log1.read_text(), re.M)[1])  # the first step the dead server did not apply
    assert reached >= 5, reached  # (killed once the chief displayed step 10: the mirror's step 1 is far behind)
    os.kill(group1, signal.SIGKILL)
    assert run.wait(timeout=120) == 0, run.stderr()
    records = [json.loads(line) for line in (run.ws / "logs" / "rejoins.jsonl").read_text().splitlines() if line.strip()]
    (rejoin,) = [r for r in records if r["group"] == 1]
    assert rejoin["incarnation"] == 1 and rejoin["step"] >= reached, (reached, rejoin)  # before: step 1, the mirror's
    assert f"Worker group 1 rejoined at step {rejoin['step']} (process 1, restart 1)" in run.stdout()
    assert_healed(run, steps, r"died \(SIGKILL\)")  # and no whole-job restart (before: the chief waited on group 1)
    ran = worker_pids(run.ws)
    assert ran[0] == [chief] and ran[1][0] == group1 and len(ran[1]) == 2, ran  # the chief kept its pid to the end
    assert leftover_processes(tmp_path) == []


@pytest.mark.slow  # the default suite's budget; the same path as before this feature (nothing mirrored, nothing restarted)
def test_without_restarts_a_dead_downpour_server_stops_the_job_as_before(blobs_job, tmp_path):
    """--max-restarts 0: nothing mirrored, nothing restarted; the server's death stops the job in one line naming it."""
    ws = tmp_path / "ws"
    proc = run_cli("run", blobs_job(train_steps=60, layout=DOWNPOUR), "--workspace", ws, "--no-progress", "--max-restarts",
                   "0", env={**os.environ, "SHOAL_INJECT_EXIT": "2:30"}, timeout=120)  # server version 30: about step 15
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line == f"{SERVER} exited with code 3; the other processes were stopped; see {ws}/logs/rank2.log", line
    assert "healed" not in proc.stdout
    assert not (ws / "logs" / "rejoins.jsonl").exists()


def test_the_mirror_interval_follows_the_updater_states_size():
    """The cost model's choice: the state's bytes over K steps at most a quarter of the chief's 2 x shard per step."""
    from shoal.runtime.exchanges.downpour_mirror import COUNTERS_EVERY, mirror_interval

    assert mirror_interval(0, 1000) == COUNTERS_EVERY  # plain SGD: counters only, now and then
    assert mirror_interval(1000, 1000) == 2  # momentum
    assert mirror_interval(2000, 1000) == 4  # Adam's two moments
    assert mirror_interval(2001, 1000) == 5  # (a per-param step slot beside them)
