"""Under torchrun a dead rank comes back into the running job; the others' processes go on (issue 38, point 1).

`torchrun ... -m shoal run JOB --max-restarts 1`: shoal's own flag grants the restarts, as under `shoal run`. The
process torchrun starts for a rank other than the chief supervises the rank's training process
(shoal.launcher.supervisor); a real SIGKILL of that process (its pid from the job registry) is answered as
`shoal run`'s launcher answers it: the next step goes on without it, a new process rejoins from the chief's state,
torchrun sees nothing fail and restarts nothing. A `shoal.session()` script's rank is supervised the same way (its
child runs the script from the top, and so does a restarted one); a session on a layout whose processes are not
restarted warns at start as a job file does.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shoal
from fault_runs import pids, summary, wait_for
from layouts import LAYOUTS, assert_ran
from test_cli import alive, leftover_processes, tagged
from test_launchers import TORCHRUN, free_port, job_secret, quiet

LAYOUT = "AllReduce, 2 processes"
DIED = ("WARNING: process 1 (worker(group=0, id=1)) died (SIGKILL); the other processes go on without it; restarting it "
        "(restart 1 of 1); it rejoins at the next step, from process 0's state")


def torchrun_in_background(job, workspace, out, err, *args: str, env=None, torchrun_restarts: int = 1,
                           nprocs: int = 2) -> subprocess.Popen:
    """`torchrun --nproc-per-node=N --max-restarts=1 -m shoal run JOB --max-restarts 1 ...`, its own session (the
    test kills it whole if it fails), output to files."""
    command = [str(TORCHRUN), "--nnodes=1", f"--nproc-per-node={nprocs}", "--master-addr=127.0.0.1", f"--master-port={free_port()}",
               f"--max-restarts={torchrun_restarts}", f"--log-dir={out.parent / 'torchrun-logs'}", "-m", "shoal", "run", str(job), "--workspace", str(workspace), "--no-progress",
               "--max-restarts", "1", *args]
    environment = {**os.environ, "PYTHONUNBUFFERED": "1", **job_secret(), **tagged(out.parent), **(env or {})}
    with open(out, "w") as stdout, open(err, "w") as stderr:
        return subprocess.Popen(command, stdout=stdout, stderr=stderr, env=environment, start_new_session=True)


def registered(workspace) -> list[dict]:
    """The job registry's records of runs in `workspace` (one per start: torchrun's whole-job restart adds one)."""
    from shoal.launcher import job_registry

    return [r for r in job_registry.all_jobs() if os.path.realpath(r.workspace) == os.path.realpath(workspace)]


@pytest.fixture
def torchruns():
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:  # a failed assertion must not leave torchrun and its processes running
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for pid in leftover_processes(proc.tmp_path, wait=0):
            os.kill(pid, signal.SIGKILL)


def start(torchruns, job, tmp_path, *args: str, env=None, torchrun_restarts: int = 1,
          nprocs: int = 2) -> tuple[subprocess.Popen, Path]:
    """torchrun in the background, once it trains (the chief displayed step 10, every rank registered): (it, its
    workspace)."""
    ws, out, err = tmp_path / "ws", tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    proc = torchrun_in_background(job, ws, out, err, *args, env=env, torchrun_restarts=torchrun_restarts, nprocs=nprocs)
    proc.tmp_path, proc.out, proc.err = tmp_path, out, err
    torchruns.append(proc)

    def training() -> bool:
        assert proc.poll() is None, err.read_text()[-3000:]
        records = registered(ws)
        return "Train @ step 10 " in out.read_text() and bool(records) and len(records[0].processes) == nprocs

    wait_for(training, 120, "never reached step 10", interval=0.05)
    return proc, ws


def training_pids(ws) -> tuple[int, int]:
    """Rank 0's and rank 1's training processes, as the job registry holds them (`shoal jobs view` shows them)."""
    (record,) = registered(ws)
    return tuple(next(p["pid"] for p in record.processes if p["rank"] == r) for r in (0, 1))


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_killed_rank_under_torchrun_rejoins_and_the_chief_never_restarts(blobs_job, tmp_path, torchruns):
    """SIGKILL rank 1's training process mid-run: torchrun restarts nothing, rank 0's process is the same from start
    to end, rank 1 ran as two processes and healed from the chief, the job exits 0 as accurate as the unfaulted run.
    The server the supervisor's children fork from was forked from the supervisor's own `shoal run` process
    (process_server._fork_server: the command line it inherited), not an interpreter importing torch again."""
    steps = 160
    job = blobs_job(train_steps=steps, layout=LAYOUT)
    # 100 ms a step until rank 1 rejoined (SHOAL_SLOW_UNTIL), then full speed: the restarted process (forked from its
    # supervisor's server) must land before the last step; at a fixed 10 ms a loaded machine let the chief finish first
    # (2 of 5 runs beside other test files); 6 runs of this file at once (load 17) rejoined 0.1-5.2 s after the kill
    release = tmp_path / "rejoined"
    proc, ws = start(torchruns, job, tmp_path, env={"SHOAL_SLOW_WORKER": "0:0+0.1", "SHOAL_SLOW_UNTIL": str(release)})
    chief, victim = training_pids(ws)
    server = parent_of(victim)
    command_line = lambda pid: Path(f"/proc/{pid}/cmdline").read_bytes()  # noqa: E731
    assert b"-m\0shoal\0run\0" in command_line(server) and command_line(server) == command_line(parent_of(server))
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: "Process 1 rejoined at step " in proc.out.read_text() or proc.poll() is not None, 120, "no rejoin")
    release.touch()
    assert proc.wait(timeout=180) == 0, proc.err.read_text()[-3000:]
    stdout, stderr = proc.out.read_text(), proc.err.read_text()
    assert DIED in stderr.splitlines(), stderr
    assert "restart 1 of 1" not in stdout  # torchrun restarted nothing: one start of the job, one registration
    (record,) = registered(ws)
    assert record.status == "finished"
    assert pids(ws, 0) == [chief]  # the chief's process never restarted
    first, second = pids(ws, 1)
    assert first == victim and second != victim and not alive(second)
    got = assert_ran(ws, LAYOUTS[LAYOUT])
    assert got.get("job_restarts", []) == [] and got["status"] == "finished"
    (rejoined,) = got["rejoins"]
    assert (rejoined["rank"], rejoined["incarnation"]) == (1, 1) and 10 <= rejoined["step"] < steps
    # a whole line of its own: torchrun's ranks write to one stdout, each line in one write (report/terminal.write_line;
    # print's separate newline once let it land inside one of rank 0's: "... sent_bytes = 0Process 1 rejoined at ...")
    assert re.search(rf"^Process 1 rejoined at step {rejoined['step']} \(restart 1\): ", stdout, re.M), stdout
    unfaulted = tmp_path / "unfaulted"  # one process, the same job (tests/test_allreduce_faults.py's tolerance)
    shoal.train(blobs_job(train_steps=steps), workspace=unfaulted, log=quiet)
    final, baseline = got["final_test"]["accuracy"], summary(unfaulted)["final_test"]["accuracy"]
    assert final >= baseline - 0.05, (final, baseline)
    assert "Traceback" not in stderr and "gloo" not in stderr.lower(), stderr
    assert leftover_processes(tmp_path) == []


@pytest.mark.slow  # a stall timeout to wait out
def test_a_stopped_rank_under_torchrun_is_ended_and_rejoins(blobs_job, tmp_path, torchruns):
    """SIGSTOP rank 1's training process past the stall timeout: the chief goes on without it, its supervisor ends
    it (SIGKILL) and starts a new one, which rejoins; torchrun restarts nothing and the job exits 0."""
    job = blobs_job(train_steps=400, layout=LAYOUT)
    proc, ws = start(torchruns, job, tmp_path, "--set", "cluster.stall_timeout_s=2", env={"SHOAL_SLOW_WORKER": "0:0+0.01"})
    chief, victim = training_pids(ws)
    os.kill(victim, signal.SIGSTOP)
    assert proc.wait(timeout=180) == 0, proc.err.read_text()[-3000:]
    stdout, stderr = proc.out.read_text(), proc.err.read_text()
    assert any(line.startswith("WARNING: process 1 (worker(group=0, id=1)) was stopped past the stall timeout (2 s)")
               and "restarting it (restart 1 of 1)" in line for line in stderr.splitlines()), stderr
    assert "restart 1 of 1;" not in stdout and len(registered(ws)) == 1
    assert pids(ws, 0) == [chief] and pids(ws, 1)[0] == victim and len(pids(ws, 1)) == 2
    assert summary(ws)["rejoins"][0]["rank"] == 1
    assert leftover_processes(tmp_path) == []


@pytest.mark.slow  # one more torchrun run; the kill test covers the supervisor in the default suite
def test_torchrun_stopping_the_job_ends_the_supervised_process_too(blobs_job, tmp_path, torchruns):
    """SIGTERM to torchrun (as Ctrl-C or a scheduler's stop): its agent stops every rank; rank 1's supervisor ends
    its training process with it: nothing is left running."""
    job = blobs_job(train_steps=100000, layout=LAYOUT)
    proc, ws = start(torchruns, job, tmp_path, env={"SHOAL_SLOW_WORKER": "0:0+0.01"})
    _, trainer = training_pids(ws)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    assert not alive(trainer)
    assert leftover_processes(tmp_path) == []


@pytest.mark.slow  # one more torchrun run
def test_shoal_jobs_kill_ends_a_supervised_torchrun_job(blobs_job, tmp_path, torchruns):
    """`shoal jobs kill ID` signals the job's chief (the lock's holder), as before supervision; torchrun (no restart
    left) stops the other ranks, whose supervisor ends its training process: the job is killed, nothing is left."""
    job = blobs_job(train_steps=100000, layout=LAYOUT)
    proc, ws = start(torchruns, job, tmp_path, env={"SHOAL_SLOW_WORKER": "0:0+0.01"}, torchrun_restarts=0)
    chief, trainer = training_pids(ws)
    (record,) = registered(ws)
    killed = subprocess.run([sys.executable, "-m", "shoal", "jobs", "kill", str(record.id)], capture_output=True, text=True,
                            timeout=60)
    assert killed.returncode == 0, killed.stderr
    proc.wait(timeout=60)
    assert not alive(chief) and not alive(trainer)
    assert registered(ws)[0].status == "killed"
    assert leftover_processes(tmp_path) == []


ASYNCHRONOUS = {  # layout, its cluster section's fields, what else it is given: group 1 runs in process 1 in each
    "Downpour": ("Downpour, 2 groups + 1 server, 3 processes", {}, []),
    "Distributed Hogwild": ("Distributed Hogwild, 2 groups", {}, []),
    "DiLoCo": ("single worker", dict(nworker_groups=2, local_steps=5),
               ["--set", "cluster.outer_updater.type=kNesterov", "--set", "cluster.outer_updater.momentum=0.9",
                "--set", "cluster.outer_updater.learning_rate.type=kFixed", "--set", "cluster.outer_updater.learning_rate.base_lr=0.7"]),
}


@pytest.mark.slow  # one torchrun run each
@pytest.mark.parametrize("framework", sorted(ASYNCHRONOUS))
def test_a_killed_group_under_torchrun_rejoins(blobs_job, tmp_path, torchruns, framework):
    """The asynchronous frameworks and DiLoCo under torchrun: worker group 1's process SIGKILLed, restarted into the
    running job by its supervisor (the line `shoal run` prints), the chief's process the same to the end, exit 0."""
    layout, fields, args = ASYNCHRONOUS[framework]
    nprocs = 3 if framework == "Downpour" else 2
    job = blobs_job(train_steps=200, layout=layout, cluster_extra=fields or None)
    proc, ws = start(torchruns, job, tmp_path, *args, env={"SHOAL_SLOW_WORKER": "0:0+0.01"}, nprocs=nprocs)
    chief, victim = training_pids(ws)
    os.kill(victim, signal.SIGKILL)
    assert proc.wait(timeout=180) == 0, proc.err.read_text()[-3000:]
    stdout, stderr = proc.out.read_text(), proc.err.read_text()
    assert any(line.startswith("WARNING: process 1 (worker(group=1, id=0)") and "restarting it (restart 1 of 1)" in line
               for line in stderr.splitlines()), stderr
    assert len(registered(ws)) == 1 and registered(ws)[0].status == "finished"
    assert pids(ws, 0) == [chief] and pids(ws, 1)[0] == victim and len(pids(ws, 1)) == 2
    assert [r["rank"] for r in summary(ws)["rejoins"]] == [1]
    assert "Traceback" not in stderr
    assert leftover_processes(tmp_path) == []


@pytest.mark.slow  # one torchrun run
def test_a_killed_downpour_server_under_torchrun_is_restarted_and_heals_from_the_chiefs_mirror(blobs_job, tmp_path, torchruns):
    """Downpour's server process under torchrun: SIGKILLed mid-run, its supervisor announces the restart at the job's
    door (the stubs wait for the new process instead of their comm timeout) and starts it; it heals from worker
    group 0's mirror, torchrun restarts nothing and the job ends as `shoal run`'s does (tests/test_server_restart.py)."""
    layout, fields, args = ASYNCHRONOUS["Downpour"]
    job = blobs_job(train_steps=300, layout=layout, cluster_extra=fields or None)
    proc, ws = start(torchruns, job, tmp_path, *args, env={"SHOAL_SLOW_WORKER": "0:0+0.01"}, nprocs=3)
    (record,) = registered(ws)
    chief, server = (next(p["pid"] for p in record.processes if p["rank"] == r) for r in (0, 2))
    os.kill(server, signal.SIGKILL)
    assert proc.wait(timeout=120) == 0, proc.err.read_text()[-3000:]
    stderr = proc.err.read_text()
    assert any(line.startswith("WARNING: process 2 (server(group=0, id=0)) died (SIGKILL); restarting it (restart 1 of 1); "
                               "it heals from worker group 0's mirror") for line in stderr.splitlines()), stderr
    assert len(registered(ws)) == 1 and registered(ws)[0].status == "finished"
    assert pids(ws, 0) == [chief]
    (healed,) = summary(ws)["rejoins"]
    assert (healed["server"], healed["rank"], healed["healed_from_group"]) == (0, 2, 0)
    assert healed["process_start_to_heal_s"] < 5  # not a stub's comm timeout
    assert "Traceback" not in stderr and "gloo" not in stderr.lower()
    assert leftover_processes(tmp_path) == []


# A user's own loop (shoal.session()) under `torchrun ... -m shoal run script.py --max-restarts 1`: rank 1's process
# torchrun started supervises a child that runs the script from the top; the test SIGKILLs that child (its pid from
# the job registry) and writes `killed`. The chief waits at step 11 for the kill and the new process (it runs the
# script from the top: its pid file), then goes on slowly until the rejoin is recorded, so that it rejoins mid-run.
# Rank 0 also runs the same loop as plain PyTorch on the same rows (AllReduce's unfaulted result, which
# tests/test_session.py's torchrun test shows the unfaulted layout equals).
SESSION_LOOP = '''
import json, os, sys, time
from pathlib import Path
import torch, shoal
from safetensors.torch import save_file

out, group_sleeps = Path(sys.argv[1]), float(sys.argv[2])
torch.manual_seed(0)
x = torch.randn(96, 8)
y = (x[:, :4].sum(1, keepdim=True) > x[:, 4:].sum(1, keepdim=True)).float()
data = torch.utils.data.TensorDataset(x, y)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
STEPS, BATCH = 60, 12

def loss_of(model, xb, yb):
    return torch.nn.functional.binary_cross_entropy_with_logits(model(xb), yb)

def ended(model):
    with torch.no_grad():
        return {"loss": float(loss_of(model, x, y)), "accuracy": float(((model(x) > 0).float() == y).float().mean())}

run = shoal.session(train_steps=STEPS, disp_freq=5)
(out / f"pid{run.rank}.{os.getpid()}").write_text("")
restarted = len(list(out.glob(f"pid{run.rank}.*"))) > 1
if run.rank == 0:
    import copy
    plain = copy.deepcopy(model)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for step in range(STEPS):
        start = step * BATCH % len(x)
        loss_of(plain, x[start:start + BATCH], y[start:start + BATCH]).backward()
        opt.step(); opt.zero_grad()
    (out / "plain.json").write_text(json.dumps(ended(plain)))
model = run.model(model)
opt = run.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
rejoined = run.workspace / "logs" / "rejoins.jsonl"
for step, (xb, yb) in run.batches(data, batch_size=BATCH, shuffle=False):
    if run.rank == 0 and step == 11:
        deadline = time.time() + 90
        while len(list(out.glob("pid1.*"))) < 2 and time.time() < deadline:
            time.sleep(0.05)
    if run.rank == 0 and step > 11 and not rejoined.exists():
        time.sleep(0.1)
    if run.rank == 1:  # (an asynchronous group 1 must still be training when it is killed)
        time.sleep(group_sleeps)
    loss = loss_of(model, xb, yb)
    loss.backward()
    opt.step(); opt.zero_grad()
    run.log(step, loss=loss)
save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / f"rank{run.rank}.safetensors"))
(out / f"rank{run.rank}.json").write_text(json.dumps(ended(model)))
print("rank", run.rank, "finished at step", step)
'''

SESSION_LAYOUTS = {  # its flags, its processes, whether its replicas end equal, group 1's sleep per step
    "AllReduce": (["--set", "cluster.nworkers_per_group=2", "--set", "cluster.nworkers_per_procs=1"], 2, True, 0),
    "Local SGD": (["--set", "cluster.nworker_groups=2", "--set", "cluster.nworkers_per_procs=1", "--set", "cluster.local_steps=5"],
                  2, True, 0),
    "Downpour": (LAYOUTS["Downpour, 2 groups + 1 server, 3 processes"].cli(), 3, False, 0.05),
    "Sandblaster": (LAYOUTS["Sandblaster, 2 workers + 1 server, 3 processes"].cli(), 3, True, 0),
}


def killed_session_rank_rejoins(tmp_path, torchruns, layout: str) -> None:
    """The session script under torchrun with `layout`; rank 1's training process SIGKILLed at step 11: it comes back
    into the running loop, the chief's process and torchrun's start are the same to the end, and the loop ends as
    accurate as the unfaulted one."""
    from safetensors.torch import load_file

    flags, nprocs, equal, group_sleeps = SESSION_LAYOUTS[layout]
    script, out = tmp_path / "loop.py", tmp_path / "out"
    script.write_text(SESSION_LOOP)
    out.mkdir()
    proc, ws = start(torchruns, script, tmp_path, *flags, "--", str(out), str(group_sleeps), nprocs=nprocs)
    chief, victim = training_pids(ws)
    os.kill(victim, signal.SIGKILL)
    assert proc.wait(timeout=180) == 0, proc.err.read_text()[-3000:]
    stdout, stderr = proc.out.read_text(), proc.err.read_text()
    assert any(line.startswith("WARNING: process 1 (worker(group=") and "restarting it (restart 1 of 1)" in line
               for line in stderr.splitlines()), stderr
    assert "restart 1 of 1" not in stdout  # torchrun restarted nothing: one start of the job, one registration
    (record,) = registered(ws)
    assert record.status == "finished"
    pids_of = {rank: sorted(int(p.name.split(".")[1]) for p in out.glob(f"pid{rank}.*")) for rank in (0, 1)}
    assert pids_of[0] == [chief] and victim in pids_of[1] and len(pids_of[1]) == 2  # rank 1 ran as two processes
    got = summary(ws)
    assert got["status"] == "finished" and got.get("job_restarts", []) == []
    (rejoined,) = got["rejoins"]
    assert rejoined["rank"] == 1 and (10 if equal else 0) <= rejoined["step"] < 60  # (Downpour: group 1's own step)
    assert "rank 1 finished at step 59" in (ws / "logs" / "rank1.log").read_text()
    if equal:  # (Local SGD: its last meeting)
        ends = [load_file(str(out / f"rank{r}.safetensors")) for r in (0, 1)]
        assert all(torch.equal(ends[0][k], ends[1][k]) for k in ends[0])
    final, plain = json.loads((out / "rank0.json").read_text()), json.loads((out / "plain.json").read_text())
    assert final["accuracy"] >= plain["accuracy"] - 0.05, (final, plain)  # tests/test_allreduce_faults.py's tolerance
    assert "Traceback" not in stderr and "gloo" not in stderr.lower(), stderr
    assert leftover_processes(tmp_path) == []


def test_a_killed_session_rank_under_torchrun_rejoins_the_running_loop(tmp_path, torchruns):
    killed_session_rank_rejoins(tmp_path, torchruns, "AllReduce")


@pytest.mark.slow  # one more torchrun run each; AllReduce's covers the session's supervisor in the default suite
@pytest.mark.parametrize("layout", ["Local SGD", "Downpour", "Sandblaster"])
def test_a_killed_group_of_a_session_under_torchrun_rejoins(tmp_path, torchruns, layout):
    killed_session_rank_rejoins(tmp_path, torchruns, layout)


NOT_RESTARTED = ("WARNING: --max-restarts: {label}'s processes are not restarted into the running job (only AllReduce's and "
                 "Sandblaster's replicas, Downpour, Local SGD and Distributed Hogwild groups are); a dead one stops the job, which "
                 "torchrun's own restarts may start again")


def test_a_session_under_torchrun_warns_at_start_when_its_processes_are_not_restarted(capsys):
    """A shoal.session() script's rank under torchrun with restarts allowed (cluster.max_restarts, as `--max-restarts 1`
    sets it) on a layout whose processes do not rejoin (in-memory Sandblaster's): the chief warns the job file's one line at the
    start (launcher/elastic.py's, one place), the other ranks say nothing; AllReduce's ranks, the chief's too (another
    process takes its place), are supervised, and Sandblaster's too. In process: the session's start-up step for a launched rank, given
    torchrun's place of each rank."""
    from shoal.config import job_pb2
    from shoal.frontend.session_start import plan_session, session_job, supervise_if_restartable
    from shoal.launcher.launchers import LaunchedProcess

    def plan(**cluster):
        return plan_session(session_job(job_pb2.ClusterProto(**{"max_restarts": 1, "nworkers_per_procs": 1, **cluster}), 10, 0, 5, 0,
                                        "loop"))

    def started(plan, rank: int) -> str:
        launched = LaunchedProcess("torchrun", rank, plan.nprocs, rank, plan.nprocs, 1, "127.0.0.1", 29500)
        supervise_if_restartable(plan, launched, None, False, print)  # returns: this rank runs the loop itself
        return capsys.readouterr().err

    from shoal.launcher import supervisor
    threads = plan(nworkers_per_group=2, nworkers_per_procs=2)  # one process: nothing to restart into
    assert started(threads, 0) == NOT_RESTARTED.format(label="in-memory Sandblaster") + "\n"
    # Sandblaster: its worker processes rejoin (process 0's place taken by the lowest living one), its server processes
    # heal: every rank is supervised (none warns)
    sandblaster = plan(nworkers_per_group=2, server_worker_separate=True)
    assert all(supervisor.supervises(sandblaster, LaunchedProcess("torchrun", r, 3, r, 3, 1, "127.0.0.1", 29500)) for r in (0, 1, 2))
    allreduce = plan(nworkers_per_group=2)  # its chief is replaced like any other process: every rank is supervised
    assert all(supervisor.supervises(allreduce, LaunchedProcess("torchrun", r, 2, r, 2, 1, "127.0.0.1", 29500)) for r in (0, 1))


@pytest.mark.slow  # a torchrun run (about 7 s on the busy machine); the check above is the default suite's
def test_a_session_script_under_torchrun_warns_at_start_when_its_process_is_not_restarted(tmp_path):
    """`torchrun --nproc-per-node=1 -m shoal run loop.py --max-restarts 1` (one worker: its process is not restarted
    into the running job): the job file's one line on stderr, once, and the loop runs to its end."""
    script = tmp_path / "loop.py"
    script.write_text("import torch, shoal\n"
                      "run = shoal.session(train_steps=3)\n"
                      "model = run.model(torch.nn.Linear(2, 1))\n"
                      "opt = run.optimizer(torch.optim.SGD(model.parameters(), lr=0.1))\n"
                      "for step, (xb,) in run.batches(torch.utils.data.TensorDataset(torch.randn(8, 2)), batch_size=4):\n"
                      "    model(xb).sum().backward(); opt.step(); opt.zero_grad()\n")
    proc = subprocess.run([str(TORCHRUN), "--nnodes=1", "--nproc-per-node=1", "--master-addr=127.0.0.1",
                           f"--master-port={free_port()}", "-m", "shoal", "run", str(script), "--workspace", str(tmp_path / "ws"),
                           "--no-progress", "--max-restarts", "1"], capture_output=True, text=True, timeout=180, cwd=tmp_path,
                          env={**os.environ, **job_secret(), **tagged(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.splitlines().count(NOT_RESTARTED.format(label="single worker")) == 1, proc.stderr
    assert "Train @ step 2 " in proc.stdout and summary(tmp_path / "ws")["status"] == "finished"
    assert leftover_processes(tmp_path) == []


REPLICATED = "AllReduce, 3 processes, replicated (max_restarts 1)"


@pytest.mark.slow  # the srun test below covers the chief's supervisor (its records, its restart) in the default suite
def test_a_killed_chief_under_torchrun_is_replaced_and_nothing_restarts(blobs_job, tmp_path, torchruns):
    """SIGKILL rank 0's training process mid-run (AllReduce's replicas, 3 ranks): torchrun restarts nothing (one
    registration, no whole-job restart); process 1 takes the chief's place (its line on torchrun's output) and finishes
    the run log; rank 0's supervisor starts a new process that rejoins as a non-chief, holds the workspace's and the
    registry's locks meanwhile and, at the end, writes the rejoins into summary.json and ends the record as finished."""
    steps = 200
    job = blobs_job(train_steps=steps, cluster_extra=dict(nworkers_per_group=3))
    proc, ws = start(torchruns, job, tmp_path, env={"SHOAL_SLOW_WORKER": "0:0+0.01"}, nprocs=3)
    victim, survivor = training_pids(ws)
    os.kill(victim, signal.SIGKILL)
    assert proc.wait(timeout=180) == 0, proc.err.read_text()[-3000:]
    stdout, stderr = proc.out.read_text(), proc.err.read_text()
    assert any(line.startswith("WARNING: process 0 (worker(group=0, id=0), server(group=0, id=0)) died (SIGKILL); the other "
                               "processes go on without it; restarting it (restart 1 of 1)") for line in stderr.splitlines()), stderr
    assert "Process 1 took the chief's place after step " in stdout, stdout
    (record,) = registered(ws)  # torchrun restarted nothing
    assert record.status == "finished", record
    assert pids(ws, 1) == [survivor] and pids(ws, 0)[0] == victim and len(pids(ws, 0)) == 2
    got = assert_ran(ws, LAYOUTS[REPLICATED])
    assert got["status"] == "finished" and got["final_test"]["step"] == steps and "0" in got["missed_steps"], got
    assert [r["rank"] for r in got["rejoins"]] == [0], got
    assert "Traceback" not in stderr and "gloo" not in stderr.lower(), stderr
    assert leftover_processes(tmp_path) == []


CHIEF_DIES = '''
import json, os, signal, sys, time
from pathlib import Path
import torch, shoal
out = Path(sys.argv[1])
run = shoal.session(train_steps=60, disp_freq=5)
(out / f"pid{run.rank}.{os.getpid()}").write_text("")
torch.manual_seed(0)
model = run.model(torch.nn.Linear(4, 1, bias=False))
opt = run.optimizer(torch.optim.SGD(model.parameters(), lr=0.05))
for step in run.steps():
    if run.rank == 0 and step == 8 and not (out / "killed").exists():
        (out / "killed").write_text("")
        os.kill(os.getpid(), signal.SIGKILL)
    if run.rank != 0:
        time.sleep(0.05)  # (the restart has time to come back)
    loss = 0.5 * ((model.weight[0] - torch.arange(4.0) - run.rank) ** 2).sum()
    loss.backward()
    opt.step(); opt.zero_grad()
    run.log(step, loss=loss)
(out / f"rank{run.rank}.{os.getpid()}.json").write_text(json.dumps({"step": step}))
'''


@pytest.mark.slow  # one more torchrun run: the job file's (above) covers the chief's supervisor in the default suite
def test_a_killed_session_chief_under_torchrun_is_replaced(tmp_path, torchruns):
    """A shoal.session() loop under torchrun (AllReduce, 2 ranks, --max-restarts 1): rank 0 SIGKILLs itself at step 8;
    its supervisor restarts it into the running loop as a non-chief, rank 1 takes the chief's place and finishes the
    run log; torchrun restarts nothing, the registry's record ends finished."""
    script, out = tmp_path / "loop.py", tmp_path / "out"
    script.write_text(CHIEF_DIES)
    out.mkdir()
    ws = tmp_path / "ws"
    proc = torchrun_in_background(script, ws, tmp_path / "stdout.txt", tmp_path / "stderr.txt", "--set",
                                  "cluster.nworkers_per_group=2", "--set", "cluster.nworkers_per_procs=1", "--", str(out))
    proc.tmp_path, proc.out, proc.err = tmp_path, tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    torchruns.append(proc)
    assert proc.wait(timeout=180) == 0, proc.err.read_text()[-3000:]
    stdout, stderr = proc.out.read_text(), proc.err.read_text()
    assert "Process 1 took the chief's place after step " in stdout, stdout
    assert any(line.startswith("WARNING: process 0 (worker(group=0, id=0)") and "restarting it (restart 1 of 1)" in line
               for line in stderr.splitlines()), stderr
    (record,) = registered(ws)
    assert record.status == "finished", record
    assert len(list(out.glob("pid0.*"))) == 2 and len(list(out.glob("pid1.*"))) == 1
    got = summary(ws)
    assert got["status"] == "finished" and [r["rank"] for r in got["rejoins"]] == [0], got
    assert sorted(json.loads(p.read_text())["step"] for p in out.glob("rank*.json")) == [59, 59]  # both ended the loop
    assert "Traceback" not in stderr and "gloo" not in stderr.lower(), stderr
    assert leftover_processes(tmp_path) == []


def test_a_killed_chief_under_srun_is_replaced_and_the_store_outlives_it(blobs_job, tmp_path):
    """Three tasks as `srun --ntasks=3 shoal run JOB --max-restarts 1` starts them (AllReduce's replicas): rank 0's
    supervisor hosts the job's store (under srun no agent does), so SIGKILLing rank 0's training process loses nothing:
    process 1 takes the chief's place, rank 0's supervisor restarts the process as a non-chief, every task exits 0."""
    from test_launchers import slurm_env

    steps = 200
    job = blobs_job(train_steps=steps, cluster_extra=dict(nworkers_per_group=3))
    port, secret, ws = free_port(10000, 30000), job_secret(), tmp_path / "ws"
    outs = [open(tmp_path / f"task{rank}.txt", "w") for rank in range(3)]
    tasks = [subprocess.Popen([sys.executable, "-m", "shoal", "run", str(job), "--workspace", str(ws), "--no-progress",
                               "--max-restarts", "1"], stdout=outs[rank], stderr=subprocess.STDOUT, start_new_session=True,
                              env={**slurm_env(rank, 3, "localhost", job_id=port - 10000, secret=secret),
                                   "SHOAL_SLOW_WORKER": "0:0+0.01", **tagged(tmp_path)})
             for rank in range(3)]
    try:
        wait_for(lambda: registered(ws) and len(registered(ws)[0].processes) == 3
                 and "Train @ step 10 " in (tmp_path / "task0.txt").read_text(), 120, "never reached step 10", interval=0.05)
        (record,) = registered(ws)
        victim = next(p["pid"] for p in record.processes if p["rank"] == 0)
        os.kill(victim, signal.SIGKILL)
        codes = [task.wait(timeout=180) for task in tasks]
    finally:
        for task in tasks:
            if task.poll() is None:
                os.killpg(task.pid, signal.SIGKILL)
        for out in outs:
            out.close()
    said = [(tmp_path / f"task{rank}.txt").read_text() for rank in range(3)]
    assert codes == [0, 0, 0], [s[-2000:] for s in said]
    assert "Process 1 took the chief's place after step " in (ws / "logs" / "rank1.log").read_text()
    (record,) = registered(ws)
    assert record.status == "finished", record
    got = summary(ws)
    assert got["status"] == "finished" and got["final_test"]["step"] == steps and [r["rank"] for r in got["rejoins"]] == [0]
    assert pids(ws, 0)[0] == victim and len(pids(ws, 0)) == 2
    assert leftover_processes(tmp_path) == []
