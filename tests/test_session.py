"""shoal.session(): the user's own loop, driven as a user would, through `shoal run script.py` with real processes.

One script (below) is run as one worker, as AllReduce over 2 processes and as DiLoCo over 2 processes; it also runs
the same loop as plain PyTorch (no shoal) on the same rows in the same process, and writes what each loop ended with.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cli_in_process import run_cli
from shoal.frontend.cli import main

LOOP = textwrap.dedent('''
    import json, os, sys
    from pathlib import Path
    import torch, shoal
    from safetensors.torch import save_file

    out, stop_after = Path(sys.argv[1]), int(sys.argv[2])
    torch.manual_seed(0)
    x = torch.randn(96, 8)
    y = (x[:, :4].sum(1, keepdim=True) > x[:, 4:].sum(1, keepdim=True)).float()
    data = torch.utils.data.TensorDataset(x, y)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model.register_parameter("unused", torch.nn.Parameter(torch.ones(3)))  # no loss reaches it: .grad stays None
    STEPS, BATCH = 20, 12

    def schedule(step):
        return 1.0 / (1 + 0.1 * step)

    def loss_of(model, xb, yb):
        return torch.nn.functional.binary_cross_entropy_with_logits(model(xb), yb)

    run = shoal.session(train_steps=STEPS, disp_freq=5)
    if run.rank == 0 and stop_after < 0:  # the same loop, plain PyTorch, on the same rows (the whole batch of each step)
        import copy
        plain = copy.deepcopy(model)
        opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        for step in range(STEPS):
            start = step * BATCH % len(x)
            loss_of(plain, x[start:start + BATCH], y[start:start + BATCH]).backward()
            torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
            opt.step(); opt.zero_grad(); sched.step()
        save_file({k: v.contiguous() for k, v in plain.state_dict().items()}, str(out / "plain.safetensors"))

    model = run.model(model)
    opt = run.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    norms = []
    for step, (xb, yb) in run.batches(data, batch_size=BATCH, shuffle=False):
        loss = loss_of(model, xb, yb)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        opt.step(); opt.zero_grad(); sched.step()
        run.log(step, loss=loss)
        if step == 9:
            run.checkpoint()
        if step == stop_after:
            sys.exit(3)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / f"rank{run.rank}.safetensors"))
    (out / f"rank{run.rank}.json").write_text(json.dumps({"pid": os.getpid(), "norms": norms, "rows": len(xb),
                                                          "label": run.label, "processes": run.processes}))
''')

ALLREDUCE = ["--set", "cluster.nworkers_per_group=2", "--set", "cluster.nworkers_per_procs=1"]
DILOCO = ["--set", "cluster.nworker_groups=2", "--set", "cluster.nworkers_per_procs=1", "--set", "cluster.local_steps=5",
          "--set", "cluster.outer_updater.type=kNesterov", "--set", "cluster.outer_updater.momentum=0.9",
          "--set", "cluster.outer_updater.learning_rate.type=kFixed", "--set", "cluster.outer_updater.learning_rate.base_lr=0.7"]


def shoal_run(script: Path, out: Path, workspace: Path, *options: str, stop_after: int = -1,
              interpreter: bool = False) -> subprocess.CompletedProcess:
    """`shoal run script.py OPTIONS -- OUT STOP_AFTER` in this test process (cli_in_process: no interpreter to start, and
    the ranks of a layout of several fork from this process's forkserver, started once), or with `interpreter` as a
    real `python -m shoal` process (the one that proves what a shell sees)."""
    out.mkdir(parents=True, exist_ok=True)
    args = ["run", str(script), "--workspace", str(workspace), *options, "--", str(out), str(stop_after)]
    if not interpreter:
        return run_cli(*args, cwd=out, timeout=240)
    return subprocess.run([sys.executable, "-m", "shoal", *args], capture_output=True, text=True, timeout=240, cwd=out)


def ended(out: Path, rank: int = 0) -> tuple[dict[str, torch.Tensor], dict]:
    return load_file(str(out / f"rank{rank}.safetensors")), json.loads((out / f"rank{rank}.json").read_text())


def train_losses(workspace: Path) -> list[float]:
    records = [json.loads(line) for line in (workspace / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["phase"] == "train"]


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("session") / "loop.py"
    path.write_text(LOOP)
    return path


# the tests that read the module's runs share one test process (--dist loadgroup), which makes each run once
SHARED_RUNS = pytest.mark.xdist_group("session_runs")


@pytest.fixture(scope="module")
def one_worker(script, tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    proc = shoal_run(script, out, out / "ws")
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="module")
def allreduce(script, tmp_path_factory):
    out = tmp_path_factory.mktemp("allreduce")
    proc = shoal_run(script, out, out / "ws", *ALLREDUCE)
    assert proc.returncode == 0, proc.stderr
    return out


@SHARED_RUNS
def test_one_worker_is_the_plain_loop_bit_for_bit(one_worker):
    """Nothing of the loop changes in one process: the same rows, the same ops, the same values to the bit."""
    values, said = ended(one_worker)
    plain = load_file(str(one_worker / "plain.safetensors"))
    assert said["label"] == "single worker" and said["processes"] == 1
    assert values.keys() == plain.keys() and all(torch.equal(values[k], plain[k]) for k in values)
    losses = train_losses(one_worker / "ws")
    assert len(losses) == 5 and losses[-1] < losses[0]  # steps 0, 5, 10, 15 and the last, in metrics.jsonl


@SHARED_RUNS
def test_allreduce_over_two_processes_is_one_worker(one_worker, allreduce):
    """Each process reads half of each batch; the group's mean gradient makes the replicas equal to one worker with the
    whole batch (within float rounding: the mean of two half-batch means sums in another order)."""
    single, _ = ended(one_worker)
    replica0, said0 = ended(allreduce, 0)
    replica1, said1 = ended(allreduce, 1)
    assert said0["pid"] != said1["pid"] and said0["processes"] == 2 and said0["label"] == "AllReduce"
    for rank, said in ((0, said0), (1, said1)):  # each rank's log names its process, as a job file's does
        assert (f"Worker (group = 0, id = {rank}) start on CPU in process {rank} (pid = {said['pid']})"
                in (allreduce / "ws" / "logs" / f"rank{rank}.log").read_text())
    assert (said0["rows"], said1["rows"]) == (6, 6)  # each process its half of the batch of 12
    assert all(torch.equal(replica0[k], replica1[k]) for k in replica0)  # the replicas are equal to the bit
    assert all(torch.allclose(replica0[k], single[k], rtol=1e-5, atol=1e-6) for k in single)
    # a param no replica computed a gradient for keeps .grad None, as in a plain loop: AdamW's weight decay skips it
    assert torch.equal(replica0["unused"], torch.ones(3)) and torch.equal(single["unused"], torch.ones(3))
    # summary.json's bytes_sent, as fit's: every step's all-reduce of [grads, a flag per param, rows] by both members
    params = [t for k, t in replica0.items()]
    per_member = 4 * (sum(t.numel() for t in params) + len(params) + 1)
    assert json.loads((allreduce / "ws" / "summary.json").read_text())["bytes_sent"] == 20 * 2 * per_member
    # the Train records are the group's, as fit's job path gives them: both halves' losses weighted by their rows (the
    # whole batch's loss, the replicas being equal), not the chief's half; the samples every process trained
    assert train_losses(allreduce / "ws") == pytest.approx(train_losses(one_worker / "ws"), rel=1e-5)
    records = [json.loads(line) for line in (allreduce / "ws" / "metrics.jsonl").read_text().splitlines()]
    assert [r["samples"] for r in records if r["phase"] == "train"] == [12, 60, 60, 60, 48]  # steps 0, 5, 10, 15, 19
    assert all(r["processes"] == 2 for r in records if r["phase"] == "train")


@SHARED_RUNS
def test_clip_grad_norm_sees_the_groups_mean_gradient(one_worker, allreduce):
    """torch's clip_grad_norm_ in the user's loop reads `.grad` after backward: under AllReduce it holds the group's mean,
    so both processes see the norm one worker sees with the whole batch (as under DDP), not their own half's."""
    _, single = ended(one_worker)
    _, said0 = ended(allreduce, 0)
    _, said1 = ended(allreduce, 1)
    assert said0["norms"] == said1["norms"]
    assert said0["norms"] == pytest.approx(single["norms"], rel=1e-5)
    assert max(single["norms"]) > 0.5  # the bound (0.5) clips: what it sees matters


SPARSELOCO = DILOCO[:6] + ["--set", "cluster.sparse_outer_step.chunk_size=64", "--set", "cluster.sparse_outer_step.topk_per_chunk=8"]


@pytest.mark.parametrize("options, label", [(DILOCO, "DiLoCo"), pytest.param(SPARSELOCO, "SparseLoCo", marks=pytest.mark.slow)])
def test_diloco_over_two_processes_trains(script, tmp_path, options, label):
    proc = shoal_run(script, tmp_path, tmp_path / "ws", *options)
    assert proc.returncode == 0, proc.stderr
    values0, said0 = ended(tmp_path, 0)
    values1, said1 = ended(tmp_path, 1)
    assert said0["pid"] != said1["pid"] and said0["label"] == label and said0["processes"] == 2
    assert all(torch.equal(values0[k], values1[k]) for k in values0)  # the last step (20) was a meeting: one anchor
    losses = train_losses(tmp_path / "ws")
    assert losses[-1] < 0.8 * losses[0]


@SHARED_RUNS
def test_checkpoint_then_resume_continues_exactly(script, one_worker, tmp_path):
    """A loop stopped after step 12 (its checkpoint after step 9), resumed with --resume: model, AdamW's moments, the
    LambdaLR's step, the data position and the metrics window come back, and it ends where the uninterrupted run did."""
    # a real interpreter: the script's sys.exit(3) ends its process, as it would a user's (in this test process the
    # workspace would stay taken by the stopped loop)
    stopped = shoal_run(script, tmp_path, tmp_path / "ws", stop_after=12, interpreter=True)
    assert stopped.returncode == 3, stopped.stderr
    assert not (tmp_path / "rank0.safetensors").exists()
    resumed = shoal_run(script, tmp_path, tmp_path / "ws", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    values, _ = ended(tmp_path)
    uninterrupted, _ = ended(one_worker)
    assert all(torch.equal(values[k], uninterrupted[k]) for k in values)
    assert train_losses(tmp_path / "ws")[-3:] == train_losses(one_worker / "ws")[-3:]  # steps 10, 15, 19 as run through


@pytest.mark.parametrize("options, named", [
    (["--set", "cluster.nworker_groups=2", "--set", "cluster.nworkers_per_procs=1", "--set", "cluster.nserver_groups=1",
      "--set", "cluster.server_worker_separate=true", "--set", "device=cuda:0"], "Downpour in your own loop runs on CPU"),
    (["--set", "cluster.nworker_groups=2", "--set", "cluster.nworkers_per_procs=2", "--set", "cluster.local_steps=2",
      "--set", "device=cuda:0"], "Local SGD / DiLoCo's groups in one process run on the CPU in your own loop"),
    (["--set", "cluster.nworker_groups=2", "--set", "cluster.nworkers_per_procs=2", "--set", "device=cpu,cuda:0"],
     "in your own loop computes around one copy of the params, on one device: give every worker the same device, "
     "not cpu, cuda:0"),
])
def test_a_layout_the_loop_cannot_run_is_refused_in_one_line(script, tmp_path, capsys, options, named):
    status = main(["run", str(script), "--workspace", str(tmp_path / "ws"), *options, "--", str(tmp_path), "-1"])
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1, err
    assert named in err and "use a job file (`shoal run job.conf`) or shoal.fit" in err
    assert not (tmp_path / "ws").exists()


def test_plain_python_with_several_processes_is_refused(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text("import shoal\nrun = shoal.session(cluster=shoal.Cluster(nworkers_per_group=2, nworkers_per_procs=1))\n"
                      "print('the loop ran')\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "shoal.session: AllReduce runs 2 processes: start the script with `shoal run plain.py --set cluster.…`, which starts "
        "one process per rank (or with torchrun: `torchrun --nproc-per-node N script.py`, SHOAL_JOB_SECRET set)"]


def test_shoal_plan_plans_the_sessions_job(script, tmp_path, capsys):
    assert main(["plan", str(script), *ALLREDUCE, "--", str(tmp_path), "-1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("job 'session': AllReduce, 2 process(es)")
    assert not list(tmp_path.iterdir())  # the script stopped at shoal.session(): nothing trained, nothing written
    assert main(["plan", str(script), "--estimate", "--", str(tmp_path), "-1"]) == 2  # no net to cost: one line
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "a shoal.session()'s job has no net to estimate" in err


@pytest.mark.slow
def test_diloco_resumes_every_groups_state_exactly(script, tmp_path):
    """Each group's process writes its part (its values, its AdamW moments, its data position; the chief's file the
    anchor and the outer Nesterov state): stopped after step 12 and resumed, the groups end where the uninterrupted
    run's did."""
    through = shoal_run(script, tmp_path / "through", tmp_path / "through" / "ws", *DILOCO)
    assert through.returncode == 0, through.stderr
    stopped = shoal_run(script, tmp_path / "again", tmp_path / "again" / "ws", *DILOCO, stop_after=12, interpreter=True)
    assert stopped.returncode != 0 and "exited with status 3" in stopped.stderr
    assert sorted(p.name for p in (tmp_path / "again" / "ws" / "checkpoint").iterdir()) == [
        "step10-group1-rank1.safetensors", "step10-worker0.safetensors"]
    resumed = shoal_run(script, tmp_path / "again", tmp_path / "again" / "ws", *DILOCO, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    for rank in (0, 1):
        values, _ = ended(tmp_path / "again", rank)
        expected, _ = ended(tmp_path / "through", rank)
        assert all(torch.equal(values[k], expected[k]) for k in values)


REJOINS = textwrap.dedent('''
    import os, signal, sys, time
    from pathlib import Path
    import torch, shoal
    from safetensors.torch import save_file
    out = Path(sys.argv[1])
    torch.manual_seed(0)
    x = torch.randn(96, 8)
    data = torch.utils.data.TensorDataset(x, x[:, :1].clone())
    run = shoal.session(train_steps=40, disp_freq=5)
    (out / f"pid{run.rank}.{os.getpid()}").write_text("")
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(8, 1))
    module.register_parameter("unused", torch.nn.Parameter(torch.ones(3)))  # never a gradient: no AdamW state on the chief
    model = run.model(module)
    opt = run.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + 0.1 * step))
    for step, (xb, yb) in run.batches(data, batch_size=12):
        if run.rank == 1 and step == 8:
            os.kill(os.getpid(), signal.SIGKILL)
        if run.rank == 0 and step >= 10:  # the chief goes on slowly once process 1 is back, so that it rejoins mid-run
            deadline = time.time() + 60
            while len(list(out.glob("pid1.*"))) < 2 and time.time() < deadline:
                time.sleep(0.05)
            time.sleep(0.1)
        loss = ((model(xb) - yb) ** 2).mean()
        loss.backward()
        opt.step(); opt.zero_grad(); sched.step()
        run.log(step, loss=loss)
    state = {f"param/{k}": v.detach().contiguous() for k, v in model.state_dict().items()}
    state |= {f"adam/{i}/{slot}": v for i, slots in opt.state_dict()["state"].items() for slot, v in slots.items()}
    state["lr"] = torch.tensor(opt.param_groups[0]["lr"])
    state["rng"] = torch.rand(4)  # the same stream on both: the restarted process took the chief's RNG state
    save_file(state, str(out / f"rank{run.rank}.safetensors"))
    print("rank", run.rank, "finished at step", step)
''')


@pytest.mark.slow
def test_a_killed_process_is_restarted_into_the_running_loop(tmp_path):
    """--max-restarts under AllReduce: process 1, SIGKILLed at step 8, is left out while the chief trains on, then
    restarted: it runs the script from the top, its session takes the chief's module, AdamW state, scheduler state and
    step at the step it is admitted, and its loop goes on from the next step; both replicas end equal to the bit."""
    script = tmp_path / "rejoins.py"
    script.write_text(REJOINS)
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run([sys.executable, "-m", "shoal", "run", str(script), "--workspace", str(tmp_path / "ws"), *ALLREDUCE,
                           "--max-restarts", "1", "--", str(out)], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "rank 0 finished at step 39" in proc.stdout
    assert "Step 8 went on without process 1" in proc.stdout
    assert len(list(out.glob("pid1.*"))) == 2  # process 1 ran as two processes
    rejoins = [json.loads(line) for line in (tmp_path / "ws" / "logs" / "rejoins.jsonl").read_text().splitlines()]
    assert len(rejoins) == 1 and rejoins[0]["rank"] == 1 and 10 < rejoins[0]["step"] < 40
    back = rejoins[0]["step"]
    assert f"Process 1 rejoined at step {back}: it took the module's values and buffers" in proc.stdout  # the chief's line
    assert "(restart 1)" not in proc.stdout  # one line on the terminal: the chief's
    log = (tmp_path / "ws" / "logs" / "rank1.log").read_text()
    assert f"Process 1 rejoined at step {back} (restart 1): the module's values and buffers" in log
    assert "rank 1 finished at step 39" in log
    summary = json.loads((tmp_path / "ws" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["rejoins"][0]["step"] == back
    assert summary["missed_steps"]["1"]["why"] == f"missing from steps 8 to {back - 1}, back at step {back}"
    ends = [load_file(str(out / f"rank{r}.safetensors")) for r in (0, 1)]
    assert set(ends[0]) == set(ends[1]) and any(k.startswith("adam/") for k in ends[0])
    assert all(torch.equal(ends[0][k], ends[1][k]) for k in ends[0])  # params, AdamW's state, the scheduled lr, the RNG
    assert len({k.split("/")[1] for k in ends[1] if k.startswith("adam/")}) == 4  # of 5 params: the unused one has no state, as in a plain loop
    assert torch.equal(ends[1]["param/unused"], torch.ones(3))
    losses = train_losses(tmp_path / "ws")
    assert losses[-1] < losses[0] / 2


REJOINS_A_MEETING = textwrap.dedent('''
    import os, signal, sys, time
    from pathlib import Path
    import torch, shoal
    from safetensors.torch import save_file
    out = Path(sys.argv[1])
    torch.manual_seed(0)
    x = torch.randn(96, 8)
    data = torch.utils.data.TensorDataset(x, x[:, :1].clone())
    run = shoal.session(train_steps=40, disp_freq=5)
    (out / f"pid{run.rank}.{os.getpid()}").write_text("")
    restarted = len(list(out.glob(f"pid{run.rank}.*"))) > 1
    model = run.model(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(8, 1)))
    opt = run.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + 0.1 * step))

    def state():
        saved = {f"param/{k}": v.detach().clone() for k, v in model.state_dict().items()}
        saved |= {f"adam/{i}/{slot}": v.clone() for i, slots in opt.state_dict()["state"].items() for slot, v in slots.items()}
        return saved | {"lr": torch.tensor(opt.param_groups[0]["lr"]), "rng": torch.get_rng_state()}

    first = None
    for step, (xb, yb) in run.batches(data, batch_size=12):
        if first is None and restarted:  # what it took at the meeting, before its first step
            save_file(state(), str(out / f"joined{step}.safetensors"))
        first = step if first is None else first
        if run.rank == 1 and step == 8 and not restarted:
            os.kill(os.getpid(), signal.SIGKILL)
        if run.rank == 0 and step % 5 == 0:  # the chief's state right after each meeting
            save_file(state(), str(out / f"chief{step}.safetensors"))
        if run.rank == 0 and step >= 10 and not list(out.glob("joined*")):  # the chief goes on slowly until process 1
            time.sleep(0.5)  # has rejoined (it trained a step), so that it rejoins mid-run: its restart, imports and knock
            # have 15 s (the chief must go on meeting meanwhile: a restarted group is admitted at a meeting)
        loss = ((model(xb) - yb) ** 2).mean()
        loss.backward()
        opt.step(); opt.zero_grad(); sched.step()
        run.log(step, loss=loss)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / f"rank{run.rank}.safetensors"))
    print("rank", run.rank, "trained steps", first, "to", step)
''')


@pytest.mark.slow
def test_a_killed_diloco_group_is_restarted_into_the_running_loop(tmp_path):
    """--max-restarts under DiLoCo (H = 5): group 1's process, SIGKILLed at step 8, is left out of the meetings while
    group 0 trains on, then restarted: it runs the script from the top, knocks, and at the next meeting takes the
    anchor, the outer momentum and group 0's module, AdamW state, scheduler state and RNG state; its loop goes on from
    the step after that meeting, and the last meeting leaves both groups equal."""
    script = tmp_path / "rejoins.py"
    script.write_text(REJOINS_A_MEETING)
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run([sys.executable, "-m", "shoal", "run", str(script), "--workspace", str(tmp_path / "ws"), *DILOCO,
                           "--max-restarts", "1", "--", str(out)], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "not restarted" not in proc.stderr
    assert "rank 0 trained steps 0 to 39" in proc.stdout
    pids = sorted(p.name for p in out.glob("pid1.*"))
    assert len(pids) == 2 and len(list(out.glob("pid0.*"))) == 1  # group 1 ran as two processes, the chief as one
    rejoins = [json.loads(line) for line in (tmp_path / "ws" / "logs" / "rejoins.jsonl").read_text().splitlines()]
    assert len(rejoins) == 1 and rejoins[0]["rank"] == 1 and rejoins[0]["group"] == 1
    back = rejoins[0]["step"]
    assert back % 5 == 0 and 10 <= back < 40, back
    assert (f"Worker group 1 rejoined at step {back} (process 1, restart 1): the anchor, the outer updater's state and "
            f"worker group 0's module buffers, optimizers' and schedulers' state and torch's RNG state, after the meeting "
            f"after step {back - 1}") in proc.stdout
    assert f"rank 1 trained steps {back} to 39" in (tmp_path / "ws" / "logs" / "rank1.log").read_text()
    took, chiefs = load_file(str(out / f"joined{back}.safetensors")), load_file(str(out / f"chief{back}.safetensors"))
    assert set(took) == set(chiefs) and any(k.startswith("adam/") for k in took)
    assert [k for k in took if not torch.equal(took[k], chiefs[k])] == []  # params, AdamW's state, the scheduled lr, the RNG
    summary = json.loads((tmp_path / "ws" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["rejoins"][0]["step"] == back
    assert summary["missed_updates"]["1"]["why"].startswith("process 1 was restarted after it exited with code -9; missing from")
    ends = [load_file(str(out / f"rank{r}.safetensors")) for r in (0, 1)]
    assert all(torch.equal(ends[0][k], ends[1][k]) for k in ends[0])  # the last step (40) was a meeting: one anchor
    losses = train_losses(tmp_path / "ws")
    assert losses[-1] < losses[0] / 2


SKIPS_AN_UPDATE = textwrap.dedent('''
    import sys
    from pathlib import Path
    import torch, shoal
    from safetensors.torch import save_file
    out = Path(sys.argv[1])
    torch.manual_seed(0)
    x = torch.randn(96, 8)
    data = torch.utils.data.TensorDataset(x, 2 * x[:, :1])
    run = shoal.session(train_steps=10)
    model = run.model(torch.nn.Linear(8, 1))
    opt = run.optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for step, (xb, yb) in run.batches(data, batch_size=12):
        ((model(xb) - yb) ** 2).mean().backward()
        if not (run.rank == 1 and step == 4):  # as a GradScaler skips a step whose gradients hold inf or NaN
            opt.step()
        opt.zero_grad()
    save_file(dict(model.state_dict()), str(out / f"rank{run.rank}.safetensors"))
''')


def test_a_skipped_update_still_meets(tmp_path):
    """DiLoCo (H = 5): group 1 skips its update at step 4, a meeting's step (a GradScaler's skip): the meeting after it
    still comes, every group at every meeting, and the last meeting leaves both groups equal."""
    script = tmp_path / "skips.py"
    script.write_text(SKIPS_AN_UPDATE)
    proc = run_cli("run", script, "--workspace", tmp_path / "ws", "--no-progress", *DILOCO, "--", tmp_path, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    # the chief's lines are in its log too (the ranks fork from this process's forkserver, whose output is not this test's)
    assert "went on without" not in proc.stdout + proc.stderr + (tmp_path / "ws" / "logs" / "rank0.log").read_text()
    summary = json.loads((tmp_path / "ws" / "summary.json").read_text())
    assert sorted(p.name for p in (tmp_path / "ws" / "logs").glob("rank*.log")) == ["rank0.log", "rank1.log"]  # 2 processes
    assert "missed_updates" not in summary, summary.get("missed_updates")
    ends = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in (0, 1)]
    assert all(torch.equal(ends[0][k], ends[1][k]) for k in ends[0])  # step 10 was a meeting: one anchor


ACCUMULATES = textwrap.dedent('''
    import sys
    from pathlib import Path
    import torch, shoal
    from safetensors.torch import save_file
    out, accumulate = Path(sys.argv[1]), sys.argv[2] == "1"
    torch.manual_seed(0)
    x = torch.randn(96, 8)
    data = torch.utils.data.TensorDataset(x, 2 * x[:, :1])
    run = shoal.session(train_steps=10)
    model = run.model(torch.nn.Linear(8, 1))
    opt = run.optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for step, (xb, yb) in run.batches(data, batch_size=12):
        if accumulate:  # this process's 6 rows as 2 micro-batches of 3: the mean once, after the second
            with run.accumulating():
                (((model(xb[:3]) - yb[:3]) ** 2).mean() / 2).backward()
            (((model(xb[3:]) - yb[3:]) ** 2).mean() / 2).backward()
        else:
            ((model(xb) - yb) ** 2).mean().backward()
        opt.step(); opt.zero_grad()
    save_file(dict(model.state_dict()), str(out / f"rank{run.rank}.safetensors"))
''')


@pytest.mark.slow
def test_gradient_accumulation_takes_the_mean_once(tmp_path):
    """`with run.accumulating(): loss.backward()` adds the micro-batch's gradient without the group's mean (DDP's
    no_sync); the backward after it takes the mean of the sum: the same step as one backward over the rows."""
    script = tmp_path / "accumulates.py"
    script.write_text(ACCUMULATES)
    ends = {}
    for accumulate in ("0", "1"):
        out = tmp_path / accumulate
        out.mkdir()
        proc = subprocess.run([sys.executable, "-m", "shoal", "run", str(script), "--workspace", str(out / "ws"), *ALLREDUCE,
                               "--", str(out), accumulate], capture_output=True, text=True, timeout=240, cwd=out)
        assert proc.returncode == 0, proc.stderr
        ends[accumulate] = load_file(str(out / "rank0.safetensors"))
    assert all(torch.allclose(ends["0"][k], ends["1"][k], rtol=1e-5, atol=1e-7) for k in ends["0"])


@pytest.mark.slow
def test_under_torchrun_each_process_is_a_rank(script, one_worker, tmp_path):
    """torchrun starts the processes (each runs `shoal run script.py`): the session reads its environment as a job file's
    rank does (launcher/launchers.py), joins the world with the job's secret, and AllReduce over its 2 processes ends
    where one worker does."""
    import os
    import secrets

    env = {**os.environ, "SHOAL_JOB_SECRET": secrets.token_hex(32)}
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", f"--log-dir={tmp_path / 'torchrun'}",
                           "-m", "shoal", "run", str(script),
                           "--workspace", str(tmp_path / "ws"), *ALLREDUCE, "--", str(tmp_path), "-1"],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "processes started by torchrun" in proc.stdout
    single, _ = ended(one_worker)
    replica0, said0 = ended(tmp_path, 0)
    replica1, said1 = ended(tmp_path, 1)
    assert said0["pid"] != said1["pid"] and said0["processes"] == 2
    assert all(torch.allclose(replica0[k], single[k], rtol=1e-5, atol=1e-6) for k in single)
    # a param no replica computed a gradient for keeps .grad None, as in a plain loop: AdamW's weight decay skips it
    assert torch.equal(replica0["unused"], torch.ones(3)) and torch.equal(single["unused"], torch.ones(3))
    assert json.loads((tmp_path / "ws" / "summary.json").read_text())["status"] == "finished"


LATE_DEATH = textwrap.dedent('''
    import os, signal, sys, time
    from pathlib import Path
    import torch, shoal

    torch.manual_seed(0)
    x = torch.randn(96, 8); y = x.sum(1, keepdim=True)
    run = shoal.session(train_steps=6, disp_freq=3)
    model = run.model(torch.nn.Linear(8, 1))
    opt = run.optimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    for step, (xb, yb) in run.batches(torch.utils.data.TensorDataset(x, y), batch_size=12):
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        loss.backward(); opt.step(); opt.zero_grad()
    print(f"rank {run.rank} ended at step {step}")  # the loop's names, after it
    if run.rank == 1:
        time.sleep(1)  # the chief has closed the meetings by now
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(2)  # the chief outlives rank 1's death
''')


def test_a_process_that_dies_after_the_last_step_is_not_restarted(tmp_path):
    """A restarted process would run the script from the top and get no step from run.batches() (the meetings are over):
    the code after the user's loop would meet names never bound. The launcher says so instead, in one line."""
    script = tmp_path / "late.py"
    script.write_text(LATE_DEATH)
    proc = run_cli("run", script, "--workspace", tmp_path / "ws", "--no-progress", "--max-restarts", "1", *ALLREDUCE)
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("WARNING")]
    assert warnings == [f"WARNING: process 1 (worker(group=0, id=1)) died (SIGKILL) after the job's last step; not restarted: "
                        f"nothing is left to train (see {tmp_path / 'ws'}/logs/rank1.log)"], proc.stderr
    assert json.loads((tmp_path / "ws" / "summary.json").read_text())["status"] == "finished"
