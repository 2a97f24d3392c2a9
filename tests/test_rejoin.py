"""A dead Downpour worker group comes back into the running job, from the servers' live params.

Real runs through the CLI on the blobs data: group 1's process is SIGKILLed mid-run (its pid from the
job registry, as `shoal jobs view` shows it); the launcher restarts it (--max-restarts), or a second
`shoal run JOB --rejoin 1` starts it by hand; refusals are one line.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from fault_runs import LayoutRun as Run, runs  # noqa: F401 - the fixture that stops what a failed test left running
from layouts import LAYOUTS, Layout, assert_ran
from test_bytes_counted import trainable_numel
from test_cli import leftover_processes, tagged

DOWNPOUR = "Downpour, 2 groups + 1 server, 3 processes"
STEPS = 150
SLOW = {"SHOAL_SLOW_WORKER": "0:0+0.01"}  # every group's steps take 10 ms or more: the run outlasts a kill and a rejoin


def rejoins(workspace) -> list[dict]:
    return [json.loads(line) for line in (workspace / "logs" / "rejoins.jsonl").read_text().splitlines()]


def server_log(workspace, server: int = 0) -> str:
    return (workspace / "logs" / f"rank{2 + server}.log").read_text()  # servers come after the 2 groups' processes


def assert_no_update_lost(workspace, steps: int, servers: int = 1) -> None:
    """Each server applied every step of both groups once, the rejoined group's over its two processes."""
    for s in range(servers):
        final = re.search(rf"server\(group=0, id={s}\): version (\d+); updates applied: group 0: (\d+), group 1: (\d+) \(2 processes\)",
                          server_log(workspace, s))
        assert final, server_log(workspace, s)[-2000:]
        version, group0, group1 = map(int, final.groups())
        assert version == group0 + group1 == 2 * steps


def assert_pulled_the_live_values(record: dict, workspace, steps: int = STEPS, servers: int = 1) -> None:
    """The rejoined process trained on exactly what each server sent at its version, not on its initial values;
    it goes on at the first step some server had not applied."""
    versions, steps_done = [], []
    for s in range(servers):
        sent = re.search(rf"sent worker group 1 \(restart {record['incarnation']}\) the live values of version (\d+) "
                         rf"\(digest (\w+)\) and its step (\d+)", server_log(workspace, s))
        assert sent, server_log(workspace, s)[-2000:]
        versions.append(int(sent[1]))
        steps_done.append(int(sent[3]))
        assert record["digests"]["pulled"][str(s)] == sent[2]
        assert record["digests"]["before"][str(s)] != sent[2]
    assert (min(versions), min(steps_done)) == (record["version"], record["step"])
    # group 0 had pushed (the kill comes after its step 10), group 1 perhaps not yet on a loaded machine
    assert 0 <= record["step"] < steps and record["version"] > record["step"]


@pytest.mark.parametrize("name, servers", [
    (DOWNPOUR, 1),
    pytest.param(DOWNPOUR, 2, marks=pytest.mark.slow),  # each server's values and version
    pytest.param("Downpour, 2 groups x 2 threads + 1 server, 3 processes", 1, marks=pytest.mark.slow),  # a group of 2 workers
])
def test_a_killed_group_is_restarted_and_rejoins_from_the_live_params(blobs_job, tmp_path, runs, name, servers):
    base = LAYOUTS[name]
    layout = Layout({**base.cluster, "nservers_per_group": servers}, base.processes + servers - 1, base.workers, "Downpour")
    run = Run(blobs_job(train_steps=STEPS), tmp_path, name, "--max-restarts", "1", "--set", "test_freq=100",
              "--set", f"cluster.nservers_per_group={servers}", env=SLOW)
    runs.append(run)
    victim = run.pid_of(1)
    os.kill(victim, signal.SIGKILL)
    assert run.wait(timeout=180) == 0, run.stderr()
    assert re.search(r"^WARNING: process 1 \(worker\(group=1, id=0\).*\) exited with code -9; restarting it \(restart 1 of 1\)",
                     run.stderr(), re.M), run.stderr()
    line = [line for line in run.out.read_text().splitlines() if line.startswith("Worker group 1 rejoined at step ")]
    assert len(line) == 1, run.out.read_text()
    assert re.search(r"live params of version \d+, [0-9.]+ s after its process started; [0-9.]+ s after its death was seen", line[0])
    summary = assert_ran(run.ws, layout)
    assert summary["status"] == "finished" and summary["steps"] == STEPS
    pids = re.findall(r"Worker \(group = 1, id = 0\) start on CPU in process 1 \(pid = (\d+)\)", (run.ws / "logs" / "rank1.log").read_text())
    # group 1 ran in two processes, one after the other (the killed one may die before it logs its start: under load
    # the kill can come that early)
    assert pids and pids[-1] != str(victim) and set(pids) <= {str(victim), pids[-1]}, (pids, victim)
    (record,) = summary["rejoins"]
    assert (record["group"], record["rank"], record["incarnation"], record["by_hand"]) == (1, 1, 1, False)
    print(f"detection to rejoin {record['detection_to_rejoin_s']} s, process start to rejoin {record['process_start_to_rejoin_s']} s")
    assert record["process_start_to_rejoin_s"] <= 2.0
    assert record["detection_to_rejoin_s"] <= 2.5
    assert_pulled_the_live_values(record, run.ws, servers=servers)
    assert_no_update_lost(run.ws, STEPS, servers)
    # summary.json's bytes: every push of both groups' 3 processes and its answer (the whole model in float32, over the
    # servers), the rejoined process's pull of the live values, and the chief's mirror of the servers' momentum (as
    # many elements as the values, every 2 of its steps) with their int64 counters
    message = 4 * trainable_numel(run.ws, STEPS)
    counters = summary["bytes_sent"] - (2 * STEPS * 2 + 1) * message - len(range(0, STEPS, 2)) * message
    assert 0 < counters < STEPS * 8 * 64 and counters % 8 == 0
    assert f"Test @ step {STEPS}" in run.out.read_text()
    assert leftover_processes(tmp_path) == []


@pytest.mark.slow
def test_a_group_killed_again_after_its_restarts_is_left_out(blobs_job, tmp_path, runs):
    """--max-restarts 1 and two kills: the second death is reported, the servers stop waiting, the job finishes."""
    run = Run(blobs_job(train_steps=STEPS), tmp_path, DOWNPOUR, "--max-restarts", "1", "--set", "test_freq=100", env=SLOW)
    runs.append(run)
    os.kill(run.pid_of(1), signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not (run.ws / "logs" / "rejoins.jsonl").exists():
        assert time.monotonic() < deadline and run.proc.poll() is None, run.stderr()
        time.sleep(0.05)
    restarted = int(re.findall(r"pid = (\d+)", (run.ws / "logs" / "rank1.log").read_text())[-1])
    os.kill(restarted, signal.SIGKILL)
    assert run.wait(timeout=180) == 0, run.stderr()
    assert "not restarted: restarted 1 time(s) already (--max-restarts 1)" in run.stderr()
    assert f"Test @ step {STEPS}" in run.out.read_text()
    assert_ran(run.ws, DOWNPOUR)
    assert leftover_processes(tmp_path) == []


def rejoin_cli(job, workspace, rank, *extra, tmp_path=None, timeout=120):
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(tagged(tmp_path) if tmp_path else {}))
    return subprocess.run([sys.executable, "-m", "shoal", "run", str(job), "--workspace", str(workspace), "--rejoin", str(rank),
                           *LAYOUTS[DOWNPOUR].cli(), *extra], capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.slow  # a fresh `shoal run` starts in 5 to 12 s on the loaded 2-core machine: the job must outlast it
def test_a_killed_group_rejoins_by_hand(blobs_job, tmp_path, runs):
    """Without --max-restarts the group stays dead until `shoal run JOB --rejoin 1` brings it back; before it died,
    the same command is refused, as it is where no job runs."""
    steps = 600
    job = blobs_job(train_steps=steps)
    proc = rejoin_cli(job, tmp_path / "none", 1)
    assert proc.returncode == 2 and "logs/store.json does not say where the job's store is" in proc.stderr, proc.stderr
    run = Run(job, tmp_path, DOWNPOUR, "--set", "test_freq=100", env={"SHOAL_SLOW_WORKER": "0:0+0.03"})
    runs.append(run)
    pid = run.pid_of(1)
    proc = rejoin_cli(job, run.ws, 1, tmp_path=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "--rejoin 1: worker group 1 is still running (serving 0); only a group whose process died can rejoin"], proc.stderr
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while "lost worker group 1" not in server_log(run.ws):
        assert time.monotonic() < deadline, server_log(run.ws)
        time.sleep(0.05)
    proc = rejoin_cli(job, run.ws, 1, "--set", "test_freq=100", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^Worker group 1 rejoined at step \d+ \(process 1, restart 1\): live params of version \d+", proc.stdout, re.M)
    assert run.wait(timeout=180) == 0, run.stderr()
    (record,) = rejoins(run.ws)
    assert record["by_hand"] and "detection_to_rejoin_s" not in record
    print(f"by hand: process start to rejoin {record['process_start_to_rejoin_s']} s")
    assert_pulled_the_live_values(record, run.ws, steps)
    assert_no_update_lost(run.ws, steps)
    assert assert_ran(run.ws, DOWNPOUR)["rejoins"] == [record]
    assert leftover_processes(tmp_path) == []


@pytest.mark.parametrize("layout, rank, says", [
    (DOWNPOUR, 0, "--rejoin 0: process 0 (worker(group=0, id=0)) hosts worker group 0, the chief's"),
    (DOWNPOUR, 2, "--rejoin 2: process 2 (server(group=0, id=0)) is a server"),
    ("Downpour, 2 groups x 2 workers + 2 servers, 6 processes", 2,
     "--rejoin 2: worker group 1 spans processes 2, 3: it comes back only when `shoal run`'s launcher, hosting all of "
     "them, restarts them together (--max-restarts N)"),
    ("Distributed Hogwild, 2 groups", 1, "--rejoin 1: Distributed Hogwild's worker groups rejoin only when the launcher restarts "
     "them (shoal run --max-restarts N)"),
    ("in-memory Hogwild, 2 groups", 0, "--rejoin 0: only Downpour, Local SGD and Distributed Hogwild worker groups can rejoin"),
])
def test_rejoin_refuses_what_cannot_come_back(blobs_job, tmp_path, capsys, layout, rank, says):
    from shoal.frontend.cli import main

    assert main(["run", str(blobs_job(train_steps=10, layout=layout)), "--workspace", str(tmp_path / "ws"), "--rejoin", str(rank)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], lines
    assert not (tmp_path / "ws").exists()  # nothing was started


def test_rejoin_refuses_where_no_job_runs_and_bad_options(blobs_job, tmp_path, capsys):
    from shoal.frontend.cli import main

    job = str(blobs_job(train_steps=10, layout=DOWNPOUR))
    for args, says in [
        (["--rejoin", "1"], f"--rejoin: {tmp_path}/none/logs/store.json does not say where the job's store is"),
        (["--rejoin", "1", "--master", "nowhere"], "--master nowhere: expected HOST:PORT"),
        (["--max-restarts", "-1"], "--max-restarts -1: expected 0 or more"),
    ]:
        assert main(["run", job, "--workspace", str(tmp_path / "none"), *args]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(says), lines


def test_a_restarted_process_that_fails_writes_its_traceback_to_its_log_not_the_terminal(tmp_path, capfd, monkeypatch):
    """A restarted process whose run fails (its server died meanwhile: the launcher's line tells that story) exits 1
    with its traceback in WORKSPACE/logs/rank<R>.log; nothing of it reaches the terminal (multiprocessing would print
    an uncaught exception's traceback to the stderr the process inherited)."""
    import multiprocessing
    from types import SimpleNamespace

    from shoal.launcher import rejoin

    def fails(*args, **kwargs):
        raise RuntimeError("server 0 of the job stopped answering")

    monkeypatch.setattr(rejoin, "run_rejoined", fails)
    (tmp_path / "logs").mkdir()
    meeting = SimpleNamespace(nnodes=1, store_host="127.0.0.1", store_port=0, interface=None, attempt=0)
    process = multiprocessing.get_context("fork").Process(
        target=rejoin._entry, args=(1, meeting, b"", str(tmp_path), [], None, None, 1, None, dict(os.environ)))
    process.start()
    process.join(30)
    assert process.exitcode == 1
    out, err = capfd.readouterr()
    assert "Traceback" not in err + out and "stopped answering" not in err + out, err
    log = (tmp_path / "logs" / "rank1.log").read_text()
    assert "Traceback" in log and "RuntimeError: server 0 of the job stopped answering" in log
