"""shoal's DiLoCo beside hivemind 1.1.12's Optimizer in its DiLoCo-like configuration, on the example GPT (issue 40,
point 1: hivemind as a second peer): speed, start-up and shutdown, bytes and validation loss.

The shoal job is benchmarks/peer_torchft.py's, run through that script (the same model, data, hyper-parameters, thread
counts and columns: read its docstring). The hivemind job is two peer processes, each a plain loop:

- its own `hivemind.DHT` on 127.0.0.1 only (peer 0 first; peer 1 joins from peer 0's address; the wheel's p2pd daemon
  runs beside each), OMP_NUM_THREADS=1 and torch.set_num_threads(1) (hivemind's DHT and averager are processes of
  their own, which the variable reaches too);
- `hivemind.Optimizer(use_local_updates=True, target_batch_size=2 x H x batch, batch_size_per_step=batch,
  delay_state_averaging=False, matchmaking_time=MATCHMAKING_S, averaging_timeout=AVERAGING_TIMEOUT_S,
  averager_opts=dict(target_group_size=2, request_timeout=REQUEST_TIMEOUT_S, initialize_optimizer=False),
  tracker_opts=REFRESH_S)` over the same AdamW (benchmarks/gpt.py's
  plain_adamw: nanoGPT's decay groups, lr 1e-3) and the same warm-up + cosine over --steps, stepped per local step in
  the loop (hivemind's own `scheduler=` would step once per epoch); clip_grad_norm 1.0 before each step. Every local
  step updates the parameters; an "epoch" ends when the two peers together have reported target_batch_size samples
  (2 x H steps' worth) through the DHT, and at its end the peers average their parameters (a butterfly all-reduce
  over libp2p), in the step, before training on: DiLoCo's meeting with the outer step "replace by the mean".
- --outer nesterov (default): DiLoCo's outer step in the loop, around hivemind's averaging: each peer keeps the
  parameters of the last meeting; when the epoch advances, (kept - averaged) is the averaged pseudo-gradient, and
  SGD lr 0.7 Nesterov 0.9 on the kept copy gives the new parameters (both peers compute the same). --outer average:
  hivemind's own outer step, the mean itself (outer SGD lr 1, no momentum).
- The loop runs until the epoch reaches --steps / H (10 meetings at 500 steps), as torchft's loop runs to its
  manager's step; a peer reads the rows peer_torchft.py's replica of the same index reads.

What differs from shoal's and torchft's DiLoCo, whatever the settings (the table's "steps" column shows the first):
  1. A meeting comes when the swarm's reported samples reach target_batch_size (each peer's progress in the DHT,
     fetched every 0.05-0.1 s here, and an estimate from each peer's samples/s in between), not after exactly H
     steps of each peer: a peer may take more or fewer local steps in an epoch, the total per peer is not exactly
     --steps, and the two together overshoot it (each trains on while the other's averaging waits for it: about
     1-10 % at 500 steps, more at 100 and under load). The ratio below the table compares samples/s.
  2. hivemind's Optimizer has no outer optimizer: with --outer average it runs Local SGD (parameter averaging); with
     --outer nesterov the loop applies the outer step itself, as a user would.
  3. Averaging is an all-reduce between the peers that matched within matchmaking_time (libp2p streams over the p2pd
     daemons, msgpack + protobuf framing); a meeting that fails (averaging_timeout) leaves each peer with its own
     parameters and the loop goes on ("averaged" column: the meetings that averaged with both peers).
  4. hivemind's tracker, DHT and averager run beside the loop (a thread and two processes per peer, and p2pd).
The loop's clock starts at the earlier peer's first step after both peers are in the DHT (so start-up, the DHT's
bootstrap and the averagers' start are in "around s", as torchft's Lighthouse and quorum are there).

Needs an interpreter with both shoal and hivemind; hivemind and what it brings (p2pd, pydantic, uvloop, ...) stay out
of shoal's and torchft's environments, in a venv of their own:

    python3 -m venv /work/venv-hivemind
    /work/venv-hivemind/bin/pip install torch==2.13.0 hivemind==1.1.12 && /work/venv-hivemind/bin/pip install -e .
    shoal prepare shakespeare --out examples/gpt/data                          # once
    /work/venv-hivemind/bin/python benchmarks/peer_hivemind.py [--steps 500] [--rounds 2] [--busy 3] [--small]

Without hivemind the script says why in one line and measures shoal alone. PEER_HIVEMIND_KEEP=1 keeps the peers'
logs and events (under the temporary folder) to read afterwards.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import gpt  # noqa: E402 - the model, data, AdamW, schedule, clipping and loss every GPT benchmark uses
import peer_torchft  # noqa: E402 - the shoal job, the data rows of each group, the load and the busy processes
from gpt_lowcomm import build, nesterov_outer, sizes  # noqa: E402 - the DiLoCo run's sizes and outer optimizer
from local_sgd import netns_available  # noqa: E402 - a namespace per job: its own bytes on the wire

H, GROUPS = peer_torchft.H, peer_torchft.GROUPS
SYSTEMS = ("shoal", "hivemind")
RUN_ID = "peer_hivemind"
# hivemind's docs: matchmaking 3-5 s for small local runs; with target_group_size 2 a group forms as soon as both
# peers ask, so this is a bound on the wait, not a cost per meeting
MATCHMAKING_S = 3.0
REQUEST_TIMEOUT_S = 1.0  # hivemind warns unless it is below matchmaking_time (its default 3 s is not)
# hivemind's docs: about twice what an all-reduce takes (here under 1.5 s even at load 12); a meeting that times out
# leaves each peer with its own parameters, and the loop waits this long for it
AVERAGING_TIMEOUT_S = 10.0
# how often a peer reads the swarm's progress from the DHT: hivemind's defaults (every 0.5-10 s, 3 s while it has seen
# no peer) are for epochs of minutes; here an epoch lasts 0.4-3 s, and a late read means local steps past H before
# the meeting or, at the start, a peer that saw only itself, ends epoch 0 alone and stays an epoch off the other
REFRESH_S = (0.05, 0.1)  # at least, at most
SAME_MODEL_RTOL = 1e-6  # hivemind adds the averaged delta to each peer's own part: the peers agree to rounding
PEER_TIMEOUT_S = 60.0  # peer 1 waiting for peer 0's address, and both waiting for each other in the DHT


def hivemind_missing() -> Optional[str]:
    """Why hivemind cannot run from this interpreter (None: it can)."""
    if importlib.util.find_spec("hivemind") is None:
        return (f"hivemind is not installed for {sys.executable}: install hivemind==1.1.12 beside torch in a venv of "
                "its own and run this script with that venv's python (see the docstring)")
    return None


# ------------------------------------------------------------------------------------------------ hivemind's job

def hivemind_job(args, out: Path) -> None:
    """The job's process: two peer processes, each a plain loop over hivemind's Optimizer."""
    folder = Path(tempfile.mkdtemp(prefix="peer-hivemind-"))
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    peers, logs = {}, []
    try:
        for g in range(GROUPS):
            cmd = [sys.executable, str(Path(__file__).resolve()), "--peer", str(g), "--folder", str(folder),
                   "--steps", str(args.steps), "--seed", str(args.seed), "--outer", args.outer]
            cmd += ["--small"] if args.small else []
            logs.append(open(folder / f"peer{g}.log", "w"))
            # a process group of its own, so that the peer's DHT and averager processes and its p2pd go with it (below);
            # not a session of its own: the kernel's autogroup scheduling would then give each peer a CPU share of its
            # own against --busy's processes, which shoal's and torchft's processes share with them
            peers[g] = subprocess.Popen(cmd, stdout=logs[-1], stderr=subprocess.STDOUT, env=env, process_group=0)
        codes = {g: p.wait(timeout=3600) for g, p in peers.items()}
    finally:
        for p in peers.values():
            try:
                os.killpg(p.pid, signal.SIGKILL)  # what a failed or stuck peer left running
            except ProcessLookupError:
                pass
            p.wait()
        for log in logs:
            log.close()
    if any(codes.values()):
        bad = next(g for g, c in codes.items() if c)
        tail = (folder / f"peer{bad}.log").read_text().strip().splitlines()[-5:]
        raise SystemExit(f"hivemind peer {bad} exited with code {codes[bad]}: " + " | ".join(tail))
    ev = {g: [json.loads(line) for line in (folder / f"events{g}.jsonl").read_text().splitlines()] for g in range(GROUPS)}
    first = min(e["t"] for g in ev for e in ev[g] if e["event"] == "first_step")
    ends = {g: next(e for e in ev[g] if e["event"] == "end") for g in range(GROUPS)}
    validated = next(e for e in ev[0] if e["event"] == "validated")
    out.write_text(json.dumps({
        "val_loss": validated["loss"], "loop_s": validated["t"] - first, "counted_bytes": None,
        "steps": [ends[g]["steps"] for g in range(GROUPS)], "meetings": ends[0]["epoch"],
        "averaged": min(ends[g]["averaged"] for g in range(GROUPS)),
        "same_model": abs(ends[0]["checksum"] - ends[1]["checksum"]) <= SAME_MODEL_RTOL * abs(ends[0]["checksum"])}))
    if not os.environ.get("PEER_HIVEMIND_KEEP"):  # kept: to read the peers' logs
        shutil.rmtree(folder, ignore_errors=True)


class AveragedRounds:
    """Counts hivemind's "Averaged parameters with N peers" lines, failed rounds and downloads of the other peer's
    state when this one fell an epoch behind (its status log; verbose=True makes it INFO)."""

    def __init__(self):
        import logging

        self.full = self.partial = self.failed = self.out_of_sync = 0
        handler = logging.Handler()
        handler.emit = self._seen
        for name in ("hivemind.optim.state_averager", "hivemind.optim.optimizer"):
            logging.getLogger(name).addHandler(handler)

    def _seen(self, record) -> None:
        text = record.getMessage()
        if text.startswith("Peer is out of sync"):
            self.out_of_sync += 1
        elif text.startswith("Averaged parameters with "):
            if int(text.split()[3]) >= GROUPS:
                self.full += 1
            else:
                self.partial += 1
        elif text.startswith("Averaging failed"):
            self.failed += 1


def hivemind_peer(args) -> None:
    """One peer: the user's loop as hivemind's Optimizer wants it (docstring)."""
    import hivemind
    import torch
    from hivemind.utils import get_dht_time
    from torch.utils.data import default_collate

    group, steps, folder = args.peer, args.steps, Path(args.folder)
    imported = time.time()
    torch.set_num_threads(1)
    model, train, val = build(args.small, args.seed)
    batch = sizes(args.small)["batch"]
    inner = gpt.plain_adamw(model)
    schedule = gpt.scheduler(inner, steps)
    events = open(folder / f"events{group}.jsonl", "a")
    events.write(json.dumps({"t": imported, "event": "imported"}) + "\n")

    def note(event: str, **fields) -> None:
        events.write(json.dumps({"t": time.time(), "event": event, **fields}) + "\n")
        events.flush()

    address = folder / "peer0.maddrs"
    if group == 0:
        dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
        (folder / "peer0.maddrs.tmp").write_text("\n".join(str(a) for a in dht.get_visible_maddrs()))
        (folder / "peer0.maddrs.tmp").rename(address)
    else:
        deadline = time.time() + PEER_TIMEOUT_S
        while not address.exists():
            if time.time() > deadline:
                raise SystemExit(f"peer 0 wrote no address to {address} within {PEER_TIMEOUT_S:.0f} s")
            time.sleep(0.01)
        dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=address.read_text().split(), start=True)
    note("dht_started")
    rounds = AveragedRounds()
    opt = hivemind.Optimizer(dht=dht, run_id=RUN_ID, target_batch_size=GROUPS * H * batch, batch_size_per_step=batch,
                             optimizer=inner, use_local_updates=True, delay_state_averaging=False,
                             matchmaking_time=MATCHMAKING_S, averaging_timeout=AVERAGING_TIMEOUT_S,
                             # a group as soon as both peers ask; no virtual AdamW step at start (it would decay the
                             # weights once and advance AdamW's step count: the others' AdamW starts clean)
                             averager_opts=dict(target_group_size=GROUPS, request_timeout=REQUEST_TIMEOUT_S,
                                                initialize_optimizer=False),
                             tracker_opts=dict(min_refresh_period=REFRESH_S[0], default_refresh_period=REFRESH_S[0],
                                               max_refresh_period=REFRESH_S[1]), verbose=True)
    # both peers in the DHT before the first step (torchft's quorum and shoal's start-up do the same): a peer alone
    # would count the whole epoch's samples itself and move on without averaging
    dht.store(f"{RUN_ID}_ready", subkey=group, value=True, expiration_time=get_dht_time() + 3600)
    note("optimizer_started")
    deadline = time.time() + PEER_TIMEOUT_S
    while len(getattr(dht.get(f"{RUN_ID}_ready", latest=True), "value", None) or {}) < GROUPS:
        if time.time() > deadline:
            raise SystemExit(f"the other peer did not appear in the DHT within {PEER_TIMEOUT_S:.0f} s")
        time.sleep(0.01)

    params = [p for g in inner.param_groups for p in g["params"]]
    kept = [p.detach().clone() for p in params]  # the parameters of the last meeting: DiLoCo's outer state
    outer = nesterov_outer(kept) if args.outer == "nesterov" else None
    note("optimizer_ready")
    rows = gpt.Rows(len(train), args.seed)
    start_row = peer_torchft.data_row(len(train), group)
    meetings = steps // H
    step = 0
    note("first_step", step=step)
    while opt.local_epoch < meetings:
        idx = rows(start_row + step * batch, batch)
        loss = gpt.next_char_loss(model, default_collate([train[i] for i in idx]))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), gpt.CLIP)
        before = opt.local_epoch
        opt.step()  # a local AdamW step; at an epoch's end, the parameters averaged with the other peer
        schedule.step()
        step += 1
        if opt.local_epoch != before:
            if outer is not None:
                with torch.no_grad():
                    for k, p in zip(kept, params):
                        k.grad = k - p  # the averaged pseudo-gradient (both peers started the epoch at `kept`)
                    outer.step()
                    for k, p in zip(kept, params):
                        p.copy_(k)
            else:
                with torch.no_grad():
                    for k, p in zip(kept, params):
                        k.copy_(p)
            note("commit", step=step, epoch=opt.local_epoch)
    if group == 0:
        note("validated", loss=gpt.validate(model, val))
    with torch.no_grad():
        checksum = float(sum(p.double().sum() for p in params))
    note("end", steps=step, epoch=opt.local_epoch, averaged=rounds.full, partial=rounds.partial, failed=rounds.failed,
         out_of_sync=rounds.out_of_sync, checksum=checksum)
    opt.shutdown()
    note("optimizer_shut_down")
    events.close()
    # no dht.shutdown(): the tracker's farewell store, sent without waiting, often leaves the DHT process a message
    # it cannot read, and it then sleeps 3 s and is terminated after its grace period; the interpreter's exit ends
    # the DHT's process (a daemon) and its p2pd at once


# ------------------------------------------------------------------------------------------------ the driver

def run_hivemind(args, netns: bool) -> dict:
    """The hivemind job in a fresh process (its own network namespace when it can be): its result, bytes, wall time."""
    out = Path(tempfile.mkdtemp(prefix="peer-hivemind-")) / "result.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--job", "hivemind", "--out", str(out), "--steps",
           str(args.steps), "--seed", str(args.seed), "--outer", args.outer] + (["--small"] if args.small else [])
    return peer_torchft.timed_job("hivemind", cmd, out, netns)


def run_job(system: str, args, netns: bool) -> dict:
    if system == "shoal":
        return peer_torchft.run_job("shoal", args, netns, kill=False) | {"steps": [args.steps] * GROUPS,
                                                                          "meetings": args.steps // H}
    return run_hivemind(args, netns)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=500, help="inner steps per group (a multiple of H = 50)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, the contestants alternating")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--small", action="store_true", help="2 layers, 64 wide, block 32, batch 8")
    parser.add_argument("--busy", type=int, default=0, help="CPU-burning processes beside every job")
    parser.add_argument("--outer", choices=("nesterov", "average"), default="nesterov",
                        help="hivemind's outer step: DiLoCo's, in the loop (default), or its own parameter mean")
    parser.add_argument("--only", choices=SYSTEMS)
    parser.add_argument("--job", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--peer", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.kill_at = 0.45  # peer_torchft's shoal job reads it; no kill here
    if args.peer is not None:
        return hivemind_peer(args)
    if args.job:
        return hivemind_job(args, args.out)
    systems = peer_torchft.systems_to_run(args, SYSTEMS, "hivemind", hivemind_missing())
    netns = netns_available()
    s = sizes(args.small)
    print(f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"machine: {gpt.machine()}; load average before: {peer_torchft.load()}; busy processes beside each job: "
          f"{args.busy}")
    print(f"GPT {s['layers']} layers, {s['heads']} heads, {s['width']} wide, block {s['block']}; 2 groups x 1 process x "
          f"1 thread, H = {H}, AdamW inside, batch {s['batch']} per group, {args.steps} steps per group, seed "
          f"{args.seed}; shoal: gloo, outer SGD 0.7 Nesterov 0.9; hivemind: target_batch_size {GROUPS * H * s['batch']}, "
          f"outer {'SGD 0.7 Nesterov 0.9 in the loop' if args.outer == 'nesterov' else 'the mean (its own)'}, "
          f"matchmaking_time {MATCHMAKING_S:g} s; validation: {s['val_windows']} windows of val.txt; wire bytes: "
          f"{'one network namespace per job' if netns else 'n/a (needs root and ip netns)'}\n", flush=True)
    busy = peer_torchft.start_busy(args.busy)
    try:
        results: dict[str, list[dict]] = {name: [] for name in systems}
        print("| round | system | loop s | job s | around s | steps per group | loop samples/s | meetings (averaged) | "
              "counted bytes | wire bytes | val loss |")
        print("|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
        for round_ in range(args.rounds):
            for name in systems if round_ % 2 == 0 else systems[::-1]:
                r = run_job(name, args, netns)
                r["samples"] = sum(r["steps"]) * s["batch"]
                results[name].append(r)
                averaged = f" ({r['averaged']}{'' if r.get('same_model', True) else ', models differ'})" \
                    if "averaged" in r else ""
                print(f"| {round_ + 1} | {name} | {r['loop_s']:.1f} | {r['job_s']:.1f} | {r['job_s'] - r['loop_s']:.1f} | "
                      f"{' / '.join(str(n) for n in r['steps'])} | {r['samples'] / r['loop_s']:.0f} | {r['meetings']}{averaged} | "
                      f"{peer_torchft.fmt(r['counted_bytes'], ',')} | {peer_torchft.fmt(r['wire_bytes'], ',')} | "
                      f"{r['val_loss']:.4f} |", flush=True)
        if args.rounds and len(systems) == 2:
            a, b = results["shoal"], results["hivemind"]
            # samples/s, not time: hivemind's peers do not take exactly --steps steps each (the docstring's point 1)
            loop = [(x["samples"] / x["loop_s"]) / (y["samples"] / y["loop_s"]) for x, y in zip(a, b)]
            job = [(x["samples"] / x["job_s"]) / (y["samples"] / y["job_s"]) for x, y in zip(a, b)]
            print(f"\nshoal's samples/s as a multiple of hivemind's, per round: loop "
                  f"{', '.join(f'{v:.2f}x' for v in loop)}; whole job {', '.join(f'{v:.2f}x' for v in job)}")
    finally:
        peer_torchft.stop_busy(busy)
    print(f"\nload average after: {peer_torchft.load()}")


if __name__ == "__main__":
    main()
