"""Exchanges raise; the launcher decides how a process ends; faults enter the step engine as hooks (issue 29)."""
from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from shoal.launcher import faults, stalls
from shoal.runtime.exchanges.downpour import REFUSED
from shoal.runtime.exchanges.downpour_stub import DownpourExchange
from shoal.runtime.interfaces import FaultInjection, GroupDropped


def test_a_refused_push_raises_group_dropped_instead_of_exiting():
    exchange = SimpleNamespace(group=2)
    DownpourExchange._leave_if_refused(exchange, 7, step=5)  # an answer with a version: nothing happens
    with pytest.raises(GroupDropped, match="worker group 2: the servers refused its push at step 5"):
        DownpourExchange._leave_if_refused(exchange, REFUSED, step=5)


def test_the_launcher_ends_a_dropped_groups_process_with_its_exit_code():
    code = ("from shoal.launcher import stalls\nfrom shoal.runtime.interfaces import GroupDropped\n"
            "with stalls.leaving_when_dropped():\n    raise GroupDropped('worker group 1: dropped')\nprint('not reached')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == stalls.GROUP_DROPPED_EXIT, proc.stderr
    assert proc.stdout.splitlines() == ["worker group 1: dropped"]
    assert proc.stderr == ""


def test_injected_faults_are_hooks_read_from_the_environment(monkeypatch):
    assert FaultInjection().process_hooks(0) == [] and FaultInjection().compute_delay(0, 0) is None
    monkeypatch.setenv("SHOAL_INJECT_GROUP_ERROR", "1:4")
    monkeypatch.setenv("SHOAL_INJECT_EXIT", "2:9")
    monkeypatch.setenv("SHOAL_SLOW_WORKER", "1.0:0+0.5")
    injected = faults.from_environment()
    assert injected.group_hooks(0) == [] and injected.compute_delay(0, 0) is None
    assert injected.compute_delay(0, 1).extra_seconds(1.0, samples=8) == pytest.approx(0.5)
    (hook,) = injected.group_hooks(1)
    hook.before_step(3)
    with pytest.raises(RuntimeError, match="injected failure"):
        hook.before_step(4)
    assert [f.step for f in injected.process_hooks(2)] == [9] and injected.process_hooks(1) == []
    assert injected.server_update_hook(1) is None
    after_update = injected.server_update_hook(2)
    after_update(8)  # not its version: the server goes on
    proc = subprocess.run([sys.executable, "-c", "from shoal.launcher import faults\nfaults.from_environment().server_update_hook(2)(9)\n"
                                                 "print('not reached')"], capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout) == (3, "")


def test_a_job_whose_data_is_missing_stops_in_one_line_naming_the_file(tmp_path):
    """Distributed Hogwild, whose groups outlive a dead one: a process that cannot read its data before its first step
    is no fault to go on from (every process reads the same file): the job stops in one line naming the file, with no
    line saying the other groups go on."""
    from cli_in_process import run_cli
    from conftest import mlp_job_text

    missing = tmp_path / "no-data"
    job = tmp_path / "job.conf"
    job.write_text(mlp_job_text(missing, layout="Distributed Hogwild, 2 groups"))
    proc = run_cli("run", job, "--workspace", tmp_path / "ws", "--no-progress", cwd=tmp_path, timeout=120)
    assert proc.returncode != 0
    said = proc.stdout + proc.stderr
    assert "go on" not in said and "Traceback" not in said and "WARNING" not in said, said
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{missing / 'train.bin'}: no such store" in lines[0], proc.stderr
    assert "failed before its first step" in lines[0], lines[0]
