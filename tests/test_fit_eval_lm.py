"""shoal.fit for a language model: gradient accumulation, bf16 autocast, metric callables, time to any target.

The model is the tiny GPT of tests/test_fit_module.py (1 layer, 32 wide, block 16) on its tiny corpus.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

import shoal
from layouts import LAYOUTS, assert_ran, summary
from shoal.frontend.module_path import FitError
from shoal.runtime.worker import micro_batch_rows
from test_fit_module import (BLOCK, CORPUS, VOCAB, CharWindows, Pairs, assert_same_params, encode, fit, next_char_loss, sequence_loss,
                             tiny_gpt, train_losses, windows)

ADAM = {"type": "kAdam", "learning_rate": {"base_lr": 0.01}}


def test_micro_batches_tile_the_share():
    assert micro_batch_rows(3, 8, 2) == [(3, 4), (7, 4)]
    assert micro_batch_rows(0, 7, 3) == [(0, 3), (3, 2), (5, 2)]
    assert micro_batch_rows(0, 2, 4) == [(0, 1), (1, 1)]  # never an empty micro-batch


@pytest.mark.parametrize("name", ["one worker", "in-memory Sandblaster, 2 threads"])
def test_accumulated_micro_batches_train_as_one_pass_on_the_whole_batch(tmp_path, name):
    cluster = None if name == "one worker" else LAYOUTS[name].fit_cluster()
    whole, h1 = fit(tmp_path, "whole", steps=10)
    accumulated, h2 = fit(tmp_path, "accum", steps=10, grad_accum_steps=2, cluster=cluster)
    if cluster is not None:
        assert_ran(tmp_path / "accum", name)
    assert train_losses(h2) == pytest.approx(train_losses(h1), rel=1e-5)
    assert_same_params(whole, accumulated)
    uneven, h3 = fit(tmp_path, "uneven", steps=10, grad_accum_steps=3)  # 8 rows as 3 + 3 + 2
    assert_same_params(whole, uneven)


@pytest.mark.parametrize("bad, message", [
    ({"grad_accum_steps": 9}, "grad_accum_steps must be a whole number from 1 to batch_size \\(8\\), got 9"),
    ({"steps": 0}, "steps must be a whole number from 1, got 0"),
    ({"test_batch": 0}, "test_batch must be a whole number from 1, got 0"),
    ({"val_freq": -1}, "val_freq must be a whole number from 0, got -1"),
    ({"steps": 2.5}, "steps must be a whole number from 1, got 2.5"),
])
def test_counts_are_checked_in_one_line(tmp_path, bad, message):
    with pytest.raises(FitError, match=message):
        fit(tmp_path, "bad", **bad)
    assert not (tmp_path / "bad").exists()


def test_bf16_autocast_trains_the_gpt_on_fp32_params_and_gradients(tmp_path):
    seen = {"logits": set(), "grads": set()}

    def observed_loss(model, batch):  # a single-process run: a closure is fine here
        logits = model(batch["x"])
        seen["logits"].add(logits.dtype)
        if torch.is_grad_enabled():
            model.lm_head.weight.register_hook(lambda g: seen["grads"].add(g.dtype))  # the gradient its leaf receives
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["y"].flatten())

    fp32, h32 = fit(tmp_path, "fp32", steps=30, loss=observed_loss, updater=ADAM)
    assert seen == {"logits": {torch.float32}, "grads": {torch.float32}}
    seen["logits"].clear()
    bf16, h16 = fit(tmp_path, "bf16", steps=30, loss=observed_loss, autocast="bf16", updater=ADAM)
    assert seen == {"logits": {torch.bfloat16}, "grads": {torch.float32}}  # computed in bf16, the exchange sees fp32
    assert all(p.dtype == torch.float32 for p in bf16.parameters())
    l16, l32 = train_losses(h16), train_losses(h32)
    assert sum(l16[-5:]) < 0.8 * sum(l16[:5])  # it trains
    assert l16 != l32 and l16[0] == pytest.approx(l32[0], rel=1e-3)  # bf16 rounding, on the same first batch
    assert sum(l16[-5:]) == pytest.approx(sum(l32[-5:]), rel=0.1)  # the runs drift apart step by step, yet end close
    with pytest.raises(FitError, match="autocast must be 'bf16'"):
        fit(tmp_path, "fp16", autocast="fp16")


def token_accuracy(model, batch):
    return (model(batch["x"]).argmax(-1) == batch["y"]).float().mean()


def val_windows():
    return CharWindows(encode(CORPUS[:200], VOCAB), BLOCK, BLOCK)  # 12 windows


def test_validation_computes_any_metric_in_eval_mode_averaged_by_samples(tmp_path):
    model, history = fit(tmp_path, "metrics", steps=20, updater=ADAM, val_data=val_windows(), val_freq=10, val_batch=4,
                         metrics={"perplexity": shoal.perplexity, "accuracy": token_accuracy,
                                  "dropout_on": lambda model, batch: float(model.training)})
    vals = history.phase("validate")
    assert [r["step"] for r in vals] == [0, 10, 20]  # and the trained model, at the end
    assert all(r["dropout_on"] == 0.0 for r in vals)  # eval mode
    # recomputed by hand on the initial model (validation at step 0): the whole set, sample-weighted
    model, data = tiny_gpt().eval(), val_windows()
    with torch.no_grad():
        batches = [torch.utils.data.default_collate([data[i] for i in range(s, min(s + 4, len(data)))]) for s in range(0, len(data), 4)]
        rows = [len(b["x"]) for b in batches]
        assert rows == [4, 4, 4]  # 12 windows: batches of 4 (fit takes the largest divisor of the set's size up to val_batch)
        losses = [next_char_loss(model, b).item() for b in batches]
        mean_loss = sum(l * n for l, n in zip(losses, rows)) / sum(rows)
        accuracy = sum(token_accuracy(model, b).item() * n for b, n in zip(batches, rows)) / sum(rows)
    first = vals[0]
    assert first["samples"] == 12
    assert first["loss"] == pytest.approx(mean_loss, rel=1e-5) and first["accuracy"] == pytest.approx(accuracy, rel=1e-5)
    assert first["perplexity"] == pytest.approx(math.exp(mean_loss), rel=1e-5)
    assert first["perplexity"] < sum(math.exp(l) * n for l, n in zip(losses, rows)) / sum(rows)  # not the mean of exps (Jensen)
    s = summary(tmp_path / "metrics")["validate"]
    assert s["perplexity"]["higher_is_better"] is False and s["accuracy"]["higher_is_better"] is True
    assert s["loss"]["final"] == vals[-1]["loss"] and s["loss"]["best"] == min(r["loss"] for r in vals)
    assert s["accuracy"]["best"] == max(r["accuracy"] for r in vals)


def test_metrics_in_the_output_form_and_declared_directions(tmp_path):
    def mistakes(output, target):
        return (output.argmax(-1) != target).float().mean()

    _, history = fit(tmp_path, "pairs", data=Pairs(windows()), loss=sequence_loss, steps=10, updater=ADAM,
                     val_data=Pairs(val_windows()), val_freq=5, val_batch=4,
                     metrics={"mistakes": mistakes, "perplexity": shoal.perplexity}, higher_is_better={"mistakes": False})
    vals = history.phase("validate")
    assert all(0 <= r["mistakes"] <= 1 and r["perplexity"] == pytest.approx(math.exp(r["loss"]), rel=1e-6) for r in vals)
    s = summary(tmp_path / "pairs")
    assert s["validate"]["mistakes"]["higher_is_better"] is False and s["goals"]["higher_is_better"] == {"mistakes": False}
    with pytest.raises(FitError, match="metrics\\['loss'\\]: the loss is always reported"):
        fit(tmp_path, "bad", metrics={"loss": token_accuracy})
    with pytest.raises(FitError, match="metrics\\['bad'\\] must return one number"):
        fit(tmp_path, "bad2", steps=1, val_data=val_windows(), val_freq=1, metrics={"bad": lambda model, batch: model(batch["x"])})


@pytest.fixture(scope="session")  # not rebuilt when xdist interleaves another module's tests (loadgroup keeps its tests on one worker)
def lm_run(tmp_path_factory):
    """A tiny GPT validated every 5 steps with perplexity and accuracy, declaring a reachable and an unreachable target."""
    root = tmp_path_factory.mktemp("lm")
    _, history = fit(root, "gpt", steps=30, updater=ADAM, val_data=val_windows(), val_freq=5, val_batch=4,
                     metrics={"perplexity": shoal.perplexity, "accuracy": token_accuracy},
                     targets={"val_loss": 2.9, "val_accuracy": 0.99})
    return root / "gpt", history


@pytest.mark.xdist_group("fit_eval_lm_run")  # one worker builds the module's fixture (scripts/test.sh: --dist loadgroup)
def test_time_to_target_on_any_metric_through_the_api(lm_run):
    workspace, history = lm_run
    vals = history.phase("validate")
    first = next(r for r in vals if r["loss"] <= 2.9)
    assert vals[0]["loss"] > 2.9 and first["step"] > 0  # reached during training, not at the start
    s = summary(workspace)
    assert s["goals"]["targets"] == ["val_loss<=2.9", "val_accuracy>=0.99"]  # directions from the names
    assert s["time_to_target"] == {"val_loss<=2.9": {"step": first["step"], "time": first["time"]}, "val_accuracy>=0.99": None}
    assert s["validate"]["perplexity"]["best"] == pytest.approx(math.exp(s["validate"]["loss"]["best"]), rel=1e-6)
    with pytest.raises(FitError, match="targets 'val_loss<=1': expected PHASE_METRIC \\(e.g. val_loss\\)"):
        fit(workspace.parent, "bad", targets={"val_loss<=1": 2.0})
    with pytest.raises(FitError, match="targets\\['val_loss'\\] must be a number"):
        fit(workspace.parent, "bad", targets={"val_loss": "low"})


@pytest.mark.xdist_group("fit_eval_lm_run")  # one worker builds the module's fixture (scripts/test.sh: --dist loadgroup)
def test_compare_shows_targets_and_validation_metrics(lm_run):
    from test_report import assert_one_line_error, shoal_cli

    workspace, history = lm_run
    vals = history.phase("validate")
    first = next(r for r in vals if r["perplexity"] <= 15)
    rows = shoal.compare_runs([workspace], targets=["val_perplexity<=15"])
    assert rows[0]["time_to_target"]["val_perplexity<=15"] == {"step": first["step"], "time": first["time"]}
    assert rows[0]["validate"]["perplexity"]["final"] == vals[-1]["perplexity"]
    as_json = shoal_cli("compare", "--json", "--target", "val_perplexity<=15", "--target", "test_loss<=1", workspace)
    row = json.loads(as_json.stdout)[0]
    assert set(row["time_to_target"]) == {"val_loss<=2.9", "val_accuracy>=0.99", "val_perplexity<=15", "test_loss<=1"}
    assert row["time_to_target"]["test_loss<=1"] is None  # no test set
    header, cells = shoal_cli("compare", "--markdown", "--target", "val_perplexity<=15", workspace).stdout.strip().splitlines()[::2]
    columns = dict(zip([c.strip() for c in header.split("|")], [c.strip() for c in cells.split("|")]))
    assert columns["→val_perplexity≤15"].endswith(f" s @{first['step']}")  # wall time @ step
    assert columns["→val_accuracy≥0.99"] == "—" and columns["val perplexity"] == format(vals[-1]["perplexity"], ".4g")
    assert not {"→90%", "final acc", "staleness"} & set(columns)  # no test accuracy, synchronous: no empty columns
    assert_one_line_error(shoal_cli("compare", "--target", "val_loss<1.9", workspace), "--target 'val_loss<1.9': expected")


@pytest.mark.xdist_group("fit_eval_lm_run")  # one worker builds the module's fixture (scripts/test.sh: --dist loadgroup)
def test_plot_draws_every_metric_present(lm_run, tmp_path):
    workspace, _ = lm_run
    svg = shoal.plot_runs([workspace], tmp_path / "lm.svg").read_text()
    for title in ("loss vs step", "accuracy vs time", "perplexity vs step"):
        assert title in svg
    assert "validate" in svg  # the validations' legend entry


def test_over_processes_accumulation_metrics_and_targets_reach_the_chief(tmp_path, capfd):
    """AllReduce over 2 processes: micro-batches hand their gradients over after the last backward (not streamed),
    and the spawned chief's summary has the fit's metrics and targets; fit's log= (quiet) silences the chief rank's
    lines, which its log file keeps."""
    single, h1 = fit(tmp_path, "single", steps=6)
    capfd.readouterr()
    model, h2 = fit(tmp_path, "allreduce", steps=6, grad_accum_steps=2, cluster=LAYOUTS["AllReduce, 2 processes"].fit_cluster(),
                    val_data=val_windows(), val_freq=3, val_batch=4, metrics={"perplexity": shoal.perplexity, "accuracy": token_accuracy},
                    targets={"val_loss": 3.2})
    assert_ran(tmp_path / "allreduce", "AllReduce, 2 processes")
    assert "Train @ step" not in capfd.readouterr().out  # (the ranks write to this process's stdout: captured by fd)
    assert "Train @ step 5" in (tmp_path / "allreduce" / "logs" / "rank0.log").read_text()
    assert train_losses(h2) == pytest.approx(train_losses(h1), rel=1e-5)
    assert_same_params(single, model)
    s = summary(tmp_path / "allreduce")
    assert set(s["validate"]) == {"loss", "perplexity", "accuracy"} and s["goals"]["targets"] == ["val_loss<=3.2"]
    assert s["time_to_target"]["val_loss<=3.2"]["step"] == 0  # the untrained GPT starts below it (about 3.1)


def test_a_lambda_optimizer_for_several_processes_is_refused_naming_the_argument(tmp_path):
    """Spawned processes receive the fit call's objects pickled: a lambda is one line, before anything starts."""
    with pytest.raises(FitError, match=r"optimizer= cannot be sent to the layout's 2 processes .*module-level function"):
        fit(tmp_path, "lambda", steps=2, cluster=LAYOUTS["AllReduce, 2 processes"].fit_cluster(), updater=None,
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    assert not (tmp_path / "lambda").exists()
