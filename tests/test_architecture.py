"""The layering rules of docs/architecture.md, checked on the source: who may import whom.

config ← planning ← runtime ← frontend, with neuralnet (net, layers, params, updaters) below
planning and runtime, data beside neuralnet, report beside everything, and comm the only code
that touches torch.distributed.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "shoal"


def imports_of(path: Path) -> set[str]:
    """Every module a file imports (absolute names), wherever the import statement is."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def files_of(package: str) -> list[Path]:
    return sorted((SRC / package).rglob("*.py")) if (SRC / package).is_dir() else [SRC / f"{package}.py"]


def offenders(packages: list[str], forbidden: list[str]) -> list[str]:
    found = []
    for package in packages:
        for path in files_of(package):
            for name in imports_of(path):
                if any(name == f or name.startswith(f + ".") for f in forbidden):
                    found.append(f"{path.relative_to(SRC)} imports {name}")
    return found


RULES = {
    "only comm touches torch.distributed": (
        [p.stem for p in SRC.iterdir() if p.stem not in ("comm", "__pycache__")], ["torch.distributed"]),
    "config imports nothing of shoal above it": (
        ["config"], ["shoal.planning", "shoal.neuralnet", "shoal.runtime", "shoal.frontend", "shoal.report", "shoal.comm", "shoal.data"]),
    "planning never imports runtime or the front ends": (["planning"], ["shoal.runtime", "shoal.frontend", "shoal.comm"]),
    "the net and its layers never import planning, runtime or the front ends": (
        ["neuralnet"], ["shoal.planning", "shoal.runtime", "shoal.frontend", "shoal.comm"]),
    "data never imports planning, runtime or the front ends": (["data"], ["shoal.planning", "shoal.runtime", "shoal.frontend", "shoal.comm"]),
    "runtime never imports the front ends": (["runtime", "comm"], ["shoal.frontend"]),
    "report never imports the runtime or the front ends": (["report"], ["shoal.runtime", "shoal.frontend", "shoal.comm"]),
    "the strategies reach the code below them through the plan, never by import": (
        [p.stem for p in SRC.iterdir() if p.stem not in ("strategies", "__pycache__")], ["shoal.strategies"]),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_layering(rule):
    packages, forbidden = RULES[rule]
    assert offenders(packages, forbidden) == []


def test_the_rules_see_a_violation(tmp_path):
    """The checker itself: an import of torch.distributed, even inside a function, is found."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    import torch.distributed as dist\n    from shoal.runtime import trainer\n")
    assert {"torch.distributed", "shoal.runtime", "shoal.runtime.trainer"} <= imports_of(bad)


def test_planning_calls_live_in_planning():
    """place/partition are called in the planning package only; everything else receives the JobPlan."""
    calls = []
    for path in SRC.rglob("*.py"):
        if path.is_relative_to(SRC / "planning"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("place", "partition", "plan_partition", "slice_params"):
                calls.append(f"{path.relative_to(SRC)}:{node.lineno} {node.func.id}()")
    assert calls == []


def test_nothing_reassigns_a_trainer_attribute_from_outside():
    """The trainer takes its extras as hooks: no module outside trainer.py assigns to `<trainer>.<attr>`."""
    found = []
    for path in SRC.rglob("*.py"):
        if path.name == "trainer.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
            for target in targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id in ("trainer", "chief", "t"):
                    found.append(f"{path.relative_to(SRC)}:{node.lineno} {target.value.id}.{target.attr}")
    assert found == []


STRATEGY_HOMES = [SRC / "strategies", SRC / "planning" / "strategy.py"]
EXCHANGES = SRC / "runtime" / "exchanges"  # defines the concrete exchanges (and may use its own), never a Framework


def _concrete_exchanges() -> set[str]:
    """The classes runtime/exchanges/ defines that an assembly would build: exchanges, servers, meetings."""
    names = set()
    for path in (SRC / "runtime" / "exchanges").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith(("Exchange", "Server", "Meeting")):
                names.add(node.name)
    return names


def framework_branches(path: Path, members: set[str], concrete: set[str]) -> list[str]:
    """Where a file decides by framework: a Framework member named, a `match` on a framework, an isinstance of a
    concrete exchange (what the framework built), or such a class imported."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        where = f"{path.relative_to(SRC) if path.is_relative_to(SRC) else path.name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Framework" and node.attr in members:
            found.append(f"{where} Framework.{node.attr}")
        elif isinstance(node, ast.Match) and "framework" in ast.unparse(node.subject):
            found.append(f"{where} match {ast.unparse(node.subject)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance" and len(node.args) == 2:
            classes = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)} | {
                n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
            if classes & concrete:
                found.append(f"{where} isinstance(..., {ast.unparse(node.args[1])})")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shoal.runtime.exchanges"):
            found.extend(f"{where} imports {a.name}" for a in node.names if a.name in concrete)
    return found


def test_only_the_strategies_branch_on_the_framework():
    """Everything specific to a framework is in its strategy module (shoal/strategies/, issue 29): no other code
    names a Framework member, matches on a framework, or tests for (or builds) a concrete exchange."""
    from shoal.planning.strategy import Framework

    members, concrete = {m.name for m in Framework}, _concrete_exchanges()
    assert {"DownpourExchange", "SlicedExchange", "PeriodicExchange", "DownpourServer"} <= concrete
    found = [hit for path in SRC.rglob("*.py") if not any(path == home or path.is_relative_to(home) for home in STRATEGY_HOMES)
             for hit in framework_branches(path, members, set() if path.is_relative_to(EXCHANGES) else concrete)]
    assert found == []


def test_the_framework_rule_sees_a_branch(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from shoal.runtime.exchanges.downpour import DownpourExchange\n"
                   "def f(plan, run):\n"
                   "    if plan.framework is Framework.DOWNPOUR: pass\n"
                   "    match plan.framework:\n        case _: pass\n"
                   "    return isinstance(run.chief.exchange, DownpourExchange)\n")
    hits = framework_branches(bad, {"DOWNPOUR"}, {"DownpourExchange"})
    assert sorted(h.split(" ", 1)[1] for h in hits) == ["Framework.DOWNPOUR", "imports DownpourExchange",
                                                         "isinstance(..., DownpourExchange)", "match plan.framework"]


JOB_BUILDERS = ["frontend", "config", "planning", "strategies"]  # they build, validate or plan jobs; the rest read the plan


def cluster_reads(path: Path) -> list[str]:
    """`job.cluster` / `<x>.job.cluster` anywhere in a file: reading the job's cluster section instead of the plan."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr == "cluster":
            base = node.value
            if (isinstance(base, ast.Name) and base.id == "job") or (isinstance(base, ast.Attribute) and base.attr == "job"):
                found.append(f"{path.relative_to(SRC) if path.is_relative_to(SRC) else path.name}:{node.lineno} {ast.unparse(node)}")
    return found


# launcher-side files that resolve settings before there is a plan (moving to launcher/: issue 29 point 5)
BEFORE_THE_PLAN = {"runtime/run_job.py"}


def test_nothing_but_planning_reads_the_jobs_cluster_section():
    """The plan decides (issue 29 point 6): outside the packages that build and plan jobs, code reads JobPlan's
    fields (and its frozen `plan.cluster`), never `job.cluster`."""
    found = [hit for path in SRC.rglob("*.py") if path.relative_to(SRC).parts[0] not in JOB_BUILDERS
             and str(path.relative_to(SRC)) not in BEFORE_THE_PLAN for hit in cluster_reads(path)]
    assert found == []


def test_the_cluster_rule_sees_a_read(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(job, trainer):\n    return job.cluster.local_steps + trainer.job.cluster.nworker_groups\n")
    assert len(cluster_reads(bad)) == 2
