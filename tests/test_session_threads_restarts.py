"""Downpour's, Local SGD / DiLoCo's, Distributed Hogwild's and Sandblaster's groups of threads over processes under
--max-restarts (issue 39 point 2): a killed process of 2 worker threads is restarted into the running loop, every one
of its threads going on from where its group rejoins (Downpour: the servers' live values in the copy its threads share;
Local SGD: a live group's state at a meeting, Sandblaster: the chief's state at the next step, which worker 0 takes
and its other worker copies; Hogwild: the live values in the copy its threads share, the skipped steps re-trained past
train_steps by every group's threads), and a killed chief's place is taken by the lowest living process, as with one
worker a process (Sandblaster's successor also becomes its servers' stub: runtime/exchanges/sandblaster.py).
Driven as a user would: `shoal run script.py --max-restarts 1`, real processes, a real SIGKILL of one thread's process."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from layouts import LAYOUTS, Layout, assert_ran

DOWNPOUR = Layout({**LAYOUTS["Downpour, 2 groups x 2 threads + 1 server, 3 processes"].cluster, "max_restarts": 1}, 3, 4,
                  "Downpour")
LOCAL_SGD = Layout(dict(nworker_groups=2, nworkers_per_group=2, nworkers_per_procs=2, local_steps=4, max_restarts=1), 2, 4,
                   "Local SGD")
HOGWILD = Layout({**LAYOUTS["Distributed Hogwild, 2 groups x 2 threads"].cluster, "max_restarts": 1}, 2, 4,
                 "Distributed Hogwild")
SANDBLASTER = Layout(dict(nworkers_per_group=4, nworkers_per_procs=2, server_worker_separate=True, max_restarts=1), 3, 4,
                     "Sandblaster")

# process KILLED's worker 1 SIGKILLs it at step 8 (its first incarnation only); the other worker process goes slowly
# from step 10 until the killed one trains again, so that it rejoins mid-run (a loaded machine starts it late)
REJOINS = textwrap.dedent('''
    import copy, json, os, signal, sys, time
    from pathlib import Path
    import torch, shoal
    from safetensors.torch import save_file
    out, killed = Path(sys.argv[1]), int(sys.argv[2])
    torch.manual_seed(0)
    x = torch.randn(96, 8)
    data = torch.utils.data.TensorDataset(x, x[:, :1].clone())
    run = shoal.session(train_steps=40, disp_freq=5)
    (out / f"pid{run.rank}.{os.getpid()}").write_text("")
    initial = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    with torch.no_grad():
        before = float(((initial(x) - x[:, :1]) ** 2).mean())

    def train(worker):
        model = worker.model(copy.deepcopy(initial))
        opt = worker.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + 0.1 * step))
        steps = []
        for step, (xb, yb) in worker.batches(data, batch_size=12):
            if run.rank == killed and step == 8 and worker.index == 1 and len(list(out.glob(f"pid{killed}.*"))) == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if run.rank == killed and len(list(out.glob(f"pid{killed}.*"))) == 2:
                (out / "back").touch()  # (the restarted process trains: it rejoined)
            if run.rank == 1 - killed and step >= 10 and worker.index == 0 and not (out / "back").exists():
                time.sleep(0.3)  # (slowly, not stopped: Local SGD's rejoin needs the next meeting)
            steps.append(step)
            loss = ((model(xb) - yb) ** 2).mean()
            loss.backward()
            opt.step(); opt.zero_grad(); sched.step()
            worker.log(step, loss=loss)
        with torch.no_grad():
            after = float(((model(x) - x[:, :1]) ** 2).mean())
        save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()},
                  str(out / f"rank{run.rank}-worker{worker.index}.safetensors"))
        (out / f"rank{run.rank}-worker{worker.index}.json").write_text(json.dumps(
            dict(steps=steps, before=before, after=after, lr=opt.param_groups[0]["lr"])))

    run.each_worker(train)
''')


@pytest.mark.slow  # (about 6 s each: 2 or 3 processes, a kill, a restart and a rejoin)
@pytest.mark.parametrize("layout, killed", [(DOWNPOUR, 1), (DOWNPOUR, 0), (LOCAL_SGD, 1), (LOCAL_SGD, 0), (HOGWILD, 1),
                                            (HOGWILD, 0), (SANDBLASTER, 1), (SANDBLASTER, 0)],
                         ids=["Downpour, group 1", "Downpour, the chief", "Local SGD, group 1", "Local SGD, the chief",
                              "Distributed Hogwild, group 1", "Distributed Hogwild, the chief", "Sandblaster, process 1",
                              "Sandblaster, the chief"])
def test_a_killed_process_of_threads_rejoins_its_groups_loop(tmp_path, layout, killed):
    script = tmp_path / "rejoins.py"
    script.write_text(REJOINS)
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run([sys.executable, "-m", "shoal", "run", str(script), "--workspace", str(tmp_path / "ws"),
                           *layout.cli(), "--", str(out), str(killed)], capture_output=True, text=True, timeout=240,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    summary = assert_ran(tmp_path / "ws", layout)
    assert summary["status"] == "finished" and "job_restarts" not in summary, summary
    assert len(list(out.glob(f"pid{killed}.*"))) == 2  # the killed process ran as two processes
    rejoins = [json.loads(line) for line in (tmp_path / "ws" / "logs" / "rejoins.jsonl").read_text().splitlines()]
    assert [r["rank"] for r in rejoins] == [killed] and 0 < rejoins[0]["step"] < 40, rejoins
    if killed == 0:  # the lowest living process took the chief's place
        assert summary["chief_succession"][0]["process"] == 1, summary
    ends = {(r, w): json.loads((out / f"rank{r}-worker{w}.json").read_text()) for r in (0, 1) for w in (0, 1)}
    for (rank, _), end in ends.items():  # every thread of the restarted process went on from its group's rejoin
        first = rejoins[0]["step"] if rank == killed else 0
        # (Distributed Hogwild: past step 39, each group's share of the steps the restarted one skipped)
        last = 39 + (rejoins[0]["skipped_steps"][1] - rejoins[0]["skipped_steps"][0] if layout is HOGWILD else 0)
        assert end["steps"] == list(range(first, end["steps"][-1] + 1)) and 39 <= end["steps"][-1] <= last, (rank, end)
        assert end["after"] < end["before"] / 2, end  # learning
    if layout is HOGWILD:
        skipped = rejoins[0]["skipped_steps"]  # [first, past the last): the survivor was at step 10 or later
        assert skipped[1] - skipped[0] >= 2 and summary["steps"] > 40, (skipped, summary)  # re-trained past step 40
    for rank in (0, 1):  # a process's workers in step, their schedulers stepped alike (every process's, but Hogwild's)
        assert ends[rank, 0]["steps"] == ends[rank, 1]["steps"] and ends[rank, 0]["lr"] == ends[rank, 1]["lr"]
    assert layout is HOGWILD or len({end["lr"] for end in ends.values()}) == 1
    values = {key: load_file(str(out / f"rank{key[0]}-worker{key[1]}.safetensors")) for key in ends}
    same = [(0, 0), (0, 1), (1, 0), (1, 1)] if layout in (LOCAL_SGD, SANDBLASTER) else [(killed, 0), (killed, 1)]
    for key in same[1:]:  # Local SGD: every replica the last meeting's anchor; Sandblaster: the servers' values;
        # Downpour, Hogwild: the threads' one copy
        assert all(torch.equal(values[same[0]][k], values[key][k]) for k in values[same[0]]), key
