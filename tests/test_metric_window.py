"""The training loop reads a loss on a device to the host only when it is shown (report.metrics.MetricWindow).

A loss read every step (`loss.item()`) makes the host wait for the device's queue every step. The window sums a
device's values where they live, in float64 (the host's arithmetic), and reads them at a display, a checkpoint
and the end of training; the numbers shown are the same. The CUDA tests skip without a GPU.
"""
from __future__ import annotations

import math

import pytest
import torch

import shoal
from shoal.report.metrics import MetricWindow

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_a_value_on_a_device_is_not_read_when_reported():
    window = MetricWindow()
    window.report("loss", torch.empty((), device="meta"), 8)  # a meta tensor has no value to read: reading raises
    assert window and window.non_finite(read=False) == {}  # checked every step: only what the host holds
    with pytest.raises(RuntimeError, match="meta tensors"):
        window.averages()  # reading it is what goes to the device


def test_host_values_and_tensors_average_alike_and_a_nan_is_caught():
    by_float, by_tensor = MetricWindow(), MetricWindow()
    for value, count in [(0.1, 3), (2.0 / 3, 5), (1e-7, 8)]:
        by_float.report("loss", torch.tensor(value, dtype=torch.float32).item(), count)  # what layers reported
        by_tensor.report("loss", torch.tensor(value, dtype=torch.float32), count)  # what they report now
    assert by_tensor.averages() == by_float.averages() and by_tensor.state() == by_float.state()
    by_tensor.report("loss", torch.tensor(math.nan), 1)
    assert math.isnan(by_tensor.non_finite(read=False)["loss"])  # a host value: caught at its step


@CUDA
def test_a_gpu_window_shows_what_the_host_would_bit_for_bit():
    values = torch.randn(50, dtype=torch.float32)
    on_host, on_gpu = MetricWindow(), MetricWindow()
    for i, value in enumerate(values):
        on_host.report("loss", value.item(), i + 1)
        on_gpu.report("loss", value.cuda(), i + 1)
    assert on_gpu.averages() == on_host.averages() and on_gpu.state() == on_host.state()


@CUDA
def test_training_on_a_gpu_reads_the_loss_only_when_shown(blobs_job, tmp_path, monkeypatch):
    steps, reads, item = 20, [], torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda self: reads.append(self.device.type) or item(self))
    history = shoal.train(shoal.load_job(blobs_job(train_steps=steps, extra=' device: "cuda:0"'), ["test_freq=0"]),
                          workspace=tmp_path / "ws", log=lambda *a: None)
    assert [r["step"] for r in history.phase("train")] == [0, 5, 10, 15]  # disp_freq 5: shown 4 times
    assert reads.count("cuda") < steps  # loss and accuracy read every step would be 2 per step
