"""What a job of several processes costs before its first step (issue 40, point 1: shoal's start-up around the loop).

shoal.fit starts the server its ranks fork from (multiprocessing's forkserver) as soon as the layout is known to need
processes, so its imports run beside the parent's checks and planning; the server imports torch._dynamo too (torch's
optimizers import it on first use: about a second of CPU; fit's loop builds one for SINGA's updater= as well), so the
ranks inherit it instead of each importing it after it started. `shoal run JOB` forks that server from its own process once it has
imported torch and shoal, instead of starting an interpreter that imports them again.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from layouts import assert_ran

SCRIPT = textwrap.dedent('''
    import sys

    import torch

    import shoal


    class Recording(torch.nn.Linear):
        """Notes, where a rank unpickles it (before the rank builds anything), whether torch._dynamo was imported."""

        def __setstate__(self, state):
            super().__setstate__(state)
            with open(state["record_to"], "a") as f:
                f.write(f"{'torch._dynamo' in sys.modules}\\n")


    def loss(output, target):
        return torch.nn.functional.mse_loss(output, target)


    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-3)


    if __name__ == "__main__":
        torch.manual_seed(0)
        model = Recording(4, 1)
        model.record_to = sys.argv[1]
        x = torch.randn(64, 4)
        shoal.fit(model, loss, (x, x.sum(1, keepdim=True)), steps=4, batch_size=8, optimizer=adamw,
                  cluster=shoal.Cluster(nworker_groups=2, local_steps=2), workspace=sys.argv[2], log=lambda line: None)
''')


# Prints, where multiprocessing starts its forkserver, what the server will import before any rank forks and whether
# this process had imported torch._dynamo itself, then ends the process: the rest of the fit is not needed
SERVER_PRELOAD = textwrap.dedent('''
    import sys
    from multiprocessing import forkserver


    def recorded(*args, **kwargs):
        print(" ".join(forkserver._forkserver._preload_modules), "| parent has torch._dynamo:", "torch._dynamo" in sys.modules,
              flush=True)
        raise SystemExit(0)


    forkserver.ensure_running = recorded
''')


@pytest.mark.parametrize("optimizer", ["torch's AdamW", "SINGA's updater"])
def test_a_fit_starts_the_ranks_server_with_torch_dynamo_before_its_checks(tmp_path, optimizer):
    """What the ranks inherit is what the server imported before they forked (multiprocessing's preload): torch._dynamo,
    for a torch optimizer and for SINGA's updater= alike (fit's loop runs it as shoal.SingaOptimizer, a torch
    optimizer); the server starts before fit's checks import it in the script's process (they run beside the
    server's). In a fresh interpreter stopped at the server's start: about a second, where the whole fit below (slow)
    takes ten."""
    script = tmp_path / "job.py"
    script.write_text(SERVER_PRELOAD + (SCRIPT if optimizer == "torch's AdamW" else SCRIPT.replace("optimizer=adamw,", "")))
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "ranks.txt"), str(tmp_path / "ws")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    preload, parent = done.stdout.strip().split(" | ")
    assert {"shoal.launcher.launch", "torch._dynamo"} <= set(preload.split()) and parent == "parent has torch._dynamo: False"


@pytest.mark.slow  # the whole fit in a fresh interpreter: about 10 s (the test above checks the server's preload)
def test_the_ranks_of_a_fit_with_a_torch_optimizer_inherit_torch_dynamo(tmp_path):
    script, record = tmp_path / "job.py", tmp_path / "ranks.txt"
    script.write_text(SCRIPT)
    # a fresh interpreter: the forkserver is one per process, and this test's must be started by the fit call
    done = subprocess.run([sys.executable, str(script), str(record), str(tmp_path / "ws")], capture_output=True, text=True,
                          cwd=tmp_path, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = record.read_text().split()  # one line per unpickling (each rank unpickles the module at least once)
    assert len(seen) >= 2 and set(seen) == {"True"}  # every rank: imported before it started


# Records every interpreter multiprocessing starts (its forkserver, its resource tracker), then runs the CLI
SERVER_STARTS = textwrap.dedent('''
    import os, sys
    from multiprocessing import util

    spawn = util.spawnv_passfds


    def recorded(path, args, passfds):
        print("started:", " ".join(map(os.fsdecode, args))[-120:], flush=True)
        return spawn(path, args, passfds)


    util.spawnv_passfds = recorded
    from shoal.frontend.cli import main

    sys.exit(main(sys.argv[1:]))
''')


def test_shoal_run_forks_the_server_of_several_processes_instead_of_starting_an_interpreter(blobs_job, tmp_path):
    """`shoal run JOB` of several processes: the server its ranks fork from is forked from the CLI's process once
    that has imported torch and shoal, instead of an interpreter importing them all again (1.5 s of CPU); the job
    runs over its processes as before (issue 40, point 5)."""
    layout = "AllReduce, 2 processes"
    job = blobs_job(train_steps=4, layout=layout)
    done = subprocess.run([sys.executable, "-c", SERVER_STARTS, "run", str(job), "--workspace", str(tmp_path / "ws")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    started = [line for line in done.stdout.splitlines() if line.startswith("started:")]
    assert len(started) == 1 and "resource_tracker" in started[0], started  # multiprocessing's tracker only
    assert_ran(tmp_path / "ws", layout)


# A user's loop; each process says whether torch._dynamo (which a torch optimizer imports) was there before the
# script's own imports: in a rank, only if the server it forked from had imported it
SESSION_SCRIPT = textwrap.dedent('''
    import sys
    inherited = "torch._dynamo" in sys.modules
    import torch, shoal

    run = shoal.session(train_steps=4)
    model = run.model(torch.nn.Linear(4, 1))
    opt = run.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    for step, (x, y) in run.batches(data, batch_size=4):
        (model(x) - y).pow(2).mean().backward()
        opt.step(); opt.zero_grad()
    print("rank", run.rank, "found torch._dynamo imported:", inherited, flush=True)
''')


def test_shoal_run_of_a_script_over_processes_forks_their_server_with_torch_dynamo(tmp_path):
    """`shoal run script.py --set cluster.…` placing several processes: the server the session's ranks fork from is
    forked from the CLI's process before the script runs, torch._dynamo imported (a torch optimizer's first use), so
    no interpreter starts for it and no rank imports torch._dynamo itself."""
    script = tmp_path / "loop.py"
    script.write_text(SESSION_SCRIPT)
    done = subprocess.run([sys.executable, "-c", SERVER_STARTS, "run", str(script), "--workspace", str(tmp_path / "ws"),
                           "--set", "cluster.nworkers_per_group=2"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    started = [line for line in done.stdout.splitlines() if line.startswith("started:")]
    assert len(started) == 1 and "resource_tracker" in started[0], started  # multiprocessing's tracker only
    assert_ran(tmp_path / "ws", "AllReduce, 2 processes")
    logs = [(tmp_path / "ws" / "logs" / f"rank{rank}.log").read_text() for rank in (0, 1)]
    said = [line for text in logs + [done.stdout] for line in text.splitlines() if "found torch._dynamo" in line]
    assert sorted(set(said)) == ["rank 0 found torch._dynamo imported: True", "rank 1 found torch._dynamo imported: True"], (
        said, done.stdout, logs)


def test_a_loop_whose_own_cluster_places_processes_starts_their_server_with_torch_dynamo(tmp_path):
    """The script's own shoal.Cluster places the processes (no --set for the CLI to fork the server early from): the
    session starts the server its ranks fork from with torch._dynamo and the session's start (what each rank would
    import itself: a torch optimizer imports torch._dynamo). Stopped at the server's start (SERVER_PRELOAD): what the
    ranks inherit is what it imports there, as the test above shows for the ranks of a --set."""
    script = tmp_path / "loop.py"
    script.write_text(SERVER_PRELOAD + SESSION_SCRIPT.replace(
        "shoal.session(train_steps=4)", "shoal.session(shoal.Cluster(nworkers_per_group=2), train_steps=4)"))
    done = subprocess.run([sys.executable, "-m", "shoal", "run", str(script), "--workspace", str(tmp_path / "ws")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    preload = done.stdout.strip().splitlines()[-1].split(" | ")[0].split()
    assert {"shoal.launcher.launch", "shoal.frontend.session_start", "torch._dynamo"} <= set(preload), done.stdout


def test_prestart_starts_the_server_before_the_script_imports_torch_and_only_in_the_script(tmp_path):
    """`shoal.prestart()` starts the server without importing torch; in a process multiprocessing started (a rank
    importing the script again) it starts none."""
    script = textwrap.dedent('''
        import multiprocessing, sys
        from multiprocessing import forkserver

        import shoal

        forkserver.ensure_running = lambda: print("started", flush=True)
        print(shoal.prestart(), "torch" in sys.modules, flush=True)
        if __name__ == "__main__":  # (spawned: cheap, and it imports the script again as a rank does)
            child = multiprocessing.get_context("spawn").Process(target=print, args=("child",))
            child.start()
            child.join()
    ''')
    path = tmp_path / "prestarted.py"
    path.write_text(script)
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["started", "True", "False", "False", "False", "child"]


PRESTARTED = """
import shoal

shoal.prestart()  # before torch

import os
import sys
from multiprocessing import forkserver

import torch


class Recording(torch.nn.Linear):
    def __setstate__(self, state):  # (where a rank unpickles it, before it builds anything)
        super().__setstate__(state)
        with open(state["record_to"], "a") as f:
            f.write(f"{os.getpid()} {os.getppid()} {'torch._dynamo' in sys.modules}\\n")


def loss(output, target):
    return torch.nn.functional.mse_loss(output, target)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


if __name__ == "__main__":
    print(os.getpid(), forkserver._forkserver._forkserver_pid, flush=True)
    model = Recording(4, 1)
    model.record_to = sys.argv[1]
    x = torch.randn(64, 4)
    shoal.fit(model, loss, (x, x.sum(1, keepdim=True)), steps=4, batch_size=8, optimizer=adamw,
              cluster=shoal.Cluster(nworker_groups=2, local_steps=2), workspace=sys.argv[2], log=lambda line: None)
"""


@pytest.mark.slow  # a fit in a fresh interpreter: about 10 s
def test_the_ranks_of_a_prestarted_fit_fork_from_the_server_the_script_started(tmp_path):
    """A script that calls shoal.prestart() before it imports torch: its fit's ranks fork from that server (their
    parent), with torch._dynamo inherited, and no rank starts a server of its own."""
    script, record = tmp_path / "job.py", tmp_path / "ranks.txt"
    script.write_text(PRESTARTED)
    done = subprocess.run([sys.executable, str(script), str(record), str(tmp_path / "ws")], capture_output=True, text=True,
                          cwd=tmp_path, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    script_pid, server = done.stdout.split()[:2]
    in_ranks = {tuple(line.split()) for line in record.read_text().splitlines() if line.split()[0] != script_pid}
    assert len({pid for pid, _, _ in in_ranks}) == 2 and {(parent, dynamo) for _, parent, dynamo in in_ranks} == {(server, "True")}
