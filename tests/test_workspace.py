"""Nothing lost: one run per workspace, never a user's files overwritten, damaged checkpoints never trained on."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_in_process import run_cli


def shoal(*args, cwd=None, env=None, timeout=180) -> subprocess.CompletedProcess:
    """`shoal ARGS` in the test's process (tests/cli_in_process.py); the run holding a workspace is a real process."""
    return run_cli(*args, cwd=cwd, env=env, timeout=timeout)


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_a_second_run_on_a_workspace_in_use_is_refused_naming_the_job(blobs_job, tmp_path):
    job, ws = blobs_job(train_steps=400), tmp_path / "ws"
    slow = dict(os.environ, SHOAL_SLOW_WORKER="0:0+0.05")  # 50 ms a step: the first run holds the workspace ~20 s
    first = subprocess.Popen([sys.executable, "-m", "shoal", "run", str(job), "--workspace", str(ws), "--no-progress"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=slow)
    try:
        lock = ws / ".shoal" / "lock"
        deadline = time.monotonic() + 60
        while not (lock.is_file() and '"pid"' in lock.read_text()):
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read() if first.stderr else ""
            time.sleep(0.2)
        line = one_line_error(shoal("run", job, "--workspace", ws, "--no-progress"))
        assert "is in use by job 'blobs-mlp'" in line and f"pid {first.pid}" in line
    finally:
        first.kill()
        first.wait()
    # the kernel released the killed run's lock: the workspace goes on with --resume or is refused for its checkpoints
    proc = shoal("run", job, "--workspace", ws, "--no-progress", "--set", "train_steps=2")
    assert "in use" not in proc.stderr


def test_a_folder_with_the_users_files_is_never_written_into(blobs_job, tmp_path):
    job = blobs_job(train_steps=4)
    commented = "# my notes\n" + job.read_text()
    job.write_text(commented)
    before = sorted(p.name for p in tmp_path.iterdir())
    line = one_line_error(shoal("run", "job.conf", "--workspace", ".", cwd=tmp_path))
    assert "holds files shoal did not write (job.conf" in line
    assert job.read_text() == commented and sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("where", ["/", "~", "a-file"])
def test_places_no_run_should_write_into_are_refused(blobs_job, tmp_path, where):
    job = blobs_job(train_steps=2)
    (tmp_path / "a-file").write_text("mine\n")
    target = str(tmp_path / where) if where == "a-file" else where
    env = dict(os.environ, HOME=str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    line = one_line_error(shoal("run", job, "--workspace", os.path.expanduser(target) if where != "~" else tmp_path / "home", env=env))
    assert {"/": "filesystem root", "~": "home directory", "a-file": "is not a folder"}[where] in line
    assert (tmp_path / "a-file").read_text() == "mine\n"


def damage(path: Path) -> None:
    """Overwrite 4,000 bytes of a checkpoint's tensor data (past the safetensors header)."""
    data = bytearray(path.read_bytes())
    header = int.from_bytes(data[:8], "little") + 8
    start = header + (len(data) - header) // 3
    data[start : start + 4000] = os.urandom(min(4000, len(data) - start))
    path.write_bytes(bytes(data))


def test_a_damaged_checkpoint_is_refused_and_resume_falls_back_to_the_newest_good_one(blobs_job, tmp_path):
    job, ws = blobs_job(train_steps=6, extra="checkpoint_freq: 2"), tmp_path / "ws"
    assert shoal("run", job, "--workspace", ws, "--no-progress").returncode == 0
    newest = ws / "checkpoint" / "step6-worker0.safetensors"
    damage(newest)
    line = one_line_error(shoal("run", job, "--test", "--checkpoint", newest, "--workspace", ws))
    assert str(newest) in line and "damaged checkpoint" in line
    (ws / "checkpoint" / "step4-worker0.safetensors.tmp").write_bytes(b"x" * 1000)  # a write a kill interrupted
    proc = shoal("run", job, "--workspace", ws, "--resume", "--no-progress", "--set", "train_steps=8")
    assert proc.returncode == 0, proc.stderr
    assert "WARNING" in proc.stderr and "step6-worker0" in proc.stderr and "WARNING" not in proc.stdout
    assert "Resume from checkpoint file" in proc.stdout and "step4-worker0" in proc.stdout
    assert not (ws / "checkpoint" / "step4-worker0.safetensors.tmp").exists()


def test_no_readable_checkpoint_is_one_line(blobs_job, tmp_path):
    job, ws = blobs_job(train_steps=2), tmp_path / "ws"
    assert shoal("run", job, "--workspace", ws, "--no-progress").returncode == 0
    for path in (ws / "checkpoint").glob("*.safetensors"):
        damage(path)
    line = one_line_error(shoal("run", job, "--workspace", ws, "--resume", "--no-progress"))
    assert "no readable checkpoint to resume from" in line


def test_the_workspace_is_marked_as_shoals(blobs_job, tmp_path):
    ws = tmp_path / "ws"
    assert shoal("run", blobs_job(train_steps=2), "--workspace", ws, "--no-progress").returncode == 0
    assert json.loads((ws / ".shoal" / "workspace.json").read_text())["created_by"] == "shoal"


def test_a_diverging_run_stops_at_the_step_and_writes_no_non_finite_checkpoint(blobs_job, tmp_path):
    job, ws = blobs_job(train_steps=40, extra="checkpoint_freq: 10"), tmp_path / "ws"
    proc = shoal("run", job, "--workspace", ws, "--no-progress", "--set", "updater.learning_rate.base_lr=1e30")
    line = one_line_error(proc)
    assert line.startswith("step ") and ("is nan" in line or "is inf" in line), line
    import torch
    from safetensors.torch import load_file

    for path in (ws / "checkpoint").glob("*.safetensors"):
        assert all(torch.isfinite(v).all() for k, v in load_file(str(path)).items() if k.startswith("param/")), path
    summary = json.loads((ws / "summary.json").read_text())
    assert summary["status"] == "failed"


def test_a_resumed_segment_supersedes_what_the_stopped_run_recorded_after_its_checkpoint(blobs_job, tmp_path):
    from shoal.report.summary import clean_records

    job, ws = blobs_job(train_steps=6, extra="checkpoint_freq: 4"), tmp_path / "ws"
    assert shoal("run", job, "--workspace", ws, "--no-progress").returncode == 0
    (ws / "checkpoint" / "step6-worker0.safetensors").unlink()  # as if stopped after step 5: resume at 4
    assert shoal("run", job, "--workspace", ws, "--resume", "--no-progress").returncode == 0
    records = [json.loads(line) for line in (ws / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["phase"] == "resume"] == [4]
    cleaned = clean_records(records)
    steps = [(r["phase"], r["step"]) for r in cleaned]
    assert len(steps) == len(set(steps)) and "resume" not in {p for p, _ in steps}
    # a record of the stopped run past the resume point that the resumed run never wrote again is dropped too
    stale = {"step": 5, "phase": "validate", "time": 1.0, "loss": 9.0}
    assert stale not in clean_records([stale] + records)


def test_a_checkpoint_written_while_hogwild_groups_update_the_params_loads(tmp_path):
    """In-memory Hogwild's other groups update the shared params while the chief writes a checkpoint: the file is a
    snapshot whose checksum matches it (it once checksummed the live tensors and then wrote them, changed)."""
    import threading

    import torch

    from shoal.neuralnet import checkpoint as ckpt_io

    live = torch.zeros(1 << 22)
    stop = threading.Event()

    def hogwild_group():
        while not stop.is_set():
            live.add_(1.0)

    writer = threading.Thread(target=hogwild_group)
    writer.start()
    try:
        for step in range(3):
            path = ckpt_io.save(tmp_path / f"step{step}.safetensors",
                                ckpt_io.Checkpoint(step=step, params={"w": live}))
            loaded = ckpt_io.load(path)  # raises CheckpointError on a checksum mismatch
            assert loaded.step == step and loaded.params["w"].shape == live.shape
    finally:
        stop.set()
        writer.join()
