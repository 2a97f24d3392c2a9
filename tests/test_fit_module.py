"""shoal.fit's module path: a torch Dataset read in place, any batch structure, both loss forms, under several layouts.

The model is examples/gpt's character GPT at a tiny size (1 layer, 32 wide, block 16) on a tiny corpus.
"""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO

import shoal
from layouts import LAYOUTS, assert_ran, summary
from shoal.data.in_place import epoch_order
from shoal.frontend.module_path import FitError, loss_form
from shoal.runtime.feed import DatasetFeed

sys.path.insert(0, str(REPO / "examples"))  # travels to spawned ranks with the rest of sys.path
from gpt.data import CharWindows, encode  # noqa: E402
from gpt.model import GPT, GPTConfig  # noqa: E402

quiet = lambda *a: None
CORPUS = "to be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. " * 4
VOCAB = "".join(sorted(set(CORPUS)))
BLOCK = 16
SGD = {"type": "kSGD", "momentum": 0.9, "learning_rate": {"base_lr": 0.5}}


def next_char_loss(model, batch):
    logits = model(batch["x"])
    return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())


def sequence_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Pairs(torch.utils.data.Dataset):
    """The same windows as (x, y) tuples, for loss_fn(output, target)."""

    def __init__(self, windows):
        self.windows = windows

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        sample = self.windows[i]
        return sample["x"], sample["y"]


def windows(stride=3):
    return CharWindows(encode(CORPUS, VOCAB), BLOCK, stride)  # 108 windows of 17 characters


def tiny_gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=len(VOCAB), block_size=BLOCK, n_layer=1, n_head=2, n_embd=32))


def fit(tmp_path, name, *, data=None, loss=next_char_loss, cluster=None, steps=12, updater=SGD, **kw):
    model = tiny_gpt()
    history = shoal.fit(model, loss, data if data is not None else windows(), steps=steps, batch_size=8, disp_freq=1,
                        cluster=cluster or shoal.Cluster(), updater=updater, workspace=tmp_path / name, log=quiet, **kw)
    return model, history


def train_losses(history):
    return [r["loss"] for r in history.phase("train")]


def assert_same_params(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_a_gpt_on_a_dataset_of_int64_dicts_trains_with_loss_of_model_and_batch(tmp_path):
    before = tiny_gpt()
    model, history = fit(tmp_path, "single", steps=30, updater={"type": "kAdam", "learning_rate": {"base_lr": 0.01}},
                         val_data=CharWindows(encode(CORPUS[:200], VOCAB), BLOCK, BLOCK), val_freq=10, val_batch=4)
    losses = train_losses(history)
    assert len(losses) == 30 and sum(losses[-5:]) < 0.8 * sum(losses[:5])  # from ln(vocab) toward memorising the line
    assert all("accuracy" not in r for r in history.records)  # no accuracy without class scores
    vals = history.phase("validate")
    assert [r["step"] for r in vals] == [0, 10, 20, 30] and vals[-1]["loss"] < vals[0]["loss"]
    assert not torch.equal(before.wte.weight, model.wte.weight)  # the caller's module holds the trained values
    assert not (tmp_path / "single" / "data").exists()


def test_loss_of_output_and_target_trains_exactly_as_loss_of_model_and_batch(tmp_path):
    """Tuple batches, the module given x, the loss (logits, B×T next-character targets): the same computation."""
    by_model, h1 = fit(tmp_path, "model")
    by_output, h2 = fit(tmp_path, "output", data=Pairs(windows()), loss=sequence_loss)
    assert train_losses(h1) == pytest.approx(train_losses(h2), rel=1e-6)
    assert_same_params(by_model, by_output)


def test_the_loss_form_is_named_or_read_from_the_first_parameter(tmp_path):
    def custom(net, batch):  # a user's loss whose first parameter is not called model
        return next_char_loss(net, batch)

    assert loss_form(F.cross_entropy, None) == "output" and loss_form(sequence_loss, None) == "output"
    assert loss_form(next_char_loss, None) == "model" and loss_form(custom, None) == "output"
    assert loss_form(custom, "model") == "model"
    with pytest.raises(FitError, match="loss_takes must be 'output'"):
        loss_form(custom, "batch")
    model, history = fit(tmp_path, "named", loss=custom, loss_takes="model", steps=3)
    assert len(train_losses(history)) == 3


def test_loss_of_output_and_target_needs_pairs(tmp_path):
    single = torch.utils.data.TensorDataset(torch.randn(64, 4))  # batches of one tensor: no target
    with pytest.raises(FitError, match="needs batches of \\(inputs, target\\)"):
        shoal.fit(torch.nn.Linear(4, 1), F.mse_loss, single, steps=1, workspace=tmp_path / "ws", log=quiet)


@pytest.mark.parametrize("name", ["in-memory Sandblaster, 2 threads", "AllReduce, 2 processes"])
def test_synchronous_module_path_equals_one_worker_step_for_step(tmp_path, name):
    single, h1 = fit(tmp_path, "single")
    model, h2 = fit(tmp_path, "sync", cluster=LAYOUTS[name].fit_cluster())
    assert_ran(tmp_path / "sync", name)
    assert train_losses(h2) == pytest.approx(train_losses(h1), rel=1e-5)  # every step, not only the end
    assert_same_params(single, model)


# Downpour counts server updates (both groups' pushes): twice the steps for as many per group
@pytest.mark.parametrize("name, steps", [("in-memory Hogwild, 2 groups", 80),
                                         pytest.param("Downpour, 2 groups + 1 server, 3 processes", 160, marks=pytest.mark.slow)])
def test_asynchronous_groups_train_the_gpt(tmp_path, name, steps):
    data = windows()
    with torch.no_grad():
        untrained = next_char_loss(tiny_gpt(), torch.utils.data.default_collate([data[i] for i in range(len(data))])).item()
    model, history = fit(tmp_path, "async", cluster=LAYOUTS[name].fit_cluster(), steps=steps, test_data=data,
                         updater={"type": "kSGD", "learning_rate": {"base_lr": 0.3}})
    assert_ran(tmp_path / "async", name)
    # measured over 6 runs at lr 0.3: 0.39-0.46 of it (Hogwild); the groups race, so runs differ (at lr 0.5 one in 9 diverged)
    assert history.final_test["loss"] < 0.75 * untrained


def test_resume_from_a_checkpoint_continues_exactly(tmp_path):
    """Stopped in the second epoch (step 15 of 8 windows over 108): the resumed run reads the same shuffled rows."""
    whole, _ = fit(tmp_path, "whole", steps=24)
    fit(tmp_path, "parts", steps=15)
    resumed, history = fit(tmp_path, "parts", steps=24, resume=True)
    assert [r["step"] for r in history.phase("train")][0] == 15
    assert_same_params(whole, resumed)


def test_shuffling_is_a_pure_function_of_seed_and_epoch():
    orders = [epoch_order(50, seed=3, epoch=e, shuffle=True) for e in (0, 1)]
    assert all(sorted(o.tolist()) == list(range(50)) for o in orders)
    assert not torch.equal(orders[0], orders[1])  # a new order every epoch
    assert torch.equal(epoch_order(50, 3, 1, True), orders[1])  # the same in any process, at any time
    assert not torch.equal(epoch_order(50, 4, 1, True), orders[1])
    assert epoch_order(5, 3, 0, False).tolist() == [0, 1, 2, 3, 4]


def test_a_batch_split_over_workers_reads_the_rows_of_one_worker():
    data = Pairs(windows())
    whole = DatasetFeed("data", data, 8, 0, 8, seed=1, shuffle=True)
    parts = [DatasetFeed("data", data, 8, offset, share, seed=1, shuffle=True) for offset, share in ((0, 3), (3, 5))]
    for cursor in (0, 8, 104, 800):  # 104: a batch across the epoch boundary
        x, _ = whole.batch(cursor, torch.device("cpu"))
        split = torch.cat([p.batch(cursor, torch.device("cpu"))[0][0] for p in parts])
        assert torch.equal(x[0], split)
        assert x[0].dtype == torch.int64


def test_tensor_pairs_are_read_in_place_without_a_copy_in_the_workspace(tmp_path):
    torch.manual_seed(0)
    x, y = torch.randn(512, 16), torch.randint(0, 4, (512,))
    model, lines = torch.nn.Linear(16, 4), []
    shoal.fit(model, F.cross_entropy, (x, y), test_data=(x[:100], y[:100]), steps=5, workspace=tmp_path / "ws", log=lines.append)
    assert lines[-1].startswith("Trained 5 steps in ") and "final test accuracy" in lines[-1]  # a closing line
    files = [p for p in (tmp_path / "ws").rglob("*") if p.is_file()]
    assert not (tmp_path / "ws" / "data").exists()
    assert sum(p.stat().st_size for p in files if p.suffix != ".safetensors") < x.nbytes // 2
    assert summary(tmp_path / "ws")["final_test"] is not None  # test_data given without test_freq: tested at the end
    pixels = (x.abs() * 80).to(torch.uint8)  # uint8 inputs become float32, as fit always made them
    shoal.fit(torch.nn.Linear(16, 4), F.cross_entropy, (pixels, y), steps=2, workspace=tmp_path / "pixels", log=quiet)


def adamw(named_params):
    """Groups by name: weight decay on weights and embeddings, none on biases and norms (torch keeps the names)."""
    named_params = list(named_params)
    no_decay = [(n, p) for n, p in named_params if n.endswith("bias") or ".ln_" in n or n.startswith("ln_")]
    decay = [(n, p) for n, p in named_params if (n, p) not in no_decay]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=3e-3)


def test_a_torch_optimizer_trains_as_a_plain_pytorch_loop(tmp_path):
    """optimizer=: torch's AdamW with param groups by name, bit for bit the plain loop on the same rows."""
    names = []
    _, history = fit(tmp_path, "names", steps=1, updater=None, optimizer=lambda named_params: names.append([n for n, _ in named_params]) or adamw(named_params))
    assert names[-1] == [n for n, _ in tiny_gpt().named_parameters()]  # the module's names, in its order
    model, history = fit(tmp_path, "adamw", steps=20, updater=None, optimizer=adamw, seed=5)
    plain, data, losses = tiny_gpt(), windows(), []
    optimizer = adamw(plain.named_parameters())
    orders = [epoch_order(len(data), 5, epoch, True) for epoch in range(2)]  # 160 rows: two epochs of 108
    for step in range(20):
        rows = [int(orders[p // len(data)][p % len(data)]) for p in range(step * 8, step * 8 + 8)]
        loss = next_char_loss(plain, torch.utils.data.default_collate([data[i] for i in rows]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert train_losses(history) == losses
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_a_torch_optimizer_resumes_exactly_and_runs_in_memory_sandblaster(tmp_path):
    whole, _ = fit(tmp_path, "whole", steps=24, updater=None, optimizer=adamw)
    fit(tmp_path, "parts", steps=15, updater=None, optimizer=adamw)
    resumed, _ = fit(tmp_path, "parts", steps=24, updater=None, optimizer=adamw, resume=True)  # AdamW's moments restored
    assert_same_params(whole, resumed)
    threads, history = fit(tmp_path, "threads", steps=24, updater=None, optimizer=adamw,
                           cluster=LAYOUTS["in-memory Sandblaster, 2 threads"].fit_cluster())
    assert_ran(tmp_path / "threads", "in-memory Sandblaster, 2 threads")
    _, single = fit(tmp_path, "single", steps=24, updater=None, optimizer=adamw)
    assert train_losses(history) == pytest.approx(train_losses(single), rel=1e-5)
    for (name, a), b in zip(whole.named_parameters(), threads.parameters()):
        # the key bias's gradient is 0 in exact arithmetic (softmax ignores a constant added to every key):
        # Adam normalises its rounding noise, which the 2-share sum rounds differently, into steps (measured 7e-5)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-3 if name.endswith("attn.c_attn.bias") else 1e-6, msg=name)


def test_an_optimizer_and_an_updater_are_not_both_given(tmp_path):
    with pytest.raises(FitError, match="not both"):
        fit(tmp_path, "both", optimizer=adamw)
    assert not (tmp_path / "both").exists()
