"""Issue 38: the chief's death survived. Under AllReduce's replicas in a user's loop (`shoal run script.py`), a dead
chief (process 0) is dropped like any other process: the lowest living process decides the next step in its place
(shoal.comm.quorum, `replaceable`), takes over the run log and the checkpoints (report/succession.py), and the
dead chief's restarted process rejoins as a non-chief, healing from it."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
import torch.distributed as dist

from shoal.comm import auth, channels, quorum, signed_store
from shoal.comm import dist as comm
from shoal.comm.signed_store import SignedStore


@pytest.fixture
def job_store(monkeypatch):
    """A job's signed store on loopback, as the launcher holds it (this process's memory of values fresh)."""
    monkeypatch.setattr(signed_store, "_book", signed_store._Freshness())
    raw = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    secret = auth.new_secret()
    monkeypatch.setattr(comm, "_signed", SignedStore(raw, secret))
    return raw, secret


def test_the_lowest_living_member_decides_in_a_dead_chiefs_place(job_store, monkeypatch):
    """Process 0 (the decider) is gone (the launcher announced its restart at the door): process 1, the lowest living
    member, decides the step in its place and every member follows it from then on; process 2 never decides while
    process 1 lives; a late outcome of the old decider (one that was stalled) does not replace its successor's."""
    raw, secret = job_store
    # (the groups re-formed over the living are gloo's; here a sum over a group holding process 0 fails, as its
    # closed connection makes it fail)
    monkeypatch.setattr(quorum.MeetingGroup, "formed", classmethod(
        lambda cls, epoch, ranks, rank, timeout_s, give_up=None: cls(epoch, ranks, rank, backend=object())))

    def contribute(attempt, rank):
        if 0 in attempt.quorum.group.ranks:
            raise quorum.PeerLost("process 0's connection closed")
        return rank

    door = lambda: channels.Door("step", raw, secret)  # noqa: E731
    members = {r: quorum.Quorum(r, [0, 1, 2], {0: 0, 1: 1, 2: 2}, door(), first=object(), replaceable=True) for r in (1, 2)}
    door().next_incarnation(0)  # the launcher saw process 0 die and restarts it
    met, errors = {}, []

    def steps(rank: int) -> None:
        try:
            for step in range(3):
                met[rank, step] = members[rank].meet(step, step, lambda attempt: contribute(attempt, rank)).came
        except Exception as err:  # noqa: BLE001 (the test reports it)
            errors.append(err)

    threads = [threading.Thread(target=steps, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and all(not t.is_alive() for t in threads), errors
    assert met == {(r, s): (1, 2) for r in (1, 2) for s in range(3)}
    assert members[1].chief and not members[2].chief and members[2].decider == 1
    store = SignedStore(raw, secret).under(quorum.KEYS)
    assert store.get("m0/a0/outcome") == "retry 1 1:0,2:0 1"  # process 1's word: again, over the living
    assert store.get("m0/a1/outcome") == "commit 1 1:0,2:0 - 1"
    assert quorum.Outcome.parse(store.get("m2/a0/outcome")) == quorum.Outcome(True, 1, (quorum.Member(1), quorum.Member(2)),
                                                                              (), 1)
    late = quorum.Outcome(True, 0, (quorum.Member(0), quorum.Member(1), quorum.Member(2)), (), 0).text()
    assert store.set_first("m0/a0/outcome", late) == "retry 1 1:0,2:0 1"  # first writer wins


CHIEF_DIES = textwrap.dedent('''
    import json, os, signal, sys, time
    from pathlib import Path
    import torch, shoal
    out, kill_at = Path(sys.argv[1]), int(sys.argv[2])
    run = shoal.session(train_steps=30, disp_freq=2, checkpoint_freq=10)
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
        if run.rank != 0 and step > kill_at >= 0:  # the survivors go on slowly until process 0 is back
            deadline = time.time() + 60
            while len(list(out.glob("pid0.*"))) < 2 and time.time() < deadline:
                time.sleep(0.02)
            if not (out / "back").exists():
                time.sleep(0.1)
        target = torch.arange(4.0) * (run.rank + 1) + step  # each process's own gradient: w - target
        loss = 0.5 * ((model.weight[0] - target) ** 2).sum()
        loss.backward()
        opt.step(); opt.zero_grad()
        run.log(step, loss=loss)
    (out / f"rank{run.rank}.json").write_text(json.dumps({"pid": os.getpid(), "first": first, "last": step,
                                                          "weight": model.weight[0].tolist()}))
''')
THREE_PROCESSES = ["--set", "cluster.nworkers_per_group=3", "--set", "cluster.nworkers_per_procs=1"]


def replayed(missed: set[int], steps: int = 30) -> torch.Tensor:
    """The loop's values where process 0's gradient is missing from the steps in `missed` (replicated.py: a step without
    a process is the mean of the gradients of those that came, weighted by their rows: here one row each)."""
    torch.manual_seed(0)
    w = torch.nn.Linear(4, 1, bias=False).weight[0].detach().clone().double()
    for step in range(steps):
        came = [1, 2] if step in missed else [0, 1, 2]
        w -= 0.1 * sum(w - (torch.arange(4.0).double() * (r + 1) + step) for r in came) / len(came)
    return w


@pytest.mark.slow  # (about 6 s: three processes and a restart through a real `python -m shoal run`)
def test_a_killed_chief_is_dropped_and_the_loop_goes_on(tmp_path):
    """--max-restarts under AllReduce in a user's loop: process 0, SIGKILLed at step 4, is dropped like any other
    process: no whole-job restart (processes 1 and 2 keep their pids to the end), process 1 decides the steps and
    continues the run log and the checkpoints, process 0's restarted process rejoins from process 1's state; the values
    are the mean over the processes that came to each step; metrics.jsonl is one log, summary.json finished."""
    script = tmp_path / "chief_dies.py"
    script.write_text(CHIEF_DIES)
    proc = subprocess.run([sys.executable, "-m", "shoal", "run", str(script), "--workspace", str(tmp_path / "ws"),
                           *THREE_PROCESSES, "--max-restarts", "1", "--", str(tmp_path), "4"],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "restarting the whole job" not in proc.stderr
    assert ("WARNING: process 0 (worker(group=0, id=0), server(group=0, id=0)) died (SIGKILL); the other processes go on "
            "without it; restarting it (restart 1 of 1); it rejoins at the next step, from the state of the lowest living "
            "process, which decides the steps now") in proc.stderr.splitlines(), proc.stderr
    ends = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)}
    pids = {r: sorted(int(p.name.split(".")[1]) for p in tmp_path.glob(f"pid{r}.*")) for r in range(3)}
    killed = int((tmp_path / "killed").read_text())
    assert pids[0][0] == killed or pids[0][1] == killed and len(pids[0]) == 2
    assert [ends[r]["pid"] for r in (1, 2)] == [pids[1][0], pids[2][0]] and len(pids[1]) == len(pids[2]) == 1
    assert ends[0]["pid"] != killed and ends[1]["first"] == ends[2]["first"] == 0
    ws = tmp_path / "ws"
    summary = json.loads((ws / "summary.json").read_text())
    back = ends[0]["first"]
    assert summary["status"] == "finished" and summary["steps"] == 30 and "job_restarts" not in summary
    assert summary["missed_steps"] == {"0": {"missed": back - 4, "of": 30, "why": f"missing from steps 4 to {back - 1}, "
                                                                                    f"back at step {back}"}}
    assert [r["rank"] for r in summary["rejoins"]] == [0] and summary["rejoins"][0]["step"] == back
    expected = replayed(set(range(4, back)))
    for r in range(3):  # every replica ends where the replay of that fault schedule does
        assert torch.allclose(torch.tensor(ends[r]["weight"]).double(), expected, rtol=1e-5, atol=1e-5), (r, ends[r], expected)
    records = [json.loads(line) for line in (ws / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [*range(0, 30, 2), 29]  # one log: the chief's, then process 1's
    assert all(b["time"] >= a["time"] for a, b in zip(records, records[1:])) and {r["phase"] for r in records} == {"train"}
    assert sorted(p.name for p in (ws / "checkpoint").iterdir()) == [f"step{s}-worker0.safetensors" for s in (10, 20, 30)]
    log1 = (ws / "logs" / "rank1.log").read_text()
    assert "Step 4 went on without process 0 (died or stopped answering)" in log1
    assert "Process 1 took the chief's place after step 4: it decides the steps, evaluates (run.evaluate), writes the run log and the checkpoints" in log1
    assert f"Process 0 rejoined at step {back}: it took the module's values" in log1 and "from process 1" in log1
    log0 = (ws / "logs" / "rank0.log").read_text()
    assert f"Process 0 rejoined at step {back} (restart 1)" in log0 and "from process 1, after step" in log0
    assert f"Process 0 rejoined at step {back} (restart 1)" not in proc.stdout  # no chief: its lines go to its log
    # the successor's lines reach the terminal too, as the chief's did
    assert "Process 1 took the chief's place after step 4: it decides the steps" in proc.stdout
    assert f"Process 0 rejoined at step {back}: it took the module's values" in proc.stdout
    assert "Train @ step 29" in proc.stdout
