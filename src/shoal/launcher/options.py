"""How to run a job on this host (`shoal run`'s options, shoal.train's and shoal.fit's arguments)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Union

from shoal.report.terminal import write_line

if TYPE_CHECKING:
    from shoal.launcher.launch import Nodes
    from shoal.neuralnet.params import ParamStore
    from shoal.planning.plan import JobPlan


@dataclass
class RunOptions:
    workspace: Optional[Path] = None  # overrides cluster.workspace
    resume: Union[bool, str] = False  # "auto": this job's newest checkpoint if the workspace has one, else start fresh
    # folders relative paths in the job are resolved against (cwd first, as SINGA)
    base_dirs: list[Path] = field(default_factory=lambda: [Path.cwd()])
    log: Callable[[str], None] = write_line
    progress: Optional[bool] = None  # None: a bar when stderr is a terminal
    nodes: Optional["Nodes"] = None  # several hosts (shoal.launcher.launch.Nodes); None: this host only
    # shoal.fit: registers its layer types in each spawned process (picklable), and sets initial param values
    process_setup: Optional[Callable[[], None]] = None
    initial_values: Optional[Callable[["ParamStore"], None]] = None
    # the job's plan, when the caller planned it already (shoal.fit checks its optimizer against it): used if it is
    # this job's on these nodes (run_job.plan_of), else the job is planned
    plan: Optional["JobPlan"] = None
    # shoal.session under `shoal run script.py`: what each spawned rank runs instead of the job's trainers (the script,
    # from the top; picklable), given (plan, rank, RunSpec)
    rank_main: Optional[Callable] = None
