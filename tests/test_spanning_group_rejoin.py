"""Issue 38: a Downpour worker group over several processes comes back into the running job, as a group of one process
does (tests/test_rejoin.py).

SINGA's own Downpour layout (2 groups x 2 workers, one worker a process, 2 servers in processes of their own): a
process of group 1 dies (SIGKILL of the pid its log names) or stalls (SIGSTOP); `shoal run --max-restarts 1` ends the
group's other process, restarts both (one line naming them), they form their group afresh on the job's store
(shoal.comm.regroup) and its stub pulls the servers' live params for both (launcher/rejoin.py's `_restart_group`,
DownpourExchange.rejoin). The other group and the servers keep their processes to the end; the run exits 0. Group 0's
chief killed the same way: group 1's stub takes the chief's duties and group 0 comes back as an ordinary group.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import signal
import threading

import pytest
from fault_runs import (LayoutRun as Run, assert_no_library_text, closing_line, pids, registered_pids,  # noqa: F401
                        runs, wait_for)
from layouts import assert_ran

from shoal.comm import regroup
from shoal.neuralnet import checkpoint as ckpt_io
from test_cli import alive, leftover_processes

LAYOUT = "Downpour, 2 groups x 2 workers + 2 servers, 6 processes"
STEPS = 150
SLOW = {"SHOAL_SLOW_WORKER": "0:0+0.01"}  # every group's steps take 10 ms or more: the run outlasts a kill and a rejoin
SERVERS = (4, 5)  # the servers' processes come after the 2 groups' 4


def start(job, tmp_path, runs, env: dict = SLOW) -> Run:
    """The layout's run of `job` with one restart per process, in `tmp_path` (made if missing). The stall timeout is
    10 s: six processes on two loaded cores once went 3 s, and once 5 s, without a heartbeat."""
    tmp_path.mkdir(exist_ok=True)
    runs.append(Run(job, tmp_path, LAYOUT, "--max-restarts", "1", "--set", "test_freq=50", env=env, stall_timeout_s=10.0))
    return runs[-1]


def server_log(workspace, rank: int) -> str:
    return (workspace / "logs" / f"rank{rank}.log").read_text()


def rejoin_lines(stdout: str, group: int = 1) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith(f"Worker group {group} rejoined at step ")]


def members(group: int) -> tuple[int, int]:
    """The group's processes: its stub, then its second worker's."""
    return 2 * group, 2 * group + 1


def run_and_fault(job, tmp_path, runs, victim: int, sig: int, env: dict = SLOW) -> tuple[Run, dict[int, int], int]:
    """The layout's run with restarts, `sig` sent to process `victim` once the chief displayed step 10; returns the run,
    the pids of the other group's processes and the servers' then, and the victim's pid. The other group's stub (the
    chief, or the one that took its place, whose last request waits for the rejoined group) and the servers are asked
    to be alive once the victim's group rejoined (the other group's second process may have trained its last step)."""
    run = start(job, tmp_path, runs, env)
    pid = run.pid_of(victim)
    group = victim // 2
    kept = (*members(1 - group), *SERVERS)
    others = {rank: pid for rank, pid in registered_pids(run.ws).items() if rank in kept}
    assert sorted(others) == sorted(kept), others
    os.kill(pid, sig)
    wait_for(lambda: rejoin_lines(run.stdout(), group) or run.proc.poll() is not None, 120, "no rejoin")
    waiting = (members(1 - group)[0], *SERVERS)
    assert [rank for rank in waiting if not alive(others[rank])] == [], run.stderr()  # nobody else stopped meanwhile
    assert run.wait(timeout=180) == 0, run.stderr()
    return run, others, pid


def assert_the_group_came_back(run: Run, others: dict[int, int], victim: int, victim_pid: int) -> dict:
    """The victim's group's two processes were each started twice (the victim's first pid the one killed), the other
    group's and the servers' once; the stub's record names both processes; every server applied all of both groups'
    steps; the layout ran to the end. Returns the summary."""
    stdout, group = run.stdout(), victim // 2
    stub, second = members(group)
    (line,) = rejoin_lines(stdout, group)
    rejoined = re.match(rf"Worker group {group} rejoined at step (\d+) \(processes {stub}, {second}, restart 1\): live params "
                        r"of version (\d+), ", line)
    assert rejoined, line
    step, version = map(int, rejoined.groups())
    assert 0 <= step < STEPS and version >= step, line
    for rank in members(group):
        first, again = pids(run.ws, rank)
        assert again != first and (rank != victim or first == victim_pid), pids(run.ws, rank)
    assert re.search(rf"^Worker group {group} rejoined at step {step} \(process {second}, restart 1\): the live params its "
                     rf"stub, process {stub}, pulled \(version {version}\)$", (run.ws / "logs" / f"rank{second}.log").read_text(), re.M)
    for rank in members(1 - group):
        assert pids(run.ws, rank) == [others[rank]], pids(run.ws, rank)
    for server, rank in enumerate(SERVERS):
        log = server_log(run.ws, rank)
        assert log.count(" start in process ") == 1, log[-2000:]  # never restarted
        final = re.search(rf"server\(group=0, id={server}\): version (\d+); updates applied: group 0: (\d+)(?: \(2 processes\))?, "
                          r"group 1: (\d+)(?: \(2 processes\))?$", log, re.M)  # (the restarted group's served by 2 processes)
        assert final and tuple(map(int, final.groups())) == (2 * STEPS, STEPS, STEPS), log[-2000:]
    records = [json.loads(r) for r in (run.ws / "logs" / "rejoins.jsonl").read_text().splitlines()]
    assert [(r["group"], r["rank"], r["processes"], r["incarnation"], r["step"]) for r in records] == [
        (group, stub, [stub, second], 1, step)]
    got = assert_ran(run.ws, LAYOUT)
    assert got["status"] == "finished" and got["steps"] == STEPS and "job_restarts" not in got, got
    assert got["rejoins"] == records, got
    assert got["final_test"]["accuracy"] > 0.9, got["final_test"]  # (the unfaulted run: 1; slow test below compares)
    assert_no_library_text(stdout, run.stderr(), *((run.ws / "logs" / f"rank{r}.log").read_text() for r in range(6)))
    assert leftover_processes(run.tmp_path) == []
    return got


@pytest.mark.slow  # 4 at once under load, 1 of 4 ended in a whole-job restart: the server stopped answering group 0 at
# step -1 while group 1 came back (not yet understood: the closing note of 2026-11-29); the chief's group's case below
# drives the same group restart in the default suite
def test_a_killed_process_of_a_group_over_two_processes_brings_the_whole_group_back(blobs_job, tmp_path, runs):
    """Process 3 (group 1's second worker) SIGKILLed: the launcher ends process 2 (the group's stub, waiting on it) and
    restarts both, in one line; they rejoin at the step the servers counted for the group."""
    run, others, victim = run_and_fault(blobs_job(train_steps=STEPS), tmp_path, runs, 3, signal.SIGKILL)
    (warning,) = [line for line in run.stderr().splitlines() if line.startswith("WARNING")]
    assert warning == (
        "WARNING: process 3 (worker(group=1, id=1)) died (SIGKILL); worker group 1 spans processes 2, 3: the launcher ended "
        "process 2 (SIGKILL); the other worker groups go on; restarting processes 2, 3 (restart 1 of 1); they form their "
        "group afresh and rejoin from the servers' live params"
    ) or re.fullmatch(  # (process 2, its peer gone, may have exited on its own before the launcher saw process 3's end)
        r"WARNING: process (3 \(worker\(group=1, id=1\)\) died \(SIGKILL\)|2 \(worker\(group=1, id=0\)\) exited with "
        r"code 1); worker group 1 spans processes 2, 3: process [23] (died \(SIGKILL\)|exited with code 1) too; the other "
        r"worker groups go on; restarting processes 2, 3 \(restart 1 of 1\); they form their group afresh and rejoin "
        r"from the servers' live params", warning), warning
    assert_the_group_came_back(run, others, 3, victim)


@pytest.mark.slow
@pytest.mark.parametrize("victim, sig", [(2, signal.SIGKILL), (3, signal.SIGSTOP)])
def test_a_group_over_two_processes_comes_back_after_its_stub_dies_or_a_process_stalls(blobs_job, tmp_path, runs, victim, sig):
    """The group's stub SIGKILLed, or its second process stopped (SIGSTOP: the chief drops the group when its heartbeat
    stops for the stall timeout, the launcher ends the stopped process past it): both processes come back, the group
    rejoins, and the run ends as accurate as the unfaulted run of the same job."""
    job = blobs_job(train_steps=STEPS)
    # a stall is seen after the stall timeout (10 s) and a beat: 120 ms a step keeps group 0 training meanwhile
    env = {"SHOAL_SLOW_WORKER": "0:0+0.12"} if sig == signal.SIGSTOP else SLOW
    run, others, victim_pid = run_and_fault(job, tmp_path / "faulted", runs, victim, sig, env)
    warnings = [line for line in run.stderr().splitlines() if line.startswith("WARNING")]
    restarting = [line for line in warnings if "worker group 1 spans processes 2, 3" in line]
    assert len(restarting) == 1 and "restarting processes 2, 3 (restart 1 of 1)" in restarting[0], warnings
    if sig == signal.SIGSTOP:  # (the launcher ends the stopped process, or the stub leaves first, dropped by the job)
        assert re.match(r"WARNING: process (3 \(worker\(group=1, id=1\)\) was stopped past the stall timeout \(10 s\) and "
                        r"dropped; the launcher ended it \(SIGKILL\)|2 \(worker\(group=1, id=0\)\) left after the job dropped it "
                        r"for a stall); ", restarting[0]), restarting
    got = assert_the_group_came_back(run, others, victim, victim_pid)
    plain = start(job, tmp_path / "plain", runs)
    assert plain.wait(timeout=180) == 0, plain.stderr()
    unfaulted = assert_ran(plain.ws, LAYOUT)["final_test"]
    assert abs(got["final_test"]["accuracy"] - unfaulted["accuracy"]) <= 0.05, (got["final_test"], unfaulted)
    assert got["final_test"]["loss"] < max(2 * unfaulted["loss"], 0.05), (got["final_test"], unfaulted)


def test_the_chiefs_group_over_two_processes_comes_back_as_an_ordinary_group(blobs_job, tmp_path, runs):
    """Process 0 (the chief, group 0's stub) SIGKILLed: the launcher ends process 1 and restarts both; process 2 (group
    1's stub, the lowest living one) takes the chief's duties: it tests, writes the run log and the final checkpoint,
    keeps the servers' mirror and sends their last request; group 0 rejoins from the servers' live params. No
    whole-job restart."""
    run, others, victim = run_and_fault(blobs_job(train_steps=STEPS), tmp_path, runs, 0, signal.SIGKILL)
    stdout, stderr = run.stdout(), run.stderr()
    (warning,) = [line for line in stderr.splitlines() if line.startswith("WARNING")]
    assert re.fullmatch(
        r"WARNING: process (0 \(worker\(group=0, id=0\)\) died \(SIGKILL\)|1 \(worker\(group=0, id=1\)\) exited with "
        r"code 1); worker group 0 spans processes 0, 1: (the launcher ended process 1 \(SIGKILL\)|process [01] (died "
        r"\(SIGKILL\)|exited with code 1) too); the other worker groups go on, the lowest living one's stub taking the "
        r"chief's place; restarting processes 0, 1 \(restart 1 of 1\); they form their group afresh and rejoin as an "
        r"ordinary group from the servers' live params", warning), warning
    took = int(re.search(r"^Process 2 took the chief's place after step (\d+): it tests and validates, writes the run log "
                         r"and the checkpoints, keeps the servers' mirror and sends their last request$", stdout, re.M)[1])
    got = assert_the_group_came_back(run, others, 0, victim)
    assert got["chief_succession"] == [{"process": 2, "after_step": took}], got
    assert got["final_test"]["step"] == STEPS, got
    final = ckpt_io.load(ckpt_io.checkpoint_file(run.ws, STEPS), parts=True)
    assert (final.trainer["writer"], final.trainer["writer_group"]) == (2, 1), final.trainer
    assert f"process 2 took the chief's place after step {took}" in closing_line(stdout)


def test_a_group_formed_afresh_sums_and_broadcasts_and_refuses_a_member_without_the_jobs_secret():
    """comm/regroup.py on a store of its own, its two members threads: a group whose members hold the job's secret
    reduces to its stub and broadcasts back; at the next incarnation a member with another secret is refused by both."""
    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=20), wait_for_workers=False)
    got: dict[int, object] = {}

    def member(rank: int, secret: bytes, incarnation: int) -> None:
        try:
            group = regroup.form_afresh("workers/g1", (2, 3), rank, incarnation, store=store, secret=secret, timeout_s=20)
            value = torch.tensor([float(rank)])
            group.reduce_sum(value, 2).wait()
            group.broadcast(value, 2).wait()
            got[rank] = float(value)
        except regroup.GroupImpostor as err:
            got[rank] = str(err)

    for incarnation, secrets in (1, {2: b"s" * 32, 3: b"s" * 32}), (2, {2: b"s" * 32, 3: b"x" * 32}):
        got.clear()
        members = [threading.Thread(target=member, args=(rank, secret, incarnation)) for rank, secret in secrets.items()]
        for thread in members:
            thread.start()
        for thread in members:
            thread.join(60)
        if incarnation == 1:
            assert got == {2: 5.0, 3: 5.0}, got
        else:
            assert got == dict.fromkeys((2, 3), "workers/g1: a process joining restart 2 of the group could not prove it "
                                                "holds the job's secret; the group was not formed"), got
