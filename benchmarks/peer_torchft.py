"""shoal's DiLoCo beside torchft 0.2.0's, on the example GPT (issue 40, point 1; issue 38, point 6): speed, start-up and
shutdown, bytes, validation loss and, with --kill, recovery from a killed group.

The same job in both: examples/gpt's GPT (4 layers, 4 heads, 128 wide, block 64; --small: 2 x 2 x 64, block 32), 2
replica groups x 1 process x 1 torch thread, gloo, H = 50 inner steps, AdamW inside (benchmarks/gpt.py's: nanoGPT's decay
groups, lr 1e-3, warm-up + cosine over --steps, clip_grad_norm 1.0), outer SGD lr 0.7 with Nesterov momentum 0.9, batch
12 per group (--small: 8), --steps inner steps per group, model initialised from --seed, and the final validation loss
over the first 1,000 non-overlapping windows of val.txt (--small: 400) in eval mode.

- shoal: `shoal.fit(..., cluster=Cluster(nworker_groups=2, local_steps=50, threads_per_worker=1), optimizer=gpt.adamw,
  outer_optimizer=SGD(0.7, Nesterov 0.9))` in one process, which starts the groups' processes itself; the process
  calls `shoal.prestart()` first, as a user's script whose fit starts several processes can: the server the groups'
  processes fork from imports torch beside the job's own import, as torchft's replicas import theirs side by side
  (--no-prestart: without it, the server starts at fit's call, after the job's imports).
- torchft: a Lighthouse (the `torchft_lighthouse` entry point of the wheel, on loopback) and two replica processes, each
  a plain loop: its own TCPStore, `ProcessGroupGloo`, `Manager(use_async_quorum=False, init_sync=False)` (the model
  starts from the same seed in both, so no copy at step 0, as torchft advises), timeouts 60 s (its defaults), and
  torchft's `DiLoCo` wrapper over the model with the same inner and outer optimizers (the scheduler's and AdamW's state
  travel with the model when a replica heals). A replica reads the rows shoal's group of the same index
  reads (shoal's epoch permutation from the seed; group g starts g / 2 of the way in), so the data is the same kind
  of stream, not the same order: an equal loss is not expected to the last digit.

Each job runs in a fresh process (in a network namespace of its own when run as root with `ip netns`: then "wire
bytes" is its loopback's tx counter, every byte it sent: gloo, stores, heartbeats, the Lighthouse), the contestants
alternate within each round, and --busy N starts N CPU-burning processes beside every job. Each runs as its user's
would, in this script's environment: shoal's ranks get OMP_WAIT_POLICY=PASSIVE unless that environment sets it
(docs/cluster.md, "Threads per worker"); torchft's replicas get what it says (OpenMP's default spinning when unset):
export OMP_WAIT_POLICY to give both the same. Columns:

- loop s: the first training step to the end of the final validation (shoal: the final test record's time in
  metrics.jsonl, whose clock starts just before the loop; torchft: the earliest replica's first step to replica 0's
  validation end). Both include the same final validation.
- job s: the whole job's process, start to exit, measured around it (interpreter start, imports, data and model
  building, start-up, the loop, shutdown).
- around s: job s - loop s, the start-up and shutdown around the loop.
- counted bytes: shoal's summary.json bytes_sent (its exchange's count, to the last meeting); torchft exposes no
  count from its process group: n/a.
- val loss: the final validation loss.

--kill: a second pass per system (disp_freq 1, restarts allowed: shoal's max_restarts 1, torchft's replica restarted
by this script as a supervisor would) SIGKILLs the non-chief group's process once the chief's step reaches --kill-at
of the run (the pid from shoal's logs/rank1.log; torchft's replica 1), and reports: kill -> the survivor's next
committed meeting (shoal: the chief's first metrics record after the kill whose meeting count rose; torchft: replica
0's manager step rising), kill -> the restarted group's healed meeting (shoal: logs/rejoins.jsonl's time; torchft: the
new replica's first commit), and the final loss against the unfaulted run's. torchft's Lighthouse then runs with
min_replicas 1, so a survivor may meet alone.

Needs an interpreter with both shoal and torchft (a separate venv keeps the project's clean):

    python3 -m venv /work/venv-torchft
    /work/venv-torchft/bin/pip install torch==2.13.0 torchft==0.2.0 && /work/venv-torchft/bin/pip install -e .
    shoal prepare shakespeare --out examples/gpt/data                          # once
    /work/venv-torchft/bin/python benchmarks/peer_torchft.py [--steps 500] [--rounds 2] [--busy 3] [--kill] [--small]

Without torchft the script says why in one line and measures shoal alone. PEER_TORCHFT_KEEP=1 keeps each job's
workspace or logs folder (under the temporary folder) to read afterwards.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

if __name__ == "__main__" and sys.argv[1:3] == ["--job", "shoal"] and "--no-prestart" not in sys.argv:
    import shoal  # shoal's job process: before anything imports torch (gpt below)

    shoal.prestart()

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import gpt  # noqa: E402 - the model, data, AdamW, schedule, clipping and loss every GPT benchmark uses
from gpt_lowcomm import build, nesterov_outer, sizes  # noqa: E402 - the DiLoCo run's sizes and outer optimizer
from local_sgd import in_namespace, netns_available  # noqa: E402 - a namespace per job: its own bytes on the wire

H = 50
SYSTEMS = ("shoal", "torchft")
GROUPS = 2


def torchft_missing() -> Optional[str]:
    """Why torchft cannot run from this interpreter (None: it can)."""
    if importlib.util.find_spec("torchft") is None:
        return (f"torchft is not installed for {sys.executable}: install torchft==0.2.0 beside torch in a separate venv "
                "and run this script with that venv's python (see the docstring)")
    if lighthouse_command(1) is None:
        return "torchft is installed but its torchft_lighthouse entry point is not beside this interpreter"
    return None


def lighthouse_command(min_replicas: int, bind: str = "127.0.0.1:0") -> Optional[list[str]]:
    script = Path(sys.executable).parent / "torchft_lighthouse"
    if not script.is_file():
        found = shutil.which("torchft_lighthouse")
        if found is None:
            return None
        script = Path(found)
    return [sys.executable, str(script), "--min_replicas", str(min_replicas), "--bind", bind]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def data_row(train_len: int, group: int) -> int:
    """Where group `group` starts reading in the epoch order (shoal's Local SGD groups start evenly spaced)."""
    return group * train_len // GROUPS


# ------------------------------------------------------------------------------------------------ shoal's job

def shoal_job(args, out: Path) -> None:
    """The job's process: shoal.fit starts the groups' processes and ends them."""
    import torch
    import shoal

    torch.set_num_threads(1)
    model, train, val = build(args.small, args.seed)
    steps = args.steps
    ws = Path(tempfile.mkdtemp(prefix="peer-torchft-shoal-")) / "ws"
    cluster = dict(nworker_groups=GROUPS, local_steps=H, threads_per_worker=1)
    if args.kill_now:
        cluster["max_restarts"] = 1
    watcher = MetricsWatcher(ws / "metrics.jsonl")
    killer = None
    if args.kill_now:
        killer = threading.Thread(target=shoal_killer, args=(ws, watcher, int(args.kill_at * steps)), daemon=True)
        killer.start()
    watcher.start()
    fit_start = time.time()
    history = shoal.fit(model, gpt.next_char_loss, train, test_data=val, test_batch=100, steps=steps,
                        batch_size=sizes(args.small)["batch"], seed=args.seed, cluster=shoal.Cluster(**cluster),
                        optimizer=gpt.adamw, scheduler=functools.partial(gpt.scheduler, steps=steps),
                        clip_grad_norm=gpt.CLIP, outer_optimizer=nesterov_outer, workspace=ws, log=lambda _line: None,
                        disp_freq=1 if args.kill_now else max(1, steps // 10))
    fit_end = time.time()
    watcher.stop()
    summary = json.loads((ws / "summary.json").read_text())
    tests = [r for r in history.records if r["phase"] == "test"]
    result = {"val_loss": history.final_test["loss"], "loop_s": tests[-1]["time"], "fit_s": fit_end - fit_start,
              "counted_bytes": summary.get("bytes_sent")}
    if args.kill_now:
        result |= shoal_recovery(ws, watcher)
    out.write_text(json.dumps(result))
    if not os.environ.get("PEER_TORCHFT_KEEP"):  # kept: to read a run's logs
        shutil.rmtree(ws.parent, ignore_errors=True)


class MetricsWatcher:
    """Tails the chief's metrics.jsonl: each record with the wall time it was seen (the records' own clock starts at
    the loop; the earliest offset seen maps it onto the wall clock within the polling interval)."""

    def __init__(self, path: Path, poll_s: float = 0.01):
        self.path, self.poll_s = path, poll_s
        self.records: list[tuple[float, dict]] = []
        self._file = None
        self._partial = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._read()
        if self._file is not None:
            self._file.close()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._read()

    def _read(self) -> None:
        if self._file is None:
            if not self.path.exists():
                return
            self._file = open(self.path)
        self._partial += self._file.read()
        *lines, self._partial = self._partial.split("\n")
        now = time.time()
        self.records += [(now, json.loads(line)) for line in lines if line.strip()]

    def wall(self, record_time: float) -> float:
        """A record's `time` on the wall clock."""
        offset = min(seen - r["time"] for seen, r in self.records)
        return offset + record_time

    def chief_step(self) -> int:
        return max((r["step"] for _, r in self.records if r.get("phase") == "train"), default=-1)


KILLED: dict = {}  # the shoal job's kill: its time and pid


def shoal_killer(ws: Path, watcher: MetricsWatcher, at_step: int) -> None:
    """SIGKILL group 1's process (its pid from its log) once the chief has trained `at_step` steps."""
    import re

    while watcher.chief_step() < at_step:
        time.sleep(0.01)
    found = re.search(r"\(pid = (\d+)\)", (ws / "logs" / "rank1.log").read_text())
    os.kill(int(found.group(1)), signal.SIGKILL)
    KILLED.update(at=time.time(), pid=int(found.group(1)))


def shoal_recovery(ws: Path, watcher: MetricsWatcher) -> dict:
    if "at" not in KILLED:
        return {"kill": "not killed (the run ended first)"}
    killed_at = KILLED["at"]
    train = [r for _, r in watcher.records if r.get("phase") == "train"]
    before = max((r["meetings"] for r in train if watcher.wall(r["time"]) <= killed_at), default=0)
    later = [r for r in train if watcher.wall(r["time"]) > killed_at and r["meetings"] > before]
    rejoins = ws / "logs" / "rejoins.jsonl"
    healed = [json.loads(line) for line in rejoins.read_text().splitlines()] if rejoins.exists() else []
    return {"killed_pid": KILLED["pid"], "survivor_commit_s": watcher.wall(later[0]["time"]) - killed_at if later else None,
            "healed_commit_s": healed[0]["time"] - killed_at if healed else None}


# ------------------------------------------------------------------------------------------------ torchft's job

def torchft_job(args, out: Path) -> None:
    """The job's process: a Lighthouse and two replica processes (each a plain loop over torchft's DiLoCo); with
    --kill, replica 1 is SIGKILLed once replica 0 reaches the kill step, and started again (as a supervisor would)."""
    folder = Path(tempfile.mkdtemp(prefix="peer-torchft-tf-"))
    port = free_port()
    logs = open(folder / "lighthouse.log", "w")
    lighthouse = subprocess.Popen(lighthouse_command(1 if args.kill_now else GROUPS, f"127.0.0.1:{port}"),
                                  stdout=logs, stderr=subprocess.STDOUT)
    replicas: dict[int, subprocess.Popen] = {}
    events = {g: folder / f"events{g}.jsonl" for g in range(GROUPS)}

    def start(group: int, incarnation: int) -> subprocess.Popen:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--replica", str(group), "--lighthouse", f"http://127.0.0.1:{port}",
               "--events", str(events[group]), "--steps", str(args.steps), "--seed", str(args.seed),
               "--incarnation", str(incarnation), "--out", str(folder / "result.json")]
        cmd += (["--small"] if args.small else []) + (["--kill-now"] if args.kill_now else [])
        log = open(folder / f"replica{group}.{incarnation}.log", "w")
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    killed_at = None
    try:
        for g in range(GROUPS):
            replicas[g] = start(g, 0)
        kill_step = int(args.kill_at * args.steps)
        while replicas[0].poll() is None:
            if args.kill_now and killed_at is None and replica_step(events[0]) >= kill_step and replicas[1].poll() is None:
                replicas[1].send_signal(signal.SIGKILL)
                killed_at = time.time()
                replicas[1].wait()
                replicas[1] = start(1, 1)
            time.sleep(0.01)
        codes = {g: p.wait(timeout=120) for g, p in replicas.items()}
    finally:
        for p in replicas.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        lighthouse.terminate()
        try:
            lighthouse.wait(timeout=10)
        except subprocess.TimeoutExpired:
            lighthouse.kill()
            lighthouse.wait()
        logs.close()
    if any(codes.values()):
        bad = next(g for g, c in codes.items() if c)
        tail = (folder / f"replica{bad}.{1 if killed_at and bad == 1 else 0}.log").read_text().strip().splitlines()[-5:]
        raise SystemExit(f"torchft replica {bad} exited with code {codes[bad]}: " + " | ".join(tail))
    ev = {g: [json.loads(line) for line in events[g].read_text().splitlines()] for g in range(GROUPS)}
    first = min(e["t"] for g in ev for e in ev[g] if e["event"] == "first_step")
    validated = next(e for e in ev[0] if e["event"] == "validated")
    result = {"val_loss": validated["loss"], "loop_s": validated["t"] - first, "counted_bytes": None}
    if args.kill_now:
        if killed_at is None:
            result["kill"] = "not killed (the run ended first)"
        else:
            survivor = [e["t"] for e in ev[0] if e["event"] == "commit" and e["t"] > killed_at]
            healed = [e["t"] for e in ev[1] if e["event"] == "commit" and e.get("incarnation") == 1]
            result |= {"survivor_commit_s": survivor[0] - killed_at if survivor else None,
                       "healed_commit_s": healed[0] - killed_at if healed else None}
    out.write_text(json.dumps(result))
    if not os.environ.get("PEER_TORCHFT_KEEP"):  # kept: to read the replicas' and the Lighthouse's logs
        shutil.rmtree(folder, ignore_errors=True)


def replica_step(events: Path) -> int:
    if not events.exists():
        return -1
    steps = [json.loads(line).get("step", -1) for line in events.read_text().splitlines() if line.strip()]
    return max(steps, default=-1)


def torchft_replica(args) -> None:
    """One replica group of one process: the user's loop as torchft's DiLoCo wants it."""
    from datetime import timedelta

    import torch
    from torch.utils.data import default_collate
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    group, steps = args.replica, args.steps
    torch.set_num_threads(1)
    model, train, val = build(args.small, args.seed)
    batch = sizes(args.small)["batch"]
    inner = gpt.plain_adamw(model)
    schedule = gpt.scheduler(inner, steps)
    outer = nesterov_outer(model.parameters())
    events = open(args.events, "a")

    def note(event: str, **fields) -> None:
        events.write(json.dumps({"t": time.time(), "event": event, "incarnation": args.incarnation, **fields}) + "\n")
        events.flush()

    def state_dict():
        return {"model": model.state_dict(), "inner": inner.state_dict(), "schedule": schedule.state_dict()}

    def load_state_dict(state) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner"])
        schedule.load_state_dict(state["schedule"])

    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=60)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=1 if args.kill_now else GROUPS,
                      load_state_dict=load_state_dict, state_dict=state_dict, use_async_quorum=False,
                      replica_id=f"replica_{group}", store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
                      lighthouse_addr=args.lighthouse, timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
                      init_sync=False)  # both replicas start from the same seed (torchft's advice): no copy at step 0
    rows = gpt.Rows(len(train), args.seed)
    start_row = data_row(len(train), group)
    meetings = steps // H
    first = True
    with DiLoCo(manager, [model], inner, outer, sync_every=H, pin_memory=False) as diloco:
        while manager.current_step() < meetings:
            step = manager.current_step() * H + diloco._local_step  # the data position follows the committed step
            if first:
                note("first_step", step=step)
                first = False
            idx = rows(start_row + step * batch, batch)
            loss = gpt.next_char_loss(model, default_collate([train[i] for i in idx]))
            inner.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), gpt.CLIP)
            before = manager.current_step()
            inner.step()  # DiLoCo's hook meets after every H-th step
            schedule.step()
            if manager.current_step() != before:
                note("commit", step=manager.current_step() * H, manager_step=manager.current_step())
            elif step % 10 == 0:
                note("step", step=step)
    if group == 0:
        note("validated", loss=gpt.validate(model, val))
    manager.shutdown(wait=False)
    events.close()


# ------------------------------------------------------------------------------------------------ the driver

def run_job(system: str, args, netns: bool, kill: bool) -> dict:
    """One job in a fresh process (its own network namespace when it can be): its result, wire bytes and wall time."""
    out = Path(tempfile.mkdtemp(prefix="peer-torchft-")) / "result.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--job", system, "--out", str(out), "--steps", str(args.steps),
           "--seed", str(args.seed), "--kill-at", str(args.kill_at)]
    cmd += (["--small"] if args.small else []) + (["--kill-now"] if kill else [])
    cmd += ["--no-prestart"] if getattr(args, "no_prestart", False) else []  # (peer_hivemind's args have none)
    cmd = ["env", f"SHOAL_HOME={out.parent / 'home'}"] + cmd  # shoal's job registry: this job's own
    return timed_job(system, cmd, out, netns)


def timed_job(system: str, cmd: list[str], out: Path, netns: bool) -> dict:
    """Run `cmd` (a job that writes its result to `out`) in its own network namespace when it can be: the result, the
    command's wall time and its wire bytes; a failed job is one line naming it."""
    start = time.perf_counter()
    wire = None
    if netns:
        proc, wire = in_namespace(cmd, f"peer-{system}-{os.getpid()}", cwd=REPO)
    else:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    job_s = time.perf_counter() - start
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        raise SystemExit(f"{system} job failed (exit {proc.returncode}): {lines[-1] if lines else 'no output'}")
    result = json.loads(out.read_text())
    shutil.rmtree(out.parent, ignore_errors=True)
    return result | {"job_s": job_s, "wire_bytes": wire}


def start_busy(n: int) -> list[subprocess.Popen]:
    """N processes that burn a CPU each until stopped (the fixed load of issue 40)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def systems_to_run(args, systems: tuple, peer: str, missing: Optional[str]) -> list[str]:
    """The contestants of this run (--only, or all), without the peer when it is not installed (said in one line);
    --steps and the GPT's data checked first."""
    if args.steps % H:
        raise SystemExit(f"--steps must be a multiple of H = {H}")
    if any(not (REPO / "examples/gpt/data" / n).is_file() for n in ("train.txt", "val.txt", "vocab.txt")):
        raise SystemExit("examples/gpt/data: run `shoal prepare shakespeare --out examples/gpt/data` first")
    chosen = [args.only] if args.only else list(systems)
    if missing and peer in chosen:
        print(f"{peer}: cannot run here: {missing}")
        chosen.remove(peer)
    if not chosen:
        raise SystemExit(1)
    return chosen


def stop_busy(busy: list[subprocess.Popen]) -> None:
    for p in busy:
        p.kill()
        p.wait()


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def fmt(x, spec: str = ".1f") -> str:
    return "n/a" if x is None else format(x, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=500, help="inner steps per group (a multiple of H = 50)")
    parser.add_argument("--rounds", type=int, default=2, help="speed rounds, the contestants alternating (0: none)")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--small", action="store_true", help="2 layers, 64 wide, block 32, batch 8")
    parser.add_argument("--busy", type=int, default=0, help="CPU-burning processes beside every job")
    parser.add_argument("--kill", action="store_true", help="also a faulted run per system (see the docstring)")
    parser.add_argument("--kill-at", type=float, default=0.45, help="the fraction of the run at which the kill comes")
    parser.add_argument("--only", choices=SYSTEMS)
    parser.add_argument("--no-prestart", action="store_true", help="shoal's job without shoal.prestart(): its fit starts the server")
    parser.add_argument("--job", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--replica", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", help=argparse.SUPPRESS)
    parser.add_argument("--events", help=argparse.SUPPRESS)
    parser.add_argument("--incarnation", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--kill-now", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.replica is not None:
        return torchft_replica(args)
    if args.job:
        return (shoal_job if args.job == "shoal" else torchft_job)(args, args.out)
    systems = systems_to_run(args, SYSTEMS, "torchft", torchft_missing())
    netns = netns_available()
    s = sizes(args.small)
    print(f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"machine: {gpt.machine()}; load average before: {load()}; busy processes beside each job: {args.busy}")
    print(f"GPT {s['layers']} layers, {s['heads']} heads, {s['width']} wide, block {s['block']}; 2 groups x 1 process x 1 thread, "
          f"gloo, H = {H}, AdamW inside, outer SGD 0.7 Nesterov 0.9, batch {s['batch']} per group, {args.steps} steps per "
          f"group, seed {args.seed}; validation: {s['val_windows']} windows of val.txt; wire bytes: "
          f"{'one network namespace per job' if netns else 'n/a (needs root and ip netns)'}\n", flush=True)
    busy = start_busy(args.busy)
    try:
        results: dict[str, list[dict]] = {name: [] for name in systems}
        if args.rounds:
            print("| round | system | loop s | job s | around s | counted bytes | wire bytes | val loss |")
            print("|---|---|---|---|---|---|---|---|", flush=True)
        for round_ in range(args.rounds):
            for name in systems if round_ % 2 == 0 else systems[::-1]:
                r = run_job(name, args, netns, kill=False)
                results[name].append(r)
                print(f"| {round_ + 1} | {name} | {r['loop_s']:.1f} | {r['job_s']:.1f} | {r['job_s'] - r['loop_s']:.1f} | "
                      f"{fmt(r['counted_bytes'], ',')} | {fmt(r['wire_bytes'], ',')} | {r['val_loss']:.4f} |", flush=True)
        if args.rounds and len(systems) == 2:
            a, b = results["shoal"], results["torchft"]
            loop = [y["loop_s"] / x["loop_s"] for x, y in zip(a, b)]
            job = [y["job_s"] / x["job_s"] for x, y in zip(a, b)]
            print(f"\nshoal's speed as a multiple of torchft's (torchft's time / shoal's, per round): loop "
                  f"{', '.join(f'{v:.2f}x' for v in loop)}; whole job {', '.join(f'{v:.2f}x' for v in job)}")
        if args.kill:
            print("\n| system (faulted) | kill -> survivor's next commit s | kill -> restarted group's healed commit s | "
                  "val loss | unfaulted val loss | job s |")
            print("|---|---|---|---|---|---|", flush=True)
            for name in systems:
                reference = results[name][0] if results[name] else run_job(name, args, netns, kill=False)
                r = run_job(name, args, netns, kill=True)
                if "kill" in r:
                    print(f"| {name} | {r['kill']} | | | | |")
                    continue
                print(f"| {name} | {fmt(r['survivor_commit_s'])} | {fmt(r['healed_commit_s'])} | {r['val_loss']:.4f} | "
                      f"{reference['val_loss']:.4f} ({r['val_loss'] / reference['val_loss'] - 1:+.2%}) | {r['job_s']:.1f} |",
                      flush=True)
    finally:
        stop_busy(busy)
    print(f"\nload average after: {load()}")


if __name__ == "__main__":
    main()
