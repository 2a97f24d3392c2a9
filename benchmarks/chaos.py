"""Claim (issue 38, point 5): every framework that outlives a fault trains the example GPT through a seeded schedule of
faults as a machine would suffer them, and loses little: on the 2-core machine, idle, every run exits 0, goodput
(the unfaulted run's wall time / the faulted run's) >= 0.9 with a kill every 60 s, the final validation loss within
1 % of the unfaulted run's, and nothing left behind (processes, listening ports, /dev/shm entries).

Each framework's job is `shoal run examples/gpt/train.py` (shoal.fit's module path) with the framework's
`--set cluster.…` and `--max-restarts`, run twice, alternating: unfaulted, then faulted (a second round, --repeats 2,
starts with the faulted one). The faulted run's schedule, drawn from --seed (the same seed, the same victims and
moments):

- SIGKILL of a random non-chief worker process every --kill-every seconds, the clock started at the chief's first
  training record. Candidates: the processes other than 0 whose log says they host a worker, alive and not stopped
  (a process the launcher is restarting is none until its new pid is in its log). A kill due while there is none
  waits for one; it is skipped when the next kill falls due first (or the run ends);
- once per run (--stop), SIGSTOP of a random candidate once the chief's step passes a drawn point in 30-50 % of the
  steps, SIGCONT after the stall timeout and 5 s more (a machine frozen, then back);
- where the job has servers of their own (Downpour's and Sandblaster's server process), one SIGKILL of a server once the chief's
  step passes a drawn point in 60-80 % of the steps (--server-kill): the launcher restarts it into the running job
  and it heals from the chief's mirror of its state (its heal record in rejoins.jsonl). The `chief` row kills
  process 0 once instead (40-60 %). Jobs with these deaths checkpoint every steps/10 (both runs). A job file's
  chief's death brings the whole job back from its newest checkpoint; train.py's fit runs DiLoCo as a user's loop on
  the session, whose chief is dropped like any other process and rejoins (its record in rejoins.jsonl), the lowest
  living process deciding the meetings meanwhile.

The victims' pids are read as a user would: a worker's from its log (WORKSPACE/logs/rank<R>.log, "… in process R
(pid = P)", the newest line being the live process), a server's from the job registry (`shoal jobs list --json
--workspace WS`, `shoal jobs view ID`).

Printed per framework: the faults injected; restarts (the launcher's warnings: processes restarted, and whole-job
restarts); heal times (a kill to the restarted process's rejoin record in WORKSPACE/logs/rejoins.jsonl, or, where the
whole job restarted, to the new chief's first training record, which train.py displays every steps/20 steps; a stop
to the warning that the process stopped answering); the final validation loss faulted and unfaulted and their
ratio; goodput; both exit codes; what the job left behind once its launcher exited (its processes, found by an environment
tag every process of the job inherits; the TCP ports its processes listened on that still listen, the same socket;
the /dev/shm entries that appeared while it ran and that a process of the job had open). Then the claims against
their goals. A run that took longer than --timeout is killed and counted as failed. Exit status 1 when a run did not
exit 0 or left something behind (the goodput and loss goals are the table's to judge).

Defaults: Downpour and DiLoCo (--frameworks all adds Distributed Hogwild, AllReduce, Sandblaster and the chief's death), a kill
every 60 s, steps per framework for an unfaulted run of about 2 minutes on the idle 2-core machine: about 10 minutes
in all (all six: about 30). --quick: the small GPT, a kill every 4 s, a 5 s stall timeout (3 s, the tests' own, once
read the store as stalled at a load of 13), 20-60 s per run.

    shoal prepare shakespeare --out examples/gpt/data     # once
    python benchmarks/chaos.py [--frameworks downpour diloco] [--kill-every 60] [--seed 1] [--steps N] [--quick]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "gpt" / "train.py"
TAG = "SHOAL_CHAOS_RUN"  # every process of a job inherits it: what is still alive after the job is its leftover
DILOCO = ("outer_updater.type=kNesterov", "outer_updater.momentum=0.9", "outer_updater.learning_rate.type=kFixed",
          "outer_updater.learning_rate.base_lr=0.7")
SIZES = {  # the example's model (train.py's defaults), and the small one of --quick
    "example": dict(layers=4, heads=4, width=128, block=64, batch=12, val_windows=1000),
    "small": dict(layers=2, heads=2, width=64, block=32, batch=8, val_windows=200),
}


@dataclass(frozen=True)
class Framework:
    label: str
    cluster: tuple[str, ...]  # cluster.FIELD=VALUE
    steps: int  # steps per group: an unfaulted run of about 2 minutes on the idle 2-core machine (example size)
    quick_steps: int  # the same at --quick's size, about 10 s
    kills: bool = True  # random non-chief worker processes every --kill-every s
    stop: bool = True  # one SIGSTOP past the stall timeout
    server: bool = False  # one SIGKILL of a server process (the job's servers are processes of their own)
    chief: bool = False  # one SIGKILL of process 0 (a job file's chief: the whole job restarts; a user's loop's: it rejoins)


FRAMEWORKS = {
    "downpour": Framework("Downpour, 2 groups + 1 server, 3 processes",
                          ("nworker_groups=2", "server_worker_separate=true"), 1400, 1000, server=True),
    "hogwild": Framework("Distributed Hogwild, 2 groups, 2 processes", ("nworker_groups=2", "nserver_groups=2"), 1300, 1000),
    "diloco": Framework("DiLoCo H=50, 3 groups, 3 processes", ("nworker_groups=3", "local_steps=50", *DILOCO), 1200, 800),
    "allreduce": Framework("AllReduce, 2 processes, 2 server slices", ("nworkers_per_group=2", "nservers_per_group=2"), 2400, 1600),
    "sandblaster": Framework("Sandblaster, 2 workers + 1 server, 3 processes",
                             ("nworkers_per_group=2", "server_worker_separate=true"), 1600, 1200, server=True),
    "chief": Framework("DiLoCo H=50, 2 groups, the chief killed once", ("nworker_groups=2", "local_steps=50", *DILOCO), 1300, 1000,
                       kills=False, stop=False, chief=True),
}
DEFAULT = ["downpour", "diloco"]  # with --kill-every 60: about 10 minutes on the idle 2-core machine
MAX_KILLS = 100  # scheduled; the run's end stops them


# -- what the job's files say, read as a user would ---------------------------------------------------
START = re.compile(r"^Worker \(group = (\d+), id = \d+\) start on \S+ in process (\d+) \(pid = (\d+)\)", re.M)


def worker_pids(ws: Path) -> dict[int, list[int]]:
    """rank -> the pid of every process that ran it, in order (its log's start lines)."""
    out: dict[int, list[int]] = {}
    for log in (ws / "logs").glob("rank*.log"):
        try:
            text = log.read_text(errors="replace")
        except OSError:
            continue
        for _group, rank, pid in START.findall(text):
            pids = out.setdefault(int(rank), [])
            if int(pid) not in pids:
                pids.append(int(pid))
    return out


def registry_pids(ws: Path, env: dict) -> dict[str, int]:
    """The newest job of this workspace in the registry: 'launcher' / rank -> pid (`shoal jobs`)."""
    listed = subprocess.run([sys.executable, "-m", "shoal", "jobs", "list", "--json", "--workspace", str(ws)],
                            capture_output=True, text=True, env=env, timeout=120)
    jobs = json.loads(listed.stdout or "[]") if listed.returncode == 0 else []
    if not jobs:
        return {}
    view = subprocess.run([sys.executable, "-m", "shoal", "jobs", "view", str(max(j["id"] for j in jobs))],
                          capture_output=True, text=True, env=env, timeout=120)
    return {rank: int(pid) for rank, pid in re.findall(r"^\s+rank (\S+): host \S+, pid (\d+)", view.stdout, re.M)}


def server_ranks(ws: Path) -> list[int]:
    """Processes whose log says they host a server and no worker (a server process of its own)."""
    ranks = []
    for log in (ws / "logs").glob("rank*.log"):
        text = log.read_text(errors="replace")
        if re.search(r"^Server \(group = \d+, id = \d+\) start in process", text, re.M) and not START.search(text):
            ranks.append(int(log.stem[len("rank"):]))
    return sorted(ranks)


def read_jsonl(path: Path) -> list[dict]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:  # a line being written
            pass
    return out


# -- what the job holds: processes, listening sockets, /dev/shm ------------------------------------------
def tagged_processes(tag: str) -> list[int]:
    mark = f"{TAG}={tag}".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if mark in environ.read_bytes().split(b"\0") and alive(int(environ.parent.name)):
                found.append(int(environ.parent.name))
        except OSError:  # ended meanwhile, or not ours
            continue
    return found


def alive(pid: int) -> bool:
    """Running or stopped, not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def listening() -> dict[int, int]:
    """socket inode -> port of every listening TCP socket on this host."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == "0A":
                out[int(cols[9])] = int(cols[1].rsplit(":", 1)[1], 16)
    return out


def holdings(pids: list[int]) -> tuple[set[int], set[str]]:
    """The socket inodes and /dev/shm names the processes have open (files or maps)."""
    sockets, shm = set(), set()
    for pid in pids:
        try:
            for fd in os.scandir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(fd.path)
                except OSError:
                    continue
                if target.startswith("socket:["):
                    sockets.add(int(target[8:-1]))
                elif target.startswith("/dev/shm/"):
                    shm.add(target[len("/dev/shm/"):].split("/")[0].removesuffix(" (deleted)"))
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                if "/dev/shm/" in line:
                    shm.add(line.split("/dev/shm/", 1)[1].split("/")[0].removesuffix(" (deleted)"))
        except OSError:
            continue
    return sockets, shm


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


# -- one run -------------------------------------------------------------------------------------------
@dataclass
class Fault:
    kind: str  # kill, stop, server, chief
    at: float  # kill: seconds since the chief's first training record; the others: the chief's step
    draw: float  # picks the victim among the candidates of the moment (drawn with the schedule: the same seed, the same pick)
    rank: Optional[int] = None
    pid: Optional[int] = None
    sent: Optional[float] = None  # wall clock
    heal_s: Optional[float] = None
    how: str = ""  # how it came back, or what happened
    skipped: str = ""
    waiting: str = ""  # due, but no process could take it (why)
    retry_at: float = 0.0
    chiefs_before: list[int] = field(default_factory=list)  # process 0's pids when it was sent


@dataclass
class Outcome:
    framework: str
    faulted: bool
    code: Optional[int] = None
    wall_s: float = 0.0
    val_loss: Optional[float] = None
    faults: list[Fault] = field(default_factory=list)
    restarts: dict[int, int] = field(default_factory=dict)  # rank -> new pids seen in its log
    process_restarts: int = 0  # the launcher's warnings: "… restarting it (restart k of N)"
    job_restarts: int = 0  # "… restarting the whole job …"
    stderr_tracebacks: int = 0  # a user reads lines, never a traceback
    processes_left: list[int] = field(default_factory=list)
    ports_left: list[int] = field(default_factory=list)
    shm_left: list[str] = field(default_factory=list)
    shm_other_new: int = 0
    last_error: str = ""
    missed: dict = field(default_factory=dict)
    missed_steps: dict = field(default_factory=dict)  # summary.json's: the steps a process or group skipped
    reshared: dict = field(default_factory=dict)  # summary.json's reshared_steps: Hogwild's skipped steps, re-trained by whom


class Job:
    """`shoal run examples/gpt/train.py …` in the background, its output in files, its session its own."""

    def __init__(self, name: str, args, folder: Path, faulted: bool):
        fw, size = FRAMEWORKS[name], SIZES[args.size]
        self.name, self.fw, self.args, self.faulted = name, fw, args, faulted
        self.steps = args.steps or (fw.quick_steps if args.quick else fw.steps)
        self.dir = Path(tempfile.mkdtemp(prefix=f"{name}-{'faulted' if faulted else 'unfaulted'}-", dir=folder))
        self.ws, self.out, self.err = self.dir / "ws", self.dir / "stdout.txt", self.dir / "stderr.txt"
        self.tag = str(self.dir)
        self.signalled: set[int] = set()
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", **{TAG: self.tag})
        sets = [a for s in fw.cluster for a in ("--set", f"cluster.{s}")]
        sets += ["--set", f"cluster.stall_timeout_s={args.stall_timeout:g}"]
        if fw.server or fw.chief:  # the chief's death: the whole job comes back from the newest checkpoint (a server heals)
            sets += ["--set", f"checkpoint_freq={max(1, self.steps // 10)}"]
        model = [a for k in ("layers", "heads", "width", "block", "batch") for a in (f"--{k}", str(size[k]))]
        self.command = [sys.executable, "-m", "shoal", "run", str(SCRIPT), "--workspace", str(self.ws), "--no-progress",
                        "--max-restarts", str(args.max_restarts), *sets, "--",
                        "--data", str(args.data), "--steps", str(self.steps), "--val-freq", str(self.steps),
                        "--val-windows", str(size["val_windows"]), "--seed", "1337", *model]

    def run(self, rng: random.Random) -> Outcome:
        """rng: the fault schedule's (unused by an unfaulted run)."""
        result = Outcome(self.name, self.faulted)
        shm_before = shm_entries()
        sockets_seen: dict[int, int] = {}  # inode -> port, of the job's listening sockets
        shm_seen: set[str] = set()
        schedule = self._schedule(rng) if self.faulted else []
        pending = sorted((f for f in schedule if f.kind != "kill"), key=lambda f: f.at)
        kills = [f for f in schedule if f.kind == "kill"]
        stopped: list[tuple[int, float]] = []  # (pid, continue at)
        seen_pids: dict[int, list[int]] = {}
        first_train: Optional[float] = None
        step = -1
        last_train = None  # the newest training record read (a whole-job restart may rewrite the file)
        waiting_for_train: list[Fault] = []  # whole-job restarts: healed at the new chief's first training record
        start = time.monotonic()
        deadline = start + self.args.timeout
        with open(self.out, "w") as out, open(self.err, "w") as err:
            proc = subprocess.Popen(self.command, stdout=out, stderr=err, env=self.env, cwd=self.dir, start_new_session=True)
        last_sample = 0.0
        try:
            while proc.poll() is None:
                now = time.monotonic()
                if now > deadline:
                    result.last_error = f"timed out after {self.args.timeout:.0f} s: the job was killed"
                    break
                self._note_pids(seen_pids)
                trains = [r for r in read_jsonl(self.ws / "metrics.jsonl") if r.get("phase") == "train"]
                if trains and (len(trains), trains[-1]) != last_train:
                    if first_train is None:
                        first_train = now
                    for fault in waiting_for_train:  # a new process 0 trains after the launcher's whole-job restart
                        # (in a user's loop a dead chief is dropped instead, and its restarted process rejoins: _heal)
                        if fault.heal_s is None and any(p not in fault.chiefs_before for p in seen_pids.get(0, [])) \
                                and "restarting the whole job" in self.err.read_text(errors="replace"):
                            fault.heal_s, fault.how = time.time() - fault.sent, "the whole job restarted"
                    step, last_train = trains[-1]["step"], (len(trains), trains[-1])
                if now - last_sample > 0.5:  # what the job holds, to know what it left
                    last_sample = now
                    pids = tagged_processes(self.tag)
                    sockets, shm = holdings(pids)
                    table = listening()
                    sockets_seen.update({i: table[i] for i in sockets if i in table})
                    shm_seen |= shm
                for pid, until in list(stopped):
                    if now >= until:
                        self._signal(pid, signal.SIGCONT)
                        stopped.remove((pid, until))
                if first_train is not None and self.faulted:
                    # a fault due while no process can take it waits for one; a kill waits until the next one is due
                    since = now - first_train
                    due = [f for f in kills if since >= f.at and f.sent is None and not f.skipped]
                    for fault in due[:-1]:
                        fault.skipped = fault.waiting or "no process could take it"
                    for fault in due[-1:] + [f for f in pending if step >= f.at and f.sent is None]:
                        if now >= fault.retry_at:
                            self._inject(fault, stopped, waiting_for_train)
                            fault.retry_at = now + (2.0 if fault.kind == "server" else 0.0)  # (the registry's answer takes a while)
                self._heal(schedule)
                time.sleep(0.1)
            if proc.poll() is None:  # timed out
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            for fault in schedule:
                if fault.sent is None and fault.waiting and not fault.skipped:
                    fault.skipped = f"{fault.waiting} until the run ended"
        except BaseException:  # interrupted: leave nothing running
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            raise
        result.wall_s = time.monotonic() - start
        result.code = proc.returncode if not result.last_error else None
        self._note_pids(seen_pids)
        self._heal(schedule)
        try:
            summary = json.loads((self.ws / "summary.json").read_text())
            result.missed, result.missed_steps = summary.get("missed_updates") or {}, summary.get("missed_steps") or {}
            result.reshared = summary.get("reshared_steps") or {}
        except (OSError, ValueError):
            pass
        for fault in schedule:
            if fault.kind == "stop" and fault.sent is not None and fault.heal_s is None and not fault.how:
                dropped = any(f"process {fault.rank} stopped answering" in str(m.get("why")) for m in result.missed.values())
                # (it was continued before the job noticed, and left or ran on; or the job ended first)
                fault.how = "dropped (summary.json), never named on the terminal" if dropped else "never named stalled"
        # what is left once the launcher exited (a moment for the last ones to be reaped)
        for _ in range(25):
            result.processes_left = tagged_processes(self.tag)
            if not result.processes_left:
                break
            time.sleep(0.2)
        table = listening()
        result.ports_left = sorted({port for inode, port in sockets_seen.items() if table.get(inode) == port})
        appeared = shm_entries() - shm_before
        result.shm_left = sorted(appeared & shm_seen)
        result.shm_other_new = len(appeared - shm_seen)
        if result.processes_left:  # they are the benchmark's to end, after they were counted
            for pid in result.processes_left:
                self._signal(pid, signal.SIGKILL)
        result.faults = schedule
        result.restarts = {rank: len(p) - 1 for rank, p in seen_pids.items() if len(p) > 1}
        stderr = self.err.read_text(errors="replace")
        result.process_restarts = len(re.findall(r"restarting it \(restart \d+ of \d+\)", stderr))
        result.job_restarts = len(re.findall(r"restarting the whole job", stderr))
        result.stderr_tracebacks = stderr.count("Traceback (most recent call last)")
        validations = [r for r in read_jsonl(self.ws / "metrics.jsonl") if r.get("phase") == "validate"]
        # the trained model's: at the last step (Distributed Hogwild's chief re-trains its share of skipped steps past it)
        final = [r for r in validations if r["step"] >= self.steps]
        result.val_loss = final[-1]["loss"] if final else None
        if result.code not in (0, None) and not result.last_error:
            lines = [line for line in self.err.read_text(errors="replace").splitlines() if line.strip()]
            result.last_error = lines[-1] if lines else f"exit {result.code}"
        return result

    def _schedule(self, rng: random.Random) -> list[Fault]:
        fw, args = self.fw, self.args
        faults = []
        if fw.kills:  # every period until the run ends
            faults += [Fault("kill", k * args.kill_every, rng.random()) for k in range(1, MAX_KILLS + 1)]
        if fw.stop and args.stop:
            faults.append(Fault("stop", round(self.steps * rng.uniform(0.3, 0.5)), rng.random()))
        if fw.server and args.server_kill:
            faults.append(Fault("server", round(self.steps * rng.uniform(0.6, 0.8)), rng.random()))
        if fw.chief:
            faults.append(Fault("chief", round(self.steps * rng.uniform(0.4, 0.6)), 0.0))
        return faults

    def _note_pids(self, seen: dict[int, list[int]]) -> None:
        for rank, pids in worker_pids(self.ws).items():
            mine = seen.setdefault(rank, [])
            mine.extend(p for p in pids if p not in mine)

    def _inject(self, fault: Fault, stopped: list, waiting: list) -> None:
        if fault.kind in ("kill", "stop"):
            live = {rank: pids[-1] for rank, pids in worker_pids(self.ws).items()
                    if rank != 0 and pids[-1] not in self.signalled and alive(pids[-1]) and not is_stopped(pids[-1])}
            if not live:
                fault.waiting = "no live non-chief worker process"
                return
            fault.rank = pick(sorted(live), fault.draw)
            fault.pid = live[fault.rank]
        elif fault.kind == "server":
            ranks = server_ranks(self.ws)
            if not ranks:
                fault.waiting = "no server process"
                return
            fault.rank = pick(ranks, fault.draw)
            fault.pid = registry_pids(self.ws, self.env).get(str(fault.rank))
        else:  # chief
            fault.rank = 0
            fault.pid = (worker_pids(self.ws).get(0) or [None])[-1]
        if fault.pid is None or fault.pid in self.signalled or not alive(fault.pid):
            fault.waiting = f"no live pid for process {fault.rank}"
            return
        fault.chiefs_before = list(worker_pids(self.ws).get(0, []))
        fault.sent = time.time()
        self.signalled.add(fault.pid)  # (a process just killed may look alive for a moment)
        if fault.kind == "stop":
            self._signal(fault.pid, signal.SIGSTOP)
            stopped.append((fault.pid, time.monotonic() + self.args.stall_timeout + 5))
        else:
            self._signal(fault.pid, signal.SIGKILL)
            if fault.kind in ("server", "chief"):
                waiting.append(fault)

    @staticmethod
    def _signal(pid: int, sig: int) -> None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    def _heal(self, schedule: list[Fault]) -> None:
        """Heal times from the job's own records: a rejoin of the rank after the fault; a stop: the chief's warning."""
        rejoins = read_jsonl(self.ws / "logs" / "rejoins.jsonl")
        stderr = self.err.read_text(errors="replace") if self.err.exists() else ""
        for fault in schedule:
            if fault.sent is None or fault.heal_s is not None:
                continue
            back = [r for r in rejoins if r.get("rank") == fault.rank and r.get("time", 0) > fault.sent]
            if back:
                how = "healed from the chief's mirror" if back[0].get("server") is not None else "rejoined"
                fault.heal_s, fault.how = back[0]["time"] - fault.sent, how
            elif fault.kind == "stop" and not fault.how and re.search(rf"process {fault.rank} \(.*\) stopped answering", stderr):
                fault.how = f"named stalled after {time.time() - fault.sent:.1f} s"


def pick(ranks: list[int], draw: float) -> int:
    return ranks[min(len(ranks) - 1, int(draw * len(ranks)))]


def is_stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


# -- the table -------------------------------------------------------------------------------------------
def describe_faults(faults: list[Fault]) -> str:
    done = [f for f in faults if f.sent is not None]
    counts = {k: sum(1 for f in done if f.kind == k) for k in ("kill", "stop", "server", "chief")}
    words = [f"{n} {k if k in ('kill', 'stop') else k + ' kill'}{'s' if n > 1 else ''}" for k, n in counts.items() if n]
    skipped = [f for f in faults if f.skipped]
    text = ", ".join(words) or "none"
    return text + (f" ({len(skipped)} skipped: {skipped[0].skipped})" if skipped else "")


def heal_times(faults: list[Fault]) -> str:
    parts = []
    for f in faults:
        if f.sent is None:
            continue
        who = f"{f.kind} {f.rank}"
        if f.heal_s is not None:
            parts.append(f"{who}: {f.heal_s:.1f}" + (" (whole job)" if f.how == "the whole job restarted" else ""))
        else:
            parts.append(f"{who}: {f.how or 'not back'}")
    return "; ".join(parts) or "—"


def left_behind(r: Outcome) -> str:
    parts = []
    if r.processes_left:
        parts.append(f"{len(r.processes_left)} processes ({', '.join(map(str, r.processes_left))})")
    if r.ports_left:
        parts.append(f"ports {', '.join(map(str, r.ports_left))}")
    if r.shm_left:
        parts.append(f"/dev/shm {', '.join(r.shm_left)}")
    text = "; ".join(parts) or "nothing"
    return text + (f" ({r.shm_other_new} other new /dev/shm entries, never open in the job)" if r.shm_other_new else "")


def clean(r: Outcome) -> bool:
    return not (r.processes_left or r.ports_left or r.shm_left)


def loss(x: Optional[float]) -> str:
    return "—" if x is None else f"{x:.4f}"


def row(faulted: Outcome, unfaulted: Outcome) -> str:
    ratio = (f"{faulted.val_loss / unfaulted.val_loss:.4f}" if faulted.val_loss and unfaulted.val_loss else "—")
    goodput = f"{unfaulted.wall_s / faulted.wall_s:.2f}" if faulted.code == 0 and unfaulted.code == 0 else "—"
    restarts = f"{faulted.process_restarts}" + (f" + {faulted.job_restarts} of the whole job" if faulted.job_restarts else "")
    leftover = left_behind(faulted) + ("" if clean(unfaulted) else f"; unfaulted: {left_behind(unfaulted)}")
    code = lambda r: "timeout" if r.code is None else str(r.code)
    return (f"| {FRAMEWORKS[faulted.framework].label} | {describe_faults(faulted.faults)} | {restarts} | {heal_times(faulted.faults)} | "
            f"{steps_missed(faulted)} | {loss(faulted.val_loss)} / {loss(unfaulted.val_loss)} = {ratio} | {faulted.wall_s:.0f} / {unfaulted.wall_s:.0f} s = "
            f"{goodput} | {code(faulted)}, {code(unfaulted)} | {leftover} |")


def steps_missed(r: Outcome) -> str:
    """The steps the faulted run's processes or groups skipped (summary.json's missed_steps), and, where Distributed
    Hogwild's groups re-trained them past the last step, by whom (reshared_steps): `12, re-trained 6 + 6`."""
    missed = sum(m.get("missed", 0) for m in r.missed_steps.values() if isinstance(m.get("missed"), int))
    if not missed:
        return "0"
    by_group = r.reshared.get("by_group") or {}
    if not by_group:
        return f"{missed}"
    return f"{missed}, re-trained " + " + ".join(str(n) for _, n in sorted(by_group.items(), key=lambda item: int(item[0])))


def details(faulted: Outcome, unfaulted: Outcome) -> list[str]:
    lines = []
    for f in faulted.faults:
        if f.sent is not None or f.skipped:
            when = f"{f.at:.0f} s after training started" if f.kind == "kill" else f"at the chief's step {f.at:.0f}"
            what = f"skipped: {f.skipped}" if f.skipped else f"process {f.rank} (pid {f.pid}): {f.how or 'not back'}"
            lines.append(f"  - {f.kind} {when}: {what}" + (f", healed in {f.heal_s:.1f} s" if f.heal_s is not None else ""))
    for r in (faulted, unfaulted):
        if r.last_error:
            lines.append(f"  - {'faulted' if r.faulted else 'unfaulted'} run failed: {r.last_error}")
    tracebacks = faulted.stderr_tracebacks + unfaulted.stderr_tracebacks
    if tracebacks:
        lines.append(f"  - the terminal showed {tracebacks} Python traceback(s) (stderr)")
    if faulted.restarts:
        lines.append("  - new pids in the logs: " + ", ".join(f"process {r} ×{n}" for r, n in sorted(faulted.restarts.items())))
    if faulted.missed:
        lines.append(f"  - missed updates (summary.json): {json.dumps(faulted.missed)}")
    if faulted.missed_steps:
        lines.append(f"  - missed steps (summary.json): {json.dumps(faulted.missed_steps)}")
    if faulted.reshared:
        lines.append(f"  - skipped steps re-trained past the last step (summary.json's reshared_steps): {json.dumps(faulted.reshared)}")
    return lines


def claims(pairs: list[tuple[Outcome, Outcome]]) -> list[tuple[str, str, str, bool]]:
    out = []
    by_name: dict[str, list[tuple[Outcome, Outcome]]] = {}
    for f, u in pairs:
        by_name.setdefault(f.framework, []).append((f, u))
    for name, runs in by_name.items():
        label = FRAMEWORKS[name].label
        codes = [(f.code, u.code) for f, u in runs]
        out.append((f"{label}: every run exits 0", ", ".join(f"{a}/{b}" for a, b in codes), "0", all(c == (0, 0) for c in codes)))
        ok = [(f, u) for f, u in runs if f.code == 0 and u.code == 0]
        if ok:
            goodput = statistics.median(u.wall_s / f.wall_s for f, u in ok)
            out.append((f"{label}: goodput (median)", f"{goodput:.3f}", ">= 0.9", goodput >= 0.9))
            ratios = [f.val_loss / u.val_loss for f, u in ok if f.val_loss and u.val_loss]
            if ratios:
                worst = max(ratios, key=lambda r: abs(r - 1)) - 1
                out.append((f"{label}: validation loss vs unfaulted (the farthest)", f"{worst:+.2%}", "within 1 %", abs(worst) <= 0.01))
        nothing = all(clean(r) for f, u in runs for r in (f, u))
        out.append((f"{label}: nothing left behind", "nothing" if nothing else "see the table", "nothing", nothing))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frameworks", nargs="+", choices=[*FRAMEWORKS, "all"], help=f"default: {' '.join(DEFAULT)}")
    parser.add_argument("--kill-every", type=float, help="seconds between kills (default 60; --quick: 4)")
    parser.add_argument("--seed", type=int, default=1, help="the fault schedule's victims and moments")
    parser.add_argument("--steps", type=int, help="steps per group for every framework (default: each framework's own)")
    parser.add_argument("--quick", action="store_true", help="the small GPT (2 layers, 64 wide, block 32), a kill every "
                        "4 s, a 5 s stall timeout: seconds per run, for the slow test and for checking")
    parser.add_argument("--stop", action=argparse.BooleanOptionalAction, default=True, help="one SIGSTOP per faulted run")
    parser.add_argument("--server-kill", action=argparse.BooleanOptionalAction, default=True,
                        help="one server SIGKILL per faulted run where the job has server processes")
    parser.add_argument("--stall-timeout", type=float, help="cluster.stall_timeout_s (default: the job's 10; --quick: 5)")
    parser.add_argument("--max-restarts", type=int, default=20, help="shoal run --max-restarts, both runs")
    parser.add_argument("--repeats", type=int, default=1, help="rounds; the faulted run goes first in every second one")
    parser.add_argument("--data", type=Path, default=REPO / "examples/gpt/data")
    parser.add_argument("--timeout", type=float, help="seconds before a run counts as hung and is killed (default 900; --quick: 300)")
    parser.add_argument("--json", type=Path, help="also write every run's numbers here")
    parser.add_argument("--keep", action="store_true", help="keep the runs' workspaces (their folder is printed)")
    args = parser.parse_args()
    args.size = "small" if args.quick else "example"
    args.kill_every = args.kill_every or (4.0 if args.quick else 60.0)
    args.stall_timeout = args.stall_timeout or (5.0 if args.quick else 10.0)
    args.timeout = args.timeout or (300.0 if args.quick else 900.0)
    names = list(FRAMEWORKS) if args.frameworks and "all" in args.frameworks else (args.frameworks or DEFAULT)
    if any(not (args.data / n).is_file() for n in ("train.txt", "val.txt", "vocab.txt")):
        raise SystemExit(f"{args.data}: run `shoal prepare shakespeare --out {args.data}` first")
    s = SIZES[args.size]
    print(f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"machine: {os.uname().machine}, {os.cpu_count()} cores; load average before: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"examples/gpt/train.py at {s['layers']} layers, {s['heads']} heads, {s['width']} wide, block {s['block']}, batch "
          f"{s['batch']} per group; seed {args.seed}; a kill every {args.kill_every:g} s; stall timeout {args.stall_timeout:g} s; "
          f"--max-restarts {args.max_restarts}; {args.repeats} round(s)\n", flush=True)
    folder = Path(tempfile.mkdtemp(prefix="shoal-chaos-"))
    pairs: list[tuple[Outcome, Outcome]] = []
    notes: list[str] = []
    for round_ in range(args.repeats):
        for name in names:
            rng = random.Random(f"{args.seed}/{name}/{round_}")
            order = (False, True) if round_ % 2 == 0 else (True, False)
            got = {faulted: Job(name, args, folder, faulted).run(rng) for faulted in order}
            pairs.append((got[True], got[False]))
            notes += [f"{FRAMEWORKS[name].label}{f' (round {round_ + 1})' if args.repeats > 1 else ''}:",
                      *details(got[True], got[False])]
            print(f"{name}: faulted exit {got[True].code} in {got[True].wall_s:.0f} s, unfaulted exit {got[False].code} "
                  f"in {got[False].wall_s:.0f} s", flush=True)
    print("\n| framework | faults injected | restarts | heal s (fault → back) | steps skipped (re-trained by group) | "
          "validation loss faulted / unfaulted = ratio | wall faulted / unfaulted = goodput | exit codes (faulted, unfaulted) | "
          "left behind (faulted) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for f, u in pairs:
        print(row(f, u))
    print("\n" + "\n".join(notes))
    print("\n| claim | measured | goal | met |\n|---|---|---|---|")
    results = claims(pairs)
    for claim, measured, goal, met in results:
        print(f"| {claim} | {measured} | {goal} | {'yes' if met else 'NO'} |")
    print(f"\nload average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        args.json.write_text(json.dumps([{"faulted": asdict(f), "unfaulted": asdict(u), "goodput": u.wall_s / f.wall_s}
                                         for f, u in pairs], indent=1) + "\n")
    if args.keep:
        print(f"workspaces kept in {folder}")
    else:
        shutil.rmtree(folder, ignore_errors=True)
    # exit status: 0 when every run exited 0, goodput > 0 and nothing was left behind (the slow test's check)
    failed = [c for c, _, _, met in results if not met and ("exits 0" in c or "left behind" in c)]
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
