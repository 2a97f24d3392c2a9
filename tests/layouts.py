"""Every cluster layout the end-to-end tests run, in one table, and the check that a run had its layout.

A test never edits a job file's text to set its layout: it applies the row's fields through the
product's own overrides (`cluster.FIELD=VALUE`, as `shoal run --set` and `shoal.load_job(path,
overrides)` take them, or `shoal.Cluster(**row.cluster)` for `shoal.fit`). And every run that
claims a layout proves it ran with it: summary.json's processes, workers and framework must be
the row's, and a launched run leaves one log per process. So a layout that silently fell back to
one worker fails instead of comparing one worker with itself.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

import shoal


@dataclass(frozen=True)
class Layout:
    """A cluster section (ClusterProto fields) and what a run of it must report."""

    cluster: dict = field(default_factory=dict)
    processes: int = 1
    workers: int = 1
    framework: str = "single worker"  # summary.json's `framework`

    @property
    def synchronous(self) -> bool:
        return self.cluster.get("nworker_groups", 1) == 1

    @property
    def launched(self) -> bool:
        """Run as several processes (each writes WORKSPACE/logs/rank<R>.log)."""
        return self.processes > 1

    def overrides(self, **extra) -> list[str]:
        """`cluster.FIELD=VALUE` strings for shoal.load_job / the Python API; extra: more cluster fields."""
        return [f"cluster.{name}={_text(value)}" for name, value in {**self.cluster, **extra}.items()]

    def cli(self, **extra) -> list[str]:
        """The same as `shoal run` options: --set cluster.FIELD=VALUE ..."""
        return [arg for override in self.overrides(**extra) for arg in ("--set", override)]

    def section(self, **extra) -> str:
        """The job file's cluster section, for jobs that must be files: `cluster { FIELD: VALUE ... }`."""
        return "cluster { " + " ".join(f"{name}: {_text(value)}" for name, value in {**self.cluster, **extra}.items()) + " }"

    def fit_cluster(self, **extra):
        return shoal.Cluster(**{**self.cluster, **extra})


def _text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


SEPARATE = {"server_worker_separate": True}

LAYOUTS: dict[str, Layout] = {
    # -- synchronous: one worker group --------------------------------------------------------
    "single worker": Layout(),
    "in-memory Sandblaster, 2 threads": Layout(dict(nworkers_per_group=2, nworkers_per_procs=2), 1, 2, "in-memory Sandblaster"),
    "in-memory Sandblaster, 3 threads (uneven 11+11+10)": Layout(dict(nworkers_per_group=3, nworkers_per_procs=3), 1, 3, "in-memory Sandblaster"),
    "in-memory Sandblaster, 4 threads": Layout(dict(nworkers_per_group=4, nworkers_per_procs=4), 1, 4, "in-memory Sandblaster"),
    "in-memory Sandblaster, 2 threads, 2 server slices": Layout(
        dict(nworkers_per_group=2, nworkers_per_procs=2, nservers_per_group=2, nservers_per_procs=2), 1, 2, "in-memory Sandblaster"),
    "AllReduce, 2 processes": Layout(dict(nworkers_per_group=2), 2, 2, "AllReduce"),
    "AllReduce, 2 processes, 2 server slices": Layout(dict(nworkers_per_group=2, nservers_per_group=2), 2, 2, "AllReduce"),
    "AllReduce, 3 processes": Layout(dict(nworkers_per_group=3, nservers_per_group=3), 3, 3, "AllReduce"),
    # restarts allowed: every process a whole replica, one all-reduce a step through the job's quorum (issue 38)
    "AllReduce, 3 processes, replicated (max_restarts 1)": Layout(dict(nworkers_per_group=3, max_restarts=1), 3, 3, "AllReduce"),
    "AllReduce, 2 processes x 2 threads": Layout(dict(nworkers_per_group=4, nworkers_per_procs=2, nservers_per_group=2), 2, 4, "AllReduce"),
    "Sandblaster, 2 workers + 1 server, 3 processes": Layout(dict(nworkers_per_group=2, **SEPARATE), 3, 2, "Sandblaster"),
    "Sandblaster, 2 workers + 2 servers, 4 processes": Layout(dict(nworkers_per_group=2, nservers_per_group=2, **SEPARATE), 4, 2, "Sandblaster"),
    "Sandblaster, 3 workers + 2 servers, 5 processes": Layout(dict(nworkers_per_group=3, nservers_per_group=2, **SEPARATE), 5, 3, "Sandblaster"),
    "Sandblaster, 2 threads + 2 servers, 3 processes": Layout(
        dict(nworkers_per_group=2, nworkers_per_procs=2, nservers_per_group=2, **SEPARATE), 3, 2, "Sandblaster"),
    # -- asynchronous: several worker groups ---------------------------------------------------
    "in-memory Hogwild, 2 groups": Layout(dict(nworker_groups=2, nworkers_per_procs=2), 1, 2, "in-memory Hogwild"),
    "in-memory Hogwild, 3 groups": Layout(dict(nworker_groups=3, nworkers_per_procs=3), 1, 3, "in-memory Hogwild"),
    "in-memory Hogwild, 2 groups x 2 threads": Layout(dict(nworker_groups=2, nworkers_per_group=2, nworkers_per_procs=4), 1, 4, "in-memory Hogwild"),
    "in-memory Downpour, 2 groups": Layout(dict(nworker_groups=2, nworkers_per_procs=2, share_memory=False), 1, 2, "in-memory Downpour"),
    "Downpour, 2 groups + 1 server, 3 processes": Layout(dict(nworker_groups=2, **SEPARATE), 3, 2, "Downpour"),
    "Downpour, 3 groups + 1 server, 4 processes": Layout(dict(nworker_groups=3, **SEPARATE), 4, 3, "Downpour"),
    # the seed docs' Downpour: 2 groups x 2 workers, 2 separate servers
    "Downpour, 2 groups x 2 workers + 2 servers, 6 processes": Layout(
        dict(nworker_groups=2, nworkers_per_group=2, nservers_per_group=2, **SEPARATE), 6, 4, "Downpour"),
    "Downpour, 2 groups x 2 threads + 1 server, 3 processes": Layout(
        dict(nworker_groups=2, nworkers_per_group=2, nworkers_per_procs=2, **SEPARATE), 3, 4, "Downpour"),
    "Distributed Hogwild, 2 groups": Layout(dict(nworker_groups=2, nserver_groups=2), 2, 2, "Distributed Hogwild"),
    # the seed docs' Distributed Hogwild: each process a whole worker group and server group
    "Distributed Hogwild, 3 groups": Layout(dict(nworker_groups=3, nserver_groups=3), 3, 3, "Distributed Hogwild"),
    # each process one group of 2 worker threads (and its server)
    "Distributed Hogwild, 2 groups x 2 threads": Layout(
        dict(nworker_groups=2, nserver_groups=2, nworkers_per_group=2, nworkers_per_procs=2), 2, 4, "Distributed Hogwild"),
}

SINGLE = LAYOUTS["single worker"]


def threads(n: int) -> Layout:
    """One process of n synchronous worker threads, every field written (to override a job file's own cluster)."""
    return Layout(dict(nworker_groups=1, nworkers_per_group=n, nworkers_per_procs=n), 1, n, "in-memory Sandblaster" if n > 1 else "single worker")

# every layout that must train exactly like one worker (the single worker itself excluded)
SYNCHRONOUS = [name for name, layout in LAYOUTS.items() if layout.synchronous and layout.workers > 1]
IN_MEMORY_SYNCHRONOUS = [name for name in SYNCHRONOUS if not LAYOUTS[name].launched]
LAUNCHED_SYNCHRONOUS = [name for name in SYNCHRONOUS if LAYOUTS[name].launched]
ASYNCHRONOUS = [name for name, layout in LAYOUTS.items() if not layout.synchronous]


def load(job: Union[str, Path], layout: Union[str, Layout], *overrides: str, **cluster_extra):
    """The job file with the layout (and further `--set`-style overrides) applied, validated."""
    layout = LAYOUTS[layout] if isinstance(layout, str) else layout
    return shoal.load_job(job, layout.overrides(**cluster_extra) + list(overrides))


def summary(workspace: Path) -> dict:
    return json.loads((Path(workspace) / "summary.json").read_text())


def assert_ran(workspace: Union[str, Path], layout: Union[str, Layout], ranks_here: int | None = None) -> dict:
    """The run in `workspace` had `layout`: its summary says so, and a launched run left a log per process
    (ranks_here: how many of them ran on this host, for multi-host runs). Returns the summary."""
    name = layout if isinstance(layout, str) else None
    layout = LAYOUTS[layout] if isinstance(layout, str) else layout
    got = summary(workspace)
    assert (got["processes"], got["workers"], got["framework"]) == (layout.processes, layout.workers, layout.framework), (
        f"{workspace} ran {got['label']!r}, not the layout {name or layout}")
    logs = sorted(p.name for p in (Path(workspace) / "logs").glob("rank*.log"))
    if layout.launched:
        assert len(logs) == (ranks_here or layout.processes), f"{workspace}: {logs} for {layout.processes} processes"
    else:
        assert logs == [], f"{workspace}: an in-process layout left process logs {logs}"
    return got


def process_logs(workspace: Union[str, Path], tail_chars: int = 4000) -> str:
    """The end of each process's log in `workspace`: what a failure message shows of a run that went wrong."""
    logs = sorted((Path(workspace) / "logs").glob("rank*.log"))
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-tail_chars:]}" for p in logs)


def assert_no_process_restarted(workspace: Union[str, Path]) -> None:
    """No process of the run in `workspace` died and was restarted (a run given restarts but no fault)."""
    pids = {log.name: set(re.findall(r"\(pid = (\d+)\)", log.read_text(errors="replace")))
            for log in (Path(workspace) / "logs").glob("rank*.log")}
    restarted = sorted(name for name, seen in pids.items() if len(seen) > 1)
    restarted += ["the whole job"] if summary(workspace).get("job_restarts") else []
    assert not restarted, f"restarted in a run with no fault injected: {restarted}\n{process_logs(workspace)}"


def train(job: Union[str, Path], layout: Union[str, Layout], workspace: Path, *overrides: str, resume=False, **cluster_extra):
    """shoal.train of the job with the layout, checked to have run with it; returns the History."""
    history = shoal.train(load(job, layout, *overrides, **cluster_extra), workspace=workspace, resume=resume, log=lambda *a: None)
    assert_ran(workspace, layout)
    return history
