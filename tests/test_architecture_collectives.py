"""Every collective runs on a group the plan names (docs/architecture.md, "Process groups"), checked on the source.

The plan lists its groups (planning/process_groups.py, JobPlan.process_groups, the whole job among them);
shoal.comm.collectives makes them (`create`, `whole_job`) and nothing else makes a `Group`. So a collective is on a
plan group when it is a `Group`'s method, or one of shoal.comm.dist's blocking wrappers given a group, or (inside
comm) a torch.distributed collective given `group=<a Group>.handle`. Where groups are made (new_group, only in
comm's plan-group builder, the quorum's re-formed meeting groups and the channels) is tests/test_architecture.py's
`test_every_process_group_is_one_the_plan_names`.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from shoal.config import job_from_text
from shoal.planning.describe import describe
from shoal.planning.plan import plan_job
from shoal.planning.process_groups import JOB_GROUP
from test_estimate import SMALL

SRC = Path(__file__).resolve().parents[1] / "src" / "shoal"

GROUP_AT = {"broadcast": 2, "all_reduce_sum": 1, "all_gather": 1}  # shoal.comm.dist's wrappers: the group's position
TORCH_COLLECTIVES = {"broadcast", "all_reduce", "reduce", "all_gather", "gather", "scatter", "reduce_scatter",
                     "all_to_all", "barrier", "monitored_barrier", "broadcast_object_list", "all_gather_object",
                     "gather_object", "scatter_object_list", "all_gather_into_tensor", "reduce_scatter_tensor",
                     "all_to_all_single"}
GROUP_MAKER = "comm/collectives.py"  # the only file that builds a Group (from the plan's list)


def aliases(tree: ast.AST) -> tuple[set[str], dict[str, str], set[str], set[str]]:
    """The names a file binds to shoal.comm.dist, to its wrappers (name -> wrapper), to torch.distributed and to
    shoal.comm.collectives' Group."""
    comm, wrappers, torch_dist, group = set(), {}, set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            for a in node.names:
                bound = a.asname or a.name
                if node.module == "shoal.comm" and a.name == "dist":
                    comm.add(bound)
                elif node.module == "shoal.comm.dist" and a.name in GROUP_AT:
                    wrappers[bound] = a.name
                elif node.module == "torch" and a.name == "distributed":
                    torch_dist.add(bound)
                elif node.module == "shoal.comm.collectives" and a.name == "Group":
                    group.add(bound)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed" and a.asname:
                    torch_dist.add(a.asname)
    return comm, wrappers, torch_dist, group


def unplanned_collectives(path: Path) -> list[str]:
    """Where a file runs a collective on no group of the plan's, each as 'file:line function what': one of comm's
    wrappers without a group, a torch.distributed collective without `group=<Group>.handle`, a `Group` built outside
    comm's builder, the whole job's group taken from anything but a plan's `.process_groups`."""
    where = str(path.relative_to(SRC)) if path.is_relative_to(SRC) else path.name
    tree = ast.parse(path.read_text())
    comm, wrappers, torch_dist, group_names = aliases(tree)
    found = []

    def hit(node: ast.Call, scope: str, what: str) -> None:
        found.append(f"{where}:{node.lineno} {scope or '<module>'} {what}")

    def visit(node: ast.AST, scope: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = f"{scope}.{node.name}" if scope else node.name
        if isinstance(node, ast.Call):
            func, keywords = node.func, {k.arg: k.value for k in node.keywords}
            owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else None
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            wrapper = name if owner in comm else wrappers.get(name) if owner is None else None
            if wrapper in GROUP_AT and len(node.args) <= GROUP_AT[wrapper] and "group" not in keywords:
                hit(node, scope, f"comm.{wrapper}() without a group")
            elif owner in torch_dist and name in TORCH_COLLECTIVES:
                given = keywords.get("group")
                if not (isinstance(given, ast.Attribute) and given.attr == "handle"):
                    hit(node, scope, f"dist.{name}() without group=<a Group>.handle")
            elif where != GROUP_MAKER and ((owner == "collectives" and name == "Group") or (owner is None and name in group_names)):
                hit(node, scope, "Group() built by hand")
            elif owner == "collectives" and name == "whole_job" and not (
                    node.args and isinstance(node.args[0], ast.Attribute) and node.args[0].attr == "process_groups"):
                hit(node, scope, f"collectives.whole_job({ast.unparse(node.args[0]) if node.args else ''})")
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(tree, "")
    return found


def test_every_collective_runs_on_a_group_the_plan_names():
    """No exchange, strategy or session issues a collective over the world by itself: it passes the plan's group
    (`run.process_groups[name]`, the whole job's included)."""
    assert [hit for path in sorted(SRC.rglob("*.py")) for hit in unplanned_collectives(path)] == []


def test_the_collective_check_sees_a_world_collective(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import torch.distributed as dist\n"
        "from shoal.comm import collectives, dist as comm\n"
        "from shoal.comm.dist import all_gather as gather_all\n"
        "from shoal.comm.collectives import Group\n"
        "class S:\n"
        "    def metrics(self, t):\n"
        "        comm.all_reduce_sum(t)\n"                                     # 7: the world's, as before the plan named it
        "        comm.broadcast(t, 0)\n"                                       # 8
        "        gather_all(t)\n"                                              # 9
        "        comm.all_reduce_sum(t, self.job); comm.broadcast(t, 0, group=self.job); gather_all(t, self.job)\n"
        "def attach(run, plan, mine):\n"
        "    world = collectives.Group('world', (0, 1), None, False)\n"       # 12
        "    also = Group('world', (0, 1), None, False)\n"                    # 13
        "    dist.all_reduce(t)\n"                                             # 14
        "    dist.broadcast(t, 0, group=mine)\n"                               # 15
        "    dist.all_reduce(t, group=run.job.handle)\n"
        "    collectives.whole_job(mine)\n"                                    # 17
        "    return collectives.whole_job(plan.process_groups)\n")
    assert unplanned_collectives(bad) == [
        "bad.py:7 S.metrics comm.all_reduce_sum() without a group", "bad.py:8 S.metrics comm.broadcast() without a group",
        "bad.py:9 S.metrics comm.all_gather() without a group", "bad.py:12 attach Group() built by hand",
        "bad.py:13 attach Group() built by hand", "bad.py:14 attach dist.all_reduce() without group=<a Group>.handle",
        "bad.py:15 attach dist.broadcast() without group=<a Group>.handle", "bad.py:17 attach collectives.whole_job(mine)"]


@pytest.mark.parametrize("cluster", ["nworkers_per_group: 2 nworkers_per_procs: 1",  # AllReduce, sliced
                                     "nworkers_per_group: 2 nworkers_per_procs: 1 max_restarts: 1",  # replicated
                                     "nworker_groups: 2 nworkers_per_procs: 1 local_steps: 2",  # Local SGD
                                     "nworker_groups: 2 nworkers_per_procs: 1 server_worker_separate: true"])  # Downpour
def test_a_plan_of_several_processes_names_the_whole_job_last_and_shows_it_nowhere(cluster):
    """The whole job is a plan group too (every rank; `world`: the world's own handle), after the strategy's own, and
    `shoal plan` lists only the strategy's (its output as before the plan named the whole job)."""
    plan = plan_job(job_from_text(SMALL.format(cluster=cluster)), cores=2)
    assert (plan.process_groups[-1].name, plan.process_groups[-1].ranks) == (JOB_GROUP, tuple(range(plan.nprocs)))
    assert [g.world for g in plan.process_groups] == [False] * (len(plan.process_groups) - 1) + [True]
    assert JOB_GROUP not in [g["name"] for g in describe(plan)["process_groups"]]


def test_a_plan_of_one_process_names_no_group():
    assert plan_job(job_from_text(SMALL.format(cluster="nworkers_per_group: 2 nworkers_per_procs: 2")), cores=2).process_groups == ()
