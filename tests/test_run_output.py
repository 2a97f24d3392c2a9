"""What `shoal run` shows: the progress bar on a terminal only, one closing line; `shoal jobs view` and labels."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from cli_in_process import run_cli

import shoal
from shoal.planning.plan import plan_job
from shoal.report.summary import describe_layout


def shoal_cli(*args, env=None):
    """`python -m shoal ARGS`: a real process, its stdout a pipe (what `shoal jobs view | less` gets)."""
    return subprocess.run([sys.executable, "-m", "shoal", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env=env, check=False)


CLOSING = re.compile(r"^Trained (\d+) steps in .+ \((\d+) samples/s\); final test accuracy ([\d.]+) on (\d+) test samples \(step (\d+)\), "
                     r"best ([\d.]+) \(step (\d+)\); checkpoint (\S+); summary (\S+)$")


def test_a_run_ends_with_one_line_built_from_its_summary(blobs_job, tmp_path):
    ws = tmp_path / "ws"
    proc = run_cli("run", blobs_job(train_steps=30), "--workspace", ws)  # in this process: its stdout and stderr, as a pipe's
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    match = CLOSING.match(last)
    assert match, last
    summary = json.loads((ws / "summary.json").read_text())
    steps, rate, final, tested, final_step, best, best_step, checkpoint, summary_path = match.groups()
    assert int(steps) == summary["steps"] == 30
    assert int(tested) == summary["final_test"]["samples"] == 2 * 64  # test_steps × the test batch
    assert int(rate) == round(summary["samples_per_sec"])
    assert float(final) == pytest.approx(summary["final_test"]["accuracy"], abs=5e-4) and int(final_step) == 30
    assert float(best) == pytest.approx(summary["best_test"]["accuracy"], abs=5e-4) and int(best_step) == summary["best_test"]["step"]
    assert os.path.samefile(checkpoint, ws / "checkpoint" / "step30-worker0.safetensors")
    assert os.path.samefile(summary_path, ws / "summary.json")
    assert "━" not in proc.stderr  # captured stderr: no bar


@pytest.mark.skipif(shutil.which("script") is None, reason="needs script(1) for a pseudo-terminal")
def test_the_progress_bar_shows_on_a_terminal(blobs_job, tmp_path):
    """Under script(1) stdout and stderr are a terminal: the bar draws with times and the loss, and goes away."""
    job = blobs_job(train_steps=200)
    typescript = tmp_path / "typescript"
    command = f"{sys.executable} -m shoal run {job} --workspace {tmp_path / 'ws'}"
    # 10 ms a step at least: the bar (redrawn every 0.25 s at most) has time to move however fast the machine
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "160", "SHOAL_SLOW_WORKER": "0:0+0.01"}
    proc = subprocess.run(["script", "-qefc", command, str(typescript)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    raw = typescript.read_text(errors="replace")
    assert "\x1b[2K" in raw  # drawn in place: erased and redrawn
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw)  # colours and erasing away: the text drawn
    drawn = re.split(r"[\r\n]+", screen)
    bars = [m.groups() for m in map(re.compile(r"train [━╸╺ ]+ *(\d+)/200 steps (\d+:\d\d:\d\d) elapsed, (\S+) left ?(.*)$").match, drawn) if m]
    assert bars, screen[-3000:]
    assert {int(done) for done, *_ in bars} - {0}  # it moved
    assert any(re.fullmatch(r"loss [\d.e+-]+", loss) for *_, loss in bars)  # the latest loss
    assert any(re.fullmatch(r"\d+:\d\d:\d\d", left) for _, _, left, _ in bars)  # and the time left
    assert "Test @ step 200  Loss" in screen and "Trained 200 steps" in screen
    # the SINGA lines print on lines of their own, whole
    assert all(line.startswith("Train @ step") for line in drawn if "Train @" in line)
    assert "\x1b[2K" in raw[raw.rindex("/200"):raw.index("Trained 200 steps")]  # erased before the closing line


def test_jobs_view_is_not_wrapped_when_piped(blobs_job, tmp_path):
    deep = tmp_path / ("a-rather-long-folder-name-" * 4) / "workspace"
    assert run_cli("run", blobs_job(train_steps=10), "--workspace", deep).returncode == 0  # (registers the job)
    proc = shoal_cli("jobs", "view", "1")  # a real process writing to a pipe
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert f"workspace: {deep}" in lines  # one line, though far wider than 80 columns
    assert any(line.startswith("  last test: ") and len(line) > 80 for line in lines)


@pytest.mark.parametrize("cluster, label", [
    (dict(nworkers_per_group=2, server_worker_separate=True), "Sandblaster, 2 workers + 1 server, 3 processes"),
    (dict(nworkers_per_group=1, server_worker_separate=True), "Sandblaster, 1 worker + 1 server, 2 processes"),
    (dict(nworker_groups=2, nworkers_per_group=1, server_worker_separate=True), "Downpour, 2 groups × 1 worker + 1 server, 3 processes"),
    (dict(nworker_groups=2, nworkers_per_group=2, nservers_per_group=2, server_worker_separate=True),
     "Downpour, 2 groups × 2 workers + 2 servers, 6 processes"),
])
def test_layout_labels_count_in_plurals_only_past_one(blobs_job, cluster, label):
    sets = [f"cluster.{k}={str(v).lower()}" for k, v in cluster.items()]
    assert describe_layout(plan_job(shoal.load_job(blobs_job(), sets)))[1] == label


@pytest.mark.parametrize("missed, of, said", [
    (1, 40, "process 2 missed 1 of 40 steps (missing from step 12, back at step 13)"),
    (3, 40, "process 2 missed 3 of 40 steps (missing from step 12, back at step 13)"),
    (1, None, "process 2 missed 1 step (missing from step 12, back at step 13)"),
    (2, None, "process 2 missed 2 steps (missing from step 12, back at step 13)"),
])
def test_the_closing_line_counts_missed_steps_in_english(tmp_path, missed, of, said):
    """The noun follows the number next to it: "1 of 40 steps", "1 step"."""
    from shoal.report.progress import closing_line

    record = {"missed": missed, "why": "missing from step 12, back at step 13"} | ({"of": of} if of else {})
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 40, "wall_time": 2.0, "missed_steps": {"2": record}}))
    assert f"; {said};" in closing_line(tmp_path)
