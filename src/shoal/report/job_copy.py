"""WORKSPACE/.shoal/job.conf: the job as the workspace's run was started.

The chief writes it once its part of the job assembled (a refused --resume leaves the earlier copy
alone); `--resume=auto` reads it to tell this job's checkpoints from another's (shoal.launcher.elastic).
"""
from __future__ import annotations

from pathlib import Path

from shoal.report.writes import own_folder, write_file

META = ".shoal"  # shoal's own folder in a workspace: its marker, its lock and this copy
JOB_COPY = Path(META) / "job.conf"


def write_job_copy(job_text: str, workspace: Path) -> Path:
    """WORKSPACE/.shoal/job.conf: the job as this run was started (read by --resume=auto)."""
    path = Path(workspace) / JOB_COPY
    own_folder(path.parent)
    write_file(path, job_text.encode())  # through no link: a .shoal/ or job.conf planted as one is refused
    return path
