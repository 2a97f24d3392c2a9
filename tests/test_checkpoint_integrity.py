"""A checkpoint's every byte is checked (issue 37, point 4): its digest covers the header's metadata (the step, the data
positions, the random_skip draws, the parts it lists, every field) as well as its tensors. An edited header is one line
naming the file: --resume refuses it, or falls back to an older whole checkpoint with a warning, as it does for a
flipped tensor byte; so does a part another trainer wrote, and shoal.fit's checkpoints. A checkpoint of an older shoal
(format 1: its digest covers the tensors only) is never resumed; its params still load, with a warning.

Each edit rewrites the safetensors header as JSON and leaves a valid safetensors file (checked with safetensors' own
reader): what `vi` or a script would leave, not a damaged file.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_in_process import one_line_error, run_cli
from conftest import mlp_job_text
from safetensors import safe_open
from safetensors.torch import load_file

import shoal
from shoal.errors import ShoalError
from shoal.neuralnet import checkpoint as ckpt_io


def shoal_cli(*args, **kw) -> subprocess.CompletedProcess:
    return run_cli(*args, **kw)



def header_of(path: Path) -> dict:
    data = path.read_bytes()
    return json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])


def rewrite_header(path: Path, edit) -> None:
    """`edit(metadata)` on the header's `__metadata__`, the tensors' bytes kept: still a valid safetensors file."""
    data = path.read_bytes()
    end = 8 + int.from_bytes(data[:8], "little")
    header = json.loads(data[8:end])
    edit(header["__metadata__"])
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data[end:])
    with safe_open(str(path), "pt") as f:  # safetensors itself reads it, with the edited metadata
        assert f.metadata() == header["__metadata__"]


def trainer_field(change):
    """An edit of the trainer's position (the JSON in metadata `trainer`): change(trainer) edits it in place."""
    def edit(metadata):
        trainer = json.loads(metadata["trainer"])
        change(trainer)
        metadata["trainer"] = json.dumps(trainer)
    return edit


def move_data_position(trainer):
    phase = next(iter(trainer["cursors"]))
    trainer["cursors"][phase] += 32  # one batch further: samples the stopped run never skipped


def move_loop_position(trainer):
    trainer["next_step"] += 1  # fit's loop over the session: one step further, a batch the stopped run never trained


def redraw_random_skip(trainer):
    for feeds in trainer["skips"].values():
        for name in feeds:
            feeds[name] += 1


def older_shoals_digest(tensors: dict[str, torch.Tensor]) -> str:
    """Format 1's checksum, as shoal wrote it before this change: the tensors' names, dtypes, shapes and bytes alone."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        value = tensors[name].contiguous()
        h.update(f"{name}|{value.dtype}|{tuple(value.shape)}|".encode())
        h.update(value.reshape(-1).view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    return h.hexdigest()


def as_an_older_shoal_wrote_it(path: Path) -> None:
    tensors = load_file(str(path))
    rewrite_header(path, lambda m: m.update(format="1", sha256=older_shoals_digest(tensors)))


EDITS = {
    "the step": lambda m: m.update(step="2"),
    "a data position": trainer_field(move_data_position),
    "a random_skip draw": trainer_field(redraw_random_skip),
    "the display window": trainer_field(lambda t: t.update(window_samples=t["window_samples"] + 1)),
    "a field added": lambda m: m.update(origin="elsewhere"),
    "the checksum removed": lambda m: m.pop("sha256"),
    "the format said to be the older one": lambda m: m.update(format="1"),
}


@pytest.fixture(scope="module")
def trained(blobs_dir, tmp_path_factory):
    """A 4-step single-worker run whose one checkpoint is step 4's; tests copy its folder."""
    folder = tmp_path_factory.mktemp("trained")
    job = folder / "job.conf"
    job.write_text(mlp_job_text(blobs_dir, train_steps=4))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SHOAL_HOME", str(folder / "home"))
        assert shoal_cli("run", job, "--workspace", folder / "ws", "--no-progress").returncode == 0
    assert [p.name for _, p in ckpt_io.list_checkpoints(folder / "ws")] == ["step4-worker0.safetensors"]
    return folder


def copy_of(trained: Path, tmp_path: Path) -> tuple[Path, Path, Path]:
    shutil.copytree(trained, tmp_path / "run", ignore=shutil.ignore_patterns("home"))
    run = tmp_path / "run"
    return run / "job.conf", run / "ws", ckpt_io.checkpoint_file(run / "ws", 4)


@pytest.mark.parametrize("what", EDITS)
def test_an_edited_header_is_refused_in_one_line_naming_the_file(trained, tmp_path, what):
    job, ws, newest = copy_of(trained, tmp_path)
    rewrite_header(newest, EDITS[what])
    line = one_line_error(shoal_cli("run", job, "--workspace", ws, "--resume", "--no-progress", "--set", "train_steps=6"))
    assert f"no readable checkpoint to resume from (newest: {newest}: " in line


def test_a_checkpoint_renamed_to_a_later_step_is_refused_and_the_untouched_one_resumes(trained, tmp_path):
    """--resume takes the newest by name and starts at the header's step: a name and a header that disagree are refused."""
    job, ws, newest = copy_of(trained, tmp_path)
    later = ckpt_io.checkpoint_file(ws, 6)
    newest.rename(later)
    line = one_line_error(shoal_cli("run", job, "--workspace", ws, "--resume", "--no-progress", "--set", "train_steps=8"))
    assert f"{later}: its header says step 4, its name step 6" in line
    later.rename(newest)
    proc = shoal_cli("run", job, "--workspace", ws, "--resume", "--no-progress", "--set", "train_steps=6")
    assert proc.returncode == 0, proc.stderr
    assert f"Resume from checkpoint file {newest} at step 4" in proc.stdout and "WARNING" not in proc.stderr


def test_an_edited_step_stops_a_real_process_in_one_line(trained, tmp_path):
    """Through `python -m shoal`: no traceback at the interpreter's level either."""
    job, ws, newest = copy_of(trained, tmp_path)
    rewrite_header(newest, EDITS["the step"])
    proc = subprocess.run([sys.executable, "-m", "shoal", "run", str(job), "--workspace", str(ws), "--resume", "--no-progress"],
                          capture_output=True, text=True, timeout=120)
    line = one_line_error(proc)
    assert f"{newest}: damaged checkpoint: its header" in line
    with pytest.raises(ckpt_io.CheckpointError, match="damaged checkpoint"):  # the params' readers refuse it too
        ckpt_io.load(newest)


@pytest.mark.parametrize("layout, rank", [("in-memory Hogwild, 2 groups", 0),
                                          pytest.param("Distributed Hogwild, 2 groups", 1, marks=pytest.mark.slow)])
def test_an_edited_header_falls_back_to_the_older_whole_checkpoint_as_a_damaged_tensor_does(blobs_job, tmp_path, layout, rank):
    """Two groups, as threads or processes: each checkpoint is the chief's file and group 1's part (written by process
    `rank`). An edited part, or a chief's file whose list of parts was edited, makes that checkpoint damaged as a whole:
    --resume warns naming the file and goes on from the older one."""
    job = blobs_job(train_steps=4, extra="checkpoint_freq: 2", layout=layout)
    trained = tmp_path / "trained"
    assert shoal_cli("run", job, "--workspace", trained, "--no-progress").returncode == 0
    edits = {
        ckpt_io.part_name(4, 1, rank): trainer_field(redraw_random_skip),  # another trainer's part: its own draw
        "step4-worker0.safetensors": lambda m: m.update(parts="{}"),  # the chief's: group 1's part no longer loaded
    }
    for name, edit in edits.items():
        ws = tmp_path / name
        shutil.copytree(trained, ws)
        rewrite_header(ws / "checkpoint" / name, edit)
        with pytest.raises(ckpt_io.CheckpointError, match=rf"{name}: damaged checkpoint"):
            ckpt_io.load(ckpt_io.checkpoint_file(ws, 4), parts=True)
        proc = shoal_cli("run", job, "--workspace", ws, "--resume", "--no-progress", "--set", "train_steps=6")
        assert proc.returncode == 0, proc.stderr
        [warning] = [line for line in proc.stderr.splitlines() if line.startswith("WARNING")]
        assert name in warning and "damaged checkpoint" in warning and "resuming from the older step2-worker0" in warning
        said = proc.stdout + "".join(log.read_text() for log in sorted((ws / "logs").glob("rank*.log")))  # spawned: their logs
        assert f"Resume from checkpoint file {ckpt_io.checkpoint_file(ws, 2)} at step 2" in said


def test_shoal_fit_refuses_to_resume_from_an_edited_header(tmp_path):
    x, y = torch.randn(64, 3, generator=torch.Generator().manual_seed(0)), torch.randn(64, 1)

    def fit(steps, resume=False):
        torch.manual_seed(0)
        return shoal.fit(torch.nn.Linear(3, 1), torch.nn.functional.mse_loss, (x, y), steps=steps, batch_size=8, disp_freq=1,
                         workspace=tmp_path / "ws", resume=resume, log=lambda *a: None)

    fit(4)
    newest = ckpt_io.checkpoint_file(tmp_path / "ws", 4)
    written = newest.read_bytes()
    rewrite_header(newest, trainer_field(move_loop_position))
    with pytest.raises(ShoalError) as refused:
        fit(6, resume=True)
    assert str(newest) in str(refused.value) and "damaged checkpoint" in str(refused.value)
    assert len(str(refused.value).splitlines()) == 1
    newest.write_bytes(written)
    assert fit(6, resume=True).phase("train")[0]["step"] == 4  # from where it stopped


def test_an_older_shoals_checkpoint_is_not_resumed_and_its_params_load_with_a_warning(trained, tmp_path):
    """Format 1 (the digest over the tensors alone) cannot show an edited header: refused for --resume; --test (params
    by name, checked) reads it, saying once that its header is unchecked."""
    job, ws, newest = copy_of(trained, tmp_path)
    as_an_older_shoal_wrote_it(newest)
    line = one_line_error(shoal_cli("run", job, "--workspace", ws, "--resume", "--no-progress"))
    assert f"{newest}: written by an older shoal (checkpoint format 1" in line and "not resumed" in line
    proc = shoal_cli("run", job, "--workspace", ws, "--test", "--checkpoint", newest)
    assert proc.returncode == 0, proc.stderr
    [warning] = [line for line in proc.stderr.splitlines() if line.startswith("WARNING")]
    assert str(newest) in warning and "format 1" in warning
    # a damaged tensor is still caught in such a file
    data = bytearray(newest.read_bytes())
    data[-1] ^= 0xFF
    newest.write_bytes(bytes(data))
    line = one_line_error(shoal_cli("run", job, "--workspace", ws, "--test", "--checkpoint", newest))
    assert f"{newest}: damaged checkpoint" in line


def test_a_header_naming_a_field_twice_is_refused(tmp_path):
    """safetensors keeps one of two equal keys and Python's json the other: such a header is not shoal's."""
    path = ckpt_io.save(tmp_path / "step3-worker0.safetensors", ckpt_io.Checkpoint(step=3, params={"w": torch.zeros(2)}))
    data = path.read_bytes()
    end = 8 + int.from_bytes(data[:8], "little")
    raw = data[8:end].replace(b'"step":"3"', b'"step":"3","step":"1"')
    assert raw != data[8:end]
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data[end:])
    with pytest.raises(ckpt_io.CheckpointError, match=r"step3-worker0.safetensors: not a readable safetensors checkpoint "
                                                      r"\(its header names 'step' twice\)"):
        ckpt_io.load(path)
