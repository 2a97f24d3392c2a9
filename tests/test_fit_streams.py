"""shoal.fit's stream inputs: an IterableDataset and a DataLoader factory, read by position (shoal.data.streams).

A group's batch split over workers reads the rows one worker would, and a resume continues on exactly
the rows the uninterrupted run read (positions in checkpoints, the stream re-iterated and skipped to them).
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset

import shoal
from layouts import LAYOUTS, assert_ran
from shoal.errors import ShoalError
from shoal.frontend.module_path import FitError
from shoal.data.in_place import epoch_order
from test_fit_module import assert_same_params, fit, next_char_loss, tiny_gpt, train_losses, windows


class WindowStream(IterableDataset):
    """The corpus's windows as a stream, in an order of its own per epoch (set_epoch), optionally without len()."""

    def __init__(self, windows, sized=True, short_epoch=None):
        self.windows, self.sized, self.short_epoch, self.epoch, self.epochs_seen = windows, sized, short_epoch, 0, []

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        self.epochs_seen.append(self.epoch)
        order = torch.randperm(len(self.windows), generator=torch.Generator().manual_seed(100 + self.epoch))
        stop = len(order) - 5 if self.epoch == self.short_epoch else len(order)
        for i in order[:stop].tolist():
            yield self.windows[i]


class Sized(WindowStream):
    def __len__(self):
        return len(self.windows)


def loader_of(dataset, batch_sampler):
    """A user's DataLoader factory (module level: it travels to spawned processes)."""
    return DataLoader(dataset, batch_sampler=batch_sampler, num_workers=0)


PLAIN_SGD = {"type": "kSGD", "learning_rate": {"base_lr": 0.5}}


def stream_order(epochs):
    """The rows WindowStream yields, epoch after epoch."""
    data = windows()
    return [data[i] for e in range(epochs) for i in torch.randperm(len(data), generator=torch.Generator().manual_seed(100 + e)).tolist()]


def dataset_order(epochs, seed=0):
    """The rows shoal reads from windows() (or a loader over it): shuffled by (seed, epoch)."""
    data = windows()
    return [data[int(i)] for e in range(epochs) for i in epoch_order(len(data), seed, e, True)]


def plain_loop(rows, steps):
    """torch's SGD on batches of 8 of `rows` in order: the model and losses shoal must reproduce."""
    model, losses = tiny_gpt(), []
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(steps):
        loss = next_char_loss(model, torch.utils.data.default_collate(rows[step * 8:step * 8 + 8]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model, losses


def assert_close_to_one_worker(model, plain):
    """A 2-share sum rounds unlike one worker's mean: measured 2e-6 on params of 0.2 after 16 steps at lr 0.5."""
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5, msg=name)


def test_an_iterable_dataset_trains_on_its_own_order_as_a_plain_loop(tmp_path):
    """No len(): epoch 0 is counted; 15 steps of 8 cross into epoch 1 (of 110 windows), which set_epoch(1) ordered."""
    model, history = fit(tmp_path, "stream", data=WindowStream(windows(), sized=False), steps=15, updater=PLAIN_SGD)
    plain, losses = plain_loop(stream_order(2), 15)
    assert train_losses(history) == pytest.approx(losses, rel=1e-5)
    assert_same_params(model, plain)


@pytest.mark.parametrize("name", ["in-memory Sandblaster, 2 threads",
                                  pytest.param("AllReduce, 2 processes", marks=pytest.mark.slow)])
def test_an_iterable_dataset_split_over_two_workers_equals_one_worker(tmp_path, name):
    """Each worker iterates the stream and keeps its rows of each batch: together the rows one worker reads."""
    model, history = fit(tmp_path, "sync", data=Sized(windows()), steps=15, updater=PLAIN_SGD, cluster=LAYOUTS[name].fit_cluster())
    assert_ran(tmp_path / "sync", name)
    plain, losses = plain_loop(stream_order(2), 15)
    assert train_losses(history) == pytest.approx(losses, rel=1e-5)
    assert_close_to_one_worker(model, plain)


def test_an_iterable_dataset_resumes_exactly_across_an_epoch(tmp_path):
    fit(tmp_path, "parts", data=Sized(windows()), steps=11, updater=PLAIN_SGD)  # position 88 of 110
    resumed, history = fit(tmp_path, "parts", data=Sized(windows()), steps=18, updater=PLAIN_SGD, resume=True)
    assert [r["step"] for r in history.phase("train")][0] == 11  # re-iterated epoch 0 to 88, then on into epoch 1
    plain, losses = plain_loop(stream_order(2), 18)
    assert train_losses(history) == pytest.approx(losses[11:], rel=1e-5)
    assert_same_params(resumed, plain)


def test_a_dataloader_factory_reads_the_rows_of_its_dataset_and_resumes_exactly(tmp_path):
    """The factory's loader fetches and collates; shoal's positions (shuffled by seed and epoch) choose the rows."""
    factory = functools.partial(loader_of, windows())
    loaded, history = fit(tmp_path, "loader", data=factory, steps=16, updater=PLAIN_SGD,
                          cluster=LAYOUTS["in-memory Sandblaster, 2 threads"].fit_cluster())
    assert_ran(tmp_path / "loader", "in-memory Sandblaster, 2 threads")
    plain, losses = plain_loop(dataset_order(2), 16)
    assert train_losses(history) == pytest.approx(losses, rel=1e-5)
    assert_close_to_one_worker(loaded, plain)
    fit(tmp_path, "parts", data=factory, steps=9, updater=PLAIN_SGD)
    resumed, _ = fit(tmp_path, "parts", data=factory, steps=16, updater=PLAIN_SGD, resume=True)
    assert_same_params(resumed, plain)


def test_stream_inputs_are_refused_in_one_line_when_they_cannot_be_read(tmp_path):
    with pytest.raises(ShoalError, match="train_data: the IterableDataset ended after 105 samples in epoch 0; every epoch must yield 110"):
        fit(tmp_path, "short", data=Sized(windows(), short_epoch=0), steps=14)  # len() says 110
    with pytest.raises(FitError, match="give a DataLoader factory"):
        fit(tmp_path, "loader", data=DataLoader(windows(), batch_size=8))
    with pytest.raises(FitError, match="the DataLoader factory failed: batch_sampler option is mutually exclusive"):
        fit(tmp_path, "both", data=lambda batch_sampler: DataLoader(windows(), batch_sampler=batch_sampler, shuffle=True))
    with pytest.raises(FitError, match="the DataLoader factory failed: .*takes 0 positional arguments"):
        fit(tmp_path, "no-argument", data=lambda: DataLoader(windows()))
    with pytest.raises(FitError, match="the DataLoader factory must pass its argument as batch_sampler="):
        fit(tmp_path, "own-sampler", data=lambda batch_sampler: DataLoader(windows(), batch_size=8))
    with pytest.raises(FitError, match="train_data: the IterableDataset yields no samples"):
        fit(tmp_path, "empty", data=WindowStream([], sized=False))
    assert not (tmp_path / "loader").exists() and not (tmp_path / "empty").exists()
