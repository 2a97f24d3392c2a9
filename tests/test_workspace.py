"""Nothing lost: one run per workspace, never a user's files overwritten, damaged checkpoints never trained on."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_in_process import one_line_error, run_cli


def shoal(*args, cwd=None, env=None, timeout=180) -> subprocess.CompletedProcess:
    """`shoal ARGS` in the test's process (tests/cli_in_process.py); the run holding a workspace is a real process."""
    return run_cli(*args, cwd=cwd, env=env, timeout=timeout)



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


def contents(folder: Path) -> dict[str, bytes]:
    """Every file under `folder`, by relative path, with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


SINGA_MNIST = Path(__file__).parent / "fixtures" / "singa" / "mnist-mlp.conf"


def test_singas_mnist_example_runs_with_its_own_folder_as_workspace(mnist_dir, tmp_path):
    """SINGA 0.3's layout: run from the source root, `cluster { workspace: "examples/mnist" }`, the example's folder
    holding its job.conf, its other jobs and its data; shoal trains there and touches none of them."""
    example = tmp_path / "examples" / "mnist"
    example.mkdir(parents=True)
    job_text = SINGA_MNIST.read_text()
    assert 'workspace: "examples/mnist"' in job_text and 'path: "examples/mnist/train_data.bin"' in job_text
    (example / "job.conf").write_text(job_text)  # SINGA's own, its paths unchanged (they are relative to the root)
    (example / "conv.conf").write_text((SINGA_MNIST.parent / "mnist-conv.conf").read_text())
    (example / "Makefile.example").write_text("# the user's sources live here too\n")
    for name in ("train_data.bin", "test_data.bin"):
        os.link(mnist_dir / name, example / name)  # the data in the example's folder, as SINGA's create_data wrote it
    before = contents(example)
    steps = ["--set", "train_steps=4", "--set", "test_freq=2", "--set", "test_steps=1", "--set", "disp_freq=2"]
    proc = shoal("run", "examples/mnist/job.conf", "--no-progress", *steps, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Train @ step 2" in proc.stdout and "Test @ step 2" in proc.stdout
    after = contents(example)
    assert {name: after[name] for name in before} == before  # the user's job, sources and data byte for byte
    assert (example / "checkpoint" / "step4-worker0.safetensors").is_file()
    assert json.loads((example / "summary.json").read_text())["status"] == "finished"
    assert (example / "metrics.jsonl").is_file() and (example / "visualization" / "train_net.json").is_file()
    assert 'name: "mlp"' in (example / ".shoal" / "job.conf").read_text() and "train_steps: 4" in (example / ".shoal" / "job.conf").read_text()
    # --resume reads shoal's copy of the job, not the user's job.conf beside it
    proc = shoal("run", "examples/mnist/job.conf", "--no-progress", "--resume=auto", *steps[:-4], "--set", "train_steps=5",
                 "--set", "test_steps=0", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (example / "checkpoint" / "step5-worker0.safetensors").is_file() and contents(example)["job.conf"] == before["job.conf"]


def test_a_folder_with_the_users_own_job_is_a_workspace_and_resume_reads_shoals_copy(blobs_job, tmp_path):
    job = blobs_job(train_steps=4)
    commented = "# my notes\n" + job.read_text()
    job.write_text(commented)
    (tmp_path / "notes.txt").write_text("mine\n")
    proc = shoal("run", "job.conf", "--workspace", ".", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert job.read_text() == commented and (tmp_path / "notes.txt").read_text() == "mine\n"
    assert (tmp_path / "checkpoint" / "step4-worker0.safetensors").is_file()
    assert json.loads((tmp_path / ".shoal" / "workspace.json").read_text())["user_entries"] == ["job.conf"]
    # the user edits their job into another one: --resume=auto compares with shoal's copy, so it refuses
    job.write_text(commented.replace("momentum: 0.9", "momentum: 0.5"))
    line = one_line_error(shoal("run", "job.conf", "--workspace", ".", "--resume=auto", "--no-progress", cwd=tmp_path))
    assert "whose updater differs" in line
    job.write_text(commented)
    proc = shoal("run", "job.conf", "--workspace", ".", "--resume=auto", "--no-progress", "--set", "train_steps=6", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert job.read_text() == commented and (tmp_path / "checkpoint" / "step6-worker0.safetensors").is_file()


@pytest.mark.parametrize("taken", ["summary.json", "checkpoint", "logs/", "metrics.jsonl", ".shoal"])
def test_a_users_file_under_one_of_shoals_names_is_refused_naming_it_and_nothing_is_written(blobs_job, tmp_path, taken):
    job = blobs_job(train_steps=2)
    folder = tmp_path / "example"
    folder.mkdir()
    (folder / "job.conf").write_text(job.read_text())
    name = taken.rstrip("/")
    if taken.endswith("/"):
        (folder / name).mkdir()
        (folder / name / "mine.txt").write_text("mine\n")
    else:
        (folder / name).write_text("mine\n")
    before = contents(folder)
    line = one_line_error(shoal("run", folder / "job.conf", "--workspace", folder, "--no-progress"))
    assert f"{folder / name} is not shoal's" in line and "move it or give another --workspace" in line
    assert contents(folder) == before and sorted(p.name for p in folder.iterdir()) == sorted(["job.conf", name])


def test_a_file_where_shoal_keeps_a_folder_is_refused_in_a_workspace_shoal_already_uses(blobs_job, tmp_path):
    job, ws = blobs_job(train_steps=2), tmp_path / "ws"
    assert shoal("run", job, "--workspace", ws, "--no-progress").returncode == 0
    import shutil

    shutil.rmtree(ws / "visualization")
    (ws / "visualization").write_text("mine\n")
    line = one_line_error(shoal("run", job, "--workspace", ws, "--resume", "--no-progress", "--set", "train_steps=4"))
    assert f"{ws / 'visualization'} is not shoal's" in line
    assert (ws / "visualization").read_text() == "mine\n" and not (ws / "checkpoint" / "step4-worker0.safetensors").exists()


def test_testing_a_checkpoint_in_a_folder_whose_visualization_is_the_users_leaves_it_alone(blobs_job, tmp_path):
    job, ws = blobs_job(train_steps=2), tmp_path / "ws"
    assert shoal("run", job, "--workspace", ws, "--no-progress").returncode == 0
    folder = tmp_path / "example"
    folder.mkdir()
    (folder / "visualization").write_text("mine\n")
    proc = shoal("run", job, "--test", "--workspace", folder, "--checkpoint", ws / "checkpoint" / "step2-worker0.safetensors")
    assert proc.returncode == 0 and "Test @ step 2" in proc.stdout, proc.stderr
    assert f"{folder / 'visualization'} is not shoal's" in proc.stderr and "Traceback" not in proc.stderr
    assert (folder / "visualization").read_text() == "mine\n" and [p.name for p in folder.iterdir()] == ["visualization"]


def test_fit_never_writes_into_a_data_folder_of_the_users(blobs_job, tmp_path):
    """`shoal run` leaves a SINGA workspace's data/ alone; so does shoal.fit, which reads its data in place."""
    import torch

    import shoal as api

    job = blobs_job(train_steps=2)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.bin").write_bytes(b"the user's records")
    assert shoal("run", "job.conf", "--workspace", ".", "--no-progress", cwd=tmp_path).returncode == 0
    folder = tmp_path / "fit"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "train.bin").write_bytes(b"the user's records")
    api.fit(torch.nn.Linear(16, 4), torch.nn.functional.cross_entropy, (torch.zeros(8, 16), torch.zeros(8, dtype=torch.long)),
            workspace=folder, steps=1, log=lambda line: None)
    for ws in (tmp_path, folder):
        assert [p.name for p in (ws / "data").iterdir()] == ["train.bin"]
        assert (ws / "data" / "train.bin").read_bytes() == b"the user's records"


def test_an_older_shoals_workspace_is_adopted_and_its_job_copy_still_read(blobs_job, tmp_path):
    """Before workspaces could hold the user's files, the job copy was WORKSPACE/job.conf (and older still, no marker)."""
    job, ws = blobs_job(train_steps=4), tmp_path / "ws"
    assert shoal("run", job, "--workspace", ws, "--no-progress").returncode == 0
    (ws / ".shoal" / "job.conf").rename(ws / "job.conf")
    copy = (ws / "job.conf").read_text()
    (ws / "job.conf").write_text(copy.replace('name: "blobs-mlp"', 'name: "renamed"'))
    line = one_line_error(shoal("run", job, "--workspace", ws, "--resume=auto", "--no-progress"))
    assert "checkpoints of job 'renamed'" in line  # read the older copy
    (ws / "job.conf").write_text(copy)
    import shutil

    shutil.rmtree(ws / ".shoal")  # a workspace from before the marker
    proc = shoal("run", job, "--workspace", ws, "--resume=auto", "--no-progress", "--set", "train_steps=6")
    assert proc.returncode == 0, proc.stderr
    assert (ws / "checkpoint" / "step6-worker0.safetensors").is_file() and (ws / "job.conf").read_text() == copy


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
