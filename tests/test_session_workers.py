"""Several workers in one process in a user's loop: `run.each_worker(train)` runs the loop's body once per worker, each
in a thread of its own, driven as a user would through `shoal run script.py --set cluster.…` (the rows of
tests/layouts.py). The group's workers train as one worker with the whole batch (to float rounding, as fit's layouts
do), every replica ends equal to the bit, the layout really ran (its summary, one thread per worker, their rows), and a
resume from a checkpoint ends where the uninterrupted run did, to the bit.
"""
from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cli_in_process import one_line_error, run_cli
from layouts import LAYOUTS, assert_ran

# The user's loop as a function of its worker. The launching rank also trains the same loop as plain PyTorch, one
# worker with the whole batch of each step, once per output folder.
LOOP = textwrap.dedent('''
    import copy, json, sys, threading
    from pathlib import Path
    import torch, shoal
    from safetensors.torch import save_file

    out = Path(sys.argv[1])
    torch.manual_seed(0)
    x = torch.randn(96, 8)
    y = (x[:, :4].sum(1, keepdim=True) > x[:, 4:].sum(1, keepdim=True)).float()
    data = torch.utils.data.TensorDataset(x, y)
    STEPS, BATCH = 20, 12

    # built before the threads start: they share torch's global generator, drawing from it in any order
    initial = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def schedule(step):
        return 1.0 / (1 + 0.1 * step)

    def loss_of(model, xb, yb):
        return torch.nn.functional.binary_cross_entropy_with_logits(model(xb), yb)

    run = shoal.session(train_steps=STEPS, disp_freq=5)
    if run.rank == 0 and not (out / "plain.safetensors").exists():
        plain = copy.deepcopy(initial)
        opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        for step in range(STEPS):
            start = step * BATCH % len(x)
            loss_of(plain, x[start:start + BATCH], y[start:start + BATCH]).backward()
            torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
            opt.step(); opt.zero_grad(); sched.step()
        save_file({k: v.contiguous() for k, v in plain.state_dict().items()}, str(out / "plain.safetensors"))

    def train(worker):
        model = worker.model(copy.deepcopy(initial))
        opt = worker.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        for step, (xb, yb) in worker.batches(data, batch_size=BATCH, shuffle=False):
            loss = loss_of(model, xb, yb)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # the group's mean gradient's norm
            opt.step(); opt.zero_grad(); sched.step()
            worker.log(step, loss=loss)
            if step == 9:
                worker.checkpoint()
        save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                  str(out / f"rank{run.rank}-worker{worker.index}.safetensors"))
        return {"rows": len(xb), "thread": threading.get_ident(), "main": threading.current_thread() is threading.main_thread()}

    said = run.each_worker(train)
    (out / f"rank{run.rank}.json").write_text(json.dumps({"workers": said, "label": run.label}))
''')

THREADS = "in-memory Sandblaster, 2 threads"
PROCESSES_OF_THREADS = "AllReduce, 2 processes x 2 threads"
SANDBLASTER_THREADS = "Sandblaster, 2 threads + 2 servers, 3 processes"


def shoal_run(script: Path, out: Path, workspace: Path, *options: str):
    out.mkdir(parents=True, exist_ok=True)
    return run_cli("run", script, "--workspace", workspace, *options, "--", out, cwd=out, timeout=240)


def replicas(out: Path, processes: int, workers: int) -> list[dict[str, torch.Tensor]]:
    return [load_file(str(out / f"rank{r}-worker{w}.safetensors")) for r in range(processes) for w in range(workers)]


def train_records(workspace: Path) -> list[dict]:
    return [r for r in map(json.loads, (workspace / "metrics.jsonl").read_text().splitlines()) if r["phase"] == "train"]


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("workers") / "loop.py"
    path.write_text(LOOP)
    return path


@pytest.fixture(scope="module")
def threads_run(script, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("threads")
    proc = shoal_run(script, out, out / "ws", *LAYOUTS[THREADS].cli())
    assert proc.returncode == 0, proc.stderr
    return out


def check_one_worker(out: Path, row: str) -> None:
    """The row ran (summary.json, a log per process), one thread per worker with its share of the batch of 12, every
    replica equal to the bit and to one worker with the whole batch within float rounding (test_session.py's bound)."""
    layout = LAYOUTS[row]
    assert_ran(out / "ws", row)
    per_process = layout.workers // layout.processes
    for rank in range(layout.processes):
        said = json.loads((out / f"rank{rank}.json").read_text())
        assert said["label"] == layout.framework
        assert [w["rows"] for w in said["workers"]] == [12 // layout.workers] * per_process
        assert len({w["thread"] for w in said["workers"]}) == per_process and not any(w["main"] for w in said["workers"])
    plain = load_file(str(out / "plain.safetensors"))
    first, *others = replicas(out, layout.processes, per_process)
    assert all(torch.equal(first[k], other[k]) for other in others for k in first)
    assert all(torch.allclose(first[k], plain[k], rtol=1e-5, atol=1e-6) for k in plain)
    assert [r["samples"] for r in train_records(out / "ws")] == [12, 60, 60, 60, 48]  # every worker's rows counted


def test_two_workers_in_one_process_train_as_one_worker_with_the_whole_batch(threads_run):
    check_one_worker(threads_run, THREADS)


def test_two_workers_resume_from_a_checkpoint_exactly(script, threads_run, tmp_path):
    """The run's checkpoint after step 9 (worker 0's replica, AdamW's moments, the LambdaLR, the data position) resumed
    with --resume by both workers: each replica ends where the uninterrupted run did, to the bit, with the same losses."""
    shutil.copytree(threads_run / "ws", tmp_path / "ws")
    shutil.copy(threads_run / "plain.safetensors", tmp_path)
    proc = shoal_run(script, tmp_path, tmp_path / "ws", "--resume", *LAYOUTS[THREADS].cli())
    assert proc.returncode == 0, proc.stderr
    uninterrupted = replicas(threads_run, 1, 2)[0]
    for resumed in replicas(tmp_path, 1, 2):
        assert all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted)
    assert [r["loss"] for r in train_records(tmp_path / "ws")][-2:] == [r["loss"] for r in train_records(threads_run / "ws")][-2:]


@pytest.mark.xdist_group("session_runs")  # (with tests/test_session.py's runs: the launcher's forkserver is started)
def test_two_processes_of_two_workers_train_as_one_worker_with_the_whole_batch(script, tmp_path):
    """AllReduce over 2 processes of 2 threads: the replicated exchange takes both local workers' parts in one
    all-reduce a step (as the Trainer hands them), and all 4 replicas train as one worker with the whole batch."""
    proc = shoal_run(script, tmp_path, tmp_path / "ws", *LAYOUTS[PROCESSES_OF_THREADS].cli())
    assert proc.returncode == 0, proc.stderr
    check_one_worker(tmp_path, PROCESSES_OF_THREADS)


@pytest.mark.xdist_group("session_runs")
def test_sandblaster_threads_with_server_processes_train_as_one_worker_with_the_whole_batch(script, tmp_path):
    """Sandblaster, one worker process of 2 threads + 2 server processes: the threads' gradients meet in their mean
    (the group's: the loop's clip_grad_norm_ clips the group's norm), which the process pushes once a step to the
    servers, each running the user's AdamW over its slices, built from the recipe; the threads share the one copy that
    takes the servers' answer, and it ends equal to one worker with the whole batch (the plain loop) to float rounding.
    Resumed from the checkpoint after step 9 (the servers' AdamW state, sent back with the chief's FIRST), both threads
    end where the uninterrupted run did, to the bit."""
    proc = shoal_run(script, tmp_path, tmp_path / "ws", *LAYOUTS[SANDBLASTER_THREADS].cli())
    assert proc.returncode == 0, proc.stderr
    assert_ran(tmp_path / "ws", SANDBLASTER_THREADS)  # 3 processes, 2 workers, Sandblaster, a log per process
    said = json.loads((tmp_path / "rank0.json").read_text())
    assert said["label"] == "Sandblaster" and [w["rows"] for w in said["workers"]] == [6, 6]
    assert len({w["thread"] for w in said["workers"]}) == 2 and not any(w["main"] for w in said["workers"])
    for rank, server in ((1, 0), (2, 1)):  # one push a step, not one a thread
        assert f"server(group=0, id={server}): version 20; updates applied: group 0: 20" in \
            (tmp_path / "ws" / "logs" / f"rank{rank}.log").read_text()
    plain = load_file(str(tmp_path / "plain.safetensors"))
    first, second = replicas(tmp_path, 1, 2)
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert all(torch.allclose(first[k], plain[k], rtol=1e-5, atol=1e-6) for k in plain)
    assert [r["samples"] for r in train_records(tmp_path / "ws")] == [12, 60, 60, 60, 48]
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "ws", resumed / "ws")
    shutil.copy(tmp_path / "plain.safetensors", resumed)
    proc = shoal_run(script, resumed, resumed / "ws", "--resume", *LAYOUTS[SANDBLASTER_THREADS].cli())
    assert proc.returncode == 0, proc.stderr
    for again in replicas(resumed, 1, 2):
        assert all(torch.equal(again[k], first[k]) for k in first)


DILOCO = ["--set", "cluster.nworker_groups=2", "--set", "cluster.local_steps=5", "--set", "cluster.outer_updater.type=kNesterov",
          "--set", "cluster.outer_updater.momentum=0.9", "--set", "cluster.outer_updater.learning_rate.type=kFixed",
          "--set", "cluster.outer_updater.learning_rate.base_lr=0.7"]


@pytest.mark.slow
def test_diloco_groups_of_two_threads_train_as_groups_of_one_worker(script, tmp_path):
    """DiLoCo over 2 processes, each group 2 threads: the group's workers' mean stays in the process between meetings,
    the meeting runs once every worker updated and its anchor reaches every replica; each group trains as a group of
    one worker with the group's whole batch (the same loop under nworkers_per_procs=1, where each_worker runs the body
    once, in the main thread), and the groups' replicas are equal after the last step's meeting; a resume is exact."""
    threads, single = tmp_path / "threads", tmp_path / "single"
    for out, options in ((threads, ["--set", "cluster.nworkers_per_group=2", "--set", "cluster.nworkers_per_procs=2"]),
                         (single, ["--set", "cluster.nworkers_per_procs=1"])):
        proc = shoal_run(script, out, out / "ws", *DILOCO, *options)
        assert proc.returncode == 0, proc.stderr
    got = json.loads((threads / "ws" / "summary.json").read_text())
    assert (got["processes"], got["workers"], got["framework"]) == (2, 4, "DiLoCo")
    for rank in range(2):
        said = json.loads((threads / f"rank{rank}.json").read_text())
        assert [w["rows"] for w in said["workers"]] == [6, 6] and not any(w["main"] for w in said["workers"])
        assert json.loads((single / f"rank{rank}.json").read_text())["workers"][0]["main"]
    first, *others = replicas(threads, 2, 2)
    assert all(torch.equal(first[k], other[k]) for other in others for k in first)
    one = replicas(single, 1, 1)[0]
    assert all(torch.allclose(first[k], one[k], rtol=1e-5, atol=1e-6) for k in one)
    # the checkpoint after step 9 (each group's part: its replica, AdamW's moments, the anchor, the outer momentum)
    # resumed by both groups' threads ends where the uninterrupted run did, to the bit
    resumed = tmp_path / "resumed"
    shutil.copytree(threads / "ws", resumed / "ws")
    shutil.copy(threads / "plain.safetensors", resumed)
    proc = shoal_run(script, resumed, resumed / "ws", "--resume", *DILOCO, "--set", "cluster.nworkers_per_group=2",
                     "--set", "cluster.nworkers_per_procs=2")
    assert proc.returncode == 0, proc.stderr
    for again, before in zip(replicas(resumed, 2, 2), [first, *others]):
        assert all(torch.equal(again[k], before[k]) for k in before)


def test_a_loop_of_one_worker_is_refused_in_one_line_under_several(tmp_path):
    """run.model under a layout of several workers in the process: one line saying how to write the loop."""
    script = tmp_path / "one.py"
    script.write_text("import torch, shoal\nrun = shoal.session()\nrun.model(torch.nn.Linear(2, 1))\n")
    line = one_line_error(run_cli("run", script, "--workspace", tmp_path / "ws", *LAYOUTS[THREADS].cli(), cwd=tmp_path))
    assert "in-memory Sandblaster runs 2 workers in this process" in line and "run.each_worker(body)" in line, line


def test_one_module_given_to_every_worker_is_refused_in_one_line(tmp_path):
    """Each worker trains a replica of its own: the same module object from two workers would be updated twice a step."""
    script = tmp_path / "shared.py"
    script.write_text("import torch, shoal\nrun = shoal.session()\nmodel = torch.nn.Linear(2, 1)\n"
                      "run.each_worker(lambda worker: worker.model(model))\n")
    line = one_line_error(run_cli("run", script, "--workspace", tmp_path / "ws", *LAYOUTS[THREADS].cli(), cwd=tmp_path))
    assert "each worker trains a replica of its own" in line, line


def test_a_workers_error_stops_the_others_and_ends_the_run(tmp_path):
    """Worker 1 raises at step 3 while worker 0 waits for its gradients: the run ends (no thread waits for it) with the
    worker's error as the script's one line."""
    script = tmp_path / "fails.py"
    script.write_text(textwrap.dedent('''
        import torch, shoal
        run = shoal.session(train_steps=10)
        def train(worker):
            model = worker.model(torch.nn.Linear(2, 1))
            opt = worker.optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
            for step in worker.steps(rows=2):
                if step == 3 and worker.index == 1:
                    raise ValueError("worker 1 found a bad batch")
                model(torch.ones(2, 2)).sum().backward()
                opt.step(); opt.zero_grad()
        run.each_worker(train)
    '''))
    line = one_line_error(run_cli("run", script, "--workspace", tmp_path / "ws", *LAYOUTS[THREADS].cli(), cwd=tmp_path,
                                  timeout=60))
    assert "ValueError: worker 1 found a bad batch" in line, line
