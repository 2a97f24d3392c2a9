"""Two faults at once (issue 38): two processes dead at the same step, and a second death while the first heals.

Real runs through the CLI (`shoal run JOB --max-restarts N`) on the blobs data, with faults injected by the
environment (shoal.launcher.faults: SHOAL_INJECT_EXIT="0:12,1:12" ends processes 0 and 1 at step 12; "1:12,1:13" ends
process 1 at step 12 and its restart right after it rejoined). Under AllReduce's replicas, Sandblaster's worker
processes and DiLoCo's groups the lowest living process decides in the dead chief's place (shoal.comm.quorum) even
when the next in line died with it, and every restart heals from it; a restart that dies again is restarted again.
Every worker process dead at once leaves nobody to admit a restart: the launcher restarts the whole job instead.
"""
from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from cli_in_process import run_cli
from fault_runs import SLOW, assert_job_processes_ended, assert_no_library_text, closing_line, pids, runs, summary, train_records, wait_for  # noqa: F401 (runs)
from layouts import LAYOUTS, Layout, assert_ran, process_logs
from test_cli import leftover_processes
from test_local_sgd_faults import DILOCO, params

from shoal.launcher import faults
from shoal.neuralnet import checkpoint as ckpt_io

REPLICATED = LAYOUTS["AllReduce, 3 processes, replicated (max_restarts 1)"]
HELD = ["--set", "cluster.stall_timeout_s=120"]  # survivors held (SIGSTOP) while restarts start: not stalled
DILOCO_3 = Layout(dict(nworker_groups=3, local_steps=5), 3, 3, "DiLoCo")  # each group in a process of its own


def test_a_fault_variable_takes_several_pairs_one_per_process_of_a_rank(monkeypatch):
    """"0:12,1:12" names two processes; the old one-pair form still works; a rank's second pair is its restart's, met at
    the first step it trains at or past it (it rejoins where it can), never its predecessor's again."""
    monkeypatch.setenv("SHOAL_INJECT_EXIT", "0:12, 1:12,1:13")
    monkeypatch.setenv("SHOAL_INJECT_STALL", "2:7")
    injected = faults.from_environment()
    assert [(f.step, f.action, f.restarted) for f in injected.process_hooks(0)] == [(12, "exit", False)]
    assert [(f.step, f.action) for f in injected.process_hooks(1)] == [(12, "exit")]
    assert [(f.step, f.action) for f in injected.process_hooks(2)] == [(7, "stall")] and injected.process_hooks(3) == []
    assert [(f.step, f.restarted) for f in faults.from_environment(1).process_hooks(1)] == [(13, True)]
    assert faults.from_environment(1).process_hooks(0) == [] and faults.from_environment(2).process_hooks(1) == []
    (first,), (restart,) = injected.process_hooks(1), faults.from_environment(1).process_hooks(1)
    assert [first._fires(s) for s in (11, 12, 13)] == [False, True, False]
    assert [restart._fires(s) for s in (12, 13, 20)] == [False, True, True]  # (rejoined at 20: at once)
    monkeypatch.setenv("SHOAL_INJECT_EXIT", "2:30,2:40")  # a Downpour server's versions
    assert faults.server_exit_version(2) == 30 and faults.server_exit_version(2, incarnation=1) == 40
    monkeypatch.setenv("SHOAL_INJECT_EXIT", "12")
    with pytest.raises(ValueError, match="SHOAL_INJECT_EXIT: RANK:STEP pairs"):
        faults.from_environment().process_hooks(0)


def test_a_restarted_process_meets_its_own_fault_not_its_predecessors():
    """Process 1's restart (incarnation 1) rejoined at step 12, its predecessor's: it goes on there; it exits at step 30."""
    import subprocess
    import sys

    code = ("from shoal.launcher import faults\n(hook,) = faults.from_environment(1).process_hooks(1)\n"
            "hook.before_step(12)\nhook.before_step(29)\nprint('went on', flush=True)\nhook.before_step(30)\nprint('not reached')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "SHOAL_INJECT_EXIT": "1:12,1:30"})
    assert (proc.returncode, proc.stdout) == (3, "went on\n"), proc.stderr


def faulted_run(job, ws, env, restarts=2):
    """`shoal run JOB --max-restarts RESTARTS` in this process (its forkserver starts the ranks), which must exit 0."""
    proc = run_cli("run", job, "--workspace", ws, "--no-progress", "--max-restarts", str(restarts),
                   env={**os.environ, **env}, timeout=180)
    assert proc.returncode == 0, proc.stderr + process_logs(ws)
    return proc


LOWEST = "the state of the lowest living process, which decides the steps now"


def exited(rank: int, donor: str = LOWEST, also: str = "", chief: str = "worker(group=0, id=0), server(group=0, id=0)") -> str:
    who = chief if rank == 0 else f"worker(group=0, id={rank})"
    return (f"WARNING: process {rank} ({who}) exited with code 3; the other processes go on without it; restarting it "
            f"(restart 1 of 2); it rejoins at the next step, from {donor}{also}")


def assert_both_exits_said(stderr: str, **kw) -> None:
    """The launcher's lines on processes 0 and 1, dead at the same step, true in either order it saw them: process 1
    seen first heals from the chief's state as far as it knows then, and the chief's line says it will not."""
    said = stderr.splitlines()
    if exited(1, **kw) in said:  # the chief's death seen first
        assert exited(0, **kw) in said, stderr
    else:
        assert exited(1, **{**kw, "donor": "process 0's state"}) in said, stderr
        assert exited(0, also=" (so does process 1, restarted before it and not admitted yet)", **kw) in said, stderr


def children(parent: int) -> set[int]:
    """The live processes whose parent is `parent`."""
    found = set()
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            if re.search(rf"^PPid:\s+{parent}$", status.read_text(), re.M):
                found.add(int(status.parent.name))
        except OSError:  # ended meanwhile
            pass
    return found


def _parent(pid: int) -> int:
    return int(re.search(r"^PPid:\s+(\d+)$", Path(f"/proc/{pid}/status").read_text(), re.M)[1])


def _state_and_cpu(pid: int) -> tuple[str, int]:
    """A process's state letter and its CPU time in clock ticks (("", -1) once it ended)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return "", -1
    return fields[0], int(fields[11]) + int(fields[12])


def hold_the_others_while_restarting(run, survivors: list[int], restarts: int, unlogged: int = 0) -> None:
    """Once the launcher said it restarts a process `restarts` times in all, the survivors are stopped (SIGSTOP) until
    every restart it announced has rejoined (its log names its pid) or waits to be admitted (asleep, its CPU time flat
    for half a second): the machine's load delays a restart's start by seconds (5.5 s seen, 4 tests at once beside
    others), more than the run lasts. The run's stall timeout is set above the hold. `unlogged`: restarts the test
    killed before they could log."""
    wait_for(lambda: run.stderr().count("; restarting it (restart") >= restarts or run.proc.poll() is not None, 90,
             f"{restarts} restarts never announced: {run.stderr()}", interval=0.01)
    if run.proc.poll() is not None:
        return
    forkserver = _parent(survivors[0])
    for pid in survivors:
        os.kill(pid, signal.SIGSTOP)
    quiet_since: dict[int, tuple[float, int]] = {}  # pid -> (since when, its CPU time then) asleep, hardly using the CPU

    def waiting() -> bool:
        logged = {pid for rank in range(3) for pid in pids(run.ws, rank)}
        rejoined = sum(len(pids(run.ws, rank)[1:]) for rank in range(3))
        pending = children(forkserver) - logged - set(survivors)
        now = time.monotonic()
        for pid in pending:
            state, cpu = _state_and_cpu(pid)
            since, then = quiet_since.get(pid, (now, cpu))
            quiet = state == "S" and cpu - then <= 2  # (its store polls and heartbeat cost a tick now and then)
            quiet_since[pid] = (since, then) if quiet else (now, cpu)
        idle = [pid for pid in pending if now - quiet_since[pid][0] >= 0.5]
        return rejoined + unlogged + len(idle) >= restarts and len(idle) == len(pending)

    try:
        wait_for(waiting, 120, "the restarts never came to wait for their admission", interval=0.05)
    finally:
        for pid in survivors:
            os.kill(pid, signal.SIGCONT)

def processes_0_and_1_exit_at(gone: int, runs, job, tmp_path, *extra):
    """The chief and process 1 exit at step `gone` (restarts allowed twice), process 2 held on while their restarts start;
    the run to its end, process 2 said to take the chief's place on the terminal. Returns the run, process 2's pid, stdout
    and stderr."""
    run = runs.start(job, tmp_path, "--max-restarts", "2", *extra, *HELD, env={"SHOAL_INJECT_EXIT": f"0:{gone},1:{gone}", **SLOW})
    survivor = run.pid_once_training(2)
    hold_the_others_while_restarting(run, [survivor], restarts=2)
    stdout, stderr = run.finished()
    assert (f"Process 2 took the chief's place after step {gone}: it decides the steps, tests and validates, writes the run "
            f"log and the checkpoints") in stdout.splitlines(), stdout
    return run, survivor, stdout, stderr



def test_the_chief_and_the_next_in_line_exit_at_once_and_the_last_process_decides(blobs_job, tmp_path, runs):
    """Processes 0 and 1 of AllReduce's 3 replicas exit at step 12: process 2 alone decides step 12 on in the chief's
    place (the next in line died with it) and says so on the terminal, both dead processes are restarted and rejoin
    from process 2's state, and process 2 (the same pid from start to end) writes the final test and checkpoint."""
    steps, gone = 300, 12  # 3 s or more (SLOW): time for both restarts to rejoin, under load
    job = blobs_job(train_steps=steps, cluster_extra=dict(nworkers_per_group=3))
    run, survivor, stdout, stderr = processes_0_and_1_exit_at(gone, runs, job, tmp_path)
    assert_both_exits_said(stderr)
    assert (f"Step {gone} went on without processes 0, 1 (died or stopped answering): the mean over the gradients of process 2 "
            f"alone") in stdout.splitlines(), stdout
    got = assert_ran(run.ws, REPLICATED)
    assert got["status"] == "finished" and got["chief_succession"] == [{"process": 2, "after_step": gone}], got
    back = {r["rank"]: r["step"] for r in got["rejoins"]}
    assert sorted(back) == [0, 1] and all(gone < step < steps for step in back.values()), got["rejoins"]
    for rank, step in back.items():
        assert re.search(rf"^Process {rank} rejoined at step {step} \(restart 1\): the params and the updater's state from "
                         rf"process 2, after step {step - 1}, ", stdout, re.M), stdout
        away = f"missing from step {gone}" if step == gone + 1 else f"missing from steps {gone} to {step - 1}"
        assert got["missed_steps"][str(rank)] == {"missed": step - gone, "of": steps, "why": f"{away}, back at step {step}"}
    assert all(r["digests"]["from_process"] == 2 for r in got["rejoins"]), got["rejoins"]
    assert pids(run.ws, 2) == [survivor] and [len(set(pids(run.ws, rank))) for rank in (0, 1)] == [2, 2]
    assert f"process 2 took the chief's place after step {gone}; " in closing_line(stdout)
    final = ckpt_io.load(ckpt_io.checkpoint_file(run.ws, steps), parts=False)
    assert final.trainer["writer"] == 2 and got["final_test"]["step"] == steps and got["final_test"]["accuracy"] > 0.8, got
    assert_no_library_text(stdout, stderr, (run.ws / "logs" / "rank2.log").read_text())
    assert leftover_processes(tmp_path) == []


@pytest.mark.slow  # three runs; one death's schedule repeats to the bit in the default suite (test_job_chief_death.py)
def test_two_processes_dead_at_the_same_step_give_the_same_bits_each_time(blobs_job, tmp_path):
    """The fault schedule decides the result: processes 0 and 1 exit at step 39 of 40, so step 39 is process 2's
    gradients alone (their restarts come back after it: nothing left to train); the same faulted job twice gives the
    same params, and not the unfaulted run's."""
    steps, gone = 40, 39
    job = blobs_job(train_steps=steps, cluster_extra=dict(nworkers_per_group=3))
    for i in range(2):
        ws = tmp_path / f"faulted{i}"
        proc = faulted_run(job, ws, {"SHOAL_INJECT_EXIT": f"0:{gone},1:{gone}"})
        assert_both_exits_said(proc.stderr)
        got = assert_ran(ws, REPLICATED)
        assert got["chief_succession"] == [{"process": 2, "after_step": gone}], got
        assert ckpt_io.load(ckpt_io.checkpoint_file(ws, steps), parts=False).trainer["writer"] == 2
        assert_no_library_text(proc.stdout, proc.stderr)
        assert_job_processes_ended(ws, wait=10)
    a, b = params(tmp_path / "faulted0", steps), params(tmp_path / "faulted1", steps)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    faulted_run(job, tmp_path / "unfaulted", {})
    c = params(tmp_path / "unfaulted", steps)
    assert any(not torch.allclose(a[k], c[k], atol=1e-6) for k in a)  # the missing rows changed the result


@pytest.mark.slow  # 4 at once under load, one restart came back after the last meeting in 2 of 4 (the hold's heuristic)
def test_two_diloco_groups_with_the_chiefs_die_at_one_meeting_and_the_third_meets_alone(blobs_job, tmp_path, runs):
    """DiLoCo, 3 groups of one process each: groups 0 (the chief's) and 1 exit at step 14, whose end holds a meeting:
    group 2 takes the chief's place and goes on meeting alone, both restarted processes rejoin at a later meeting from
    its state, and it writes the final test and checkpoint."""
    steps, gone = 300, 14  # 3 s or more (SLOW): time for both restarts to rejoin, under load
    job = blobs_job(train_steps=steps, cluster_extra=dict(nworker_groups=3, local_steps=5))
    run, survivor, stdout, stderr = processes_0_and_1_exit_at(gone, runs, job, tmp_path, *DILOCO)
    for rank, who in ((0, "worker(group=0, id=0), server(group=0, id=0)"), (1, "worker(group=1, id=0)")):
        assert (f"WARNING: process {rank} ({who}) exited with code 3; restarting it (restart 1 of 2); it rejoins at the groups' "
                f"next meeting, from a live group's state") in stderr.splitlines(), stderr
    got = assert_ran(run.ws, DILOCO_3)
    assert got["status"] == "finished" and got["chief_succession"] == [{"process": 2, "after_step": gone}], got
    back = {r["group"]: r["step"] for r in got["rejoins"]}
    assert sorted(back) == [0, 1] and all(r["digests"]["from_group"] == 2 for r in got["rejoins"]), got["rejoins"]
    for group, step in back.items():
        assert gone < step < steps and step % 5 == 0, back  # after a meeting
        assert re.search(rf"^Worker group {group} rejoined at step {step} \(process {group}, restart 1\): the anchor, the outer "
                         rf"updater's state and worker group 2's inner updater state, after the meeting after step {step - 1}, ",
                         stdout, re.M), stdout
        missed = got["missed_updates"][str(group)]
        away = (f"the meeting after step {gone}, back after it" if step == gone + 1 else
                f"the meetings after steps {gone} to {step - 1}, back after the last")
        assert missed["why"] == f"process {group} was restarted after it exited with code 3; missing from {away}", missed
        assert (missed["of"], missed["rejoined_at"]) == (steps // 5, [step]), missed
    records = train_records(run.ws)
    alone = [r for r in records if gone < r["step"] < min(back.values())]
    assert all(r["groups_met"] == 3 for r in records if r["step"] < gone) and records[-1]["groups_met"] == 3, records
    assert all(r["groups_met"] == 1 for r in alone), records  # group 2 met alone until the first came back
    assert pids(run.ws, 2) == [survivor] and [len(set(pids(run.ws, rank))) for rank in (0, 1)] == [2, 2]
    final = ckpt_io.load(ckpt_io.checkpoint_file(run.ws, steps), parts=True)
    assert (final.trainer["writer"], final.trainer["writer_group"]) == (2, 2) and got["final_test"]["step"] == steps
    assert f"process 2 took the chief's place after step {gone}; " in closing_line(stdout)
    assert_no_library_text(stdout, stderr, (run.ws / "logs" / "rank2.log").read_text())
    assert leftover_processes(tmp_path) == []


def assert_came_back_twice(run, stdout: str, stderr: str, second: str, survivors: dict, logged: int = 3) -> dict:
    """Process 1 died, its restart died again (`second`: how, in the launcher's line), and its second restart rejoined
    and trained to the end, healed from the chief each time; processes 0 and 2 kept their pids; exit 0 (finished).
    `logged`: how many of process 1's processes wrote their start line (a restart killed at once writes none)."""
    said = stderr.splitlines()
    assert exited(1, donor="process 0's state") in said, stderr
    assert (f"WARNING: process 1 (worker(group=0, id=1)) {second}; the other processes go on without it; restarting it "
            f"(restart 2 of 2); it rejoins at the next step, from process 0's state") in said, stderr
    got = assert_ran(run.ws, REPLICATED)
    assert got["status"] == "finished" and "chief_succession" not in got, got
    last = got["rejoins"][-1]
    assert (last["rank"], last["incarnation"], last["digests"]["from_process"]) == (1, 2, 0), got["rejoins"]
    assert re.search(rf"^Process 1 rejoined at step {last['step']} \(restart 2\): the params and the updater's state from "
                     rf"process 0, after step {last['step'] - 1}, ", stdout, re.M), stdout
    assert got["missed_steps"]["1"]["why"].endswith(f", back at step {last['step']}"), got["missed_steps"]
    assert train_records(run.ws)[-1]["processes"] == 3  # all three at the end
    assert {rank: pids(run.ws, rank) for rank in survivors} == {rank: [pid] for rank, pid in survivors.items()}
    assert len(set(pids(run.ws, 1))) == logged  # process 1 ran as three processes, one after the other
    final = ckpt_io.load(ckpt_io.checkpoint_file(run.ws, got["steps"]), parts=False)
    assert final.trainer["writer"] == 0 and got["final_test"]["step"] == got["steps"], got
    assert_no_library_text(stdout, stderr, (run.ws / "logs" / "rank0.log").read_text())
    assert leftover_processes(run.tmp_path) == []
    return got


@pytest.mark.slow  # a joiner lost around its handover, at the quorum, is tests/test_quorum_handover.py's (default suite)
def test_a_restart_that_dies_again_right_after_its_handover_comes_back_again(blobs_job, tmp_path, runs):
    """Process 1 exits at step 12, and its restart again right after the chief admitted it and handed it the state,
    before its first step ("1:12,1:13": the restart's pair, met at the step it rejoins at): the others go on (that
    step without it, said on the terminal), and the second restart rejoins and trains to the end."""
    steps, gone = 300, 12
    job = blobs_job(train_steps=steps, cluster_extra=dict(nworkers_per_group=3))
    run = runs.start(job, tmp_path, "--max-restarts", "2", *HELD, env={"SHOAL_INJECT_EXIT": f"1:{gone},1:{gone + 1}", **SLOW})
    survivors = {rank: run.pid_once_training(rank) for rank in (0, 2)}
    for restarts in (1, 2):
        hold_the_others_while_restarting(run, list(survivors.values()), restarts)
    stdout, stderr = run.finished()
    got = assert_came_back_twice(run, stdout, stderr, "exited with code 3", survivors)
    first = got["rejoins"][0]
    assert (first["incarnation"], len(got["rejoins"])) == (1, 2) and gone < first["step"] < got["rejoins"][1]["step"], got
    again = first["step"]  # the first restart rejoined at this step, and exited before training it
    assert f"Step {again} went on without process 1 (died or stopped answering): the mean over the gradients of processes " \
           f"0, 2, weighted by their rows" in stdout.splitlines(), stdout
    assert got["missed_steps"]["1"]["why"] == f"missing from steps {gone} to {got['rejoins'][1]['step'] - 1}, back at step " \
                                              f"{got['rejoins'][1]['step']}", got["missed_steps"]


@pytest.mark.slow  # the deterministic second death (just after the handover) is the test above; this one's window varies
def test_a_restart_killed_before_its_admission_comes_back_again(blobs_job, tmp_path, runs):
    """Process 1 exits at step 40, and its restart is SIGKILLed as soon as the launcher started it (its forkserver's
    new child), before it is admitted (building its net, or knocking; a joiner lost during the handover is
    tests/test_quorum_handover.py's): the others go on, the second restart rejoins from the chief to the end."""
    steps, gone = 300, 40
    job = blobs_job(train_steps=steps, cluster_extra=dict(nworkers_per_group=3))
    run = runs.start(job, tmp_path, "--max-restarts", "2", *HELD, env={"SHOAL_INJECT_EXIT": f"1:{gone}", **SLOW})
    survivors = {rank: run.pid_once_training(rank) for rank in (0, 2)}
    first = pids(run.ws, 1)[0]
    forkserver = _parent(survivors[0])
    started = set()
    wait_for(lambda: started.update(children(forkserver) - {first, *survivors.values()}) or started or run.proc.poll() is not None,
             90, "process 1 was never restarted", interval=0.005)
    (restart,) = started
    os.kill(restart, signal.SIGKILL)
    hold_the_others_while_restarting(run, list(survivors.values()), restarts=2, unlogged=1)
    stdout, stderr = run.finished()
    logged = 3 if restart in pids(run.ws, 1) else 2  # (killed before its start line, unless the machine's load delayed the kill)
    assert_came_back_twice(run, stdout, stderr, "died (SIGKILL)", survivors, logged)


@pytest.mark.parametrize("framework", ["AllReduce", pytest.param("DiLoCo", marks=pytest.mark.slow)])
def test_every_worker_process_dead_at_once_restarts_the_whole_job_and_says_why(blobs_job, tmp_path, runs, framework):
    """All three of AllReduce's replicas (or DiLoCo's groups) exit at step 14: no living process holds the job's state,
    so no restart can be admitted (nobody decides a step or a meeting, nobody hands the state over). The launcher does
    not restart them into the running job for ever: it restarts the whole job (from step 0: no checkpoint yet), which
    meets the same faults, and then stops, each time in one line saying why; nothing is left running."""
    cluster, options = (dict(nworkers_per_group=3), []) if framework == "AllReduce" else (dict(nworker_groups=3, local_steps=5), DILOCO)
    job = blobs_job(train_steps=40, cluster_extra=cluster)
    run = runs.start(job, tmp_path, "--max-restarts", "1", *options, env={"SHOAL_INJECT_EXIT": "0:14,1:14,2:14"})
    stdout, stderr = run.finished(code=2)
    lines = stderr.splitlines()
    whole = [line for line in lines if "the whole job" in line]
    (last,) = [line for line in lines if not line.startswith("WARNING: ")]
    cause = (r"process (\d) \(.*?\) exited with code 3 after step \d+: the job cannot go on without it \(processes "
             r"(\d), (\d) died too( and no restart was admitted back yet)?: no living process holds the job's state\)")
    assert len(whole) == 1 and re.fullmatch(rf"WARNING: {cause}; restarting the whole job from step 0 \(no checkpoint was "
                                            rf"written yet\) \(restart 1 of 1\)", whole[0]), stderr
    said = re.fullmatch(rf"{cause}; no restarts left \(--max-restarts 1, restarted once\); see {re.escape(str(run.ws))}/logs/"
                        rf"rank\d\.log", last)
    assert said and sorted(said.groups()[:3]) == ["0", "1", "2"], stderr
    # a process seen dead while another still lived was restarted into the job first (its line true when said)
    assert all("; restarting it (restart 1 of 1); it rejoins at the " in line for line in lines if line not in whole and line != last), stderr
    ended = summary(run.ws)
    assert ended["status"] == "failed" and len(ended["job_restarts"]) == 1, ended
    assert "Trained " not in stdout and "went on without" not in stdout
    assert_no_library_text(stdout, stderr)
    assert leftover_processes(tmp_path) == []


@pytest.mark.slow  # Sandblaster's chief succession (the servers' stub) is tests/test_sandblaster_chief_death.py's; this doubles it
def test_sandblasters_chief_and_another_worker_process_exit_at_once(blobs_job, tmp_path, runs):
    """Sandblaster, 3 worker processes + 1 server process: worker processes 0 (the chief, the servers' stub) and 1
    exit at step 12: process 2 decides the step alone, becomes the servers' stub (pushing the step's mean the dead
    chief had not), both rejoin from the servers' values through it, and the server process lives on."""
    from test_sandblaster_faults import CLUSTER

    steps, gone = 300, 12
    job = blobs_job(train_steps=steps, cluster_extra=CLUSTER)
    run = runs.start(job, tmp_path, "--max-restarts", "2", *HELD, env={"SHOAL_INJECT_EXIT": f"0:{gone},1:{gone}", **SLOW})
    survivor = run.pid_once_training(2)
    hold_the_others_while_restarting(run, [survivor], restarts=2)
    stdout, stderr = run.finished()
    assert "process 3" not in stderr  # the server lived on
    assert_both_exits_said(stderr, chief="worker(group=0, id=0)",
                           donor="the state of the lowest living process, which decides the steps and pushes to the servers now")
    said = stdout.splitlines()
    assert (f"Process 2 took the chief's place after step {gone}: it decides the steps, tests and validates, writes the run "
            f"log and the checkpoints, pushes to the servers and keeps their mirror") in said, stdout
    assert f"Step {gone} went on without processes 0, 1 (died or stopped answering): the mean over the gradients of process 2 alone" in said
    assert (f"Process 2 connected to the servers as worker group 0 (restart 1) at step {gone}: pushed the step's mean, which "
            f"the dead chief had not; it asked for their mirror at once") in said, stdout
    got = assert_ran(run.ws, Layout(dict(CLUSTER, max_restarts=2), 4, 3, "Sandblaster"))
    assert got["status"] == "finished" and got["chief_succession"] == [{"process": 2, "after_step": gone}], got
    back = {r["rank"]: r["step"] for r in got["rejoins"]}
    assert sorted(back) == [0, 1] and all(r["digests"]["from_process"] == 2 for r in got["rejoins"]), got["rejoins"]
    for rank, step in back.items():
        assert re.search(rf"^Process {rank} rejoined at step {step} \(restart 1\): the servers' values after step {step - 1}, "
                         rf"through process 2, ", stdout, re.M), stdout
    assert pids(run.ws, 2) == [survivor] and [len(set(pids(run.ws, rank))) for rank in (0, 1)] == [2, 2]
    final = ckpt_io.load(ckpt_io.checkpoint_file(run.ws, steps), parts=False)
    assert final.trainer["writer"] == 2 and got["final_test"]["step"] == steps, got
    assert_no_library_text(stdout, stderr, (run.ws / "logs" / "rank2.log").read_text())
    assert leftover_processes(tmp_path) == []
