"""nanoGPT's own `train.py` through shoal's session API (issue 39, point 3): how many of its lines change, and what it
measures under each framework a user's loop runs (one worker, AllReduce over 2 processes, DiLoCo over 2 groups).

    python benchmarks/nanogpt_adoption.py --nanogpt PATH [--data examples/gpt/data] [--steps 500]

PATH is a checkout of https://github.com/karpathy/nanoGPT, or a bare git mirror of it (its HEAD is read with git).
Nothing of nanoGPT is kept in this repository: train.py, model.py and configurator.py are copied into a temporary
folder, and train.py is edited there by EDITS below, (old line, new lines) pairs that fail loudly if nanoGPT's text
moved. The data is nanoGPT's shakespeare_char layout (train.bin / val.bin of uint16 character ids, meta.pkl with the
vocabulary, as its data/shakespeare_char/prepare.py writes them) made from our offline Shakespeare (`shoal prepare
shakespeare --out DIR`: train.txt, val.txt); meta.pkl is pickle because nanoGPT's own code reads it: this script only
writes it, and shoal never reads it.

The runs, each a fresh process started from the temporary folder, with the same tiny config on CPU (nanoGPT's
command-line overrides: 2 layers, 2 heads, 64 wide, block 64, batch 12, no dropout, float32, no torch.compile,
AdamW lr 1e-3 with warm-up and cosine decay, an evaluation of 20 batches every --steps/5 iterations):

- plain: `python train.py ...` (nanoGPT unchanged: one process);
- single worker: `shoal run train.py -- ...` (the edited script);
- AllReduce: `shoal run train.py --set cluster.nworkers_per_group=2 --set cluster.nworkers_per_procs=1 -- ...`;
- DiLoCo: `shoal run train.py --set cluster.nworker_groups=2 --set cluster.nworkers_per_procs=1 --set
  cluster.local_steps=H` with an outer SGD of lr 0.7 and Nesterov momentum 0.9;
- Downpour: `shoal run train.py --set cluster.nworker_groups=2 --set cluster.nworkers_per_procs=1 --set
  cluster.server_worker_separate=true`: 2 groups pushing to a server process of their own, which runs nanoGPT's AdamW
  (rebuilt from its recipe) and its schedule, stepped by each group's own iterations;
- Distributed Hogwild: `shoal run train.py --set cluster.nworker_groups=2 --set cluster.nserver_groups=2 --set
  cluster.nworkers_per_procs=1`: each group updates its own replica with nanoGPT's AdamW and syncs with the other
  group's masters (cluster.sync_freq).

Each run goes through a few lines of wrapper (written next to train.py) that runs the script with runpy and then saves
nanoGPT's final model (`raw_model`) as safetensors, so that one worker can be compared with plain nanoGPT to the bit;
it adds nothing inside the loop. Columns: steps (nanoGPT runs max_iters + 1 iterations), the last evaluation's train and
val loss as nanoGPT prints it (at iteration --steps), the whole command's wall time, and the loop's samples/s: rows of
all processes per iteration over the chief's mean iteration time as nanoGPT prints it, leaving out iteration 0 and the
iterations that evaluated. Under AllReduce, DiLoCo, Downpour and Hogwild each process draws its own rows (nanoGPT's get_batch, seeded
1337 + run.rank): the rows are nanoGPT's random windows, not shoal's shards, and a step trains 2 x 12 rows.

Don't take timings on a busy machine: the load average is printed before and after.
"""
from __future__ import annotations

import argparse
import difflib
import os
import pickle  # nanoGPT's meta.pkl, written here and read only by nanoGPT's own train.py
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
FILES = ("train.py", "model.py", "configurator.py")
BATCH = 12  # rows per process and iteration (nanoGPT's batch_size)

# nanoGPT's train.py, line by line as it is (its HEAD of 2024-12, 3adf61e), and what replaces each: the whole edit
EDITS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ddp = int(os.environ.get('RANK', -1)) != -1 # is this a ddp run?",
     ("import shoal",
      "run = shoal.session(train_steps=max_iters + 1)  # the layout: `shoal run train.py --set cluster.…`",
      "ddp = False  # shoal's layouts in place of nanoGPT's own DDP (under torchrun too)")),
    ("    master_process = True",
     ("    master_process = run.chief",)),
    ("    seed_offset = 0",
     ("    seed_offset = run.rank  # each process draws its own rows",)),
    ("model.to(device)",
     ("model = run.model(model)",)),
    ("optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)",
     ("optimizer = run.optimizer(model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type))",)),
    ("while True:",
     ("for iter_num in run.steps(rows=batch_size * gradient_accumulation_steps):",)),
    ('        print(f"iter {iter_num}: loss {lossf:.4f}, time {dt*1000:.2f}ms, mfu {running_mfu*100:.2f}%")',
     ('        print(f"iter {iter_num}: loss {lossf:.4f}, time {dt*1000:.2f}ms, mfu {running_mfu*100:.2f}%")',
      "        run.log(iter_num, loss=lossf)")),
)

PROBE = '''import runpy, sys
from safetensors.torch import save_file
found = runpy.run_path({script!r}, run_name="__main__")
rank = found["run"].rank if "run" in found else 0
save_file({{k: v.detach().clone().contiguous() for k, v in found["raw_model"].state_dict().items()}},
          {out!r} + f"/final-rank{{rank}}.safetensors")
'''

ALLREDUCE = ("--set", "cluster.nworkers_per_group=2", "--set", "cluster.nworkers_per_procs=1")
DOWNPOUR = ("--set", "cluster.nworker_groups=2", "--set", "cluster.nworkers_per_procs=1",
            "--set", "cluster.server_worker_separate=true")
HOGWILD = ("--set", "cluster.nworker_groups=2", "--set", "cluster.nserver_groups=2", "--set", "cluster.nworkers_per_procs=1")
FRAMEWORKS = ("plain", "single", "allreduce", "diloco", "downpour", "hogwild")


def diloco(local_steps: int) -> tuple[str, ...]:
    return ("--set", "cluster.nworker_groups=2", "--set", "cluster.nworkers_per_procs=1",
            "--set", f"cluster.local_steps={local_steps}", "--set", "cluster.outer_updater.type=kNesterov",
            "--set", "cluster.outer_updater.momentum=0.9", "--set", "cluster.outer_updater.learning_rate.type=kFixed",
            "--set", "cluster.outer_updater.learning_rate.base_lr=0.7")


class EditFailed(SystemExit):
    pass


def edited(text: str) -> str:
    """train.py with EDITS applied; each old line must be there exactly once."""
    lines = text.splitlines()
    for old, new in EDITS:
        at = [i for i, line in enumerate(lines) if line == old]
        if len(at) != 1:
            raise EditFailed(f"nanoGPT's train.py: the line {old!r} is there {len(at)} times, not once (its text moved): "
                             "update EDITS in benchmarks/nanogpt_adoption.py")
        lines[at[0]:at[0] + 1] = list(new)
    return "\n".join(lines) + "\n"


def changed_lines(before: str, after: str) -> tuple[int, int]:
    """(lines added or changed, lines removed or changed) of the edit, as a unified diff counts them."""
    diff = list(difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=0))
    plus = sum(1 for d in diff if d.startswith("+") and not d.startswith("+++"))
    minus = sum(1 for d in diff if d.startswith("-") and not d.startswith("---"))
    return plus, minus


def nanogpt_sources(path: Path) -> dict[str, str]:
    """train.py, model.py and configurator.py from a checkout, or from a bare mirror's HEAD."""
    path = path.resolve()
    if all((path / name).is_file() for name in FILES):
        return {name: (path / name).read_text() for name in FILES}
    if (path / "HEAD").is_file() and (path / "objects").is_dir():
        found = {}
        for name in FILES:
            proc = subprocess.run(["git", "--git-dir", str(path), "show", f"HEAD:{name}"], capture_output=True, text=True)
            if proc.returncode:
                raise SystemExit(f"{path}: no {name} at HEAD ({proc.stderr.strip().splitlines()[-1] if proc.stderr else ''})")
            found[name] = proc.stdout
        return found
    raise SystemExit(f"{path}: neither a nanoGPT checkout (train.py, model.py, configurator.py) nor a bare git mirror")


def prepare_data(data: Path, into: Path) -> int:
    """nanoGPT's data/shakespeare_char from our train.txt / val.txt: uint16 character ids, the vocabulary sorted as
    nanoGPT's prepare.py sorts it. Returns the vocabulary's size."""
    missing = [n for n in ("train.txt", "val.txt") if not (data / n).is_file()]
    if missing:
        raise SystemExit(f"{data}: no {', '.join(missing)}; run `shoal prepare shakespeare --out {data}` first")
    train, val = ((data / n).read_text(encoding="utf-8") for n in ("train.txt", "val.txt"))
    chars = sorted(set(train + val))
    if len(chars) > 65535:
        raise SystemExit(f"{data}: {len(chars)} distinct characters do not fit nanoGPT's uint16 ids")
    stoi = {c: i for i, c in enumerate(chars)}
    into.mkdir(parents=True, exist_ok=True)
    for name, text in (("train", train), ("val", val)):
        np.array([stoi[c] for c in text], dtype=np.uint16).tofile(into / f"{name}.bin")
    with open(into / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}, f)
    return len(chars)


def config(args) -> list[str]:
    eval_interval = max(1, args.steps // 5)
    return [f"--{k}={v}" for k, v in (
        ("dataset", "shakespeare_char"), ("device", "cpu"), ("compile", False), ("dtype", "float32"),
        ("n_layer", 2), ("n_head", 2), ("n_embd", 64), ("block_size", 64), ("batch_size", BATCH), ("dropout", 0.0),
        ("gradient_accumulation_steps", 1), ("max_iters", args.steps), ("lr_decay_iters", args.steps),
        ("learning_rate", 1e-3), ("min_lr", 1e-4), ("beta2", 0.99), ("warmup_iters", max(1, args.steps // 10)),
        ("eval_interval", eval_interval), ("eval_iters", 20), ("log_interval", 1), ("always_save_checkpoint", False))]


def run_one(name: str, folder: Path, script: str, shoal_options, args, processes: int) -> dict:
    out = folder / f"out-{name}"
    out.mkdir()
    probe = folder / f"probe_{name}.py"
    probe.write_text(PROBE.format(script=str(folder / script), out=str(out)))
    options = config(args) + [f"--out_dir={out / 'nanogpt'}"]
    if shoal_options is None:
        command = [sys.executable, str(probe), *options]
    else:
        command = [sys.executable, "-m", "shoal", "run", str(probe), "--workspace", str(out / "ws"), *shoal_options,
                   "--", *options]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=folder, capture_output=True, text=True, env=env, timeout=args.timeout)
    wall = time.perf_counter() - started
    (out / "stdout.txt").write_text(proc.stdout)
    (out / "stderr.txt").write_text(proc.stderr)
    if proc.returncode:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise SystemExit(f"{name}: {' '.join(command[:6])} ... exited with status {proc.returncode}:\n{tail}")
    evals = re.findall(r"^step (\d+): train loss ([\d.]+), val loss ([\d.]+)$", proc.stdout, re.M)
    iters = [(int(i), float(loss), float(ms)) for i, loss, ms in
             re.findall(r"^iter (\d+): loss ([\d.]+), time ([\d.]+)ms", proc.stdout, re.M)]
    if not evals or not iters:
        raise SystemExit(f"{name}: no evaluation or iteration lines in its output ({out / 'stdout.txt'})")
    eval_interval = max(1, args.steps // 5)
    loop_ms = [ms for i, _, ms in iters if i > 0 and i % eval_interval]
    rows = BATCH * processes
    return {"name": name, "steps": iters[-1][0] + 1, "train": float(evals[-1][1]), "val": float(evals[-1][2]),
            "at": int(evals[-1][0]), "wall": wall, "samples_per_s": rows / (statistics.mean(loop_ms) / 1000),
            "losses": [loss for _, loss, _ in iters], "out": out}


def same_values(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file
    import torch

    x, y = load_file(str(a)), load_file(str(b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nanogpt", type=Path, required=True, help="a nanoGPT checkout, or a bare git mirror of it")
    parser.add_argument("--data", type=Path, default=REPO / "examples/gpt/data",
                        help="train.txt and val.txt, from `shoal prepare shakespeare --out DIR`")
    parser.add_argument("--steps", type=int, default=500, help="nanoGPT's max_iters (it runs max_iters + 1 iterations)")
    parser.add_argument("--local-steps", type=int, default=50, help="DiLoCo's H")
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS), help=f"which runs, of {','.join(FRAMEWORKS)}")
    parser.add_argument("--keep", type=Path, help="work in this (new) folder and keep it, instead of a temporary one")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one run may take")
    args = parser.parse_args()
    wanted = args.frameworks.split(",")
    unknown = set(wanted) - set(FRAMEWORKS)
    if unknown or args.steps < 10 or args.steps % 5:
        raise SystemExit(f"--frameworks: unknown {sorted(unknown)}" if unknown else "--steps: a multiple of 5 from 10 (the "
                         "evaluations are every steps / 5 iterations, the last at --steps)")

    sources = nanogpt_sources(args.nanogpt)
    if args.keep:
        args.keep.mkdir(parents=True)
        folder, cleanup = args.keep.resolve(), None
    else:
        cleanup = tempfile.TemporaryDirectory(prefix="nanogpt-")
        folder = Path(cleanup.name)
    try:
        for name, text in sources.items():
            (folder / name).write_text(text)
        shoal_train = edited(sources["train.py"])
        (folder / "train_shoal.py").write_text(shoal_train)
        plus, minus = changed_lines(sources["train.py"], shoal_train)
        vocab = prepare_data(args.data.resolve(), folder / "data" / "shakespeare_char")
        print(f"nanoGPT from {args.nanogpt}; train.py edited: {plus} lines added or changed, {minus} removed or changed "
              f"(of {len(sources['train.py'].splitlines())}); vocabulary {vocab} characters; load average "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        runs = {"plain": ("plain nanoGPT (python train.py)", "train.py", None, 1),
                "single": ("shoal: single worker", "train_shoal.py", (), 1),
                "allreduce": ("shoal: AllReduce, 2 processes", "train_shoal.py", ALLREDUCE, 2),
                "diloco": (f"shoal: DiLoCo, 2 groups, H={args.local_steps}", "train_shoal.py", diloco(args.local_steps), 2),
                "downpour": ("shoal: Downpour, 2 groups + 1 server", "train_shoal.py", DOWNPOUR, 2),
                "hogwild": ("shoal: Distributed Hogwild, 2 groups", "train_shoal.py", HOGWILD, 2)}
        results = {}
        for key in wanted:
            label, script, options, processes = runs[key]
            results[key] = run_one(key, folder, script, options, args, processes) | {"label": label, "changed": 0 if
                                                                                      key == "plain" else plus}
        print(f"{'framework':34} {'changed lines':>13} {'steps':>5} {'train loss':>10} {'val loss':>8} {'wall s':>7} "
              f"{'samples/s':>9}")
        for r in results.values():
            print(f"{r['label']:34} {r['changed']:>13} {r['steps']:>5} {r['train']:>10.4f} {r['val']:>8.4f} "
                  f"{r['wall']:>7.1f} {r['samples_per_s']:>9.0f}")
        print(f"(losses: nanoGPT's evaluation at iteration {next(iter(results.values()))['at']}; load average after "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())})")
        if "plain" in results and "single" in results:
            same = same_values(results["plain"]["out"] / "final-rank0.safetensors",
                               results["single"]["out"] / "final-rank0.safetensors")
            print(f"one worker through shoal vs plain nanoGPT: final model {'bit-identical' if same else 'DIFFERENT'}, "
                  f"every printed loss {'equal' if results['plain']['losses'] == results['single']['losses'] else 'NOT equal'}")
        if "allreduce" in results:
            same = same_values(*(results["allreduce"]["out"] / f"final-rank{r}.safetensors" for r in (0, 1)))
            print(f"AllReduce: the 2 replicas' final models {'bit-identical' if same else 'DIFFERENT'}")
    finally:
        if cleanup is not None:
            cleanup.cleanup()


if __name__ == "__main__":
    main()
