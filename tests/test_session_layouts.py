"""shoal.session() over the rows of tests/layouts.py: which layouts a user's own loop runs, Distributed Hogwild and
Downpour in it.

Driven as a user would: `shoal plan script.py` / `shoal run script.py --set cluster.…` with real processes. Every row of
the shared layout table is either planned for the loop (its framework and process count) or refused in one line naming
it; Distributed Hogwild's rows train the user's loop (the user's AdamW is each group's local update, the groups sync
every cluster.sync_freq steps), resume from a checkpoint exactly, and a killed group is restarted into the running loop. Downpour's row trains the
user's loop with the user's AdamW running on the server process (built there from plain JSON), its scheduler's lr
carried by every push. Sandblaster's rows (one synchronous group, server processes of its own running the user's AdamW)
train the loop as one worker with the whole batch does, its clip_grad_norm_ the group's global norm; the checkpoint
holds the servers' AdamW state, a resume continues exactly, a killed server heals from the chief's mirror of it in the
running loop, a killed worker process rejoins the running loop, process 0's too (the lowest living one takes the chief's
place and becomes the servers' stub);
with cluster.compression the group's pushes are encoded (fewer bytes in summary.json) and the loop still trains.
"""
from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cli_in_process import run_cli
from fault_runs import runs, summary  # noqa: F401 (runs: the fixture)
from layouts import LAYOUTS, assert_ran
from shoal.frontend.cli import main

# A user's loop. Rank 0 also runs the same loop as plain PyTorch (no shoal) over the first group's rows and writes
# its loss over the whole data set. After the update of step CHECKPOINT (a sync when sync_freq divides CHECKPOINT + 1)
# the processes wait for each other before the checkpoint: from there to the end no group syncs (STEPS < the next
# sync), so the rest of the run is deterministic and a resume from that checkpoint must end where it did, to the bit.
LOOP = textwrap.dedent('''
    import json, sys, time
    from pathlib import Path
    import torch, shoal
    from safetensors.torch import save_file

    out = Path(sys.argv[1])
    torch.manual_seed(0)
    x = torch.randn(192, 8)
    y = (x[:, :4].sum(1, keepdim=True) > x[:, 4:].sum(1, keepdim=True)).float()
    data = torch.utils.data.TensorDataset(x, y)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    STEPS, BATCH, CHECKPOINT = 24, 12, 19

    def loss_of(model, xb, yb):
        return torch.nn.functional.binary_cross_entropy_with_logits(model(xb), yb)

    def schedule(step):
        return 1.0 / (1 + 0.05 * step)

    run = shoal.session(train_steps=STEPS, disp_freq=5)
    if run.rank == 0 and run.step == 0:
        import copy
        plain = copy.deepcopy(model)
        opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        for step in range(STEPS):
            start = step * BATCH % len(x)
            loss_of(plain, x[start:start + BATCH], y[start:start + BATCH]).backward()
            opt.step(); opt.zero_grad(); sched.step()
        with torch.no_grad():
            (out / "plain.json").write_text(json.dumps({"loss": float(loss_of(plain, x, y))}))
    model = run.model(model)
    opt = run.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    with torch.no_grad():
        first = float(loss_of(model, x, y))
    for step, (xb, yb) in run.batches(data, batch_size=BATCH, shuffle=False):
        loss = loss_of(model, xb, yb)
        loss.backward()
        opt.step(); opt.zero_grad(); sched.step()
        run.log(step, loss=loss)
        if step == CHECKPOINT:  # every group synced after this update: wait for the others, then checkpoint
            (out / f"synced{run.rank}").write_text("")
            while len(list(out.glob("synced*"))) < run.processes:
                time.sleep(0.01)
            run.checkpoint()
    with torch.no_grad():
        ended = float(loss_of(model, x, y))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / f"rank{run.rank}.safetensors"))
    (out / f"rank{run.rank}.json").write_text(json.dumps({"first": first, "loss": ended, "label": run.label,
                                                          "processes": run.processes, "syncs": run.exchange.syncs,
                                                          "lr": opt.param_groups[0]["lr"]}))
''')

SYNC_EVERY_5 = ["--set", "cluster.sync_freq=5"]  # syncs after updates 5, 10, 15, 20 of 24
# the rows a user's loop runs (tests/test_session.py runs one worker and AllReduce; this file Distributed Hogwild,
# Downpour and Sandblaster; tests/test_session_workers.py several workers in a process)
RUNS_IN_A_LOOP = {"single worker", "AllReduce, 2 processes", "AllReduce, 2 processes, 2 server slices", "AllReduce, 3 processes",
                  "AllReduce, 3 processes, replicated (max_restarts 1)", "Distributed Hogwild, 2 groups",
                  "Distributed Hogwild, 3 groups", "Downpour, 2 groups + 1 server, 3 processes",
                  "Downpour, 3 groups + 1 server, 4 processes", "Downpour, 2 groups x 2 workers + 2 servers, 6 processes",
                  "Sandblaster, 2 workers + 1 server, 3 processes", "Sandblaster, 2 workers + 2 servers, 4 processes",
                  "Sandblaster, 3 workers + 2 servers, 5 processes",
                  # several workers in a process, one synchronous group (run.each_worker: tests/test_session_workers.py)
                  "in-memory Sandblaster, 2 threads", "in-memory Sandblaster, 3 threads (uneven 11+11+10)",
                  "in-memory Sandblaster, 4 threads", "in-memory Sandblaster, 2 threads, 2 server slices",
                  "AllReduce, 2 processes x 2 threads", "Sandblaster, 2 threads + 2 servers, 3 processes",
                  # asynchronous groups of threads: around an in-process server, or over processes with a server
                  # process (tests/test_session_groups.py)
                  "in-memory Hogwild, 2 groups", "in-memory Hogwild, 3 groups", "in-memory Downpour, 2 groups",
                  "in-memory Hogwild, 2 groups x 2 threads", "Downpour, 2 groups x 2 threads + 1 server, 3 processes",
                  # Distributed Hogwild's groups of threads (tests/test_session_hogwild_threads.py)
                  "Distributed Hogwild, 2 groups x 2 threads"}


def shoal_run(script: Path, out: Path, workspace: Path, *options: str, timeout: int = 240,
              in_process: bool = False) -> subprocess.CompletedProcess:
    """`shoal run script.py OPTIONS -- OUT` as a real `python -m shoal` process (what a shell sees; the ranks' lines on
    its stdout), or with `in_process` in this test process (cli_in_process: no interpreter to start, and the ranks fork
    from this process's forkserver, started once) where a test reads only what the run wrote."""
    out.mkdir(parents=True, exist_ok=True)
    args = ["run", str(script), "--workspace", str(workspace), *options, "--", str(out)]
    if in_process:
        return run_cli(*args, cwd=out, timeout=timeout)
    return subprocess.run([sys.executable, "-m", "shoal", *args], capture_output=True, text=True, timeout=timeout, cwd=out)


def ended(out: Path, rank: int) -> tuple[dict[str, torch.Tensor], dict]:
    return load_file(str(out / f"rank{rank}.safetensors")), json.loads((out / f"rank{rank}.json").read_text())


def train_losses(workspace: Path) -> list[float]:
    records = [json.loads(line) for line in (workspace / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["phase"] == "train"]


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("layouts") / "loop.py"
    path.write_text(LOOP)
    return path


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_row_is_planned_for_the_loop_or_refused_in_one_line(script, tmp_path, capsys, name):
    """`shoal plan script.py` plans the session's job as `shoal run` would: a row the loop runs is planned with its
    framework and processes; any other is refused in one line that names it and says what runs it."""
    layout = LAYOUTS[name]
    status = main(["plan", str(script), *layout.cli(), "--", str(tmp_path)])
    out, err = capsys.readouterr()
    if name in RUNS_IN_A_LOOP:
        assert status == 0, err
        assert out.startswith(f"job 'session': {layout.framework}, {layout.processes} process(es)"), out
    else:
        assert status == 2 and len(err.strip().splitlines()) == 1, err
        assert layout.framework in err and "not supported in your own loop yet" in err and "shoal.fit" in err, err
    assert not list(tmp_path.iterdir())  # the script stopped at shoal.session(): nothing trained, nothing written


def test_distributed_hogwild_on_a_gpu_is_refused_in_one_line(script, tmp_path, capsys):
    """Its syncs go point-to-point over gloo from the module's params, which stay on the host only in a job file's run."""
    status = main(["plan", str(script), *LAYOUTS["Distributed Hogwild, 2 groups"].cli(), "--set", "device=cuda:0",
                   "--", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert status == 2 and err.splitlines() == [err] and "Distributed Hogwild in your own loop runs on CPU" in err


def check_hogwild_trains(out: Path, workspace: Path, row: str) -> None:
    """The row's layout ran (summary.json, a log per process); every group trained (its loss over the whole data set
    fell by half) and synced after updates 5, 10, 15 and 20; each ends within 20 % of the plain one-worker loop's loss
    (each group runs that loop's steps on its own shard, with the others' progress merged at each sync)."""
    assert_ran(workspace, row)
    plain = json.loads((out / "plain.json").read_text())["loss"]
    for rank in range(LAYOUTS[row].processes):
        _, said = ended(out, rank)
        assert said["label"] == "Distributed Hogwild" and said["processes"] == LAYOUTS[row].processes
        assert said["syncs"] == 4 * (LAYOUTS[row].processes - 1), said  # (a sync asks each other group's master)
        assert said["loss"] < 0.5 * said["first"] and said["loss"] < 1.2 * plain, (said, plain)
    losses = train_losses(workspace)
    assert losses[-1] < 0.7 * losses[0]


@pytest.fixture(scope="module")
def hogwild_run(script, tmp_path_factory):
    out = tmp_path_factory.mktemp("hogwild")
    proc = shoal_run(script, out, out / "ws", *LAYOUTS["Distributed Hogwild, 2 groups"].cli(), *SYNC_EVERY_5, in_process=True)
    assert proc.returncode == 0, proc.stderr
    return out


SHARED_RUN = pytest.mark.xdist_group("session_hogwild_run")


@SHARED_RUN
def test_distributed_hogwild_over_two_processes_trains_the_users_loop(hogwild_run):
    check_hogwild_trains(hogwild_run, hogwild_run / "ws", "Distributed Hogwild, 2 groups")
    # each group wrote its part of the checkpoint (its values, its AdamW state, its last syncs), the chief's file lists it
    assert sorted(p.name for p in (hogwild_run / "ws" / "checkpoint").iterdir()) == [
        "step20-group1-rank1.safetensors", "step20-worker0.safetensors"]


@pytest.mark.slow
@SHARED_RUN
def test_distributed_hogwild_resumes_every_groups_state_exactly(script, hogwild_run, tmp_path):
    """The checkpoint after step 19 (a sync, then the groups quiet to the end) resumed in a new workspace: each group
    takes its own part back (its values, AdamW's moments, the scheduler's step, its data position, the values of its
    last syncs and its sync count) and ends where the uninterrupted run's group did, to the bit."""
    workspace = tmp_path / "ws"
    workspace.mkdir()
    shutil.copytree(hogwild_run / "ws" / "checkpoint", workspace / "checkpoint")
    proc = shoal_run(script, tmp_path, workspace, *LAYOUTS["Distributed Hogwild, 2 groups"].cli(), *SYNC_EVERY_5, "--resume")
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "plain.json").exists()  # (resumed at step 20: the script's plain loop did not run)
    for rank in (0, 1):
        values, said = ended(tmp_path, rank)
        expected, through = ended(hogwild_run, rank)
        assert all(torch.equal(values[k], expected[k]) for k in expected)
        assert said["loss"] == through["loss"] and said["lr"] == through["lr"]
        assert said["syncs"] == 0  # none after step 20
    assert train_losses(workspace)[-1] == train_losses(hogwild_run / "ws")[-1]  # step 23's display line


@pytest.mark.slow
def test_distributed_hogwild_over_three_processes_trains_the_users_loop(script, tmp_path):
    proc = shoal_run(script, tmp_path, tmp_path / "ws", *LAYOUTS["Distributed Hogwild, 3 groups"].cli(), *SYNC_EVERY_5)
    assert proc.returncode == 0, proc.stderr
    check_hogwild_trains(tmp_path, tmp_path / "ws", "Distributed Hogwild, 3 groups")


REJOINS = textwrap.dedent('''
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
    opt = run.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + 0.1 * step))
    for step, (xb, yb) in run.batches(data, batch_size=12):
        if run.rank == 1 and step == 12 and len(list(out.glob("pid1.*"))) == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if run.rank == 0 and step == 14:  # the chief waits for group 1 to be back, so that they sync again
            deadline = time.time() + 60
            while not (run.workspace / "logs" / "rejoins.jsonl").exists() and time.time() < deadline:
                time.sleep(0.05)
        loss = ((model(xb) - yb) ** 2).mean()
        loss.backward()
        opt.step(); opt.zero_grad(); sched.step()
        run.log(step, loss=loss)
    (out / f"rank{run.rank}.json").write_text(json.dumps({"lr": opt.param_groups[0]["lr"], "syncs": run.exchange.syncs}))
    print("rank", run.rank, "finished at step", step)
''')


@pytest.mark.slow
def test_a_killed_hogwild_group_is_restarted_into_the_running_loop(tmp_path):
    """--max-restarts: group 1's process, SIGKILLed at step 12, is restarted; it runs the script from the top, its
    session knocks at group 0 at run.batches(), takes the live values and its own slices as of its last sync, and joins
    at its peers' step, its scheduler stepped to it; the two groups sync again and both finish."""
    script = tmp_path / "rejoins.py"
    script.write_text(REJOINS)
    out = tmp_path / "out"
    proc = shoal_run(script, out, tmp_path / "ws", *LAYOUTS["Distributed Hogwild, 2 groups"].cli(), *SYNC_EVERY_5,
                     "--max-restarts", "1")
    assert proc.returncode == 0, proc.stderr
    assert "rank 0 finished at step " in proc.stdout  # 39, and beyond: its share of the steps group 1 skipped
    assert len(list(out.glob("pid1.*"))) == 2  # group 1 ran as two processes
    rejoins = [json.loads(line) for line in (tmp_path / "ws" / "logs" / "rejoins.jsonl").read_text().splitlines()]
    assert len(rejoins) == 1 and rejoins[0]["rank"] == 1 and 10 < rejoins[0]["step"] <= 14  # its peers' (group 0 waits at 14)
    back = rejoins[0]["step"]
    assert rejoins[0]["skipped_steps"] == [10, back]
    assert f"Worker group 1 rejoined at step {back} (process 1, restart 1): the live values of the slices worker group 0 " \
           "masters" in proc.stdout
    shares = {g: (back - 10) // 2 + (g < (back - 10) % 2) for g in (0, 1)}  # the skipped steps, re-trained by both groups
    assert f"rank 0 finished at step {39 + shares[0]}" in proc.stdout
    assert f"rank 1 finished at step {39 + shares[1]}" in (tmp_path / "ws" / "logs" / "rank1.log").read_text()
    said = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert said[0]["lr"] == said[1]["lr"]  # the restarted group's scheduler was stepped to its step
    assert said[1]["syncs"] == (40 + shares[1]) // 5 - back // 5 and said[0]["syncs"] >= 5  # they synced again after step 15
    assert json.loads((tmp_path / "ws" / "summary.json").read_text())["status"] == "finished"
    losses = train_losses(tmp_path / "ws")
    assert losses[-1] < losses[0] / 2


def test_a_downpour_server_rebuilds_the_users_optimizer_from_plain_json_and_follows_its_schedule():
    """Downpour in a user's loop, its pieces: the chief describes its torch optimizer as plain JSON, the
    server builds the same optimizer from it (torch.optim's classes only: a name outside it, or a class of the user's,
    is refused in one line), and a push's hyper-parameter vector puts the user's scheduled lr on the server's groups."""
    from shoal.runtime import session_exchange as se

    def module():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))

    user, server = module(), module()
    named = list(user.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
                             {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}], lr=0.01, betas=(0.8, 0.9))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    recipe = json.loads(json.dumps(se.optimizer_recipe(opt, named)))  # what crosses the wire: JSON, no pickle
    built = se.optimizer_from_recipe(recipe, list(server.named_parameters()))
    assert type(built) is torch.optim.AdamW and len(built.param_groups) == 2
    assert built.param_groups[0]["betas"] == (0.8, 0.9) and built.param_groups[1]["weight_decay"] == 0.0
    # the same update on both sides, step after step, with the user's schedule carried in each push's vector
    x = torch.randn(8, 4)
    for _ in range(3):
        for m, o in ((user, opt), (server, built)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
        se.set_hyper(built, se.hyper_vector(opt))
        opt.step(); built.step(); sched.step()
    assert built.param_groups[0]["lr"] == 0.01 * 0.5 ** 2
    for a, b in zip(user.parameters(), server.parameters()):
        assert torch.equal(a, b)
    assert se.hyper_size(built) == se.hyper_vector(opt).numel()
    for name in ("Optimizer", "os.system", "lr_scheduler", 3):
        with pytest.raises(se.RecipeError, match="not one of torch.optim's optimizers"):
            se.optimizer_from_recipe(dict(recipe, **{"class": name}), named)

    class Mine(torch.optim.SGD):
        pass

    with pytest.raises(se.RecipeError, match="torch.optim's optimizers and shoal.SingaOptimizer only, not test_session_layouts.Mine"):
        se.optimizer_recipe(Mine(user.parameters(), lr=0.1), named)


# Downpour: the server process never runs the loop (its shoal.session() serves, then ends the script). Every group
# starts from the chief's values (they wait for each other before their first push): group 1's own differ before the
# loop and must not matter. From step FREEZE the user's LambdaLR sets lr = 0: the groups wait for each other there
# (every push of an earlier step answered), so the server's
# values after the chief's push of step FREEZE are final only if each push's lr reached the server's AdamW.
DOWNPOUR = textwrap.dedent('''
    import json, os, sys, time
    from pathlib import Path
    import torch, shoal
    from safetensors.torch import save_file

    out = Path(sys.argv[1])
    (out / f"pid{os.getpid()}").write_text("")  # every process runs the script from the top
    torch.manual_seed(0)
    x = torch.randn(192, 8)
    y = (x[:, :4].sum(1, keepdim=True) > x[:, 4:].sum(1, keepdim=True)).float()
    data = torch.utils.data.TensorDataset(x, y)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    STEPS, BATCH, FREEZE = 24, 12, 16

    def loss_of(model, xb, yb):
        return torch.nn.functional.binary_cross_entropy_with_logits(model(xb), yb)

    def schedule(step):
        return 1.0 if step < FREEZE else 0.0

    def meet(name):  # every group's process here, before its push of this step
        (out / f"{name}{run.rank}").write_text("")
        while len(list(out.glob(f"{name}*"))) < run.plan.nworkers:
            time.sleep(0.01)

    run = shoal.session(train_steps=STEPS, disp_freq=5)
    (out / f"session{run.rank}").write_text("")  # (not the server's: its shoal.session() serves, then ends the script)
    if run.rank == 0:
        import copy
        plain = copy.deepcopy(model)
        opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        for step in range(STEPS):
            start = step * BATCH % len(x)
            loss_of(plain, x[start:start + BATCH], y[start:start + BATCH]).backward()
            opt.step(); opt.zero_grad(); sched.step()
        with torch.no_grad():
            (out / "plain.json").write_text(json.dumps({"loss": float(loss_of(plain, x, y))}))
    else:
        with torch.no_grad():
            model[0].weight.add_(1.0)  # not the chief's: the servers' values replace it
    model = run.model(model)
    opt = run.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    for step, (xb, yb) in run.batches(data, batch_size=BATCH):
        if step == 0:  # (nobody pushed yet: group 1 pulled the values the chief's FIRST gave the server)
            with torch.no_grad():
                first = float(loss_of(model, x, y))
            meet("first")
        if step == FREEZE:  # every push of an earlier step answered
            meet("freeze")
        loss = loss_of(model, xb, yb)
        loss.backward()
        opt.step(); opt.zero_grad(); sched.step()
        run.log(step, loss=loss)
        if step == FREEZE and run.rank == 0:
            save_file({k: v.clone() for k, v in model.state_dict().items()}, str(out / "frozen.safetensors"))
    with torch.no_grad():
        ended = float(loss_of(model, x, y))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / f"rank{run.rank}.safetensors"))
    (out / f"rank{run.rank}.json").write_text(json.dumps({"first": first, "loss": ended, "label": run.label,
                                                          "processes": run.processes, "lr": opt.param_groups[0]["lr"]}))
''')


def test_downpour_over_three_processes_trains_the_users_loop_on_its_server(tmp_path):
    """2 groups + 1 server process through `shoal run script.py`: the server process ran the script only to
    shoal.session() (no result of the loop from it), built the user's AdamW from the chief's plain-JSON recipe and applied
    both groups' 24 pushes; each group started from the chief's values; the loss fell, ending within 25 % of the plain
    one-worker loop's; and the user's LambdaLR reached the server: from step 16 (lr = 0) the values never changed again."""
    script = tmp_path / "downpour.py"
    script.write_text(DOWNPOUR)
    row = "Downpour, 2 groups + 1 server, 3 processes"
    out, workspace = tmp_path / "out", tmp_path / "ws"
    proc = shoal_run(script, out, workspace, *LAYOUTS[row].cli())
    assert proc.returncode == 0, proc.stderr
    assert_ran(workspace, row)
    # the launcher and each of the 3 processes ran the script from the top; the server's ended at shoal.session()
    assert len(list(out.glob("pid*"))) == 4
    assert sorted(p.name for p in out.glob("session*")) == ["session0", "session1"]
    server_log = (workspace / "logs" / "rank2.log").read_text()
    assert "server(group=0, id=0): version 48; updates applied: group 0: 24, group 1: 24" in server_log
    assert server_log.startswith("Server (group = 0, id = 0) start in process 2: "), server_log  # (as a job file's says)
    plain = json.loads((out / "plain.json").read_text())["loss"]
    said = [ended(out, rank)[1] for rank in (0, 1)]
    assert said[0]["first"] == said[1]["first"]  # group 1 started from the chief's values, not its own
    for one in said:
        assert one["label"] == "Downpour" and one["processes"] == 3 and one["lr"] == 0.0
        assert one["loss"] < 0.5 * one["first"] and one["loss"] < 1.25 * plain, (said, plain)
    frozen, final = load_file(str(out / "frozen.safetensors")), ended(out, 0)[0]
    assert all(torch.equal(frozen[k], final[k]) for k in final)  # lr 0 travelled with every push from step 16
    losses = train_losses(workspace)
    assert losses[-1] < 0.7 * losses[0]


# --max-restarts: the chief SIGKILLs the server process at step 12 (its pid, written before shoal.session() from the
# rank's context), or group 1's process kills itself there; the launcher restarts it; the script runs from the top in
# the new process: a server's shoal.session() waits for the chief's HEAL (its values and its mirror of the updater
# state), a group's run.batches() pulls the servers' live values and the steps it had done.
DOWNPOUR_RESTARTS = textwrap.dedent('''
    import json, os, signal, sys, time
    from pathlib import Path
    import torch, shoal
    from shoal.frontend.session_start import rank_context

    out = Path(sys.argv[1])
    victim = (out / "victim").read_text()
    if rank_context() is not None:
        (out / f"rank{rank_context().rank}.{os.getpid()}").write_text(str(os.getpid()))
    torch.manual_seed(0)
    x = torch.randn(192, 8)
    y = (x[:, :4].sum(1, keepdim=True) > x[:, 4:].sum(1, keepdim=True)).float()
    data = torch.utils.data.TensorDataset(x, y)
    run = shoal.session(train_steps=40, disp_freq=5)
    model = run.model(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
    opt = run.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + 0.05 * step))
    for step, (xb, yb) in run.batches(data, batch_size=12):
        if step == 12 and run.rank == 0 and victim == "server":
            os.kill(int(next(out.glob("rank2.*")).read_text()), signal.SIGKILL)
        if step == 12 and run.rank == 1 and victim == "group1" and len(list(out.glob("rank1.*"))) == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(xb), yb)
        loss.backward()
        opt.step(); opt.zero_grad(); sched.step()
        run.log(step, loss=loss)
    (out / f"end{run.rank}.json").write_text(json.dumps({"lr": opt.param_groups[0]["lr"], "step": step}))
''')


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["server", "group1"])
def test_a_killed_downpour_process_is_restarted_into_the_running_loop(tmp_path, victim):
    """--max-restarts 1 under Downpour in a user's loop: the killed server process (or group 1's) is restarted and runs
    the script from the top; the server heals from the chief's mirror (one line on the terminal, a record in
    rejoins.jsonl), the group pulls the servers' live values and steps its scheduler to its step; both groups finish
    all 40 steps with the scheduler's last lr, and the loss falls."""
    script = tmp_path / "restarts.py"
    script.write_text(DOWNPOUR_RESTARTS)
    out, workspace = tmp_path / "out", tmp_path / "ws"
    out.mkdir()
    (out / "victim").write_text(victim)
    proc = shoal_run(script, out, workspace, *LAYOUTS["Downpour, 2 groups + 1 server, 3 processes"].cli(), "--max-restarts", "1")
    assert proc.returncode == 0, proc.stderr
    rank = 2 if victim == "server" else 1
    assert len(list(out.glob(f"rank{rank}.*"))) == 2  # it ran as two processes
    rejoins = [json.loads(line) for line in (workspace / "logs" / "rejoins.jsonl").read_text().splitlines()]
    assert len(rejoins) == 1 and rejoins[0]["rank"] == rank
    if victim == "server":
        assert "server(group=0, id=0) (process restart 1) healed from worker group 0's mirror" in proc.stdout
    else:
        assert rejoins[0]["step"] > 0 and "Worker group 1 rejoined at step" in proc.stdout
    for r in (0, 1):
        said = json.loads((out / f"end{r}.json").read_text())
        assert said["step"] == 39 and said["lr"] == pytest.approx(0.01 / (1 + 0.05 * 40))
    assert json.loads((workspace / "summary.json").read_text())["status"] == "finished"
    losses = train_losses(workspace)
    assert losses[-1] < 0.6 * losses[0]


# Sandblaster: one synchronous group over processes, its servers in processes of their own that run the user's AdamW
# (built from its plain-JSON recipe, its LambdaLR's lr carried by every push). The loop clips the gradient's norm to
# CLIP, which every step reaches: only the group's global norm (the group's mean gradient in every process's .grad when
# backward ends, as under DDP) gives what one worker on the whole batch gets.
SANDBLASTER = textwrap.dedent('''
    import json, os, sys, time
    from pathlib import Path
    import torch, shoal
    from safetensors.torch import save_file

    out = Path(sys.argv[1])
    (out / f"pid{os.getpid()}").write_text("")  # every process runs the script from the top
    pause = float(os.environ.get("SANDBLASTER_STEP_PAUSE", "0"))  # (a run that outlasts a kill)
    torch.manual_seed(0)
    x = torch.randn(192, 8)
    y = (x[:, :4].sum(1, keepdim=True) > x[:, 4:].sum(1, keepdim=True)).float()
    data = torch.utils.data.TensorDataset(x, y)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    STEPS, BATCH, CHECKPOINT, CLIP = 24, 12, 15, 0.05

    run = shoal.session(train_steps=STEPS, disp_freq=5)
    (out / f"session{run.rank}").write_text("")  # (not a server's: its shoal.session() serves, then ends the script)
    model = run.model(model)
    opt = run.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + 0.05 * step))
    for step, (xb, yb) in run.batches(data, batch_size=BATCH, shuffle=False):
        time.sleep(pause)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(xb), yb)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step(); opt.zero_grad(); sched.step()
        run.log(step, loss=loss)
        if step == CHECKPOINT:
            run.checkpoint()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / f"rank{run.rank}.safetensors"))
    (out / f"rank{run.rank}.json").write_text(json.dumps({"label": run.label, "processes": run.processes,
                                                          "lr": opt.param_groups[0]["lr"]}))
''')
SANDBLASTER_ROW = "Sandblaster, 2 workers + 1 server, 3 processes"


def plain_sandblaster_loop(workers: int = 1):
    """SANDBLASTER's loop as plain PyTorch on one worker (the whole batch of each step), or as `workers` workers that
    each clip their own share's gradient (what a local clip would give): (values, AdamW's state after step 15, lr)."""
    torch.manual_seed(0)
    x = torch.randn(192, 8)
    y = (x[:, :4].sum(1, keepdim=True) > x[:, 4:].sum(1, keepdim=True)).float()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + 0.05 * step))
    names = {p: n for n, p in model.named_parameters()}
    for step in range(24):
        rows = torch.arange(step * 12, step * 12 + 12) % len(x)
        summed = None
        for share in rows.chunk(workers):
            torch.nn.functional.binary_cross_entropy_with_logits(model(x[share]), y[share]).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            grads = [p.grad * len(share) / 12 for p in model.parameters()]
            summed = grads if summed is None else [a + b for a, b in zip(summed, grads)]
            opt.zero_grad()
        for p, g in zip(model.parameters(), summed):
            p.grad = g
        opt.step(); opt.zero_grad(); sched.step()
        if step == 15:
            state = {f"{names[p]}/{slot}": v.clone() for p, slots in opt.state.items() for slot, v in slots.items()}
    return {k: v.clone() for k, v in model.state_dict().items()}, state, opt.param_groups[0]["lr"]


@pytest.fixture(scope="module")
def sandblaster_run(tmp_path_factory):
    where = tmp_path_factory.mktemp("sandblaster")
    script = where / "sandblaster.py"
    script.write_text(SANDBLASTER)
    proc = shoal_run(script, where / "out", where / "ws", *LAYOUTS[SANDBLASTER_ROW].cli(), in_process=True)
    assert proc.returncode == 0, proc.stderr
    return where


SANDBLASTER_RUN = pytest.mark.xdist_group("session_sandblaster_run")


@SANDBLASTER_RUN
def test_sandblaster_with_server_processes_trains_the_users_loop_as_one_worker(sandblaster_run):
    """2 workers + 1 server process through `shoal run script.py`: the server ran the script only to shoal.session(),
    built the user's AdamW from the chief's recipe and applied one update per step, each the whole group's gradient
    clipped to the group's global norm; both workers end equal to plain PyTorch on one worker with the same 12 rows a
    step (and the scheduler's lr), which workers clipping their own gradients do not; the chief's checkpoint holds the
    server's AdamW state, equal to the one-worker optimizer's."""
    out, workspace = sandblaster_run / "out", sandblaster_run / "ws"
    assert_ran(workspace, SANDBLASTER_ROW)  # 3 processes, 2 workers, Sandblaster, a log per process
    assert len(list(out.glob("pid*"))) == 4  # the launcher and each process ran the script from the top ...
    assert sorted(p.name for p in out.glob("session*")) == ["session0", "session1"]  # ... the server's to shoal.session()
    assert "server(group=0, id=0): version 24; updates applied: group 0: 24" in (workspace / "logs" / "rank2.log").read_text()
    values, state, lr = plain_sandblaster_loop()
    clipped_apart = plain_sandblaster_loop(workers=2)[0]
    assert max((clipped_apart[k] - values[k]).abs().max() for k in values) > 1e-4  # the test tells the two clips apart
    for rank in (0, 1):
        got, said = ended(out, rank)
        assert said["label"] == "Sandblaster" and said["processes"] == 3 and said["lr"] == lr
        for key, value in values.items():
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6)
    assert sorted(p.name for p in (workspace / "checkpoint").iterdir()) == ["step16-worker0.safetensors"]
    from shoal.neuralnet import checkpoint as ckpt_io

    saved = ckpt_io.load(workspace / "checkpoint" / "step16-worker0.safetensors", parts=True).exchange
    for key, value in state.items():  # the servers' AdamW moments and step counts, gathered by the chief
        torch.testing.assert_close(saved[f"updater/{key}"].reshape(value.shape), value, rtol=1e-4, atol=1e-7)


@pytest.mark.slow
@SANDBLASTER_RUN
def test_sandblaster_resumes_the_servers_optimizer_exactly(sandblaster_run, tmp_path):
    """The checkpoint after step 15 resumed in a new workspace: the chief's FIRST hands the server the checkpoint's
    AdamW state with the values, the schedulers and the data position come back, and both workers end where the
    uninterrupted run did, to the bit."""
    workspace = tmp_path / "ws"
    workspace.mkdir()
    shutil.copytree(sandblaster_run / "ws" / "checkpoint", workspace / "checkpoint")
    proc = shoal_run(sandblaster_run / "sandblaster.py", tmp_path / "out", workspace, *LAYOUTS[SANDBLASTER_ROW].cli(), "--resume")
    assert proc.returncode == 0, proc.stderr
    assert "server(group=0, id=0): version 24; updates applied: group 0: 8" in (workspace / "logs" / "rank2.log").read_text()
    for rank in (0, 1):
        values, said = ended(tmp_path / "out", rank)
        expected, through = ended(sandblaster_run / "out", rank)
        assert all(torch.equal(values[k], expected[k]) for k in expected) and said["lr"] == through["lr"]
    assert train_losses(workspace)[-1] == train_losses(sandblaster_run / "ws")[-1]


def _kill_a_sandblaster_loop_process(sandblaster_run, tmp_path, runs, rank):
    """The Sandblaster loop under --max-restarts 1 with a checkpoint every 4 steps, process `rank` SIGKILLed at step 5;
    its run, output folder, stdout, stderr and WARNING lines once it finished."""
    out = tmp_path / "out"
    out.mkdir()
    run = runs.start(sandblaster_run / "sandblaster.py", tmp_path, *LAYOUTS[SANDBLASTER_ROW].cli(), "--set", "checkpoint_freq=4",
                     "--max-restarts", "1", "--", str(out), env={"SANDBLASTER_STEP_PAUSE": "0.2"})
    run.signal(rank, signal.SIGKILL, step=5, registry=True)
    stdout, stderr = run.finished()
    return run, out, stdout, stderr, [line for line in stderr.splitlines() if line.startswith("WARNING")]


@pytest.mark.slow
@SANDBLASTER_RUN
def test_a_killed_sandblaster_server_is_restarted_into_the_running_loop(sandblaster_run, tmp_path, runs):
    """--max-restarts 1: the server process, SIGKILLed mid-run, is restarted into the running loop (it runs the script
    to shoal.session(), rebuilds the user's AdamW from the chief's recipe) and heals from the chief's mirror of its
    AdamW state; the worker processes keep their pids, nothing is read from a checkpoint, both end equal to each other
    and near the uninterrupted run (the push of the step it died in and the state's last < 4 steps are lost)."""
    run, out, stdout, stderr, warning = _kill_a_sandblaster_loop_process(sandblaster_run, tmp_path, runs, 2)
    assert warning == ["WARNING: process 2 (server(group=0, id=0)) died (SIGKILL); restarting it (restart 1 of 1); it "
                       "heals from worker group 0's mirror of its state, the other processes wait for it"], stderr
    assert "restarting the whole job" not in stderr and "the whole job restarted" not in stdout, stderr
    assert "server(group=0, id=0) (process restart 1) healed from worker group 0's mirror: its values of version " in stdout
    got = summary(run.ws)
    assert got["status"] == "finished" and "job_restarts" not in got, got
    (record,) = got["rejoins"]
    assert (record["server"], record["rank"], record["incarnation"]) == (0, 2, 1), record
    assert len(list(out.glob("pid*"))) == 1 + 3 + 1  # the launcher, 3 processes, the server's restarted one
    assert sorted(p.name for p in out.glob("session*")) == ["session0", "session1"]  # the worker processes ran once
    (first, _), (second, _) = ended(out, 0), ended(out, 1)
    expected = ended(sandblaster_run / "out", 0)[0]
    assert all(torch.equal(first[k], second[k]) for k in first)  # one model: both installed the healed server's answers
    assert max((first[k] - expected[k]).abs().max() for k in expected) < 0.05  # a step's update lost, not the run


@pytest.mark.slow
@SANDBLASTER_RUN
@pytest.mark.parametrize("compression", [["cluster.compression=kBF16"],
                                         ["cluster.compression=kTopK", "cluster.topk_fraction=0.1"]], ids=["bf16", "topk"])
def test_sandblaster_in_the_users_loop_compresses_its_pushes(sandblaster_run, tmp_path, compression):
    """--set cluster.compression=…: the group's push to the server is encoded (error feedback at the stub), the values
    the server sends back stay float32. The loop trains (the loss falls, the server applied every step's update), both
    workers end equal to each other but not to the dense run (the server applied the decoded gradient), and
    summary.json's bytes_sent is below the dense run's by what the encoding saved on the pushes. A resume from the
    checkpoint after step 15 (the stub's residual in it) ends where the uninterrupted run did."""
    out, workspace = tmp_path / "out", tmp_path / "ws"
    settings = [flag for setting in compression for flag in ("--set", setting)]
    proc = shoal_run(sandblaster_run / "sandblaster.py", out, workspace, *LAYOUTS[SANDBLASTER_ROW].cli(), *settings)
    assert proc.returncode == 0, proc.stderr
    assert_ran(workspace, SANDBLASTER_ROW)
    assert "server(group=0, id=0): version 24; updates applied: group 0: 24" in (workspace / "logs" / "rank2.log").read_text()
    losses = train_losses(workspace)
    assert losses[-1] < 0.8 * losses[0], losses
    (first, said), (second, _) = ended(out, 0), ended(out, 1)
    dense = ended(sandblaster_run / "out", 0)[0]
    assert all(torch.equal(first[k], second[k]) for k in first)  # one model: both installed the server's answers
    assert not all(torch.equal(first[k], dense[k]) for k in dense)  # the server applied the decoded, not the dense, push
    assert said["label"] == "Sandblaster" and said["lr"] == ended(sandblaster_run / "out", 0)[1]["lr"]
    sent, dense_sent = summary(workspace)["bytes_sent"], summary(sandblaster_run / "ws")["bytes_sent"]
    floats = sum(v.numel() for v in dense.values())  # a dense step: the push and the answer, float32
    assert dense_sent == 24 * 2 * 4 * floats
    if "kBF16" in compression[0]:
        assert sent == 24 * (2 + 4) * floats  # the push in bf16, the answer in float32
    else:
        assert sent == 24 * (6 * math.ceil(0.1 * floats) + 4 * floats)  # the 10 % top-k entries at 6 bytes, the answer
    # the chief's checkpoint after step 15 holds the stub's residual (what the encoding left out) and the byte count:
    # resumed, the run ends where the uninterrupted one did, to the bit, and counts the same bytes
    resumed = tmp_path / "resumed"
    (resumed / "ws").mkdir(parents=True)
    shutil.copytree(workspace / "checkpoint", resumed / "ws" / "checkpoint", ignore=shutil.ignore_patterns("step24*"))
    proc = shoal_run(sandblaster_run / "sandblaster.py", resumed / "out", resumed / "ws", *LAYOUTS[SANDBLASTER_ROW].cli(),
                     *settings, "--resume")
    assert proc.returncode == 0, proc.stderr
    again = ended(resumed / "out", 0)[0]
    assert all(torch.equal(again[k], first[k]) for k in first)
    assert summary(resumed / "ws")["bytes_sent"] == sent


@pytest.mark.slow
@SANDBLASTER_RUN
def test_a_killed_sandblaster_worker_rejoins_the_running_loop(sandblaster_run, tmp_path, runs):
    """--max-restarts 1: worker process 1, SIGKILLed mid-run, is left out of the next steps (the servers apply process
    0's clipped gradient alone), restarted, takes process 0's loop state (its scheduler's too) and rejoins the running
    loop (tests/test_sandblaster_loop_faults.py replays it exactly); nothing is read from a checkpoint, the other
    processes keep their pids, both workers end equal to each other and near the uninterrupted run."""
    run, out, stdout, stderr, warning = _kill_a_sandblaster_loop_process(sandblaster_run, tmp_path, runs, 1)
    assert warning == ["WARNING: process 1 (worker(group=0, id=1)) died (SIGKILL); the other processes go on without it; "
                       "restarting it (restart 1 of 1); it rejoins at the next step, from process 0's state"], stderr
    assert "restarting the whole job" not in stderr and "the whole job restarted" not in stdout, stderr
    got = summary(run.ws)
    assert got["status"] == "finished" and "job_restarts" not in got, got
    assert [r["rank"] for r in got["rejoins"]] == [1] and list(got["missed_steps"]) == ["1"]
    assert len(list(out.glob("pid*"))) == 1 + 3 + 1  # the launcher, 3 processes, process 1's restarted one
    (first, said), (second, _) = ended(out, 0), ended(out, 1)
    expected, through = ended(sandblaster_run / "out", 0)
    assert all(torch.equal(first[k], second[k]) for k in first)  # one model: both took the servers' values
    assert said["lr"] == through["lr"]  # (the restarted one's scheduler took process 0's position)
    assert max((first[k] - expected[k]).abs().max() for k in expected) < 0.05  # half the batch on a few steps


@pytest.mark.slow
@SANDBLASTER_RUN
def test_a_killed_sandblaster_chief_is_replaced_in_the_running_loop(sandblaster_run, tmp_path, runs):
    """--max-restarts 1: process 0 (the servers' one stub and the keeper of their mirror), SIGKILLed mid-run, is left out
    like any worker process: process 1 takes its place (the run log, the checkpoints, the servers' stub: each step's
    mean applied once, the AdamW moments going on at the server) and process 0, restarted, takes process 1's loop state
    and rejoins; nothing is read from a checkpoint, process 1 and the server keep their pids, both workers end equal to
    each other and near the uninterrupted run (tests/test_sandblaster_chief_death.py replays such a schedule exactly)."""
    run, out, stdout, stderr, warning = _kill_a_sandblaster_loop_process(sandblaster_run, tmp_path, runs, 0)
    assert warning == ["WARNING: process 0 (worker(group=0, id=0)) died (SIGKILL); the other processes go on without it; "
                       "restarting it (restart 1 of 1); it rejoins at the next step, from the state of the lowest living "
                       "process, which decides the steps and pushes to the servers now"], stderr
    assert "restarting the whole job" not in stderr and "the whole job restarted" not in stdout, stderr
    assert "Process 1 took the chief's place after step " in stdout and "Process 1 connected to the servers" in stdout
    got = summary(run.ws)
    assert got["status"] == "finished" and "job_restarts" not in got, got
    assert got["chief_succession"][0]["process"] == 1 and [r["rank"] for r in got["rejoins"]] == [0], got
    assert len(list(out.glob("pid*"))) == 1 + 3 + 1  # the launcher, 3 processes, process 0's restarted one
    (first, said), (second, _) = ended(out, 0), ended(out, 1)
    expected, through = ended(sandblaster_run / "out", 0)
    assert all(torch.equal(first[k], second[k]) for k in first)  # one model: both took the servers' values
    assert said["lr"] == through["lr"]  # (the restarted one's scheduler took process 1's position)
    assert max((first[k] - expected[k]).abs().max() for k in expected) < 0.05  # half the batch on a few steps


@pytest.mark.slow
def test_sandblaster_over_three_workers_and_two_servers_trains_as_one_worker(tmp_path):
    """3 workers (4 rows each) + 2 server processes, each server updating its slices of every param with its own
    AdamW built from the recipe: the workers end equal to one worker on the whole batch."""
    row = "Sandblaster, 3 workers + 2 servers, 5 processes"
    script = tmp_path / "sandblaster.py"
    script.write_text(SANDBLASTER)
    proc = shoal_run(script, tmp_path / "out", tmp_path / "ws", *LAYOUTS[row].cli())
    assert proc.returncode == 0, proc.stderr
    assert_ran(tmp_path / "ws", row)
    values, _, lr = plain_sandblaster_loop()
    for rank in (0, 1, 2):
        got, said = ended(tmp_path / "out", rank)
        assert said["label"] == "Sandblaster" and said["processes"] == 5 and said["lr"] == lr
        for key, value in values.items():
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6)
