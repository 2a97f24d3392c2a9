"""A partitioned module (SINGA's `partition_dim: 1`) in a user's own loop (issue 39, point 1).

Not built yet (torch's tensor parallelism is the way: docs/architecture.md, the step boundary's *Not built*); until it is, a session's
job that asks for it is refused in one line, by `shoal run script.py` and `shoal plan script.py` alike, instead of
silently training a replicated module."""
from __future__ import annotations

import pytest

from cli_in_process import one_line_error, run_cli

SCRIPT = """import torch, shoal
run = shoal.session()
model = run.model(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)))
print("the loop ran")
"""


@pytest.mark.parametrize("command", ["run", "plan"])
def test_a_partitioned_module_is_refused_in_one_line(tmp_path, command):
    script = tmp_path / "loop.py"
    script.write_text(SCRIPT)
    workspace = ["--workspace", str(tmp_path / "ws")] if command == "run" else []
    proc = run_cli(command, script, *workspace, "--set", "cluster.nworkers_per_group=2",
                   "--set", "cluster.nworkers_per_procs=1", "--set", "neuralnet.partition_dim=1", cwd=tmp_path, timeout=60)
    line = one_line_error(proc)
    assert line.startswith("shoal.session: neuralnet.partition_dim 1: a partitioned module is not supported"), line
    assert "the loop ran" not in proc.stdout
    assert not (tmp_path / "ws").exists()

