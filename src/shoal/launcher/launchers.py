"""Which process of a launched job this is: torchrun's, srun's or a plain env:// environment, read into one description.

A launcher (torchrun, Slurm's srun, a Kubernetes PyTorchJob, ...) starts every
process of the job itself and tells each who it is through environment
variables. `detect` reads them, purely (an environment in, a description
out), in this order:

- torchrun (torch.distributed.elastic): TORCHELASTIC_RUN_ID with RANK,
  WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_WORLD_SIZE, MASTER_ADDR/PORT,
  TORCHELASTIC_RESTART_COUNT/MAX_RESTARTS, TORCHELASTIC_USE_AGENT_STORE (the
  agent on node 0 hosts the rendezvous store; every rank is its client);
- env://: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT all set (a PyTorchJob
  running `shoal run` without torchrun, or a hand-written script);
- Slurm: a task of an srun step (SLURM_STEP_ID) with SLURM_PROCID,
  SLURM_NTASKS, SLURM_LOCALID and the step's node list; the first node is the
  master, at MASTER_PORT or a port derived from SLURM_JOB_ID. The node list's
  compressed form (`node[01-03,07]`) is expanded here, without scontrol.

Rank 0 of the launched world is the chief, as with shoal's own launcher.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Mapping, Optional

from shoal.errors import ShoalError

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
SLURM_BATCH_STEP = "4294967294"  # the step id of an sbatch script itself: no srun step, no ranks
SLURM_PORT_BASE, SLURM_PORT_SPAN = 10000, 20000


class LauncherEnvError(ShoalError, ValueError):
    """The launcher's environment is inconsistent (one line naming the variable)."""


@dataclass(frozen=True)
class LaunchedProcess:
    """This process's place in a world a launcher started."""

    launcher: str  # "torchrun" | "env" | "slurm"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    nnodes: int
    master_addr: str
    master_port: int
    agent_store: bool = False  # torchrun's agent hosts the store: rank 0 connects to it rather than hosting one
    restart: int = 0  # how many times torchrun restarted the job's processes so far
    max_restarts: int = 0

    @property
    def world_variable(self) -> str:
        """The variable that told this process the world's size."""
        return "SLURM_NTASKS" if self.launcher == "slurm" else "WORLD_SIZE"

    @property
    def on_loopback(self) -> bool:
        return self.master_addr in LOOPBACK_HOSTS

    def describe(self) -> str:
        restarts = f", restart {self.restart} of {self.max_restarts}" if self.max_restarts else ""
        return f"{self.launcher}: rank {self.rank} of {self.world_size}, master {self.master_addr}:{self.master_port}{restarts}"


def detect(env: Mapping[str, str]) -> Optional[LaunchedProcess]:
    """This process's description if a launcher started it, else None (shoal spawns the job's processes itself)."""
    if env.get("TORCHELASTIC_RUN_ID"):
        return _torchrun(env)
    if all(env.get(name) for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return _env_rendezvous(env)
    if env.get("SLURM_PROCID") and (env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")):
        if (env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")) != SLURM_BATCH_STEP:
            return _slurm(env)
    return None


def _number(env: Mapping[str, str], name: str, default: Optional[int] = None, low: int = 0) -> int:
    value = env.get(name)
    if value is None or value == "":
        if default is None:
            raise LauncherEnvError(f"{name} is not set (the launcher sets it for every process)")
        return default
    if not re.fullmatch(r"\d+", value.strip()) or int(value) < low:
        raise LauncherEnvError(f"{name}={value!r}: expected a whole number >= {low}")
    return int(value)


def _checked(process: LaunchedProcess, rank_var: str, world_var: str) -> LaunchedProcess:
    if process.rank >= process.world_size:
        raise LauncherEnvError(f"{rank_var}={process.rank} is not below {world_var}={process.world_size}")
    if not 0 < process.master_port < 65536:
        raise LauncherEnvError(f"master port {process.master_port}: expected 1..65535")
    return process


def _torchrun(env: Mapping[str, str]) -> LaunchedProcess:
    world = _number(env, "WORLD_SIZE", low=1)
    local_world = _number(env, "LOCAL_WORLD_SIZE", default=world, low=1)
    return _checked(LaunchedProcess(
        launcher="torchrun",
        rank=_number(env, "RANK"),
        world_size=world,
        local_rank=_number(env, "LOCAL_RANK", default=0),
        local_world_size=local_world,
        nnodes=_number(env, "GROUP_WORLD_SIZE", default=-(-world // local_world), low=1),
        master_addr=env.get("MASTER_ADDR") or "127.0.0.1",
        master_port=_number(env, "MASTER_PORT"),
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        restart=_number(env, "TORCHELASTIC_RESTART_COUNT", default=0),
        max_restarts=_number(env, "TORCHELASTIC_MAX_RESTARTS", default=0),
    ), "RANK", "WORLD_SIZE")


def _env_rendezvous(env: Mapping[str, str]) -> LaunchedProcess:
    world = _number(env, "WORLD_SIZE", low=1)
    local_world = _number(env, "LOCAL_WORLD_SIZE", default=1, low=1)
    return _checked(LaunchedProcess(
        launcher="env",
        rank=_number(env, "RANK"),
        world_size=world,
        local_rank=_number(env, "LOCAL_RANK", default=0),
        local_world_size=local_world,
        nnodes=-(-world // local_world),
        master_addr=env["MASTER_ADDR"],
        master_port=_number(env, "MASTER_PORT"),
    ), "RANK", "WORLD_SIZE")


def _slurm(env: Mapping[str, str]) -> LaunchedProcess:
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise LauncherEnvError("SLURM_NODELIST is not set: cannot tell the first node (the master)")
    nodes = expand_nodelist(nodelist)
    world = _number(env, "SLURM_NTASKS", low=1)
    return _checked(LaunchedProcess(
        launcher="slurm",
        rank=_number(env, "SLURM_PROCID"),
        world_size=world,
        local_rank=_number(env, "SLURM_LOCALID", default=0),
        local_world_size=-(-world // len(nodes)),
        nnodes=len(nodes),
        master_addr=env.get("MASTER_ADDR") or nodes[0],
        master_port=_number(env, "MASTER_PORT") if env.get("MASTER_PORT") else slurm_port(env),
    ), "SLURM_PROCID", "SLURM_NTASKS")


def slurm_port(env: Mapping[str, str]) -> int:
    """The master's port for a Slurm job without MASTER_PORT: one per job id, so that jobs sharing a node differ."""
    return SLURM_PORT_BASE + _number(env, "SLURM_JOB_ID", default=0) % SLURM_PORT_SPAN


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list, in order: "node[01-03,07],gpu5" -> node01 node02 node03 node07 gpu5.

    Several bracket groups in one name multiply ("r[1-2]n[1-2]" -> r1n1 r1n2 r2n1 r2n2); a range keeps
    the zero padding of its lower bound, as Slurm's.
    """
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip(), nodelist):
        parts = re.split(r"(\[[^\]]*\])", item)
        choices = []
        for part in parts:
            if part.startswith("["):
                choices.append(_expand_ranges(part[1:-1], nodelist))
            elif "[" in part or "]" in part:
                raise LauncherEnvError(f"SLURM_NODELIST={nodelist!r}: unbalanced brackets")
            else:
                choices.append([part])
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    if not hosts or any(not h for h in hosts):
        raise LauncherEnvError(f"SLURM_NODELIST={nodelist!r}: an empty host name")
    return hosts


def _split_top_level(text: str, whole: str) -> list[str]:
    """Split at commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise LauncherEnvError(f"SLURM_NODELIST={whole!r}: nested brackets")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise LauncherEnvError(f"SLURM_NODELIST={whole!r}: unbalanced brackets")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise LauncherEnvError(f"SLURM_NODELIST={whole!r}: unbalanced brackets")
    items.append(text[start:])
    return items


def _expand_ranges(spec: str, whole: str) -> list[str]:
    out = []
    for piece in spec.split(","):
        m = _RANGE.match(piece.strip())
        if not m:
            raise LauncherEnvError(f"SLURM_NODELIST={whole!r}: {piece!r} is not a number or a range")
        low, high = m.group(1), m.group(2) or m.group(1)
        if int(high) < int(low):
            raise LauncherEnvError(f"SLURM_NODELIST={whole!r}: range {piece!r} runs backwards")
        out.extend(str(n).zfill(len(low)) for n in range(int(low), int(high) + 1))
    return out
