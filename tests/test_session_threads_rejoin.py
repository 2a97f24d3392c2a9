"""AllReduce over processes of several worker threads each under --max-restarts (issue 39 point 2): a killed process
is left out, restarted, and rejoins the running loop, every one of its workers taking the chief's state (the chief hands
over its worker 0's replica, optimizer and scheduler; the restarted process's other workers copy its worker 0's), so
all 4 replicas end equal to the bit; shoal.fit runs the layout on the session, as its job path did, to float rounding.
Driven as a user would: `shoal run script.py --max-restarts 1`, real processes, a real SIGKILL."""
from __future__ import annotations

import copy
import functools
import json
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import shoal
from layouts import Layout, assert_ran
from shoal.frontend import fit as fitting
from shoal.frontend import fit_loop

THREADS_RESTARTS = Layout(dict(nworkers_per_group=4, nworkers_per_procs=2, max_restarts=1), 2, 4, "AllReduce")

REJOINS = textwrap.dedent('''
    import copy, os, signal, sys, time
    from pathlib import Path
    import torch, shoal
    from safetensors.torch import save_file
    out = Path(sys.argv[1])
    torch.manual_seed(0)
    x = torch.randn(96, 8)
    data = torch.utils.data.TensorDataset(x, x[:, :1].clone())
    run = shoal.session(train_steps=40, disp_freq=5)
    (out / f"pid{run.rank}.{os.getpid()}").write_text("")
    initial = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def train(worker):
        model = worker.model(copy.deepcopy(initial))
        opt = worker.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + 0.1 * step))
        for step, (xb, yb) in worker.batches(data, batch_size=12):
            if run.rank == 1 and step == 8 and worker.index == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if run.rank == 0 and step >= 10 and worker.index == 0:  # slowly once process 1 is back: it rejoins mid-run
                deadline = time.time() + 60
                while len(list(out.glob("pid1.*"))) < 2 and time.time() < deadline:
                    time.sleep(0.05)
                time.sleep(0.1)
            loss = ((model(xb) - yb) ** 2).mean()
            loss.backward()
            opt.step(); opt.zero_grad(); sched.step()
            worker.log(step, loss=loss)
        state = {f"param/{k}": v.detach().contiguous() for k, v in model.state_dict().items()}
        state |= {f"adam/{i}/{slot}": v for i, slots in opt.state_dict()["state"].items() for slot, v in slots.items()}
        state["lr"] = torch.tensor(opt.param_groups[0]["lr"])
        save_file(state, str(out / f"rank{run.rank}-worker{worker.index}.safetensors"))
        return step

    print("rank", run.rank, "finished at steps", run.each_worker(train))
''')


@pytest.mark.slow  # (about 6 s: a kill, a restart and a rejoin)
def test_a_killed_process_of_threads_rejoins_every_worker_from_the_chief(tmp_path):
    script = tmp_path / "rejoins.py"
    script.write_text(REJOINS)
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run([sys.executable, "-m", "shoal", "run", str(script), "--workspace", str(tmp_path / "ws"),
                           *THREADS_RESTARTS.cli(), "--", str(out)], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert_ran(tmp_path / "ws", THREADS_RESTARTS)
    assert "rank 0 finished at steps [39, 39]" in proc.stdout and "Step 8 went on without process 1" in proc.stdout
    assert len(list(out.glob("pid1.*"))) == 2  # process 1 ran as two processes
    rejoins = [json.loads(line) for line in (tmp_path / "ws" / "logs" / "rejoins.jsonl").read_text().splitlines()]
    assert len(rejoins) == 1 and rejoins[0]["rank"] == 1 and 10 < rejoins[0]["step"] < 40
    assert f"Process 1 rejoined at step {rejoins[0]['step']}: it took the module's values" in proc.stdout
    assert "rank 1 finished at steps [39, 39]" in (tmp_path / "ws" / "logs" / "rank1.log").read_text()
    ends = [load_file(str(out / f"rank{r}-worker{w}.safetensors")) for r in (0, 1) for w in (0, 1)]
    assert all(set(end) == set(ends[0]) for end in ends) and any(k.startswith("adam/") for k in ends[0])
    for end in ends[1:]:  # params, AdamW's state and the scheduled lr: every replica the chief's, to the bit
        assert all(torch.equal(ends[0][k], end[k]) for k in ends[0])


def test_fit_runs_threads_under_restarts_on_the_session_as_its_job_path(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(80, 6, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long()
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 2))
    fit = functools.partial(shoal.fit, loss_fn=F.cross_entropy, train_data=(x, y), val_data=(x, y), val_freq=3,
                            val_batch=40, steps=8, batch_size=16, optimizer=functools.partial(torch.optim.AdamW, lr=2e-2),
                            cluster=THREADS_RESTARTS.fit_cluster(), log=lambda line: None)
    calls = []
    monkeypatch.setattr(fit_loop, "fit_on_session", lambda *a, _on=fit_loop.fit_on_session, **k: calls.append(1) or _on(*a, **k))
    on_session, on_the_job_path = copy.deepcopy(model), copy.deepcopy(model)
    history = fit(on_session, workspace=tmp_path / "session")
    assert calls == [1]
    assert_ran(tmp_path / "session", THREADS_RESTARTS)
    monkeypatch.setattr(fitting, "ON_SESSION", frozenset())
    job = fit(on_the_job_path, workspace=tmp_path / "job")
    assert calls == [1]
    assert [r["loss"] for r in history.phase("validate")] == pytest.approx([r["loss"] for r in job.phase("validate")],
                                                                           rel=1e-5, abs=1e-6)
    for (name, a), b in zip(on_session.named_parameters(), on_the_job_path.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
