"""Which framework reaches a given MNIST accuracy soonest on this machine?

Trains SINGA's MNIST MLP (examples/mnist/tuned.conf: Nesterov momentum, batch 64) under every
framework layout with the same wall-clock budget each, one after the other, through `shoal run`
exactly as a user would (only `--set cluster.*` differs), then writes into `--out` (default: the run folder;
`--out docs` for the MNIST MLP's page, with tests: a timing run must not replace its accuracy table)

    frameworks.png   loss and accuracy against step and wall-clock time (`shoal plot`)
    frameworks.md    the `shoal compare` table, with machine, date and command

A layout the runtime refuses (none today) is listed and skipped with the runtime's own message.
Next to each measured samples/s it prints what `shoal plan --compare` predicted for that layout
before anything ran (shoal.planning.estimate on this machine's cached calibration), and the error.
`--model cifar10` runs SINGA's cifar10 convnet (examples/cifar10/job.conf) on random images in the
CIFAR-10 binary format, prepared by `shoal prepare cifar10` (throughput does not depend on pixels).
`--model gpt` runs the character GPT of the module path (examples/gpt/train.py, `shoal.fit`: a torch
module, AdamW) on examples/gpt/data (`shoal prepare shakespeare --out examples/gpt/data`); its
predictions come from `shoal plan examples/gpt/train.py --estimate --json`, as a user would ask.

    python benchmarks/frameworks.py [--seconds 40] [--steps N] [--keep DIR] [--only single,allreduce] [--model cifar10|gpt] [--out docs]
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from shoal.frontend import api
from shoal.report.compare import compare_runs, render_markdown
from shoal.report.plot import plot_runs
from shoal.planning.plan import UnsupportedClusterError, plan_job
from shoal.planning.estimate import estimate, plan_kernels
from shoal.runtime import calibrate

JOB = REPO / "examples/mnist/tuned.conf"
MODELS = {"mnist": "SINGA's MNIST MLP (tuned.conf)", "cifar10": "SINGA's cifar10 convnet (job.conf, random images)",
          "gpt": "the character GPT (examples/gpt/train.py, shoal.fit, AdamW)"}
GPT = REPO / "examples/gpt/train.py"
SCRIPT_ARGS = ["--", "--val-freq", "0"]  # the GPT's own validation (2000 windows at step 0) would eat a short budget


@dataclass(frozen=True)
class Layout:
    name: str  # run folder
    cluster: str  # `--set cluster.` overrides, space separated
    about: str


LAYOUTS = [
    Layout("single", "", "one worker, every core"),
    Layout("inmem-sandblaster", "nworkers_per_group=2 nworkers_per_procs=2", "one group of 2 workers as threads of one process"),
    Layout("allreduce", "nworkers_per_group=2 nservers_per_group=2", "2 processes, each a worker and the server of half the params"),
    Layout("sandblaster", "nworkers_per_group=2 nservers_per_group=2 server_worker_separate=true", "2 worker processes + 2 server processes"),
    # asynchronous worker groups
    Layout("downpour", "nworker_groups=2 server_worker_separate=true", "2 async groups of 1 worker + 1 server process"),
    Layout("dist-hogwild", "nworker_groups=2 nserver_groups=2", "2 async groups, each with its own server; servers sync"),
    Layout("inmem-hogwild", "nworker_groups=2 nworkers_per_procs=2", "2 async groups as threads sharing one param copy"),
]


def overrides(layout: Layout, steps: int, test_freq: int, disp_freq: int = 20) -> list[str]:
    sets = [f"train_steps={steps}", f"disp_freq={disp_freq}", "checkpoint_freq=0"]
    # a shoal.fit script validates (its val_data); a job.conf tests on its test store
    sets += [f"validate_freq={test_freq}"] if JOB.suffix == ".py" else [f"test_freq={test_freq}", "test_steps=10"]
    return sets + [f"cluster.{kv}" for kv in layout.cluster.split()]


def cifar10_job(root: Path) -> Path:
    """examples/cifar10/job.conf beside stores of random images (`shoal prepare cifar10` on fake binary batches)."""
    import numpy as np

    from shoal.data.prepare import prepare_cifar10

    rng = np.random.default_rng(0)
    source = root / "cifar-10-batches-bin"
    source.mkdir(parents=True, exist_ok=True)
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        rows = rng.integers(0, 256, (1000, 1 + 3 * 32 * 32), dtype=np.uint8)
        rows[:, 0] %= 10
        (source / name).write_bytes(rows.tobytes())
    prepare_cifar10(root / "data", source, overwrite=True)
    job = root / "job.conf"
    shutil.copy(REPO / "examples/cifar10/job.conf", job)
    return job


def predicted(sets: list[str]) -> float:
    """samples/s `shoal plan --compare` predicts for the layout (calibrating the kernels it needs, once)."""
    if JOB.suffix == ".py":
        return script_plan(sets)[1]["estimate"]["samples_per_s"]
    plan = plan_job(api.load_job(JOB, sets))
    return estimate(plan, calibrate.calibration(plan_kernels(plan))).samples_per_s


def script_plan(sets: list[str]) -> tuple[int, dict | str]:
    """`shoal plan SCRIPT --estimate --json` with the layout's --sets: (exit status, the JSON or the one-line error)."""
    args = [sys.executable, "-m", "shoal", "plan", str(JOB), "--estimate", "--json"] + [a for s in sets for a in ("--set", s)] + SCRIPT_ARGS
    out = subprocess.run(args, cwd=REPO, capture_output=True, text=True, env=child_env(), timeout=600)
    if out.returncode:
        return out.returncode, (out.stderr.strip().splitlines() or ["no output"])[-1]
    return 0, __import__("json").loads(out.stdout)


def refusal(layout: Layout, sets: list[str]) -> str | None:
    """The runtime's one-line refusal when it cannot run this layout yet, else None."""
    if JOB.suffix == ".py":
        code, said = script_plan(sets)
        return said if code else None
    try:
        plan_job(api.load_job(JOB, sets))
    except UnsupportedClusterError as err:
        return str(err).splitlines()[0]
    return None


def child_env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}


def run(layout: Layout, sets: list[str], workspace: Path, seconds: float | None) -> int:
    """`shoal run` the layout; with a time budget, Ctrl-C it `seconds` after it starts training."""
    args = [sys.executable, "-m", "shoal", "run", str(JOB), "--workspace", str(workspace), "--no-progress"]
    for s in sets:
        args += ["--set", s]
    args += SCRIPT_ARGS if JOB.suffix == ".py" else []
    env = child_env()
    with open(workspace.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    if seconds is None:
        return proc.wait()
    while not (workspace / "summary.json").exists():  # written when the chief starts training
        if proc.poll() is not None:
            return proc.returncode
        time.sleep(0.2)
    try:
        return proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # as Ctrl-C: the metrics and summary so far stay
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return 0


def prediction_table(rows: list[dict], predictions: dict[str, float]) -> str:
    """Markdown: each layout's predicted and measured samples/s, the error, and whether the ranking agrees."""
    lines = ["| layout | predicted samples/s | measured | steps measured | error |", "|---|---|---|---|---|"]
    pairs = []
    for row in rows:
        name = Path(row["run"]).name
        guess, got = predictions.get(name), row["samples_per_sec"]
        if guess is None or not got:
            continue
        pairs.append((name, guess, got))
        lines.append(f"| {name} ({row['layout']}) | {guess:.0f} | {got:.0f} | {row['steps']} | {100 * (guess - got) / got:+.0f} % |")
    if pairs:
        top_guess = max(pairs, key=lambda p: p[1])[0]
        top_got = max(pairs, key=lambda p: p[2])[0]
        within = sum(abs(g - m) <= 0.25 * m for _, g, m in pairs)
        lines.append("")
        lines.append(f"Within 25 %: {within} of {len(pairs)} layouts. Predicted fastest: {top_guess}; measured fastest: {top_got}"
                     f" ({'agree' if top_guess == top_got else 'disagree'}).")
    return "\n".join(lines)


def machine() -> str:
    import torch

    cpu = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("model name")), platform.processor())
    return f"{platform.machine()}, {os.cpu_count()} cores ({cpu}), torch {torch.__version__}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=40.0, help="wall-clock budget of each layout (default 40)")
    parser.add_argument("--steps", type=int, help="a step budget instead of a time budget")
    parser.add_argument("--test-freq", type=int, default=50, help="test every N steps (1000 test images each)")
    parser.add_argument("--disp-freq", type=int, default=20,
                        help="steps per display window (samples/s leaves out the first window: short budgets need small windows)")
    parser.add_argument("--only", help="comma-separated layout names")
    parser.add_argument("--keep", type=Path, help="keep the run folders here (default: a temporary folder)")
    parser.add_argument("--out", type=Path, help="where frameworks.png and frameworks.md go (default: the run folder; "
                        "docs for the MNIST MLP's page)")
    parser.add_argument("--note", default="", help="a sentence for the table's caption (e.g. that the machine was shared)")
    parser.add_argument("--model", choices=list(MODELS), default="mnist", help="the MNIST MLP (default) or the cifar10 convnet")
    args = parser.parse_args()
    global JOB
    # started in the background (`... &`), a shell leaves SIGINT ignored, and children inherit that:
    # the budget's Ctrl-C must reach `shoal run`
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.model == "mnist" and not (REPO / "examples/mnist/data/train_data.bin").exists():
        sys.exit("prepare MNIST first: shoal prepare mnist --out examples/mnist/data")

    root = args.keep or Path(tempfile.mkdtemp(prefix="shoal-frameworks-"))
    if args.out is None:  # docs/frameworks.md is asked for by name: a timing run's table must not replace its accuracies
        args.out = root
    if args.out.resolve() == (REPO / "docs").resolve() and args.model != "mnist":
        sys.exit("--out docs: docs/frameworks.md is the MNIST MLP's page; write another model's table elsewhere")
    root.mkdir(parents=True, exist_ok=True)
    if args.model == "cifar10":
        JOB = cifar10_job(root / "cifar10")
    if args.model == "gpt":
        if not (REPO / "examples/gpt/data/train.txt").exists():
            sys.exit("prepare the text first: shoal prepare shakespeare --out examples/gpt/data")
        JOB = GPT
    load_before = os.getloadavg()
    steps = args.steps or 1_000_000  # with a time budget the run is stopped long before
    seconds = None if args.steps else args.seconds
    chosen = [l for l in LAYOUTS if not args.only or l.name in args.only.split(",")]
    done, skipped, predictions = [], [], {}
    for layout in chosen:
        sets = overrides(layout, steps, args.test_freq, args.disp_freq)
        why = refusal(layout, sets)
        if why:
            print(f"{layout.name:<18} skipped, not yet runnable: {why}")
            skipped.append((layout, why))
            continue
        predictions[layout.name] = predicted(sets)  # before it runs: the estimate never sees a measurement
        workspace = root / layout.name
        if workspace.exists():
            shutil.rmtree(workspace)
        started = time.perf_counter()
        code = run(layout, sets, workspace, seconds)
        if not (workspace / "metrics.jsonl").exists():
            sys.exit(f"{layout.name}: `shoal run` exited with {code} before training; see {workspace.with_suffix('.log')}")
        if not (workspace / "metrics.jsonl").read_text().strip():
            print(f"{layout.name:<18} no display window in the budget (give more --seconds); left out", flush=True)
            continue
        print(f"{layout.name:<18} ran {time.perf_counter() - started:.0f} s ({layout.about})", flush=True)
        done.append(workspace)

    if not done:
        sys.exit("no layout ran (each was refused: above)")
    budget = f"{args.steps} steps" if args.steps else f"{args.seconds:.0f} s of training"
    rows = compare_runs(done)
    table = render_markdown(rows)
    print("\n" + table)
    load_after = os.getloadavg()
    against = prediction_table(rows, predictions)
    print(f"\npredicted (before running) against measured; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after\n")
    print(against)
    args.out.mkdir(parents=True, exist_ok=True)
    plot_runs(done, args.out / "frameworks.png", title=f"{MODELS[args.model]}, {budget} per layout")
    command = "python benchmarks/frameworks.py" + (f" --steps {args.steps}" if args.steps else f" --seconds {args.seconds:g}")
    lines = [
        f"# Frameworks compared: {MODELS[args.model]}",
        "",
        f"Generated by `{command}` on {datetime.date.today().isoformat()}.",
        f"Machine: {machine()}. {args.note}".rstrip(),
        "",
        (
            f"{MODELS[args.model]}, {budget} per layout, run one after the other; a test every {args.test_freq} steps "
            "(its time counts in the wall clock). Time columns: wall-clock seconds since the start of training, "
            "@ the step, of the first test at or above that accuracy; — where the budget ran out first."
        ),
        "",
        "![loss and accuracy of each framework against step and wall-clock time](frameworks.png)",
        "",
        table,
        "",
        f"Predicted by `shoal plan --compare` before each run, against measured (load average {load_before[0]:.1f} "
        f"before the runs, {load_after[0]:.1f} after):",
        "",
        against,
        "",
        "| layout | `cluster {}` (via `--set cluster.…`) | |",
        "|---|---|---|",
    ]
    for layout in chosen:
        why = next((w for l, w in skipped if l is layout), None)
        refused = f"; **not yet runnable**: {why.split(';')[0]}" if why else ""
        lines.append(f"| {layout.name} | `{layout.cluster or '(defaults)'}` | {layout.about}{refused} |")
    (args.out / "frameworks.md").write_text("\n".join(lines) + "\n")
    print(f"\nwrote {args.out / 'frameworks.png'} and {args.out / 'frameworks.md'} (runs in {root})")


if __name__ == "__main__":
    main()
