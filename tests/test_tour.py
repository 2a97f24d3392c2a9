"""What a new user meets in the README's tour (issue 28, point 6): `--test` against the run's own final test,
a resumed run's closing line, summary.json's steps, `shoal jobs list` with workspaces."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from cli_in_process import run_cli

from shoal.report.summary import summarize


def displayed_tests(stdout: str) -> dict[int, str]:
    """{step: the "Test @ step N  Loss = …" line} of a run's output."""
    return {int(m.group(1)): m.group(0) for m in re.finditer(r"^Test @ step (\d+)  .*$", stdout, flags=re.M)}


def table_rows(printed: str) -> list[list[str]]:
    """The cells of each row of a table rich printed (header first)."""
    return [[cell.strip() for cell in line.strip("│┃").split("│" if "│" in line else "┃")]
            for line in printed.splitlines() if line.startswith(("│", "┃"))]


def test_test_mode_tests_the_samples_the_run_tested_and_says_how_many(blobs_job, tmp_path):
    """One test batch of 64 of the 128 test samples: the run's tests walk the test data (steps 0, 10, 20 and the
    final 23 read samples 0, 64, 0, 64), so only the same cursor gives `--test` the run's own figures."""
    job = blobs_job(train_steps=23, extra="checkpoint_freq: 5")
    ws, test_one_batch = tmp_path / "ws", ("--set", "test_steps=1")
    run = subprocess.run([sys.executable, "-m", "shoal", "run", str(job), "--workspace", str(ws), *test_one_batch],
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr
    run_tests, closing = displayed_tests(run.stdout), run.stdout.strip().splitlines()[-1]
    assert re.search(r"final test accuracy [\d.]+ on 64 test samples \(step 23\)", closing), closing
    summary = json.loads((ws / "summary.json").read_text())
    assert summary["final_test"]["samples"] == 64 and summary["final_test"]["step"] == 23

    tested = run_cli("run", job, "--workspace", ws, "--test", *test_one_batch)  # the newest checkpoint: step 23
    assert tested.returncode == 0, tested.stderr
    assert displayed_tests(tested.stdout) == {23: run_tests[23]}  # loss and accuracy, digit for digit
    assert "on 64 test samples (test_steps 1 × batch 64): the same samples as the run's own test at step 23" in tested.stdout

    # a checkpoint taken where the run tested (step 10): that test again; where it did not (step 5): from the start
    at_10 = run_cli("run", job, "--workspace", ws, "--test", "--checkpoint", ws / "checkpoint" / "step10-worker0.safetensors",
                    *test_one_batch)
    assert displayed_tests(at_10.stdout) == {10: run_tests[10]} and "own test at step 10" in at_10.stdout
    at_5 = run_cli("run", job, "--workspace", ws, "--test", "--checkpoint", ws / "checkpoint" / "step5-worker0.safetensors",
                   *test_one_batch)
    assert at_5.returncode == 0 and "on 64 test samples (test_steps 1 × batch 64): from the start of the test data" in at_5.stdout
    # the whole test set (2 batches): every test reads the same samples, and says so
    whole = run_cli("run", job, "--workspace", ws, "--test")
    assert "on 128 test samples (test_steps 2 × batch 64)" in whole.stdout


def test_a_resumed_runs_closing_line_counts_its_own_steps_and_time(blobs_job, tmp_path):
    job, ws = blobs_job(train_steps=20), tmp_path / "ws"
    first = run_cli("run", job, "--workspace", ws)
    assert first.returncode == 0, first.stderr
    resumed = run_cli("run", job, "--workspace", ws, "--resume", "--set", "train_steps=40")
    assert resumed.returncode == 0, resumed.stderr
    closing = resumed.stdout.strip().splitlines()[-1]
    match = re.match(r"Trained 20 steps \(20 → 40\) in (\d+) s \((\d+) samples/s\); 40 steps in (\d+) s in all; ", closing)
    assert match, closing
    summary = json.loads((ws / "summary.json").read_text())
    latest = summary["latest_run"]
    assert summary["steps"] == 40 and latest["from_step"] == 20 and latest["steps"] == 20
    assert 0 < latest["wall_time"] < summary["wall_time"]
    assert int(match.group(1)) == round(latest["wall_time"]) and int(match.group(3)) == round(summary["wall_time"])
    assert int(match.group(2)) == round(latest["samples_per_sec"])


def test_summary_steps_are_the_steps_trained(blobs_job, tmp_path):
    """23 and then 37 steps, neither a multiple of disp_freq 5 or checkpoint_freq 10, and no test at the end."""
    job, ws = blobs_job(train_steps=23, extra="checkpoint_freq: 10"), tmp_path / "ws"
    assert run_cli("run", job, "--workspace", ws, "--set", "test_freq=0").returncode == 0
    records = [json.loads(line) for line in (ws / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records) == 20  # the last display: what summary.json used to say
    assert json.loads((ws / "summary.json").read_text())["steps"] == 23
    resumed = run_cli("run", job, "--workspace", ws, "--set", "test_freq=0", "--set", "train_steps=37", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads((ws / "summary.json").read_text())
    assert summary["steps"] == 37 and summary["latest_run"]["from_step"] == 23 and summary["latest_run"]["steps"] == 14
    assert resumed.stdout.strip().splitlines()[-1].startswith("Trained 14 steps (23 → 37) in ")


def test_steps_of_a_run_that_stopped_count_its_last_display():
    """A display at step s follows the (s + 1)th step; a test at s comes before training step s."""
    train = {"phase": "train", "time": 1.0, "samples": 32, "window_sec": 0.1}
    assert summarize([{"step": 0, "phase": "test", "time": 0.0}, {"step": 20, **train}])["steps"] == 21
    assert summarize([{"step": 15, **train}, {"step": 20, "phase": "test", "time": 2.0}])["steps"] == 20
    assert summarize([{"step": 10, "phase": "resume", "time": 2.0}])["steps"] == 10


def test_jobs_list_shows_workspaces_and_lists_one_folders_jobs(blobs_job, tmp_path):
    job = blobs_job(train_steps=3)
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    for folder in (here, elsewhere):
        folder.mkdir()
        assert run_cli("run", job, "--workspace", "runs/mlp", cwd=folder).returncode == 0

    listing = run_cli("jobs", "list", cwd=here)
    assert listing.returncode == 0, listing.stderr
    rows = table_rows(listing.stdout)
    assert rows[0][:3] == ["id", "name", "workspace"]
    # inside the current directory: relative to it; outside: the whole path
    assert [row[:3] for row in rows[1:]] == [["1", "blobs-mlp", "runs/mlp"], ["2", "blobs-mlp", str(elsewhere / "runs" / "mlp")]]

    only_here = run_cli("jobs", "list", "--here", cwd=here)
    assert table_rows(only_here.stdout)[1:] == rows[1:2]
    listed = json.loads(run_cli("jobs", "list", "--json", "--workspace", elsewhere, cwd=here).stdout)
    assert [(r["id"], r["workspace"], r["status"]) for r in listed] == [(2, str(elsewhere / "runs" / "mlp"), "finished")]
    none = run_cli("jobs", "list", "--workspace", tmp_path / "nowhere", cwd=here)
    assert none.returncode == 0 and none.stdout.strip() == f"no jobs with a workspace in {tmp_path / 'nowhere'}"
    both = run_cli("jobs", "list", "--here", "--workspace", here, cwd=here)
    assert both.returncode == 2 and "not allowed with" in both.stderr and "Traceback" not in both.stderr
    assert len(json.loads(run_cli("jobs", "list", "--json").stdout)) == 2  # no filter: every job, as before
    assert os.path.isabs(listed[0]["workspace"])
