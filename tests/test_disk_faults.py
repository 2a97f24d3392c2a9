"""Faults of the machine are one line: a full disk, a read-only workspace, a dead torchrun agent.

Real filesystems: a small tmpfs filled by the run itself, and a read-only bind mount of a finished run
(both need root and mount; skipped with the reason where the test cannot mount).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_in_process import run_cli
from test_multihost import with_job_secret

from shoal.neuralnet import checkpoint as ckpt_io
from shoal.report.metrics import MetricsLog, read_metrics
from shoal.report.writes import WorkspaceWriteError, write_error

REPO = Path(__file__).resolve().parents[1]


def shoal_process(*args, cwd=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "shoal", *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout)


def assert_one_line_error(proc, *fragments):
    err = proc.stderr.strip()
    assert proc.returncode == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for fragment in fragments:
        assert fragment in err, err


def _mount(*args: str) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount here (mount {' '.join(args)}: {done.stderr.strip() or done.returncode}); "
                    "the disk-fault tests need root and mount")


@contextlib.contextmanager
def mounted(target: Path, *args: str):
    target.mkdir(parents=True, exist_ok=True)
    _mount(*args, str(target))
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


def tmpfs(target: Path, size: str):
    return mounted(target, "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs")


def read_only_view(source: Path, target: Path):
    """`mount --bind` then remount read-only: the finished run as an archive would hold it."""

    @contextlib.contextmanager
    def view():
        with mounted(target, "--bind", str(source)):
            _mount("-o", "remount,bind,ro", str(target))
            yield target

    return view()


def summary_of(workspace: Path) -> dict:
    return json.loads((workspace / "summary.json").read_text())


def assert_whole_lines(metrics: Path) -> list[dict]:
    data = metrics.read_bytes()
    assert data.endswith(b"\n"), data[-80:]
    lines = data.decode().splitlines()
    return [json.loads(line) for line in lines]  # every line a whole record


# -- a full disk -------------------------------------------------------------------------------------
@pytest.mark.parametrize("processes", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_checkpoint_that_fills_the_disk_is_one_line_and_the_previous_one_stays(blobs_job, tmp_path, processes):
    """Checkpoints of ~690 kB on a 1700 kB tmpfs: steps 0 and 10 fit, step 20 does not."""
    job = blobs_job(train_steps=40, hidden=4096, extra="checkpoint_freq: 10")
    with tmpfs(tmp_path / "disk", "1700k") as disk:
        ws = disk / "ws"
        proc = shoal_process("run", job, "--workspace", ws, "--set", f"cluster.nworkers_per_group={processes}")
        target = ws / "checkpoint" / "step20-worker0.safetensors"
        assert_one_line_error(proc, f"cannot write {target}: no space left on device")
        if processes > 1:  # the launcher names the rank that failed
            assert proc.stderr.startswith("process 0 (") and "shoal.report" not in proc.stderr
        else:
            assert proc.stderr.startswith("shoal: cannot write")
        folder = sorted(p.name for p in (ws / "checkpoint").iterdir())
        assert not [name for name in folder if name.endswith(".tmp")]  # no partial temp file left
        # over processes rank 1 writes its own part beside the chief's file; a step is a checkpoint
        # only when the chief's file (which lists its parts) is there
        assert [name for name in folder if name.endswith("-worker0.safetensors")] == \
            ["step0-worker0.safetensors", "step10-worker0.safetensors"]
        assert ckpt_io.load(ws / "checkpoint" / "step10-worker0.safetensors").step == 10  # intact: its checksum holds
        summary = summary_of(ws)
        assert summary["status"] == "failed"
        assert f"cannot write {target}: no space left on device" in summary["reason"]
        assert_whole_lines(ws / "metrics.jsonl")


def test_metrics_that_fill_the_disk_leave_no_half_line_and_a_failed_summary(blobs_job, tmp_path):
    """The tmpfs is filled up to 64 kB before the run; a record every step fills the rest."""
    job = blobs_job(train_steps=2000)
    with tmpfs(tmp_path / "disk", "512k") as disk:
        st = os.statvfs(disk)
        (disk / "filler").write_bytes(b"\0" * (st.f_bavail * st.f_frsize - 64 * 1024))
        ws = disk / "ws"
        proc = run_cli("run", job, "--workspace", ws, "--set", "disp_freq=1", "--set", "test_freq=0", timeout=120)
        assert_one_line_error(proc, f"shoal: cannot write {ws / 'metrics.jsonl'}: no space left on device")
        records = assert_whole_lines(ws / "metrics.jsonl")
        assert len(records) > 50 and records[-1]["phase"] == "train"
        summary = summary_of(ws)  # no room for a new file: written over its own blocks
        assert summary["status"] == "failed" and "metrics.jsonl: no space left on device" in summary["reason"]
        assert summary["steps"] == records[-1]["step"] + 1  # a display at step s follows the (s + 1)th step
        assert not list(ws.glob("summary.json.tmp"))
        # what was written stays readable: the reports take the run as it is
        compare = run_cli("compare", ws, "--json")
        assert compare.returncode == 0, compare.stderr
        assert json.loads(compare.stdout)[0]["steps"] == records[-1]["step"] + 1


def test_a_disk_full_from_the_start_is_one_line(blobs_job, tmp_path):
    job = blobs_job(train_steps=12)
    with tmpfs(tmp_path / "disk", "256k") as disk:
        (disk / "ws").mkdir()
        st = os.statvfs(disk)
        with open(disk / "filler", "wb") as f:
            with contextlib.suppress(OSError):  # up to the last byte
                f.write(b"\0" * (st.f_bavail * st.f_frsize))
        proc = run_cli("run", job, "--workspace", disk / "ws", timeout=120)  # (a real process: the checkpoint case above)
        assert_one_line_error(proc, f"shoal: cannot write {disk / 'ws'}", "no space left on device")


# -- a read-only workspace ---------------------------------------------------------------------------
def test_a_finished_run_on_a_read_only_mount_can_be_tested_but_not_resumed(blobs_job, tmp_path):
    job = blobs_job(train_steps=12)
    ws = tmp_path / "ws"
    assert run_cli("run", job, "--workspace", ws).returncode == 0
    before = sorted(str(p.relative_to(ws)) for p in ws.rglob("*"))
    with read_only_view(ws, tmp_path / "archive") as archive:
        tested = run_cli("run", job, "--workspace", archive, "--test", timeout=120)
        assert tested.returncode == 0, tested.stderr
        assert "Test @ step 12  Loss = " in tested.stdout and "read-only" in tested.stdout
        assert "Traceback" not in tested.stderr
        resumed = run_cli("run", job, "--workspace", archive, "--resume")
        assert_one_line_error(resumed, f"cannot write {archive}", "read-only file system")
        again = run_cli("run", job, "--workspace", archive / "fresh")
        assert_one_line_error(again, "read-only file system")
    assert sorted(str(p.relative_to(ws)) for p in ws.rglob("*")) == before  # nothing written, nothing lost


# -- readers of a cut metrics file -------------------------------------------------------------------
def test_every_reader_skips_a_cut_line_and_a_new_log_starts_on_a_line_of_its_own(tmp_path, blobs_job):
    """An older shoal (or a crash) left half a line; a resumed run appends after it."""
    job = blobs_job(train_steps=12)
    ws = tmp_path / "ws"
    assert run_cli("run", job, "--workspace", ws).returncode == 0
    metrics = ws / "metrics.jsonl"
    whole = read_metrics(metrics)
    metrics.write_bytes(metrics.read_bytes() + b'{"step": 13, "phase": "tra')  # cut mid-record
    assert read_metrics(metrics) == whole
    log = MetricsLog(metrics, elapsed_before=5.0)  # as a resumed run opens it
    log.write(13, "train", {"loss": 0.5}, samples=32, samples_per_sec=1.0, window_sec=1.0, compute_sec=0.5, exchange_sec=0.5)
    log.close()
    lines = metrics.read_text().splitlines()
    assert lines[-2] == '{"step": 13, "phase": "tra' and json.loads(lines[-1])["step"] == 13
    assert read_metrics(metrics)[:-1] == whole and read_metrics(metrics)[-1]["loss"] == 0.5
    compare = run_cli("compare", ws, "--json")
    assert compare.returncode == 0 and json.loads(compare.stdout)[0]["steps"] == 14, compare.stderr  # trained by the display at 13
    plot = run_cli("plot", ws, "-o", tmp_path / "runs.png")
    assert plot.returncode == 0 and (tmp_path / "runs.png").stat().st_size > 0, plot.stderr
    from shoal.launcher import job_registry

    (record,) = job_registry.all_jobs()
    assert job_registry.last_metrics(record)["train"]["step"] == 13


# -- the one-line causes -----------------------------------------------------------------------------
@pytest.mark.parametrize("code, cause", [(errno.ENOSPC, "no space left on device"), (errno.EDQUOT, "disk quota exceeded"),
                                         (errno.EROFS, "read-only file system"), (errno.EACCES, "permission denied")])
def test_write_errors_name_the_file_and_the_cause(code, cause):
    err = write_error("ws/summary.json", OSError(code, os.strerror(code)))
    assert isinstance(err, WorkspaceWriteError) and str(err) == f"shoal: cannot write ws/summary.json: {cause}"


def test_a_safetensors_error_is_read_for_its_os_error():
    from safetensors import SafetensorError

    quoted = SafetensorError("Error while serializing: I/O error: Disk quota exceeded (os error 122)")
    assert str(write_error("ws/c.safetensors", quoted)) == "shoal: cannot write ws/c.safetensors: disk quota exceeded"


# -- torchrun's agent killed -------------------------------------------------------------------------
TORCHRUN = Path(sys.executable).with_name("torchrun")


def _free_port() -> int:
    from shoal.comm.dist import free_port

    return free_port()


def _pids_in_logs(logs: Path) -> list[int]:
    import re

    return [int(m) for f in logs.glob("rank*.log") for m in re.findall(r"\(pid = (\d+)\)", f.read_text())]


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed next to this Python")
def test_each_rank_names_a_killed_torchrun_agent_in_one_line(blobs_job, tmp_path):
    job = blobs_job(train_steps=1_000_000)
    ws, errors = tmp_path / "ws", tmp_path / "stderr.txt"
    port = _free_port()
    command = [str(TORCHRUN), "--nnodes=1", "--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={port}",
               f"--log-dir={tmp_path / 'torchrun'}", "-m", "shoal", "run", str(job), "--workspace", str(ws), "--set", "cluster.nworkers_per_group=2",
               "--set", "test_freq=0", "--set", "disp_freq=20"]
    with open(errors, "w") as stderr:
        agent = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, env=with_job_secret(PYTHONUNBUFFERED="1", SHOAL_SLOW_WORKER="0:0+0.05"))
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not (ws / "metrics.jsonl").exists() or not read_metrics(ws / "metrics.jsonl"):
            assert agent.poll() is None and time.monotonic() < deadline, errors.read_text()
            time.sleep(0.2)
        ranks = _pids_in_logs(ws / "logs")
        assert len(ranks) == 2
        agent.kill()
        agent.wait()
        deadline = time.monotonic() + 60
        while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        lines = [line for line in errors.read_text().splitlines() if line.startswith("process ")]
        assert sorted(line.split(" ", 2)[1] for line in lines) == ["0", "1"], errors.read_text()
        for line in lines:
            assert f"lost the job's store at 127.0.0.1:{port} (torchrun's agent died?)" in line, line
        text = errors.read_text() + "".join(f.read_text() for f in (ws / "logs").glob("rank*.log"))
        assert "Traceback" not in text and "frame #" not in text and "Connection reset" not in text
    finally:
        agent.kill()
        for pid in ranks:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False
