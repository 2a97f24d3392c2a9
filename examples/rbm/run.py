"""The whole deep-autoencoder pipeline of SINGA's examples/rbm on MNIST, through shoal's Python API.

    python examples/rbm/run.py                 # CI-sized: 300 CD steps per RBM, 300 fine-tuning steps
    python examples/rbm/run.py --steps 6000 --finetune-steps 12200   # SINGA's schedule
    python examples/rbm/run.py --dims 784,32,16,8,4 --steps 20 --finetune-steps 20   # a narrow stack, in seconds

Run from the repository root after `shoal prepare mnist --out examples/mnist/data`.
1. rbm1..rbm4.conf: each RBM trains by contrastive divergence (kCD) on the features of the
   ones below it, which it loads from the previous RBM's checkpoint (checkpoint_path).
2. autoencoder.conf: tested with the RBMs' weights (before fine-tuning), then fine-tuned by
   back-propagation (kBP) and tested again.
3. Pictures in the workspace: filters.png (RBM 1's first 100 weight vectors as 28×28 images)
   and reconstructions.png (test digits; the RBM stack's reconstructions; the fine-tuned ones).
Every job runs under the cluster the confs give; --set applies to all of them
(e.g. --set cluster.nworkers_per_group=2 --set cluster.nworkers_per_procs=2); --dims sets the
stack's widths in every job (SINGA's 784,1000,500,250,30 by default).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from shoal.frontend import api
from shoal.neuralnet.checkpoint import latest
from shoal.neuralnet.checkpoint import load as load_checkpoint
from shoal.config import job_pb2
from shoal.config.validate import in_phase
from shoal.runtime.feed import resolve_data_path

HERE = Path(__file__).resolve().parent
DIMS = [784, 1000, 500, 250, 30]


def width_sets(job: str, dims: list[int]) -> list[str]:
    """--set lines giving a job of the pipeline (rbm1..rbm4, autoencoder) the stack's widths `dims`."""
    if job == "autoencoder":  # encoder Inner1..4 to dims[1..4], decoder Inner5..7 back to dims[3..1] (Inner8: 784)
        encoder = [f"neuralnet.layer[name=Inner{j}].innerproduct_conf.num_output={dims[j]}" for j in range(1, 5)]
        return encoder + [f"neuralnet.layer[name=Inner{9 - j}].innerproduct_conf.num_output={dims[j - 1]}" for j in range(2, 5)]
    k = int(job.removeprefix("rbm"))  # RBM k reads the features of Inner1..k-1 and has dims[k] hidden units
    below = [f"neuralnet.layer[name=Inner{j}].innerproduct_conf.num_output={dims[j]}" for j in range(1, k)]
    return below + [f"neuralnet.layer[name={name}].rbm_conf.hdim={dims[k]}" for name in ("RBMVis", "RBMHid")]


def train_stack(workspace: Path, steps: int, finetune_steps: int, overrides: list[str], dims: list[int] = DIMS, log=print) -> dict:
    """Train the four RBMs and the autoencoder; return the test reconstruction errors along the way,
    and the test store the autoencoder read."""
    summary: dict = {"rbm": {}}
    for k in range(1, 5):
        sets = [f"train_steps={steps}", f"cluster.workspace={workspace / f'rbm{k}'}"] + width_sets(f"rbm{k}", dims) + overrides
        if k > 1:
            sets.append(f"checkpoint_path={workspace / f'rbm{k - 1}'}")
        history = api.train(api.load_job(HERE / f"rbm{k}.conf", sets), log=log)
        tests = history.phase("test")
        summary["rbm"][k] = {"first": tests[0]["Squared Error"], "last": tests[-1]["Squared Error"]}
    sets = [
        f"train_steps={finetune_steps}",
        f"cluster.workspace={workspace / 'autoencoder'}",
        "checkpoint_path=" + ",".join(str(workspace / f"rbm{k}") for k in range(1, 5)),
    ] + width_sets("autoencoder", dims) + overrides
    job = api.load_job(HERE / "autoencoder.conf", sets)
    test_store = next(layer.store_conf.path for layer in job.neuralnet.layer if layer.HasField("store_conf") and in_phase(layer, job_pb2.kTest))
    summary["test_store"] = str(resolve_data_path(test_store, api.base_dirs(job)))
    summary["before_finetuning"] = api.evaluate(job, workspace=workspace / "autoencoder", log=log)["loss"]
    history = api.train(job, log=log)
    summary["after_finetuning"] = history.final_test["loss"]
    return summary


def reconstruct(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The autoencoder's forward pass (as autoencoder.conf) on images x (N, 784) in [0, 1]."""
    h = x
    for k in range(1, 5):
        h = h @ params[f"w{k}"].t() + params[f"b{k}2"]
        h = torch.sigmoid(h) if k < 4 else h
    for k in range(4, 0, -1):
        h = torch.sigmoid(h @ params[f"w{k}"] + params[f"b{k}1"])
    return h


def stack_params(workspace: Path) -> dict[str, torch.Tensor]:
    """The RBMs' params as the autoencoder loads them (later checkpoints win)."""
    params: dict[str, torch.Tensor] = {}
    for k in range(1, 5):
        params.update(load_checkpoint(latest(workspace / f"rbm{k}")).params)
    return params


def test_images(path: str, count: int) -> torch.Tensor:
    from shoal.data.dataset import open_store

    store = job_pb2.StoreProto(backend="kvfile", path=path, shape=[784])
    return torch.from_numpy(open_store(store).rows(0, count)[0].reshape(count, 784) / 255.0).float()


def tile(images: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """(rows·cols, 784) -> one (rows·29, cols·29) picture with a 1-pixel gap."""
    out = np.full((rows * 29, cols * 29), np.nan)
    for i, img in enumerate(images[: rows * cols]):
        r, c = divmod(i, cols)
        out[r * 29 : r * 29 + 28, c * 29 : c * 29 + 28] = img.reshape(28, 28)
    return out


def write_pictures(workspace: Path, test_store: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    before = stack_params(workspace)
    after = load_checkpoint(latest(workspace / "autoencoder")).params
    w1 = before["w1"][:100].numpy()
    w1 = (w1 - w1.mean(1, keepdims=True)) / (w1.std(1, keepdims=True) + 1e-8)  # each filter on its own scale
    fig, ax = plt.subplots(figsize=(8, 8))
    ax.imshow(tile(w1, 10, 10), cmap="gray")
    ax.set_title("RBM 1: weights of the first 100 hidden units")
    ax.axis("off")
    paths = [workspace / "filters.png"]
    fig.savefig(paths[0], dpi=100, bbox_inches="tight")
    plt.close(fig)

    x = test_images(test_store, 10)
    rows = [x, reconstruct(before, x), reconstruct(after, x)]
    fig, axes = plt.subplots(3, 1, figsize=(10, 4))
    for ax, images, title in zip(axes, rows, ["test digits", "RBM stack (before fine-tuning)", "fine-tuned autoencoder"]):
        ax.imshow(tile(images.detach().numpy(), 1, 10), cmap="gray", vmin=0, vmax=1)
        ax.set_title(title, fontsize=9)
        ax.axis("off")
    paths.append(workspace / "reconstructions.png")
    fig.savefig(paths[1], dpi=100, bbox_inches="tight")
    plt.close(fig)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="CD steps per RBM (SINGA: 6000)")
    parser.add_argument("--finetune-steps", type=int, default=300, help="fine-tuning steps of the autoencoder (SINGA: 12200)")
    parser.add_argument("--workspace", type=Path, default=Path("workspace/rbm"), help="one folder per job below this")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE", help="override a field of every job")
    parser.add_argument("--dims", default=",".join(map(str, DIMS)), help="the stack's widths, input first (default: SINGA's)")
    args = parser.parse_args()
    dims = [int(d) for d in args.dims.split(",")]
    if len(dims) != 5 or dims[0] != 784:
        parser.error(f"--dims: five widths starting with 784 (MNIST's pixels), got {args.dims}")
    summary = train_stack(args.workspace, args.steps, args.finetune_steps, args.overrides, dims)
    summary["pictures"] = [str(p) for p in write_pictures(args.workspace, summary["test_store"])]
    (args.workspace / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
