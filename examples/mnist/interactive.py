"""SINGA 0.3's tool/python/examples/train_mnist.py with shoal.frontend.keras: the training loop written out.

    python examples/mnist/interactive.py                   # after `shoal prepare mnist --out examples/mnist/data`
    python examples/mnist/interactive.py --widths 128 --lr 0.05 --momentum 0.9 --steps 200

Each step feeds a batch (ImageInput / LabelInput), runs every layer's compute_feature, the
loss's compute_gradient (backward) and the updater's update(step, layer), as SINGA 0.3's
interactive Python did (SINGA's names, Feed / ComputeFeature / ComputeGradient / Update, work
too). The layers are shoal's, and SGD(...) is the updater a job with the same `updater {}` uses.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from shoal.data.dataset import open_store
from shoal.frontend.keras import SGD, Dense, ImageInput, LabelInput, Loss, Store

MEAN, STD = 127.5, 127.5  # pixels to [-1, 1], as examples/mnist/job.conf


def batches(path: Path, batch_size: int):
    """(images, labels) of consecutive batches of a record store, wrapping at its end, images scaled to [-1, 1]."""
    data = open_store(Store(path, batch_size=batch_size).conf())
    start = 0
    while True:
        images, labels = data.rows(start, batch_size)
        yield (torch.from_numpy(images) - MEAN) / STD, labels
        start += batch_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path(__file__).parent / "data", help="folder of train_data.bin and test_data.bin")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--widths", default="2500,2000,1500,1000,500", help="hidden layers (SINGA's Ciresan MLP)")
    parser.add_argument("--lr", type=float, default=0.001)
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument("--disp-freq", type=int, default=20)
    parser.add_argument("--test-batches", type=int, default=10, help="batches of 100 test images at the end")
    args = parser.parse_args()

    image, label = ImageInput(28, 28, 1), LabelInput()
    layers = [Dense(int(w), init="uniform", activation="stanh", w_low=-0.05, w_high=0.05) for w in args.widths.split(",")]
    layers.append(Dense(10, init="uniform", w_low=-0.05, w_high=0.05))  # scores: the loss applies the softmax
    loss = Loss("softmaxloss")
    sgd = SGD(lr=args.lr, momentum=args.momentum, lr_type="step")

    train = batches(args.data / "train_data.bin", args.batch_size)
    for step in range(args.steps):
        x, y = next(train)
        h = image.feed(x)
        label.feed(y)
        for layer in layers:
            h = layer.compute_feature(h)
        loss.compute_feature(h, label)
        loss.compute_gradient()
        for layer in layers:
            sgd.update(step, layer)
        if step % args.disp_freq == 0 or step == args.steps - 1:
            print(f"step {step}: loss {loss.metrics['loss']:.4f}, accuracy {loss.metrics['accuracy']:.3f}", flush=True)

    test, correct, total = batches(args.data / "test_data.bin", 100), 0.0, 0.0
    for _ in range(args.test_batches):
        x, y = next(test)
        h = image.feed(x)
        for layer in layers:
            h = layer.compute_feature(h, phase="test")
        loss.compute_feature(h, label.feed(y), phase="test")
        correct, total = correct + loss.metrics["accuracy"] * len(y), total + len(y)
    print(f"test accuracy {correct / total:.4f} on {int(total)} images after {args.steps} steps")


if __name__ == "__main__":
    main()
