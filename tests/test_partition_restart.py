"""A partitioned group's mirror (issue 38, point 1): a group whose layers are cut over processes cannot step without
one, so under `shoal run --max-restarts N` a dead process restarts the whole job, from the mirror the group writes every
K steps (the plan's cost model's K): the steps redone are at most K, and the job ends bit for bit where the unfaulted
run ends. Real processes, a real SIGKILL (tests/fault_runs.py)."""
from __future__ import annotations

import signal

import pytest
import torch
from fault_runs import Run, pids, runs, summary, train_records  # noqa: F401 - the fixture that stops what a failed test left running
from safetensors.torch import load_file
from test_partition import job_text, load

from shoal.planning.exchange_choice import mirror_every
from shoal.planning.plan import plan_job

LAYOUT = "AllReduce, 2 processes"
SLOW = {"SHOAL_SLOW_WORKER": "0:0+0.01"}  # steps of 10 ms or more: the run outlasts a kill and a restart


def partitioned_job(blobs_dir, tmp_path, steps: int):
    path = tmp_path / "job.conf"
    path.write_text(job_text(blobs_dir, net="partition_dim: 1", steps=steps, layout=LAYOUT))
    return path


def test_shoal_plan_says_what_the_mirror_costs_and_how_often(blobs_dir, tmp_path):
    """Momentum: the params and one slot, every 4 steps (their bytes over 4 steps = a quarter of 2 x the params');
    without restarts, or not partitioned, no mirror."""
    from cli_in_process import run_cli

    text = job_text(blobs_dir, net="partition_dim: 1", layout=LAYOUT)
    assert mirror_every(plan_job(load(text, tmp_path))) == 0
    assert mirror_every(plan_job(load(text.replace("nworkers_per_group: 2", "nworkers_per_group: 2 max_restarts: 1"), tmp_path))) == 4
    adam = text.replace("type: kSGD momentum: 0.9", "type: kAdam").replace("nworkers_per_group: 2", "nworkers_per_group: 2 max_restarts: 1")
    assert mirror_every(plan_job(load(adam, tmp_path))) == 6
    whole = job_text(blobs_dir, layout=LAYOUT).replace("nworkers_per_group: 2", "nworkers_per_group: 2 max_restarts: 1")
    assert mirror_every(plan_job(load(whole, tmp_path))) == 0  # replicated: it goes on without the process
    result = run_cli("plan", partitioned_job(blobs_dir, tmp_path, 8), "--set", "cluster.max_restarts=1")
    assert result.returncode == 0, result.stderr
    note = next(line for line in result.stdout.splitlines() if "mirror" in line)
    assert "every 4 steps" in note and "5.41 kB" in note and "redoing at most 4 steps" in note, note


@pytest.mark.slow  # two runs of 2 processes and a whole-job restart: ~15 s on the 2-core machine
def test_a_dead_process_of_a_partitioned_group_costs_at_most_the_steps_since_the_mirror(blobs_dir, tmp_path, runs):
    steps = 200
    job = partitioned_job(blobs_dir, tmp_path, steps)
    (tmp_path / "clean").mkdir()
    clean = Run(job, tmp_path / "clean", "--max-restarts", "1", env=SLOW)
    clean.finished()
    faulted = runs.start(job, tmp_path, "--max-restarts", "1", env=SLOW)
    victim = faulted.signal(1, signal.SIGKILL, step=30)
    stdout, stderr = faulted.finished()
    assert pids(faulted.ws, 1)[0] == victim and len(pids(faulted.ws, 1)) == 2, stderr
    restart, = summary(faulted.ws)["job_restarts"]
    assert restart["from_step"] % 4 == 0 and restart["from_step"] >= 28, restart
    assert 0 <= restart["steps_redone"] <= 4, restart  # the mirror's K (the plan's note above)
    assert f"restarting the whole job from the checkpoint of step {restart['from_step']}" in stderr, stderr
    assert summary(faulted.ws)["status"] == "finished"
    final = f"checkpoint/step{steps}-worker0.safetensors"
    ours, theirs = load_file(faulted.ws / final), load_file(clean.ws / final)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key  # bit for bit: the resume from the mirror is exact
    # each step's loss as the clean run's (a step trained twice: the restart's record, after the first start's)
    assert {r["step"]: r["loss"] for r in train_records(faulted.ws)} == {r["step"]: r["loss"] for r in train_records(clean.ws)}
    mirrors = sorted((faulted.ws / "checkpoint").glob("step*-worker0.safetensors"))
    # this start's two newest mirrors, the first start's last two (a start removes only what it wrote: a file it did not
    # write may be a checkpoint the job asked for) and the final checkpoint
    assert len(mirrors) <= 5, mirrors
    clean.stop()
