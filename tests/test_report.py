"""Comparing runs: the metrics schema, summary.json, `shoal plot`, `shoal compare`, TensorBoard events."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from cli_in_process import run_cli
from conftest import mlp_job_text
from layouts import LAYOUTS, assert_ran

import shoal
from shoal.planning.placement import place
from shoal.report.metrics import RECORD_KEYS, read_metrics, record_problems
from shoal.report.plot import COLOURS
from shoal.report.summary import THRESHOLDS, threshold_key

# one run per kind: one worker, threads of one process, processes (rows of tests/layouts.py)
RUN_LAYOUTS = ["single worker", "in-memory Sandblaster, 2 threads", "AllReduce, 2 processes, 2 server slices"]


def shoal_process(*args, env=None, timeout=300):
    """`python -m shoal ARGS`: a process of its own (a missing package)."""
    return subprocess.run([sys.executable, "-m", "shoal", *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env, check=False)


def shoal_cli(*args, timeout=300):
    """`shoal ARGS` in the test's process (tests/cli_in_process.py): no torch start-up per command."""
    return run_cli(*args, timeout=timeout)


def assert_one_line_error(proc, *fragments):
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for fragment in fragments:
        assert fragment in err, err


@pytest.fixture(scope="session")  # not rebuilt when xdist interleaves another module's tests (loadgroup keeps its tests on one worker)
def layout_runs(blobs_dir, tmp_path_factory):
    """One real 30-step run of the blobs MLP per layout (through the CLI, as a user starts it; in this process, whose
    forkserver starts the ranks: the file's real `python -m shoal` processes are the crashed run's and tensorboard's)."""
    root = tmp_path_factory.mktemp("layouts")
    job = root / "job.conf"
    job.write_text(mlp_job_text(blobs_dir, train_steps=30))
    runs = {}
    for n, name in enumerate(RUN_LAYOUTS):
        proc = shoal_cli("run", job, "--workspace", root / f"run{n}", "--no-progress", *LAYOUTS[name].cli())
        assert proc.returncode == 0, proc.stderr
        runs[name] = root / f"run{n}"
    return runs


# -- metrics.jsonl -------------------------------------------------------------------------

@pytest.mark.parametrize("layout", RUN_LAYOUTS)
@pytest.mark.xdist_group("report_layout_runs")  # one worker builds the module's fixture (scripts/test.sh: --dist loadgroup)
def test_every_record_follows_the_schema(layout_runs, layout):
    records = read_metrics(layout_runs[layout] / "metrics.jsonl")
    assert records and all(record_problems(r) == [] for r in records), [record_problems(r) for r in records]
    assert set().union(*records) <= set(RECORD_KEYS) | {"loss", "accuracy"}
    assert [r["time"] for r in records] == sorted(r["time"] for r in records)
    train = [r for r in records if r["phase"] == "train"]
    assert [r["step"] for r in train] == list(range(0, 30, 5))
    previous = -1
    for r in train:
        assert r["samples"] == 32 * (r["step"] - previous)  # global batch 32 per step of the window
        previous = r["step"]
        assert r["samples_per_sec"] == pytest.approx(r["samples"] / r["window_sec"], rel=0.02)
        assert 0 < r["compute_sec"] and 0 <= r["exchange_sec"]
        assert r["compute_sec"] + r["exchange_sec"] <= r["window_sec"] * 1.01 + 1e-3
        assert "staleness" not in r  # synchronous: reserved for asynchronous groups
    # the chief's process reports its own workers: both threads in memory, worker 0 across processes
    expected_workers = {"0", "1"} if layout == "in-memory Sandblaster, 2 threads" else {"0"}
    assert all(set(r["worker_compute_sec"]) == expected_workers for r in train)


@pytest.mark.parametrize("record, problem", [
    ({"phase": "test", "time": 1.0}, "missing 'step'"),
    ({"step": 3, "phase": "train", "time": 1.0, "loss": 0.1}, "missing 'samples'"),
    ({"step": -1, "phase": "test", "time": 1.0}, "step = -1"),
    ({"step": 1, "phase": "test", "time": 1.0, "loss": "0.1"}, "loss = '0.1'"),
    ({"step": 1, "phase": "bogus", "time": 1.0}, "phase = 'bogus'"),
    ({"step": 1, "phase": "test", "time": -2.0}, "time is negative"),
])
def test_schema_check_names_what_is_wrong(record, problem):
    assert problem in record_problems(record)


# -- summary.json --------------------------------------------------------------------------

@pytest.mark.parametrize("layout", RUN_LAYOUTS)
@pytest.mark.xdist_group("report_layout_runs")  # one worker builds the module's fixture (scripts/test.sh: --dist loadgroup)
def test_summary_of_a_finished_run(layout_runs, layout):
    workspace = layout_runs[layout]
    summary = assert_ran(workspace, layout)
    records = read_metrics(workspace / "metrics.jsonl")
    tests = [r for r in records if r["phase"] == "test"]
    framework, processes = LAYOUTS[layout].framework, LAYOUTS[layout].processes
    job = shoal.load_job(workspace / ".shoal" / "job.conf")
    assert summary["job"] == "blobs-mlp" and summary["status"] == "finished"
    assert summary["framework"] == framework and summary["label"].startswith(framework)
    assert summary["processes"] == processes == len(place(job.cluster).processes)
    assert summary["workers"] == len(summary["devices"]) == job.cluster.nworkers_per_group
    assert summary["cluster"]["nworkers_per_group"] == job.cluster.nworkers_per_group
    assert summary["threads_per_worker"] >= 1 and summary["host"]["cores"] == os.cpu_count()
    assert summary["steps"] == summary["train_steps"] == 30
    assert summary["wall_time"] >= records[-1]["time"]
    assert summary["samples_per_sec"] > 0
    assert summary["final_test"]["step"] == 30 and summary["final_test"]["accuracy"] == tests[-1]["accuracy"]
    assert summary["best_test"]["accuracy"] == max(r["accuracy"] for r in tests)
    for threshold in THRESHOLDS:
        first = next((r for r in tests if r["accuracy"] >= threshold), None)
        reached = summary["time_to_accuracy"].get(threshold_key(threshold))
        assert reached == (None if first is None else {"step": first["step"], "time": first["time"]})
    assert summary["time_to_accuracy"], "the blobs MLP passes 90% within 30 steps"
    assert summary["staleness_mean"] is None


def test_a_crashed_run_keeps_the_summary_of_its_last_test(blobs_job, tmp_path):
    """Rank 0 (the chief) dies at step 25 of a two-process run: summary.json is the one of the test at 20."""
    job = blobs_job(train_steps=40)
    # in this test's process: the chief is a rank forked from its forkserver, the launcher that outlives it is here
    proc = run_cli("run", job, "--workspace", tmp_path / "ws", "--no-progress", *LAYOUTS["AllReduce, 2 processes"].cli(),
                   env={**os.environ, "SHOAL_INJECT_EXIT": "0:25"}, timeout=300)
    assert proc.returncode == 2, proc.stderr
    summary = assert_ran(tmp_path / "ws", "AllReduce, 2 processes")
    assert summary["status"] == "failed" and "process 0" in summary["reason"]  # the launcher says what the dead chief could not
    assert summary["final_test"]["step"] == 20
    assert summary["label"] == "AllReduce, 2 workers, 2 processes"
    png = shoal.plot_runs([tmp_path / "ws"], tmp_path / "crash.png")
    assert png.stat().st_size > 0


def test_resumed_run_summary_covers_every_step(blobs_job, tmp_path):
    quiet = lambda *_: None
    job = blobs_job(train_steps=20, extra="checkpoint_freq: 10")
    shoal.train(job, workspace=tmp_path / "ws", log=quiet)
    first = json.loads((tmp_path / "ws" / "summary.json").read_text())
    job.write_text(job.read_text().replace("train_steps: 20", "train_steps: 40"))
    shoal.train(job, workspace=tmp_path / "ws", resume=True, log=quiet)
    summary = json.loads((tmp_path / "ws" / "summary.json").read_text())
    assert summary["steps"] == 40 and summary["final_test"]["step"] == 40
    assert summary["wall_time"] > first["wall_time"]
    # thresholds reached before the resume keep their times
    for key, point in first["time_to_accuracy"].items():
        assert summary["time_to_accuracy"][key]["step"] <= point["step"]


# -- synthetic runs for plot and compare ---------------------------------------------------

def synthetic_run(root, name, *, rate, sec_per_step, steps=400, label=None, workers=1, truncate=False, staleness=None):
    """A run folder whose test accuracy is 1 - 0.9·exp(-step/rate), tested every 50 steps."""
    ws = root / name
    ws.mkdir(parents=True)
    lines = []
    for step in range(steps + 1):
        t = round(step * sec_per_step, 4)
        acc = 1 - 0.9 * math.exp(-step / rate)
        if step % 50 == 0:
            lines.append({"step": step, "phase": "test", "time": t, "loss": 2.3 * (1 - acc) + 0.01, "accuracy": acc})
        if step % 10 == 0 and step < steps:
            rec = {"step": step, "phase": "train", "time": t, "loss": 2.3 * (1 - acc) + 0.02, "accuracy": acc - 0.01,
                   "samples": 640, "samples_per_sec": 640 / (10 * sec_per_step), "window_sec": 10 * sec_per_step,
                   "compute_sec": 8 * sec_per_step, "exchange_sec": sec_per_step}
            if staleness is not None:
                rec["staleness"] = staleness
            lines.append(rec)
    text = "".join(json.dumps(r) + "\n" for r in lines)
    if truncate:  # the process died while writing its last line
        text = text[: -len(json.dumps(lines[-1])) // 2 - 1]
    (ws / "metrics.jsonl").write_text(text)
    if label is not None:
        (ws / "summary.json").write_text(json.dumps({"label": label, "framework": label, "workers": workers, "status": "finished"}))
    return ws


def first_test_at(rate, threshold, every=50):
    step = rate * math.log(0.9 / (1 - threshold))
    return int(math.ceil(step / every - 1e-9) * every)


RATES = {"fast": (60.0, 0.05, 4), "medium": (90.0, 0.02, 2), "slow": (160.0, 0.01, 1)}


@pytest.fixture
def synthetic_runs(tmp_path):
    return [synthetic_run(tmp_path, name, rate=rate, sec_per_step=sps, label=f"layout {name}", workers=w)
            for name, (rate, sps, w) in RATES.items()]


def png_pixels(path):
    from matplotlib.image import imread

    return imread(str(path))[..., :3]


def png_colours(pixels):
    """The picture's distinct colours (RGB in [0, 1]) and how many pixels have each: a PNG's channels are bytes, so
    the checks below look at a few thousand colours instead of every one of a million pixels."""
    levels = np.round(pixels.reshape(-1, 3) * 255).astype(np.int64)
    packed, counts = np.unique((levels[:, 0] << 16) | (levels[:, 1] << 8) | levels[:, 2], return_counts=True)
    return np.stack([packed >> 16, (packed >> 8) & 255, packed & 255], axis=1) / 255, counts


def colour_present(colours, hex_colour, tolerance=0.02, min_pixels=50):
    """At least `min_pixels` pixels within `tolerance` of `hex_colour`; `colours`: png_colours(pixels)."""
    rgb = np.array([int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    values, counts = colours
    return int(counts[np.abs(values - rgb).max(axis=-1) < tolerance].sum()) >= min_pixels


@pytest.mark.parametrize("x, nruns", [(("step", "time"), 1), (("step", "time"), 3), (("step",), 3), (("time",), 2)])
def test_plot_draws_every_run_in_its_colour(synthetic_runs, tmp_path, x, nruns):
    out = shoal.plot_runs(synthetic_runs[:nruns], tmp_path / "runs.png", x=x)
    pixels = png_pixels(out)
    assert pixels.shape[:2] == (900, 1400)  # height, width of the default 1400 x 900
    colours = png_colours(pixels)
    for k, colour in enumerate(COLOURS):
        if colour != "#000000":  # black is also the text's colour
            assert colour_present(colours, colour) == (k < nruns), colour
    assert len(np.unique(colours[0].round(2), axis=0)) > 20  # not blank


def test_plot_size_and_format_follow_the_caller(synthetic_runs, tmp_path):
    from shoal.report.plot import plot_runs

    out = plot_runs(synthetic_runs, tmp_path / "small.png", size=(800, 600))
    assert png_pixels(out).shape[:2] == (600, 800)
    svg = plot_runs(synthetic_runs, tmp_path / "runs.svg")
    assert svg.read_text().lstrip().startswith("<?xml") and "layout fast" in svg.read_text()


def test_a_crashed_runs_partial_metrics_still_plot_and_compare(tmp_path):
    whole = synthetic_run(tmp_path, "whole", rate=60.0, sec_per_step=0.05, label="layout whole")
    crashed = synthetic_run(tmp_path, "crashed-run", rate=90.0, sec_per_step=0.02, steps=230, truncate=True)
    assert not (crashed / "metrics.jsonl").read_text().endswith("\n")
    out = shoal.plot_runs([whole, crashed], tmp_path / "runs.png")
    colours = png_colours(png_pixels(out))
    assert colour_present(colours, COLOURS[0]) and colour_present(colours, COLOURS[1])
    rows = shoal.compare_runs([whole, crashed])
    assert rows[1]["layout"] == "crashed-run" and rows[1]["status"] == "no summary"
    assert rows[1]["steps"] < 230 and rows[1]["final_test_accuracy"] is not None


def test_compare_rows_hold_what_each_run_reached(synthetic_runs, tmp_path):
    rows = shoal.compare_runs(synthetic_runs)
    assert [r["layout"] for r in rows] == [f"layout {n}" for n in RATES]
    for row, (name, (rate, sec_per_step, workers)) in zip(rows, RATES.items()):
        assert row["workers"] == workers
        assert row["samples_per_sec"] == pytest.approx(640 / (10 * sec_per_step))
        for key, point in row["time_to_accuracy"].items():
            step = first_test_at(rate, float(key))
            assert point == ({"step": step, "time": pytest.approx(step * sec_per_step)} if step <= 400 else None)
        assert row["final_test_accuracy"] == pytest.approx(1 - 0.9 * math.exp(-400 / rate))
        assert row["staleness_mean"] is None


def test_compare_reports_mean_staleness_when_runs_have_it(tmp_path):
    ws = synthetic_run(tmp_path, "async", rate=60.0, sec_per_step=0.05, label="Downpour", staleness=1.5)
    assert shoal.compare_runs([ws])[0]["staleness_mean"] == pytest.approx(1.5)


def test_compare_cli_table_json_and_markdown(synthetic_runs):
    table = shoal_cli("compare", *synthetic_runs)
    assert table.returncode == 0, table.stderr
    for name in RATES:
        assert f"layout {name}" in table.stdout
    as_json = shoal_cli("compare", "--json", *synthetic_runs)
    assert json.loads(as_json.stdout) == json.loads(json.dumps(shoal.compare_runs(synthetic_runs)))
    markdown = shoal_cli("compare", "--markdown", *synthetic_runs).stdout.strip().splitlines()
    assert len(markdown) == 2 + len(RATES) and markdown[0].startswith("| run | layout | workers | samples/s | →90%")
    assert "—" in markdown[-1]  # the slow run does not reach 97% within 400 steps


def test_plot_cli_writes_the_picture(synthetic_runs, tmp_path):
    proc = shoal_cli("plot", *synthetic_runs, "-o", tmp_path / "cli.png", "--x", "time")
    assert proc.returncode == 0, proc.stderr
    assert png_pixels(tmp_path / "cli.png").shape[:2] == (900, 1400)


@pytest.mark.parametrize("command", ["plot", "compare"])
def test_cli_errors_are_one_line(synthetic_runs, tmp_path, command):
    out = ["-o", tmp_path / "x.png"] if command == "plot" else []
    assert_one_line_error(shoal_cli(command, synthetic_runs[0], tmp_path / "missing", *out), "missing: no such run folder")
    (tmp_path / "empty").mkdir()
    assert_one_line_error(shoal_cli(command, tmp_path / "empty", *out), "empty: no metrics.jsonl")
    if command == "plot":
        assert_one_line_error(shoal_cli("plot", synthetic_runs[0], "-o", tmp_path / "nowhere" / "x.png"), "nowhere does not exist")
        assert not (tmp_path / "x.png").exists()


# -- TensorBoard ---------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["--tensorboard", "tensorboard: true"])
def test_tensorboard_events_hold_the_metrics(blobs_job, tmp_path, how):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    job = blobs_job(train_steps=20, extra=how if how.startswith("tensorboard:") else "")
    proc = shoal_cli("run", job, "--workspace", tmp_path / "ws", "--no-progress", *([how] if how.startswith("--") else []))
    assert proc.returncode == 0, proc.stderr
    events = EventAccumulator(str(tmp_path / "ws" / "tensorboard"))
    events.Reload()
    records = read_metrics(tmp_path / "ws" / "metrics.jsonl")
    for phase, metric in [("train", "loss"), ("train", "accuracy"), ("test", "accuracy"), ("train", "samples_per_sec")]:
        expected = [(r["step"], r[metric]) for r in records if r["phase"] == phase]
        got = [(e.step, e.value) for e in events.Scalars(f"{phase}/{metric}")]
        assert [s for s, _ in got] == [s for s, _ in expected]
        assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-6)


def test_tensorboard_missing_is_a_one_line_error(blobs_job, tmp_path):
    """Asked for TensorBoard without the package: refused before anything is written."""
    fake = tmp_path / "site"
    (fake / "tensorboard").mkdir(parents=True)
    (fake / "tensorboard" / "__init__.py").write_text("raise ImportError('No module named tensorboard')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake), os.environ.get("PYTHONPATH", "")])}
    proc = shoal_process("run", blobs_job(train_steps=5), "--workspace", tmp_path / "ws", "--tensorboard", env=env)
    assert_one_line_error(proc, "pip install 'shoal[tensorboard]'")
    assert not (tmp_path / "ws").exists()


# -- benchmarks/frameworks.py --------------------------------------------------------------

def test_framework_benchmark_layouts_are_what_they_claim():
    """Every layout places, is named as its framework, and runs."""
    from benchmark_scripts import load_benchmark

    from shoal.planning.plan import plan_job
    from shoal.report.summary import describe_layout

    bench = load_benchmark("frameworks")
    expected = {"single": "single worker", "inmem-sandblaster": "in-memory Sandblaster", "allreduce": "AllReduce",
                "sandblaster": "Sandblaster", "downpour": "Downpour", "dist-hogwild": "Distributed Hogwild",
                "inmem-hogwild": "in-memory Hogwild"}
    assert [l.name for l in bench.LAYOUTS] == list(expected)
    for layout in bench.LAYOUTS:
        sets = bench.overrides(layout, 100, 50)
        job = shoal.load_job(bench.JOB, sets)
        assert describe_layout(plan_job(job))[0] == expected[layout.name]
        assert bench.refusal(layout, sets) is None  # every framework runs
