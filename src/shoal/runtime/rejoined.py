"""Inside a process restarted into a running job (shoal.launcher.rejoin starts it): after the assembly and before
the first step, its group takes the servers' live params and the steps it had done (Downpour), or, admitted at the
groups' next meeting, that meeting's anchor and updater state from the chief's group (Local SGD).

Each rejoin is one line on the terminal and in the process's log and one JSON line in
WORKSPACE/logs/rejoins.jsonl (the launcher adds this run's lines to summary.json at the end).
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch

from shoal.report.terminal import also_on_the_terminal, write_line
from shoal.report.writes import open_for_append

RECORDS_FILE = "rejoins.jsonl"


def process_started_at() -> float:
    """When this process started (the kernel's word, 10 ms ticks), on the wall clock."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        since_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)
    except (OSError, IndexError, ValueError, AttributeError):
        return _imported_at


_imported_at = time.time()


def complete(run, spec) -> None:
    """Pull the live params, the version and the group's steps from the servers; train from there on."""
    trainer, ticket = run.chief, spec.rejoin
    knocked_at = time.time()  # the process is built (imports, plan, net, data): the handshake and the pull from here
    step, version, digests = run.plan.strategy.complete_rejoin(run, ticket.incarnation)
    trainer.start_at(step)
    # a group over several processes, all restarted (Downpour's, `regroups`; a replica of AllReduce's rejoins alone)
    members = run.plan.ranks_of_group(trainer.group) if run.plan.strategy.regroups else [run.rank]
    if len(members) > 1 and run.rank != members[0]:  # its stub reports the rejoin
        write_line(f"Worker group {trainer.group} rejoined at step {step} (process {run.rank}, restart {ticket.incarnation}): "
                   f"the live params its stub, process {members[0]}, pulled (version {version})")
        return
    if len(members) > 1:
        digests["processes"] = list(members)
    report(spec.workspace, ticket, trainer.group, run.rank, step, version, digests, knocked_at)


def report(workspace, ticket, group: int, rank: int, step: int, version: int, digests: dict, knocked_at: float,
           terminal: bool = True) -> None:
    """The rejoin's line (this process's log, and the job's terminal unless the chief says it there: `terminal` False)
    and its record in logs/rejoins.jsonl."""
    rejoined_at = time.time()
    started_at = process_started_at()
    record = {"group": group, "rank": rank, "incarnation": ticket.incarnation, "step": step, "version": version,
              "process_start_to_rejoin_s": round(rejoined_at - started_at, 3), "handshake_and_pull_s": round(rejoined_at - knocked_at, 3),
              "time": rejoined_at,
              "by_hand": ticket.detected_at is None, "digests": digests}
    if "processes" in digests:  # a group over several processes, all restarted: its stub's record names them
        record["processes"] = digests.pop("processes")
    if "skipped_steps" in digests:  # Distributed Hogwild: [first, joined), the steps whose rows the group skipped
        record["skipped_steps"] = digests.pop("skipped_steps")
    if ticket.detected_at is not None:
        record["detection_to_rejoin_s"] = round(rejoined_at - ticket.detected_at, 3)
    since_death = f"; {record['detection_to_rejoin_s']:.2f} s after its death was seen" if ticket.detected_at is not None else ""
    # Local SGD: `version` is the meeting it joined after, and the exchange says what it took there
    took = digests.pop("took", None) or f"live params of version {version}"
    who = digests.pop("who", None)  # a process of a group of replicas (AllReduce) names itself: its group went on
    where = (f"processes {', '.join(map(str, record['processes']))}" if "processes" in record else f"process {rank}")
    line = (f"{who} rejoined at step {step} (restart {ticket.incarnation})" if who else
            f"Worker group {group} rejoined at step {step} ({where}, restart {ticket.incarnation})")
    line += f": {took}, {record['process_start_to_rejoin_s']:.2f} s after its process started{since_death}"
    write_line(line)  # this process's log
    if terminal:
        also_on_the_terminal(line)  # the job's terminal (the launcher's, or the --rejoin command's)
    with open_for_append(Path(workspace) / "logs" / RECORDS_FILE) as f:  # through no link
        f.write(json.dumps(record) + "\n")


def fingerprint(tensors: list[torch.Tensor]) -> str:
    """16 hex digits of the tensors' bytes, in order: what a rejoin record shows a restarted process held before and
    after it took the live state (rejoins.jsonl, the process's log)."""
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]
