"""Distributed Hogwild groups rejoin from the live values, as Downpour's do (issue 38, point 3).

Group 1's process is SIGKILLed (its pid from its log) mid-run with --max-restarts 1: the launcher restarts it; the new
process knocks at each live group, takes the live values of the slices they master and its own slices as the
latest of their synced copies, and joins at its peers' step, skipping the steps from its last sync to there; every
group then re-trains its share of the skipped steps past train_steps (the groups' updates add up to the unfaulted
run's, and the job waits about half as long as one group re-training them alone); the other groups' syncs with it
resume. Real runs through the CLI on the blobs data, and a user's loop (shoal.session) under `shoal run script.py`.
"""
from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from cli_in_process import run_cli
from fault_runs import SLOW, assert_job_processes_ended, assert_no_library_text, closing_line, pids, runs, summary, train_records  # noqa: F401 (runs: a fixture)
from test_bytes_counted import trainable_numel
from test_cli import leftover_processes

STEPS = 240
SYNC_FREQ = 4
GROUPS = dict(sync_freq=SYNC_FREQ)


# Under a loaded CI (2 of about 7 fresh-clone runs on 2026-11-28) the restarted group's first syncs with group 0 went
# unanswered until gloo's 45 s timeout, and the groups then stopped syncing for good: a race in the rejoin's re-linking
# (a sync under way read the old link), fixed in cec8daa; 24 runs of both cases beside two CPU hogs and two other copies
# (2026-11-29) never hung
@pytest.mark.parametrize("groups, extra", [(2, {}), pytest.param(3, dict(compression="kTopK", topk_fraction=0.5),
                                                                 marks=pytest.mark.slow)])  # (the same race: suite time)
def test_a_killed_hogwild_group_is_restarted_and_syncs_again(blobs_job, tmp_path, runs, groups, extra):
    """--max-restarts 1, group 1's process SIGKILLed: exit 0, group 1 runs under two pids (the rejoin line names the
    step it joined at, its peers', later than its last sync's, the steps it skipped and what it took), the others' pids
    unchanged, group 0 syncs with it again to the end, the closing line and summary.json say it was restarted and count
    the steps it skipped, the job's steps are as configured, the accuracy is the unfaulted run's; no library text."""
    job = blobs_job(train_steps=STEPS, layout=f"Distributed Hogwild, {groups} groups", cluster_extra=dict(GROUPS, **extra))
    unfaulted = run_cli("run", job, "--workspace", tmp_path / "unfaulted", "--no-progress", timeout=120)
    assert unfaulted.returncode == 0, unfaulted.stderr
    run = runs.start(job, tmp_path, "--max-restarts", "1", env=SLOW)
    chief = run.pid_once_training(0)
    victim = run.signal(1, signal.SIGKILL, step=20)
    stdout, stderr = run.finished()
    assert re.search(r"^WARNING: process 1 \(worker\(group=1, id=0\), server\(group=1, id=0\)\) exited with code -9; restarting it "
                     r"\(restart 1 of 1\); it rejoins from the other groups' live values$", stderr, re.M), stderr
    (line,) = [line for line in stdout.splitlines() if line.startswith("Worker group 1 rejoined at step ")]
    step = int(re.match(r"Worker group 1 rejoined at step (\d+) \(process 1, restart 1\): ", line)[1])
    got = summary(run.ws)
    (record,) = got["rejoins"]  # logs/rejoins.jsonl's line
    synced, joined = record["skipped_steps"]  # [its last sync's step, the step it joined at)
    # its peers' step, at or past its last sync (at it: a restart quick enough that its peers had not moved on); 0 where
    # it was killed before its first sync (a loaded machine can hold group 1 back while group 0 reaches the kill's step:
    # once in a fresh-clone suite, 2026-11-29)
    assert synced % SYNC_FREQ == 0 and 0 <= synced <= joined == step < STEPS, (line, record)
    assert step >= 20, line  # group 0 (the chief) had displayed step 20 before the kill: the peers' step, at least
    skipped_text = (f"step {synced} (1 step" if step - synced == 1 else f"steps {synced} to {step - 1} ({step - synced} steps")
    assert (f"; it skipped {skipped_text}, to its peers' step: " in line) == (step > synced), line
    masters = "worker group 0 masters" if groups == 2 else "worker groups 0 and 2 master"
    assert re.search(f"the live values of the slices {masters}, and its own slices as worker group [02] last synced them "
                     r"\(its updates since that sync were lost\)", line), line
    assert pids(run.ws, 0) == [chief] and pids(run.ws, 1)[0] == victim and len(set(pids(run.ws, 1))) == 2
    assert (record["group"], record["rank"], record["incarnation"], record["step"]) == (1, 1, 1, step)
    # the steps it skipped are re-shared: every group trains its share beyond train_steps (group 0 the odd one), so the
    # groups' updates add up to the unfaulted run's, and the chief's last step (its final test, checkpoint) is its own
    skipped = step - synced
    shares = {str(g): skipped // groups + (g < skipped % groups) for g in range(groups)}
    if skipped:
        assert got["reshared_steps"] == {"skipped": skipped, "retrained": skipped, "by_group": shares}, got.get("reshared_steps")
        assert got["steps_per_group"] == {str(g): STEPS - skipped * (g == 1) + shares[str(g)] for g in range(groups)}
        assert sum(got["steps_per_group"].values()) == groups * STEPS
    else:  # nothing to re-share
        assert "reshared_steps" not in got and "missed_steps" not in got, got
    last = STEPS + shares["0"]
    assert got["steps"] == last and got["status"] == "finished" and got["final_test"]["step"] == last
    assert (run.ws / "checkpoint" / f"step{last}-worker0.safetensors").exists()
    assert (run.ws / "checkpoint" / f"step{STEPS + shares['1']}-group1-rank1.safetensors").exists()
    # the groups' syncs resumed both ways: the restarted process synced with group 0, and group 0 said so
    rank0, rank1 = (run.ws / "logs" / "rank0.log").read_text(), (run.ws / "logs" / "rank1.log").read_text()
    assert "worker group 0 syncs with worker group 1 again (its restart 1)" in stdout, stdout
    if groups == 3:
        assert "worker group 2 syncs with worker group 1 again (its restart 1)" in (run.ws / "logs" / "rank2.log").read_text()
        assert pids(run.ws, 2)[-1] == pids(run.ws, 2)[0]
    # group 0's records: it syncs with group 1's masters (its only ones) again, to the end. A sync is counted when its
    # answer is applied, and an answer later than SYNC_PATIENCE_S (a loaded machine) is applied at a later sync point,
    # or that point is skipped: so not every display window holds one, but most sync points do, up to the last steps
    records = train_records(run.ws)
    second_half = [r["syncs"] for r in records if r["step"] >= STEPS // 2]
    assert sum(second_half) >= (records[-1]["step"] - STEPS // 2) // SYNC_FREQ // 2, records
    assert any(r["syncs"] for r in records if r["step"] >= 3 * STEPS // 4), records
    assert got["missed_updates"] == {"1": {"why": "process 1 was restarted after it exited with code -9", "rejoined_at": [step]}}
    if skipped:
        why = f"skipped steps {synced} to {step - 1}" if skipped > 1 else f"skipped step {synced}"
        assert got["missed_steps"] == {"1": {"missed": skipped, "of": STEPS, "why": f"{why}, back at step {step}"}}
        retrained = " and ".join(f"{shares[str(g)]} by worker group {g}" for g in range(groups) if shares[str(g)])
        assert (f"worker group 1 was restarted and rejoined at step {step}, skipping {skipped} step{'s' if skipped > 1 else ''} "
                f"(process 1 was restarted after it exited with code -9)" in closing_line(stdout)), closing_line(stdout)
        were = "steps were" if skipped > 1 else "step was"
        assert f"the {skipped} skipped {were} re-trained beyond step {STEPS}: {retrained}" in closing_line(stdout), closing_line(stdout)
    else:
        assert (f"worker group 1 was restarted and rejoined at step {step} (process 1 was restarted after it exited with "
                f"code -9)" in closing_line(stdout)), closing_line(stdout)
    # summary.json's bytes: group 0's syncs, and group 1's of both processes (the dead one's as group 0 answered them,
    # the restarted one's own count with what it took when it rejoined); no more than the unfaulted run's and that
    # handover (its 24-byte header: three int64, and the whole model in float32: the live slices and its own)
    if groups == 2:
        handover = 24 + 4 * trainable_numel(tmp_path / "unfaulted", STEPS)
        assert sum(r["sync_bytes"] for r in records) < got["bytes_sent"] <= summary(tmp_path / "unfaulted")["bytes_sent"] + handover
    final, baseline = got["final_test"]["accuracy"], summary(tmp_path / "unfaulted")["final_test"]["accuracy"]
    assert final >= baseline - 0.05, (final, baseline)
    assert_no_library_text(stdout, stderr, rank0, rank1)
    assert leftover_processes(tmp_path) == []


def test_a_group_killed_before_its_first_sync_of_a_resumed_run_skips_from_the_resumed_step(blobs_job, tmp_path, runs):
    """A run resumed from its checkpoint of step 40, syncing too rarely to sync again: group 1's process killed before
    any sync of this run joins at its peers' step and skips from step 40, where every group began (its last synced
    work: it took step 0 for that before, and trained the whole run again)."""
    job = blobs_job(train_steps=40, layout="Distributed Hogwild, 2 groups", cluster_extra=GROUPS)
    first = run_cli("run", job, "--workspace", tmp_path / "ws", "--no-progress", "--set", "checkpoint_freq=20", timeout=120)
    assert first.returncode == 0, first.stderr
    run = runs.start(job, tmp_path, "--resume", "--set", "train_steps=400", "--set", "cluster.sync_freq=1000", "--max-restarts", "1",
                     env=SLOW)
    run.signal(1, signal.SIGKILL, step=60)
    stdout, _ = run.finished()
    (line,) = [line for line in stdout.splitlines() if line.startswith("Worker group 1 rejoined at step ")]
    step = int(re.match(r"Worker group 1 rejoined at step (\d+) \(process 1, restart 1\): ", line)[1])
    assert step >= 60 and f"; it skipped steps 40 to {step - 1} " in line, line
    assert summary(run.ws)["missed_updates"]["1"]["rejoined_at"] == [step]
    assert summary(run.ws)["rejoins"][0]["skipped_steps"] == [40, step]
    assert leftover_processes(tmp_path) == []


def last_displayed_step(stdout: str) -> int:
    steps = re.findall(r"^Train @ step (\d+) ", stdout, re.M)
    return int(steps[-1]) if steps else -1


@pytest.mark.slow
def test_a_stopped_hogwild_group_holds_nobody_up_and_rejoins_at_its_peers_step(blobs_job, tmp_path, runs):
    """Group 1's process SIGSTOPped (3 s stall timeout, --max-restarts 1): group 0 trains on at its pace while it is
    stopped (its sync with group 1's masters waits SYNC_PATIENCE_S, not the stall timeout: it waited the whole timeout
    before). Stopped 2 s and continued, group 1 answers the late sync and stays in the job; stopped past the timeout,
    the launcher ends its process and restarts it, which rejoins at its peers' step; exit 0, the job's steps as
    configured, group 0's pid unchanged, the accuracy as good."""
    steps = 1500
    job = blobs_job(train_steps=steps, layout="Distributed Hogwild, 2 groups", cluster_extra=dict(sync_freq=1, stall_timeout_s=3))
    run = runs.start(job, tmp_path, "--max-restarts", "1", env=SLOW)  # group 0's steps take 10 ms or more
    chief = run.pid_once_training(0)
    victim = run.signal(1, signal.SIGSTOP, step=50)
    at_stop = last_displayed_step(run.stdout())
    time.sleep(2)  # a short stop: the late answer comes when it runs again, and is applied
    os.kill(victim, signal.SIGCONT)
    assert last_displayed_step(run.stdout()) >= at_stop + 30, run.stdout()[-2000:]
    time.sleep(0.5)
    assert run.stderr() == "" and pids(run.ws, 1) == [victim], run.stderr()  # nobody dropped, nothing restarted
    os.kill(victim, signal.SIGSTOP)
    at_stop = last_displayed_step(run.stdout())
    time.sleep(2.5)  # within the stall timeout: group 1 is not dropped yet
    assert last_displayed_step(run.stdout()) >= at_stop + 40, run.stdout()[-2000:]
    stdout, stderr = run.finished()
    (line,) = [line for line in stdout.splitlines() if line.startswith("Worker group 1 rejoined at step ")]
    got = summary(run.ws)
    (record,) = got["rejoins"]
    synced, joined = record["skipped_steps"]
    assert synced < joined == record["step"] and joined > at_stop, (line, record)
    assert f"; it skipped steps {synced} to {joined - 1} " in line, line
    skipped = joined - synced  # re-trained past the last step by both groups: their updates add up to the unfaulted run's
    assert got["reshared_steps"] == {"skipped": skipped, "retrained": skipped, "by_group": {"0": (skipped + 1) // 2, "1": skipped // 2}}
    assert got["status"] == "finished" and got["steps"] == steps + (skipped + 1) // 2
    assert sum(got["steps_per_group"].values()) == 2 * steps
    assert pids(run.ws, 0) == [chief] and pids(run.ws, 1)[0] == victim and len(set(pids(run.ws, 1))) == 2
    assert "was stopped past the stall timeout" in stderr, stderr
    assert got["final_test"]["accuracy"] >= 0.9, got["final_test"]
    assert leftover_processes(tmp_path) == []


LOOP = '''
import json, os, signal, sys, time
from pathlib import Path
import torch, shoal
out = Path(sys.argv[1])
torch.manual_seed(0)
x = torch.randn(96, 8)
data = torch.utils.data.TensorDataset(x, x[:, :1].clone())
run = shoal.session(train_steps=40, disp_freq=5)
(out / f"pid{run.rank}.{os.getpid()}").write_text("")
model = run.model(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)))
opt = run.optimizer(torch.optim.SGD(model.parameters(), lr=0.05))
first = updates = None
for step, (xb, yb) in run.batches(data, batch_size=12):
    first = step if first is None else first
    if run.rank == 1 and step == 12 and len(list(out.glob("pid1.*"))) == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if sys.argv[2:] == ["end"] and step == 41:  # killed again in its share, once group 0 finished its own and waits
        if run.rank == 0:
            (out / "rank0.at41").write_text("")
        elif len(list(out.glob("pid1.*"))) == 2:
            while not (out / "rank0.at41").exists():
                time.sleep(0.05)
            time.sleep(1)
            os.kill(os.getpid(), signal.SIGKILL)
    if run.rank == 0 and step == 14:  # the chief waits for group 1 to be back: it skipped steps 10 to 13
        deadline = time.time() + 60
        while not (run.workspace / "logs" / "rejoins.jsonl").exists() and time.time() < deadline:
            time.sleep(0.05)
    loss = ((model(xb) - yb) ** 2).mean()
    loss.backward()
    opt.step(); opt.zero_grad()
    run.log(step, loss=loss)
(out / f"rank{run.rank}.json").write_text(json.dumps({"first": first, "last": step}))
'''


@pytest.mark.slow  # 5 s: a script's two processes and a restart
@pytest.mark.parametrize("again", ["", "end"])
def test_a_killed_hogwild_groups_skipped_steps_are_retrained_in_a_users_loop(tmp_path, again):
    """shoal.session's run.batches() goes on past train_steps for a Distributed Hogwild group's share of the steps a
    restarted group skipped: group 1, killed at step 12 of 40 (its last sync at 10), rejoins at 14 and skips 4 steps;
    each group trains 2 more (steps 40 and 41, its shard's next rows), and summary.json says so. `end`: group 1 is
    killed again at step 41, after group 0 trained its share and waits in its finish: group 0 lets the restarted process
    in (its door stays open until every peer said STOP), which joins at its last sync (step 40) and trains its share to
    the end, so every skipped step is still re-trained."""
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    out, ws = tmp_path / "out", tmp_path / "ws"
    out.mkdir()
    proc = run_cli("run", script, "--workspace", ws, "--no-progress", "--set", "cluster.nworker_groups=2",
                   "--set", "cluster.nserver_groups=2", "--set", "cluster.sync_freq=5", "--max-restarts", "2", "--", out,
                   *([again] if again else []), timeout=120, cwd=out)
    assert proc.returncode == 0, proc.stderr
    record, *later = [json.loads(line) for line in (ws / "logs" / "rejoins.jsonl").read_text().splitlines()]
    assert record["skipped_steps"] == [10, 14], record
    if again:  # back at its last sync, past train_steps: nothing skipped, its share trained to its end
        assert [(r["incarnation"], r["step"], r.get("skipped_steps")) for r in later] == [(2, 40, [40, 40])], later
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == {"first": 0, "last": 41} and ranks[1] == {"first": 40 if again else 14, "last": 41}, ranks  # 40 + its share of 4
    got = summary(ws)
    assert got["reshared_steps"] == {"skipped": 4, "retrained": 4, "by_group": {"0": 2, "1": 2}}
    assert got["steps_per_group"] == {"0": 42, "1": 38} and got["status"] == "finished"  # 80 updates, as unfaulted
    assert "the 4 skipped steps were re-trained beyond step 40: 2 by worker group 0 and 2 by worker group 1" in proc.stdout
    assert_job_processes_ended(ws)  # (run in this process: its ranks carry no tag for leftover_processes)
