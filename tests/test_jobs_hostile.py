"""A job registry that cannot be turned into a weapon: hostile files in $SHOAL_HOME/jobs for `shoal jobs`.

`jobs list` lists the good records and gives one line per bad file, never hangs; `jobs view` and `jobs kill`
refuse a bad record in one line; `jobs kill` signals no process its record does not match. The kill cases run
inside a PID namespace of the test's own, so that a regression (`kill(-1)`, `kill(1)`) cannot hurt the machine.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cli_in_process import run_cli

from shoal.launcher import job_registry as jobs

NOBODY = 65534


def record(job_id: int, **changes) -> dict:
    """A record as shoal writes it, for a finished job, with `changes` (a process field: process_<name>)."""
    process = {"rank": 0, "host": socket.gethostname(), "pid": 4242, "start": 1000, "cmdline": ["python", "-m", "shoal", "run", "job.conf"]}
    for key in [k for k in changes if k.startswith("process_")]:
        process[key[len("process_"):]] = changes.pop(key)
    now = time.time()
    return {"id": job_id, "name": "blobs-mlp", "job_file": "job.conf", "workspace": "/nonexistent/ws", "status": "finished",
            "started": now - 10, "ended": now, "processes": [process], "message": "", **changes}


def write(folder: Path, job_id: int, content, mode: int = 0o600) -> Path:
    path = folder / f"{job_id}.json"
    path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    path.chmod(mode)
    return path


def missing(field: str) -> dict:
    out = record(8)
    del out[field]
    return out


def hostile_registry(folder: Path, elsewhere: Path) -> dict[int, str]:
    """Good records 1 and 30 (shown as written), and the bad files: {id: what the one line must say}."""
    folder.mkdir(parents=True, mode=0o700)
    write(folder, 1, record(1))
    write(folder, 30, record(30, name="[/] \x1b[2J [bold]x", status="running"))  # rich markup and a terminal escape
    bad = {}
    os.mkfifo(folder / "2.json", 0o600)
    bad[2] = "a FIFO"
    write(folder, 3, bytes(range(256)) * 4)
    bad[3] = "not text"
    write(folder, 4, record(4, message="x" * (2 << 20)))
    bad[4] = "larger than"
    write(folder, 5, record(5, process_pid="4242"))
    bad[5] = "processes[0].pid is \"4242\""
    write(folder, 6, record(6, process_pid=[4242]))
    bad[6] = "processes[0].pid is [4242]"
    write(folder, 7, record(7, process_pid=4242.0))
    bad[7] = "processes[0].pid is 4242.0"
    write(folder, 8, missing("workspace"))
    bad[8] = "workspace is missing"
    (folder / "9.json").mkdir()
    bad[9] = "a folder"
    write(elsewhere, 10, record(10))
    (folder / "10.json").symlink_to(elsewhere / "10.json")
    bad[10] = "a symbolic link"
    for job_id, pid in ((11, -1), (12, 0), (13, 1)):
        write(folder, job_id, record(job_id, status="running", process_pid=pid))
        bad[job_id] = f"processes[0].pid is {pid}, expected a process id (an integer above 1)"
    write(folder, 14, b"[" * 200000)
    bad[14] = "not a job record"
    write(folder, 15, json.dumps(record(15, started=12.5)).replace("12.5", "NaN").encode())
    bad[15] = "NaN"
    write(folder, 16, record(1))
    bad[16] = "named for job 16"
    write(folder, 17, record(17, processes="all of them"))
    bad[17] = "processes is \"all of them\", expected a list"
    write(folder, 18, [record(18)])
    bad[18] = "not a JSON object"
    write(folder, 19, record(19), mode=0o666)
    bad[19] = "other users may write it"
    write(folder, 20, record(20, process_rank=True))
    bad[20] = "processes[0].rank is true"
    write(folder, 21, record(21, process_cmdline="python -m shoal"))
    bad[21] = "processes[0].cmdline is"
    if os.geteuid() == 0:  # only root can give a file away
        os.chown(write(folder, 22, record(22)), NOBODY, NOBODY)
        bad[22] = f"owned by uid {NOBODY}, not by you"
    try:  # a device (/dev/zero's numbers): read, it would never end
        os.mknod(folder / "23.json", stat.S_IFCHR | 0o600, os.makedev(1, 5))
        bad[23] = "a character device"
    except OSError:
        pass  # only root may make device files
    (folder / "notes.txt").write_text("not a record: ignored")
    return bad


def test_list_shows_good_records_and_one_line_per_hostile_file(job_registry, tmp_path):
    bad = hostile_registry(job_registry, tmp_path)
    started = time.monotonic()
    # a real process: a FIFO opened for reading would block it, hence the timeout; no traceback at any level
    out = subprocess.run([sys.executable, "-m", "shoal", "jobs", "list"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - started < 30
    rows = {line.split("│")[1].strip() for line in out.stdout.splitlines() if line.startswith("│")}
    assert rows == {"1", "30"}, out.stdout
    assert "[/]" in out.stdout and "\\x1b[2J" in out.stdout and "\x1b" not in out.stdout  # shown, not obeyed
    lines = out.stderr.strip().splitlines()
    assert len(lines) == len(bad), out.stderr
    for job_id, said in bad.items():
        mine = [line for line in lines if f"/{job_id}.json" in line]
        assert len(mine) == 1 and said in mine[0] and mine[0].endswith("skipped"), (job_id, said, mine)
    assert "Traceback" not in out.stderr
    assert stat.S_ISLNK(os.lstat(job_registry / "10.json").st_mode) and (tmp_path / "10.json").exists()  # nothing removed


# `jobs kill` of each hostile file, in the test's own PID namespace (a regression's kill(-1) stays in there)
KILL_EACH = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from cli_in_process import run_cli
    results = {}
    for job_id in sys.argv[2:]:
        out = run_cli("jobs", "kill", job_id, timeout=20)
        results[job_id] = [out.returncode, out.stdout, out.stderr]
    print(json.dumps(results))
""")


def test_view_and_kill_refuse_each_hostile_file_in_one_line(job_registry, tmp_path):
    bad = hostile_registry(job_registry, tmp_path)
    before = {p.name: p.lstat().st_mtime_ns for p in job_registry.iterdir()}
    views = {job_id: run_cli("jobs", "view", job_id, timeout=20) for job_id in bad}
    views = {str(job_id): [out.returncode, out.stdout, out.stderr] for job_id, out in views.items()}
    out = _in_own_pid_namespace(sys.executable, "-c", KILL_EACH, str(Path(__file__).parent), *map(str, bad), timeout=120)
    assert out.returncode == 0, out.stderr
    kills = json.loads(out.stdout.strip().splitlines()[-1])
    for job_id, said in bad.items():
        for verb, (returncode, stdout, stderr) in (("view", views[str(job_id)]), ("kill", kills[str(job_id)])):
            assert returncode == 2 and stdout == "", (verb, job_id, stdout, stderr)
            assert len(stderr.strip().splitlines()) == 1 and f"{job_id}.json" in stderr and said in stderr, (verb, job_id, stderr)
    assert {p.name: p.lstat().st_mtime_ns for p in job_registry.iterdir()} == before  # nothing rewritten


def test_view_of_a_record_whose_workspace_holds_a_fifo_returns(job_registry, tmp_path):
    workspace = tmp_path / "ws"
    workspace.mkdir()
    os.mkfifo(workspace / "metrics.jsonl")
    job_registry.mkdir(mode=0o700)
    write(job_registry, 1, record(1, workspace=str(workspace)))
    out = run_cli("jobs", "view", 1, timeout=20)
    assert out.returncode == 0 and str(workspace) in out.stdout and "last" not in out.stdout, out


def test_registry_is_private_and_refuses_another_users_folder(job_registry, tmp_path):
    job_registry.mkdir(mode=0o755)  # as an older shoal left it, under a 022 umask
    record_ = jobs.register("blobs-mlp", "job.conf", tmp_path)
    jobs.finish(record_, "finished")
    assert stat.S_IMODE(job_registry.stat().st_mode) == 0o700
    assert stat.S_IMODE(record_.path.stat().st_mode) == 0o600 and record_.path.stat().st_uid == os.geteuid()
    entry = jobs.load(record_.id).processes[0]
    assert entry["pid"] == os.getpid() and entry["start"] is not None and entry["cmdline"] == jobs.process_identity.command_line(os.getpid())
    assert sorted(p.name for p in job_registry.iterdir()) == ["1.json"]  # no temporary file left behind
    if os.geteuid() != 0:
        return
    os.chown(job_registry, NOBODY, NOBODY)
    with pytest.raises(jobs.RegistryError, match=f"belongs to uid {NOBODY}, not to you; set SHOAL_HOME"):
        jobs.register("blobs-mlp", "job.conf", tmp_path)



def test_list_and_registration_remove_the_locks_of_runs_killed_with_sigkill(job_registry, tmp_path):
    """A run killed with SIGKILL leaves its <id>.lock behind: `jobs list` (and the next registration) removes a lock
    nobody holds of a job whose record no longer runs, and nothing else: not a lock a process holds, nor one of a
    running job (a run may be between making its lock and locking it), nor a link, a hard link, another user's file
    or a lock without a record."""
    job_registry.mkdir(mode=0o700)
    here = socket.gethostname()
    ended = subprocess.Popen(["true"])
    ended.wait()  # a pid that has exited
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)\n"
                               "fcntl.lockf(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(120)\n",
                               str(job_registry / "4.lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        me = {"rank": 0, "host": here, "pid": os.getpid(), "start": jobs.start_time(os.getpid()),
              "cmdline": jobs.process_identity.command_line(os.getpid())}
        write(job_registry, 1, record(1))  # finished
        write(job_registry, 2, record(2, status="running", process_pid=ended.pid, process_host=here))  # died
        write(job_registry, 3, record(3, status="running", processes=[me]))  # alive
        for job_id in (4, 5, 6, 8, 9):
            write(job_registry, job_id, record(job_id))
        target = tmp_path / "target"
        target.write_text("someone's\n")
        for job_id in (1, 2, 3, 8):
            (job_registry / f"{job_id}.lock").write_text("")
        (job_registry / "5.lock").symlink_to(target)
        os.link(target, job_registry / "6.lock")
        (job_registry / "7.lock").write_text("")  # no record
        if os.geteuid() == 0:
            os.chown(job_registry / "8.lock", NOBODY, NOBODY)
        out = subprocess.run([sys.executable, "-m", "shoal", "jobs", "list"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stderr == "", out.stderr
        locks = sorted(p.name for p in job_registry.glob("*.lock"))
        assert locks == ["3.lock", "4.lock", "5.lock", "6.lock", "7.lock"] + (["8.lock"] if os.geteuid() == 0 else [])
        assert target.read_text() == "someone's\n" and os.path.islink(job_registry / "5.lock")
    finally:
        holder.kill()
        holder.wait()
    (job_registry / "9.lock").write_text("")  # another run killed; 4's run, too, now: the next run removes both
    record_ = jobs.register("blobs-mlp", "job.conf", tmp_path)
    assert not (job_registry / "9.lock").exists() and not (job_registry / "4.lock").exists()
    assert (job_registry / f"{record_.id}.lock").exists()  # its own
    jobs.finish(record_, "finished")


# --- jobs kill, inside a PID namespace of the test's own ---------------------------------------------------------

# Run as the namespace's first process (pid 1 there: a stray kill(-1) or kill(1) spares it, so it can tell).
# Decoys are `sleep`s; every record below but the last names one of them, a pid that must never be signalled, or a
# stand-in for shoal's run that the record cannot prove: a process holding the lock of another job, not of its own.
IN_NAMESPACE = textwrap.dedent("""
    import json, os, socket, subprocess, sys, time

    class ids:  # what /proc says, read here rather than by the code under test
        start_time = lambda pid: int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19])
        command_line = lambda pid: open(f"/proc/{pid}/cmdline", "rb").read().decode().rstrip("\\0").split("\\0")
    def alive(pid):
        try:
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    folder = sys.argv[1]
    os.makedirs(folder, mode=0o700, exist_ok=True)
    def exec_done(pid, argv):
        while ids.command_line(pid) != argv:  # until it has exec'd
            time.sleep(0.01)
        return pid
    def sleeper(**kw):
        proc = subprocess.Popen(["sleep", "300"], **kw)
        exec_done(proc.pid, ["sleep", "300"])
        return proc.pid
    # a stand-in for shoal's run of a job: it holds the job's lock (a POSIX write lock on <id>.lock, as shoal's
    # register does) and has started a process of its own
    HOLD = ("import fcntl, os, subprocess, sys, time\\n"
            "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)\\n"
            "fcntl.lockf(fd, fcntl.LOCK_EX)\\n"
            "print(subprocess.Popen(['sleep', '300']).pid, flush=True)\\n"
            "time.sleep(300)\\n")
    def run_of(job_id):
        proc = subprocess.Popen([sys.executable, "-c", HOLD, f"{folder}/{job_id}.lock"], stdout=subprocess.PIPE, text=True)
        child = exec_done(int(proc.stdout.readline()), ["sleep", "300"])
        return exec_done(proc.pid, [sys.executable, "-c", HOLD, f"{folder}/{job_id}.lock"]), child
    decoy, other_users = sleeper(), sleeper(user=65534) if os.geteuid() == 0 else None
    run14, _ = run_of(14)
    run16, started_by_run16 = run_of(16)
    bystanders = [pid for pid in (decoy, other_users, run14) if pid]
    def process(real_pid, **changes):
        entry = {"rank": 0, "host": socket.gethostname(), "pid": real_pid, "start": ids.start_time(real_pid),
                 "cmdline": ids.command_line(real_pid)}
        return {**entry, **changes}
    def nobody_holds_13():
        os.close(os.open(f"{folder}/13.lock", os.O_CREAT | os.O_WRONLY, 0o600))
    def link_15_to_14s_lock():
        os.link(f"{folder}/14.lock", f"{folder}/15.lock")
    cases = {  # case: (the record's processes, what is done first)
        "pid -1": [process(decoy, pid=-1)], "pid 0": [process(decoy, pid=0)], "pid 1": [process(decoy, pid=1)],
        "pid as a string": [process(decoy, pid=str(decoy))], "pid as a float": [process(decoy, pid=float(decoy))],
        "unrelated live process": [process(decoy, start=12345, cmdline=["python", "-m", "shoal", "run", "job.conf"])],
        "right pid, other start time": [process(decoy, start=ids.start_time(decoy) - 1)],
        "right pid and start, other command line": [process(decoy, cmdline=["python", "-m", "shoal", "run", "job.conf"])],
        "no start time recorded": [process(decoy, start=None)],
        "no command line recorded": [process(decoy, cmdline=None)],
        "another user's process": [process(other_users)] if other_users else None,
        "a sleep matching its record, no lock": [process(decoy)],
        "a sleep matching its record, a lock nobody holds": ([process(decoy)], nobody_holds_13),
        "a sleep matching its record while the run holds the lock": [process(decoy)],
        "the run of another job, through a hard link to its lock": ([process(run14)], link_15_to_14s_lock),
        "the run and the process it started": [process(run16, rank="launcher"), process(started_by_run16)],
    }
    # `shoal jobs kill ID` in a process of its own, not pid 1 (a fork of this one: shoal's CLI imported once, not an
    # interpreter per case), in this process's group as a command run from here would be
    sys.path.insert(0, sys.argv[2])
    from cli_in_process import run_cli
    def kill_in_a_child(job_id):
        read, write = os.pipe()
        child = os.fork()
        if child == 0:
            os.close(read)
            code = 1
            try:
                out = run_cli("jobs", "kill", job_id, timeout=60)
                os.write(write, json.dumps({"rc": out.returncode, "stdout": out.stdout, "stderr": out.stderr}).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        with os.fdopen(read, "rb") as answer:
            said = answer.read()
        assert os.waitpid(child, 0)[1] == 0 and said, f"jobs kill {job_id}: its process failed"
        return json.loads(said)
    results = {}
    for job_id, (case, what) in enumerate(cases.items(), 1):
        if what is None:
            continue
        named, prepare = what if isinstance(what, tuple) else (what, None)
        if prepare:
            prepare()
        rec = {"id": job_id, "name": case, "job_file": "job.conf", "workspace": "/nonexistent", "status": "running",
               "started": time.time(), "processes": named, "message": ""}
        with open(os.open(f"{folder}/{job_id}.json", os.O_CREAT | os.O_WRONLY, 0o600), "w") as f:
            f.write(json.dumps(rec))
        out = kill_in_a_child(job_id)
        results[case] = {**out, "bystanders_alive": all(alive(pid) for pid in bystanders), "named": named,
                         "status": json.load(open(f"{folder}/{job_id}.json"))["status"]}
    # a stray signal takes effect within moments: once, after every case, each case's processes are looked at again
    # (a bystander must be alive both right after each case and now; the named ones as each case expects)
    time.sleep(0.5)
    for result in results.values():
        named = result.pop("named")
        result["bystanders_alive"] = result["bystanders_alive"] and all(alive(pid) for pid in bystanders)
        result["named_alive"] = [alive(p["pid"]) for p in named if isinstance(p["pid"], int) and p["pid"] > 1]
    for pid in bystanders + [run16, started_by_run16]:
        if alive(pid):
            os.kill(pid, 9)
    print(json.dumps(results))
""")


def _in_own_pid_namespace(*command: str, timeout: float) -> subprocess.CompletedProcess:
    if not shutil.which("unshare"):
        pytest.skip("unshare (util-linux) is not installed: no PID namespace to run hostile kills in")
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a PID namespace here (needs root or user namespaces): {probe.stderr.strip()}")
    # a session of its own too: process groups span PID namespaces, and a regression's kill(0) signals the caller's group
    return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", *command], capture_output=True, text=True,
                          timeout=timeout, start_new_session=True)


def test_kill_signals_only_a_process_that_provably_is_the_jobs_run(job_registry):
    out = _in_own_pid_namespace(sys.executable, "-c", IN_NAMESPACE, str(job_registry), str(Path(__file__).parent), timeout=180)
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout.strip().splitlines()[-1])
    expected_words = {
        "pid -1": "expected a process id", "pid 0": "expected a process id", "pid 1": "expected a process id",
        "pid as a string": "expected a process id", "pid as a float": "expected a process id",
        "unrelated live process": "another process now", "right pid, other start time": "another process now",
        "right pid and start, other command line": "runs another command", "no start time recorded": "no start time",
        "no command line recorded": "no command line",
        "another user's process": f"belongs to uid {NOBODY}",
        # issue 37: pid, start time, owner and command line all match, yet nothing proves the process is the job's run
        "a sleep matching its record, no lock": f"is not shown to be this job's run: its lock {job_registry / '12.lock'} is gone",
        "a sleep matching its record, a lock nobody holds": f"nothing here holds its lock {job_registry / '13.lock'}",
        "a sleep matching its record while the run holds the lock": "is not shown to be this job's run: it neither holds the job's lock "
                                                                    "nor was started by its holder",
        "the run of another job, through a hard link to its lock": "is not a lock file shoal made",
    }
    for case, said in expected_words.items():
        if case not in results:
            continue  # another user's process: only root can start one
        result = results[case]
        assert result["bystanders_alive"] and all(result["named_alive"]), (case, result)
        assert result["rc"] == 2 and result["stdout"] == "" and result["status"] == "running", (case, result)
        lines = result["stderr"].strip().splitlines()
        assert len(lines) == 1 and said in lines[0], (case, result["stderr"])
    assert set(expected_words) - set(results) <= {"another user's process"}
    run = results["the run and the process it started"]  # the lock's holder, and its child: both signalled
    assert run["rc"] == 0 and "killed" in run["stdout"] and run["stderr"] == "", run
    assert run["named_alive"] == [False, False] and run["bystanders_alive"] and run["status"] == "killed", run
