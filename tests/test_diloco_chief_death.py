"""Issue 38, point 2: Local SGD / DiLoCo's group 0 in a user's loop dies like any other group. Its process (the chief)
SIGKILLed mid-interval: the other groups' next meeting goes on without it and the lowest living process decides the
meetings from then on (shoal.comm.quorum's `replaceable`), takes over the run log, summary.json and the checkpoints
(report/succession.py); under --max-restarts the restarted process rejoins at a meeting from a live group's state,
as a non-chief. A checkpoint the successor wrote names it (`writer`): a resume gives each process its own group's
state. A job file's trainer keeps the whole-job restart (its chief's duties are its own)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from shoal.frontend import session_state
from shoal.launcher import ranks, rejoin, stalls
from shoal.neuralnet import checkpoint as ckpt_io

GROUP_0_DIES = textwrap.dedent('''
import json, os, signal, sys, time
from pathlib import Path
import torch, shoal
out, kill_at = Path(sys.argv[1]), int(sys.argv[2])
run = shoal.session(train_steps=30, disp_freq=2, checkpoint_freq=12)
(out / f"pid{run.rank}.{os.getpid()}").write_text("")
torch.manual_seed(0)
model = run.model(torch.nn.Linear(4, 1, bias=False))
opt = run.optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
first = None
for step in run.steps():
    first = step if first is None else first
    if run.rank == 0 and step == kill_at and not (out / "killed").exists():
        (out / "killed").write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    if run.rank == 0 and first > 0 and step == first:
        (out / "back").write_text(str(step))
    if run.rank != 0 and step >= kill_at >= 0 and sys.argv[3] == "wait" and not (out / "back").exists():
        time.sleep(0.3)  # the survivor goes on slowly until group 0's process is back (admitted at a meeting)
    target = torch.arange(4.0) * (run.rank + 1) + step  # each group's own gradient: w - target
    loss = 0.5 * ((model.weight[0] - target) ** 2).sum()
    loss.backward()
    opt.step(); opt.zero_grad()
    run.log(step, loss=loss)
(out / f"rank{run.rank}.json").write_text(json.dumps({"pid": os.getpid(), "first": first, "last": step,
                                                      "weight": model.weight[0].tolist()}))
''')
DILOCO = ["--set", "cluster.nworker_groups=2", "--set", "cluster.nworkers_per_procs=1", "--set", "cluster.local_steps=5",
          "--set", "cluster.outer_updater.type=kSGD", "--set", "cluster.outer_updater.learning_rate.type=kFixed",
          "--set", "cluster.outer_updater.learning_rate.base_lr=1.0"]  # (outer SGD at lr 1: the anchor is the groups' mean)


def plan_of(own_loop: bool, **cluster):
    from shoal.frontend.session_start import session_job
    from shoal.planning.plan import plan_job
    from shoal.strategies.registry import REGISTRY
    import shoal

    plan = plan_job(session_job(shoal.Cluster(**cluster), 10, 0, 10, 0, "t"), strategies=REGISTRY)
    return plan if own_loop else AsAJobFile(plan)


class AsAJobFile:
    """The same plan, as a job file's (its net has layers: no user's loop)."""

    own_loop = False

    def __init__(self, plan):
        self._plan = plan

    def __getattr__(self, name):
        return getattr(self._plan, name)


DILOCO_CLUSTER = dict(nworker_groups=2, nworkers_per_procs=1, local_steps=5)


def test_group_0s_process_is_replaceable_where_the_groups_are_one_process_each():
    """In a user's loop and in a job file alike (a job file's trainer takes over too: tests/test_job_chief_death.py);
    not Downpour's group 0."""
    for plan in plan_of(True, **DILOCO_CLUSTER), plan_of(False, **DILOCO_CLUSTER):
        assert ranks.chief_replaceable(plan) and ranks.expendable(plan, 0) and rejoin.why_not(plan, 0) is None
    downpour = plan_of(True, nworker_groups=2, nworkers_per_procs=1, nserver_groups=1, server_worker_separate=True)
    assert not ranks.chief_replaceable(downpour)  # (its group 0 holds what the servers start from)


def test_a_stalled_group_0_is_warned_of_by_its_successor_and_ended_once_the_others_finished(tmp_path, monkeypatch):
    loop = plan_of(True, nworker_groups=3, nworkers_per_procs=1, local_steps=5)
    policies = {r: stalls.StallPolicy(loop, r, tmp_path, False) for r in range(3)}
    assert [policies[r]._speaks_for_the_job(0) for r in (1, 2)] == [True, False]  # process 1 decides the meetings now
    assert policies[2]._speaks_for_the_job(1)  # 0 and 1 both seen stalled: process 2 is the lowest left
    assert not stalls.StallPolicy(loop, 1, tmp_path, False)._speaks_for_the_job(2)  # the chief lives: it warns
    downpour = plan_of(True, nworker_groups=2, nworkers_per_procs=1, nserver_groups=1, server_worker_separate=True)
    assert not stalls.StallPolicy(downpour, 1, tmp_path, False)._speaks_for_the_job(0)  # (its chief is not replaced)
    # a chief killed (not stalled) and replaced by process 1: process 1 warns of a later stall of process 2
    from shoal.report import succession

    monkeypatch.setattr(succession, "_took_over", True)
    assert stalls.StallPolicy(loop, 1, tmp_path, False)._speaks_for_the_job(2)
    monkeypatch.setattr(succession, "_took_over", False)

    class Process:
        def __init__(self, pid, exitcode):
            self.pid, self.exitcode, self.sentinel, self.killed = pid, exitcode, pid, False

        def kill(self):
            self.killed, self.exitcode = True, -9

        def join(self):
            pass

    monkeypatch.setattr(stalls, "is_stopped", lambda pid: pid == 100)  # process 0 (pid 100) stopped
    everyone_expendable = lambda rank: False  # noqa: E731  (no essential process: Local SGD's groups in a loop)
    for codes, ended in (((0, 0), [0]), ((0, -9), [0]), ((0, None), []), ((-9, 1), [])):
        procs = [Process(100, None), Process(101, codes[0]), Process(102, codes[1])]
        context = type("Context", (), {"processes": procs, "sentinels": {p.sentinel: i for i, p in enumerate(procs)}})()
        assert stalls.end_dropped(context, [0, 1, 2], everyone_expendable) == ended, codes
        assert procs[0].killed == bool(ended)


def test_a_resume_gives_the_file_to_the_process_that_wrote_it_and_each_other_its_part(tmp_path):
    part = lambda group, rank: ckpt_io.part_name(24, group, rank)  # noqa: E731
    mine = {name: ckpt_io.Checkpoint(step=24, params={"w": torch.full((2,), float(rank))}, trainer={"session": True})
            for name, rank in ((part(0, 0), 0), (part(2, 2), 2))}
    main = ckpt_io.Checkpoint(step=24, params={"w": torch.ones(2)}, trainer={"session": True, "writer": 1}, parts=mine)
    said = []
    took = {rank: session_state.own_part(main, tmp_path, rank, rank, False, True, said.append) for rank in range(3)}
    assert took[1] is main and took[0] is mine[part(0, 0)] and took[2] is mine[part(2, 2)] and not said
    older = ckpt_io.Checkpoint(step=24, params={}, trainer={"session": True}, parts={})  # (before `writer`: process 0's)
    assert session_state.own_part(older, tmp_path, 0, 0, False, True, said.append) is older


def run_group_0_dies(tmp_path, *options, wait: bool, layout=tuple(DILOCO)):
    script = tmp_path / "group0_dies.py"
    script.write_text(GROUP_0_DIES)
    return subprocess.run([sys.executable, "-m", "shoal", "run", str(script), "--workspace", str(tmp_path / "ws"), *layout,
                           *options, "--", str(tmp_path), "7", "wait" if wait else "go"],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path)


def replayed(back: int, kill: int = 7, steps: int = 30, every: int = 5, groups: int = 2) -> torch.Tensor:
    """The groups' values where group 0 is gone from its step `kill` until its step `back` (the meetings' mean over the
    groups that came; a rejoined group starts from the meeting's anchor)."""
    torch.manual_seed(0)
    w0 = torch.nn.Linear(4, 1, bias=False).weight[0].detach().clone().double()
    w = {g: w0.clone() for g in range(groups)}
    for step in range(steps):
        alive = list(range(groups)) if step < kill or step >= back else list(range(1, groups))
        for g in alive:
            w[g] -= 0.1 * (w[g] - (torch.arange(4.0).double() * (g + 1) + step))
        if (step + 1) % every == 0:
            anchor = sum(w[g] for g in alive) / len(alive)
            w = {g: anchor.clone() for g in range(groups)}
    return w[0]


@pytest.mark.slow  # (about 8 s: two real `python -m shoal run`, a kill and a restart, and a resume)
def test_a_killed_group_0_is_dropped_and_rejoins_from_the_live_group(tmp_path):
    proc = run_group_0_dies(tmp_path, "--max-restarts", "1", wait=True)
    assert proc.returncode == 0, proc.stderr
    assert "restarting the whole job" not in proc.stderr
    assert proc.stderr.splitlines() == [  # the one fault line, no library text
        "WARNING: process 0 (worker(group=0, id=0), server(group=0, id=0)) exited with code -9; restarting it "
        "(restart 1 of 1); it rejoins at the groups' next meeting, from a live group's state"]
    ends = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)}
    pids = {r: sorted(int(p.name.split(".")[1]) for p in tmp_path.glob(f"pid{r}.*")) for r in range(2)}
    killed = int((tmp_path / "killed").read_text())
    assert killed in pids[0] and len(pids[0]) == 2 and ends[0]["pid"] != killed  # group 0 ran as two processes
    assert pids[1] == [ends[1]["pid"]] and ends[1]["first"] == 0  # group 1's one process, from the start
    assert not [pid for pid in pids[0] + pids[1] if subprocess.run(["ps", "-p", str(pid)], capture_output=True).returncode == 0]
    back = ends[0]["first"]
    assert back % 5 == 0 and 10 <= back <= 25, back  # admitted at a meeting, after the one it missed
    expected = replayed(back)
    for r in range(2):
        assert torch.allclose(torch.tensor(ends[r]["weight"]).double(), expected, rtol=1e-5, atol=1e-5), (r, ends[r], expected)
    ws = tmp_path / "ws"
    summary = json.loads((ws / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 30 and "job_restarts" not in summary
    assert [(r["group"], r["rank"], r["step"]) for r in summary["rejoins"]] == [(0, 0, back)]
    missed = back // 5 - 1  # the meetings after steps 9 .. back - 1
    assert summary["missed_updates"]["0"]["meetings"] == 6 - missed
    records = [json.loads(line) for line in (ws / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records]
    assert steps == sorted(steps) and steps[:4] == [0, 2, 4, 6] and steps[-1] == 29  # one log: the chief's, then its successor's
    assert all(b["time"] >= a["time"] for a, b in zip(records, records[1:]))
    log1 = (ws / "logs" / "rank1.log").read_text()
    assert "Process 1 took the chief's place after step 9: it decides the steps, evaluates (run.evaluate), writes the run log and the checkpoints" in log1
    assert "Process 1 took the chief's place after step 9" in proc.stdout and "Train @ step 29" in proc.stdout  # the terminal
    assert f"Worker group 0 rejoined at step {back} (process 0, restart 1): " in (ws / "logs" / "rank0.log").read_text()
    # the checkpoint of step 24 (mid-interval: the groups' values differ) was written by process 1, group 0's as its part:
    # resumed, each process takes its own group's, and the run ends where the uninterrupted one did, to the bit
    if back <= 20:
        assert ckpt_io.load(ckpt_io.checkpoint_file(ws, 24), parts=True).trainer["writer"] == 1
    again = tmp_path / "again"
    again.mkdir()
    resumed = subprocess.run([sys.executable, "-m", "shoal", "run", str(tmp_path / "group0_dies.py"), "--workspace", str(ws),
                              *DILOCO, "--resume", "--", str(again), "-1", "go"], capture_output=True, text=True, timeout=240,
                             cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    for r in range(2):
        assert json.loads((again / f"rank{r}.json").read_text())["weight"] == ends[r]["weight"]


@pytest.mark.slow
def test_without_restarts_the_other_groups_finish_without_group_0(tmp_path):
    proc = run_group_0_dies(tmp_path, wait=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [
        "WARNING: process 0 (worker(group=0, id=0), server(group=0, id=0)) exited with code -9; the other worker "
        f"groups go on (see {tmp_path}/ws/logs/rank0.log)"]
    summary = json.loads((tmp_path / "ws" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 30
    assert summary["missed_updates"]["0"] == {"meetings": 1, "of": 6, "why": "process 0 exited with code -9; missing from "
                                              "the meetings after steps 9 to 29"}
    assert json.loads((tmp_path / "rank1.json").read_text())["weight"] == pytest.approx(replayed(back=30).tolist(), rel=1e-5)
    assert "worker group 0 came to 1 of 6 meetings" in proc.stdout


@pytest.mark.slow  # (about 7-10 s: the stall timeout, 2 s, then 3 processes)
def test_local_sgd_goes_on_without_a_stopped_group_0_and_the_next_process_speaks(tmp_path):
    """Local SGD, 3 groups, no restarts: group 0's process SIGSTOPped (never continued) mid-interval. The heartbeat
    drops it past the stall timeout; process 1 (the lowest living) decides the meetings, warns once on the terminal
    (the chief that would have is the one stopped), and the launcher ends the stopped process once the others finished
    (it waited for it forever: every process of this layout is expendable)."""
    script = tmp_path / "group0_stops.py"
    script.write_text(GROUP_0_DIES.replace("signal.SIGKILL", "signal.SIGSTOP"))
    local_sgd = [a.replace("nworker_groups=2", "nworker_groups=3") for a in DILOCO[:6]]  # (no outer updater: the mean)
    proc = subprocess.run([sys.executable, "-m", "shoal", "run", str(script), "--workspace", str(tmp_path / "ws"), *local_sgd,
                           "--set", "cluster.stall_timeout_s=2", "--", str(tmp_path), "7", "go"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    said = proc.stderr.splitlines()  # one warning, the successor's (process 2's stays in its log), no library text
    assert len(said) == 1 and re.fullmatch(
        re.escape("WARNING: worker group 0 dropped: process 0 (worker(group=0, id=0), server(group=0, id=0)) stopped "
                  "answering (no heartbeat for 2 s") + r"(, the last at step [0-6])?" + re.escape(
            f"); the other worker groups go on (see {tmp_path}/ws/logs/rank0.log)"), said[0]), said
    stopped = int((tmp_path / "killed").read_text())
    assert subprocess.run(["ps", "-p", str(stopped)], capture_output=True).returncode != 0  # ended, not left behind
    summary = json.loads((tmp_path / "ws" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 30
    assert summary["missed_updates"]["0"] == {"meetings": 1, "of": 6, "why": "dropped: process 0 stopped answering; "
                                              "missing from the meetings after steps 9 to 29"}
    expected = replayed(back=30, groups=3).tolist()
    for r in (1, 2):
        assert json.loads((tmp_path / f"rank{r}.json").read_text())["weight"] == pytest.approx(expected, rel=1e-5)
    assert "Process 1 took the chief's place after step 9" in proc.stdout and "Train @ step 29" in proc.stdout
    assert "Process 2 took" not in (tmp_path / "ws" / "logs" / "rank2.log").read_text()


SPARSELOCO = [*DILOCO[:6], "--set", "cluster.sparse_outer_step.chunk_size=2", "--set", "cluster.sparse_outer_step.topk_per_chunk=1"]


@pytest.mark.slow  # (10-20 s: two runs, a kill, a restart that waits for a meeting)
def test_sparseloco_resumed_after_a_succession_gives_each_group_its_own_error_feedback(tmp_path):
    """SparseLoCo's accumulator (error feedback) is each group's own: after group 0's process died and process 1 took
    its place, the checkpoint file holds group 1's and group 0's part its own (they differ: the rejoined group's started
    at zero); resumed, the run ends where the uninterrupted one did, to the bit."""
    proc = run_group_0_dies(tmp_path, "--max-restarts", "1", wait=True, layout=SPARSELOCO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [
        "WARNING: process 0 (worker(group=0, id=0), server(group=0, id=0)) exited with code -9; restarting it "
        "(restart 1 of 1); it rejoins at the groups' next meeting, from a live group's state"]
    ends = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)}
    ws = tmp_path / "ws"
    saved = ckpt_io.load(ckpt_io.checkpoint_file(ws, 24), parts=True)
    if ends[0]["first"] <= 20:  # (rejoined before the checkpoint: process 1 wrote it)
        assert saved.trainer["writer"] == 1
        feedback = "updater/weight/outer.error_feedback"
        group_0s = saved.parts[ckpt_io.part_name(24, 0, 0)].exchange[feedback]
        assert not torch.equal(saved.exchange[feedback], group_0s)
    again = tmp_path / "again"
    again.mkdir()
    resumed = subprocess.run([sys.executable, "-m", "shoal", "run", str(tmp_path / "group0_dies.py"), "--workspace", str(ws),
                              *SPARSELOCO, "--resume", "--", str(again), "-1", "go"], capture_output=True, text=True,
                             timeout=240, cwd=tmp_path)
    assert resumed.returncode == 0 and not resumed.stderr, resumed.stderr
    for r in range(2):
        assert json.loads((again / f"rank{r}.json").read_text())["weight"] == ends[r]["weight"]
