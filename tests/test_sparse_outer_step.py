"""SparseLoCo's outer step (cluster.sparse_outer_step): chunk-wise top-k of an error-feedback accumulator, 2-bit values."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

import shoal
from cli_in_process import run_cli
from layouts import Layout, assert_ran, load
from shoal.planning.plan import UnsupportedClusterError, plan_job
from shoal.runtime.exchanges.sparse_outer import SparseOuterStep

SIZES = {"w1": 16 * 32, "b1": 32, "w2": 32 * 4, "b2": 4}  # the blobs MLP's params
CHUNK, TOPK = 64, 4
SPARSE = [f"cluster.sparse_outer_step.chunk_size={CHUNK}", f"cluster.sparse_outer_step.topk_per_chunk={TOPK}"]
PROCESSES = Layout(dict(nworker_groups=2, local_steps=5), 2, 2, "SparseLoCo")
THREADS = Layout(dict(nworker_groups=2, local_steps=5, nworkers_per_procs=2), 1, 2, "SparseLoCo")


def bytes_by_hand() -> int:
    """One group's buffer: per param, chunks of min(64, n) entries keeping ceil(4 · width / 64) of them; positions
    in 12 bits (two in three bytes), values in 2 bits (four in a byte) and two bfloat16 magnitudes per chunk."""
    entries = rows = 0
    for n in SIZES.values():
        width = min(CHUNK, n)
        rows += math.ceil(n / width)
        entries += math.ceil(n / width) * min(width, math.ceil(TOPK * width / CHUNK))
    return math.ceil(entries / 2) * 3 + math.ceil(entries / 4) + 2 * 2 * rows


def checkpoint(ws, name):
    return load_file(str(ws / "checkpoint" / f"{name}.safetensors"))


def train_records(ws):
    return [json.loads(line) for line in (ws / "metrics.jsonl").read_text().splitlines() if '"phase": "train"' in line]


def test_each_chunk_sends_its_largest_entries_and_the_buffer_decodes_to_what_was_taken_out():
    torch.manual_seed(0)
    step = SparseOuterStep(list(SIZES.values()), CHUNK, TOPK, 2, error_decay=0.9, outer_lr=1.0)
    delta = torch.randn(sum(SIZES.values()))
    buffer, sent = step.encode(delta)
    assert buffer.dtype == torch.uint8 and buffer.numel() == bytes_by_hand() == step.message_bytes()
    assert torch.equal(step.decode(buffer), sent) and torch.equal(step.error, delta - sent)  # e = 0.9 · 0 + Δ − sent
    w1 = delta[: SIZES["w1"]].view(-1, CHUNK)  # each 64-entry chunk of w1: its 4 largest |Δ| go out, with their signs
    got = sent[: SIZES["w1"]].view(-1, CHUNK)
    for row, out in zip(w1, got):
        assert set(out.nonzero().view(-1).tolist()) == set(row.abs().topk(TOPK).indices.tolist())
        assert torch.equal(out[out != 0].sign(), row[out != 0].sign())
    again, _ = step.encode(torch.zeros_like(delta))  # nothing new: what was kept goes out, decayed
    assert torch.allclose(step.decode(again) + step.error, 0.9 * (delta - sent))


def test_each_entry_moves_by_its_mean_over_the_groups_that_sent_it():
    """Group a sends entries 0 and 1, group b entries 1 and 2 (one chunk of 4, k 2, bfloat16 values): the outer step
    is a's value at 0, the mean at 1, b's at 2, nothing at 3; outer_lr scales it."""
    a, b = (SparseOuterStep([4], 4, 2, 16, error_decay=0.0, outer_lr=0.5) for _ in range(2))
    buffer_a, sent_a = a.encode(torch.tensor([4.0, 2.0, 0.0, 0.5]))
    buffer_b, sent_b = b.encode(torch.tensor([0.0, -6.0, 8.0, 0.5]))
    step = a.outer_step(a.contribution(buffer_a) + a.contribution(buffer_b))
    assert torch.equal(step, torch.tensor([0.5 * 4.0, 0.5 * (2.0 - 6.0) / 2, 0.5 * 8.0, 0.0]))


def test_the_estimate_counts_one_buffer_per_meeting(blobs_job):
    plan = run_cli("plan", blobs_job(train_steps=100), "--estimate", "--json", *PROCESSES.cli(),
                   *sum((["--set", s] for s in SPARSE + ["cluster.local_steps=50"]), []))
    assert plan.returncode == 0, plan.stderr
    # 2 meetings in 100 steps; an all-gather of 2 processes: each sends its buffer to the other once
    assert [p["sent"] for p in json.loads(plan.stdout)["estimate"]["processes"]] == [int(bytes_by_hand() * 2 / 100)] * 2
    assert "SparseLoCo outer step (cluster.sparse_outer_step)" in run_cli("plan", blobs_job(train_steps=100), *PROCESSES.cli(),
                                                                        *sum((["--set", s] for s in SPARSE), [])).stdout


def test_over_processes_it_sends_the_counted_bytes_and_every_outer_step_leaves_the_groups_equal(blobs_job, tmp_path):
    """Two groups in two processes meet after steps 4 and 9: each hands over exactly its buffer, and after each meeting
    (checkpoints at steps 5 and 10) both hold the same values and anchor but each its own accumulator."""
    job, ws = blobs_job(train_steps=11), tmp_path / "ws"
    shoal.train(load(job, PROCESSES, *SPARSE, "checkpoint_freq=5"), workspace=ws, log=lambda *a: None)
    assert_ran(ws, PROCESSES)
    train = train_records(ws)
    assert train[-1]["meetings"] == 2 and sum(r["sent_bytes"] for r in train) == 2 * bytes_by_hand()
    for step in (5, 10):
        chief, other = checkpoint(ws, f"step{step}-worker0"), checkpoint(ws, f"step{step}-group1-rank1")
        for name in SIZES:
            assert torch.equal(chief[f"param/{name}"], other[f"exchange/value/{name}"]), (step, name)
            assert torch.equal(chief[f"state/{name}/outer.anchor"], other[f"exchange/state/{name}/outer.anchor"])
        mine, theirs = chief["state/w1/outer.error_feedback"], other["exchange/state/w1/outer.error_feedback"]
        assert mine.abs().sum() > 0 and not torch.equal(mine, theirs)  # each group's own residual


def test_groups_that_would_start_from_different_values_are_stopped_in_one_line():
    """Nothing is broadcast at the start: each process's anchor digest is all-gathered (8 bytes) and must agree."""
    from types import SimpleNamespace

    from shoal.runtime.exchanges.periodic import GroupsDisagree, ProcessMeeting

    class Peers:  # the meeting's process group, as seen from one process: the other group's digest is `theirs`
        def __init__(self, theirs):
            self.theirs = theirs

        def all_gather(self, tensor):
            return [tensor, tensor if self.theirs is None else self.theirs]

    store = SimpleNamespace(values={"w": torch.ones(3)}, device=torch.device("cpu"))  # what the check reads of an anchor
    ProcessMeeting(2, first=Peers(None)).check_same(store, ["w"])
    with pytest.raises(GroupsDisagree, match="^Local SGD: the groups' processes start from different values"):
        ProcessMeeting(2, first=Peers(torch.tensor([12345]))).check_same(store, ["w"])


def test_a_resumed_run_keeps_every_groups_accumulator(blobs_job, tmp_path):
    """Stopped at step 7 (mid-round, after one meeting) and resumed to 12: the same values as the uninterrupted run,
    which needs each group's accumulator back (without it the second meeting would send other entries)."""
    job = blobs_job(train_steps=12)
    whole = tmp_path / "whole"
    shoal.train(load(job, THREADS, *SPARSE), workspace=whole, log=lambda *a: None)
    ws = tmp_path / "resumed"
    shoal.train(load(job, THREADS, *SPARSE, "train_steps=7"), workspace=ws, log=lambda *a: None)
    assert checkpoint(ws, "step7-worker0")["state/w1/outer.error_feedback"].abs().sum() > 0
    shoal.train(load(job, THREADS, *SPARSE), workspace=ws, resume=True, log=lambda *a: None)
    assert_ran(ws, THREADS)
    a, b = checkpoint(whole, "step12-worker0"), checkpoint(ws, "step12-worker0")
    for key in a:
        if key.startswith(("param/", "state/")):
            assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("sets, message", [
    (["cluster.outer_updater.type=kNesterov"], "cluster.sparse_outer_step: replaces the outer updater"),
    (["cluster.compression=kBF16"], "cluster.sparse_outer_step: encodes the pseudo-gradients itself"),
    (["cluster.sparse_outer_step.topk_per_chunk=65"], r"cluster.sparse_outer_step.topk_per_chunk: must be in \[1, chunk_size = 64\]"),
    (["cluster.sparse_outer_step.value_bits=4"], "cluster.sparse_outer_step.value_bits: 2 .* or 16"),
])
def test_what_it_replaces_and_bad_fields_are_refused_in_one_line(blobs_job, sets, message):
    with pytest.raises(UnsupportedClusterError, match=f"^{message}"):
        plan_job(load(blobs_job(train_steps=4), THREADS, *SPARSE, *sets))


def test_without_local_sgd_it_is_refused(blobs_job):
    with pytest.raises(UnsupportedClusterError, match="^cluster.sparse_outer_step: applies to Local SGD only"):
        plan_job(shoal.load_job(blobs_job(train_steps=4), ["cluster.sparse_outer_step.chunk_size=64"]))
