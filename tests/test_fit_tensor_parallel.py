"""shoal.fit with `partition_dim=1`: the module cut on its features over one synchronous group's processes (torch's
tensor parallelism, as `run.model` cuts a user's loop's module: frontend/session_partition.py), fit's loop on the
session. It trains as one worker does, to float rounding, and hands the caller's module the whole trained values."""
from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

import shoal
from shoal.frontend import fit_loop
from shoal.frontend.fit_metrics import FitError

STEPS, BATCH = 8, 12
CUTS = {"fc1": "colwise", "fc2": "rowwise"}  # run.model's form: a pair outside any nn.Sequential, named


class PairedMLP(torch.nn.Module):
    """A Linear → element-wise → Linear pair that is not an nn.Sequential: fit cuts it where `cuts=` names it."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(6, 16), torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


@pytest.fixture(scope="module")
def problem():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(96, 6, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 0.5).long()
    torch.manual_seed(5)
    return (x, y), PairedMLP()


def fitted(model, train, workspace, **keywords):
    return shoal.fit(model, F.cross_entropy, train, steps=STEPS, batch_size=BATCH, disp_freq=4, workspace=workspace,
                     optimizer=torch.optim.AdamW, log=lambda _line: None, **keywords)


def test_fit_cuts_the_module_over_two_processes_and_trains_as_one_worker(tmp_path, problem, monkeypatch):
    """partition_dim=1 with cuts= over 2 processes: fit's loop on the session ran (2 processes, 2 workers, the
    tensor-parallel AllReduce), each train record's loss and the trained values equal one worker's fit to float
    rounding, and the caller's module holds them whole (not torch's parametrized shards)."""
    train, model = problem
    alone, cut = copy.deepcopy(model), copy.deepcopy(model)
    fitted(alone, train, tmp_path / "one")
    ran = []
    monkeypatch.setattr(fit_loop, "fit_on_session", lambda *a, _on=fit_loop.fit_on_session, **k: ran.append(1) or _on(*a, **k))
    history = fitted(cut, train, tmp_path / "cut", cluster=shoal.Cluster(nworkers_per_group=2, nworkers_per_procs=1),
                     partition_dim=1, cuts=CUTS)
    summary = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert ran and (summary["processes"], summary["workers"], summary["label"]) == (
        2, 2, "AllReduce, tensor-parallel, 2 workers, 2 processes"), summary
    assert sorted(p.name for p in (tmp_path / "cut" / "logs").glob("rank*.log")) == ["rank0.log", "rank1.log"]
    losses = [r["loss"] for r in history.phase("train")]
    assert len(losses) == 3 and losses == pytest.approx([r["loss"] for r in _train_records(tmp_path / "one")], rel=1e-5)
    assert [n for n, _ in cut.named_parameters()] == [n for n, _ in model.named_parameters()]
    for (name, a), b, before in zip(cut.named_parameters(), alone.parameters(), model.parameters()):
        assert torch.allclose(a, b, atol=1e-6), name
        assert not torch.equal(a, before), name  # trained


def _train_records(workspace):
    return [json.loads(line) for line in (workspace / "metrics.jsonl").read_text().splitlines()
            if json.loads(line).get("phase") == "train"]


@pytest.mark.parametrize("keywords, said", [
    (dict(partition_dim=2), "shoal.fit: partition_dim must be 0 (the batch) or 1 (the module's features), got 2"),
    (dict(cuts=CUTS), "shoal.fit: cuts= names what to cut on the features: it needs partition_dim=1"),
    (dict(partition_dim=1, cuts=["fc1"]), "shoal.fit: cuts= is a dict of module names to 'colwise', 'rowwise' or 'heads', got list"),
])
def test_fit_refuses_a_partition_it_cannot_run_in_one_line(tmp_path, problem, keywords, said):
    train, model = problem
    with pytest.raises(FitError) as caught:
        fitted(copy.deepcopy(model), train, tmp_path / "ws", **keywords)
    assert str(caught.value) == said and not (tmp_path / "ws").exists()
