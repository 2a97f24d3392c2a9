"""The layering rules of docs/architecture.md, checked on the source: who may import whom.

config ← planning ← runtime ← launcher ← frontend, with neuralnet (net, layers, params, updaters)
below planning and runtime, data beside neuralnet, report beside everything, and comm the only code
that touches torch.distributed. No import cycles, function-level imports and importlib loads by name included; only the launcher
ends a process; only shoal.launcher.faults reads the fault-injection settings; every process group is one the
plan names (made by shoal.comm.collectives.create).
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "shoal"

# every rule scans the whole source: one test process parses it once for all of them (--dist loadgroup)
pytestmark = pytest.mark.xdist_group("architecture_source")


def parse(path: Path) -> ast.Module:
    """A file's syntax tree, parsed once per version of the file for all the rules (each scans the whole source)."""
    return _parsed(path, path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=None)
def _parsed(path: Path, _version: int) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def imports_of(path: Path) -> set[str]:
    """Every module a file imports (absolute names), wherever the import statement is."""
    names: set[str] = set()
    for node in ast.walk(parse(path)):
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
        ["config"], ["shoal.planning", "shoal.neuralnet", "shoal.runtime", "shoal.launcher", "shoal.frontend", "shoal.report",
                     "shoal.comm", "shoal.data"]),
    "planning never imports runtime, the launcher or the front ends": (
        ["planning"], ["shoal.runtime", "shoal.launcher", "shoal.frontend", "shoal.comm"]),
    "the net and its layers never import planning, runtime, the launcher or the front ends": (
        ["neuralnet"], ["shoal.planning", "shoal.runtime", "shoal.launcher", "shoal.frontend", "shoal.comm"]),
    "data never imports planning, runtime, the launcher or the front ends": (
        ["data"], ["shoal.planning", "shoal.runtime", "shoal.launcher", "shoal.frontend", "shoal.comm"]),
    "runtime never imports the launcher or the front ends": (["runtime", "comm"], ["shoal.launcher", "shoal.frontend"]),
    "the launcher never imports the front ends": (["launcher"], ["shoal.frontend"]),
    "report never imports the runtime, the launcher or the front ends": (
        ["report"], ["shoal.runtime", "shoal.launcher", "shoal.frontend", "shoal.comm"]),
    "the strategies reach the code below them through the plan, never by import": (
        [p.stem for p in SRC.iterdir() if p.stem not in ("strategies", "launcher", "frontend", "__pycache__")], ["shoal.strategies"]),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_layering(rule):
    packages, forbidden = RULES[rule]
    assert offenders(packages, forbidden) == []


def strategy_imports(paths: list[Path]) -> list[str]:
    """Imports of shoal.strategies other than its registry (`shoal.strategies.registry`, its REGISTRY)."""
    return [f"{path.relative_to(SRC) if path.is_relative_to(SRC) else path.name} imports {name}" for path in paths
            for name in sorted(imports_of(path)) if (name == "shoal.strategies" or name.startswith("shoal.strategies."))
            and name not in ("shoal.strategies.registry", "shoal.strategies.registry.REGISTRY")]


def test_the_layers_above_the_strategies_take_only_their_registry():
    """The launcher and the front ends plan jobs: they import the registry and pass it to plan_job (issue 41), never a
    framework's module (they reach a strategy through the plan: `plan.strategy`)."""
    assert strategy_imports([p for package in ("launcher", "frontend") for p in files_of(package)]) == []


def test_the_registry_rule_sees_a_strategy_module(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from shoal.strategies.registry import REGISTRY\nfrom shoal.strategies import downpour\n"
                   "def f():\n    from shoal.strategies.local_sgd import refuse_sparse_outer_step\n")
    assert strategy_imports([bad]) == ["bad.py imports shoal.strategies", "bad.py imports shoal.strategies.downpour",
                                       "bad.py imports shoal.strategies.local_sgd",
                                       "bad.py imports shoal.strategies.local_sgd.refuse_sparse_outer_step"]


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
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("place", "partition", "plan_partition", "slice_params"):
                calls.append(f"{path.relative_to(SRC)}:{node.lineno} {node.func.id}()")
    assert calls == []


def test_nothing_reassigns_a_trainer_attribute_from_outside():
    """The trainer takes its extras as hooks: no module outside trainer.py assigns to `<trainer>.<attr>`."""
    found = []
    for path in SRC.rglob("*.py"):
        if path.name == "trainer.py":
            continue
        for node in ast.walk(parse(path)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
            for target in targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id in ("trainer", "chief", "t"):
                    found.append(f"{path.relative_to(SRC)}:{node.lineno} {target.value.id}.{target.attr}")
    assert found == []


def module_name(path: Path, root: Path = SRC) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_by_name(tree: ast.Module) -> set[str]:
    """Modules a file loads by name: `importlib.import_module(X)` / `import_module(X)` where X is a string constant,
    written there or bound to a module-level name (`REGISTRY_MODULE = "shoal.strategies.registry"`). An import scan
    does not see these edges; a loop they close is a loop all the same (issue 41)."""
    constants = {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                 for target in node.targets if isinstance(target, ast.Name)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            if (isinstance(func, ast.Attribute) and func.attr == "import_module") or (isinstance(func, ast.Name) and func.id == "import_module"):
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    found.add(arg.value)
                elif isinstance(arg, ast.Name) and arg.id in constants:
                    found.add(constants[arg.id])
    return found


def import_graph(root: Path = SRC) -> dict[str, set[str]]:
    """Every module under `root` → the modules of `root` it imports, at the top or inside a function (TYPE_CHECKING
    too), or loads by name through importlib (a string constant).

    `from shoal.a import b` names module shoal.a.b when that is a module, else shoal.a (b is defined there)."""
    modules = {module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        tree = parse(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, `level - 1` packages up
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        targets |= imported_by_name(tree)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as [a, b, ..., a] (empty: the graph is acyclic), by depth-first search."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_no_import_cycles():
    """No module imports itself back through others, counting imports inside functions (issue 29) and modules loaded
    by name through importlib (issue 41: planning used to load the strategies' registry so; the launcher and the front
    ends now pass it to plan_job, and the registry installs itself as planning's default when imported)."""
    cycle = find_cycle(import_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_planning_loads_nothing_by_name():
    """Planning reaches the strategies only through what it is given (a registry argument or the installed one), never
    by a module name it holds: no importlib there, constant or computed (a computed name is no edge the scan sees)."""
    assert [f"{p.relative_to(SRC)} imports {n}" for p in files_of("planning") for n in imports_of(p)
            if n == "importlib" or n.startswith("importlib.")] == []


def test_the_cycle_finder_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_the_import_graph_sees_a_module_loaded_by_name(tmp_path):
    """A loop closed by `importlib.import_module("...")` (through a module-level constant, or written in the call) is
    found; a name computed at run time is not a constant, and not an edge."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text('import importlib\nPLUGIN = "pkg.high"\n'
                                    'def load():\n    return importlib.import_module(PLUGIN)\n')
    (package / "high.py").write_text("from pkg import low\n")
    (package / "other.py").write_text('from importlib import import_module\n'
                                      'def f(name):\n    return import_module("pkg.low"), import_module(name)\n')
    graph = import_graph(package)
    assert graph["pkg.low"] == {"pkg.high"} and graph["pkg.other"] == {"pkg.low"}
    assert find_cycle(graph) == ["pkg.high", "pkg.low", "pkg.high"]


# calls that end the process: only the launcher decides that (an exchange raises, e.g. GroupDropped)
EXITS = {("os", "_exit"), ("os", "abort"), ("sys", "exit"), (None, "exit"), (None, "quit")}


def process_exits(path: Path) -> list[str]:
    """Every call of os._exit / os.abort / sys.exit / exit / quit and every `raise SystemExit` in a file."""
    found = []
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Call):
            func = node.func
            name = (func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else None,
                    func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else "")
            if name in EXITS:
                found.append(f"{path.name}:{node.lineno} {'.'.join(filter(None, name))}()")
        elif isinstance(node, ast.Raise) and node.exc is not None:
            raised = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(raised, ast.Name) and raised.id == "SystemExit":
                found.append(f"{path.name}:{node.lineno} raise SystemExit")
    return found


def test_nothing_below_the_launcher_exits_the_process():
    """Exchanges, trainers and workers raise; the launcher's process entry decides how a process ends."""
    below = [p for package in ("runtime", "planning", "neuralnet", "data", "config", "comm", "report") for p in files_of(package)]
    assert [exit for path in below for exit in process_exits(path)] == []


def test_the_exit_check_sees_an_exit(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os, sys\ndef f():\n    os._exit(3)\ndef g():\n    sys.exit(1)\ndef h():\n    raise SystemExit(2)\n")
    assert sorted(process_exits(bad)) == ["bad.py:3 os._exit()", "bad.py:5 sys.exit()", "bad.py:7 raise SystemExit"]


FAULT_SETTINGS = ("SHOAL_INJECT_", "SHOAL_SLOW_WORKER")


def naming(path: Path, settings: tuple[str, ...]) -> list[str]:
    """Where a file names one of `settings` in a string that is not a docstring (reads or sets it)."""
    tree = parse(path)
    docstrings = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr)}
    return [f"{path.relative_to(SRC) if path.is_relative_to(SRC) else path.name}:{node.lineno}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
            and any(setting in node.value for setting in settings)]


def test_only_the_faults_module_reads_the_fault_settings():
    """Fault injection lives in shoal.launcher.faults and reaches the step engine as hooks (RunSpec.faults)."""
    readers = [hit for path in SRC.rglob("*.py") if path != SRC / "launcher" / "faults.py" for hit in naming(path, FAULT_SETTINGS)]
    assert readers == []
    importers = [f"{path.relative_to(SRC)} imports {name}" for path in SRC.rglob("*.py") for name in imports_of(path)
                 if name == "shoal.launcher.faults"]
    assert all(line.startswith("launcher/") for line in importers), importers
ALLOCATORS = {"zeros", "empty", "full", "ones", "tensor", "arange", "rand", "randn", "randint", "eye", "linspace", "as_tensor"}


def unplaced_allocations(paths: list[Path]) -> list[str]:
    """`torch.<allocator>(...)` calls that name no device (a `*_like` call takes its argument's)."""
    found = []
    for path in paths:
        for node in ast.walk(parse(path)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ALLOCATORS
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                    and not any(k.arg == "device" for k in node.keywords)):
                found.append(f"{path.relative_to(SRC) if path.is_relative_to(SRC) else path.name}:{node.lineno} torch.{node.func.attr}()")
    return found


def test_exchanges_name_the_device_of_every_tensor_they_allocate():
    """Tensors stay where they live (issue 29): exchanges, partitioned groups' bridges and comm allocate on a named device."""
    paths = files_of("runtime/exchanges") + [SRC / "runtime" / "partitioned.py"] + files_of("comm")
    assert unplaced_allocations(paths) == []


def test_the_device_check_sees_an_unplaced_allocation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\na = torch.zeros(3)\nb = torch.zeros(3, device='cpu')\nc = torch.zeros_like(a)\nd = torch.tensor([1])\n")
    assert unplaced_allocations([bad]) == ["bad.py:2 torch.zeros()", "bad.py:5 torch.tensor()"]


# tagged point-to-point stays only where the protocol is request/response (issue 29): Downpour's stubs and servers (a
# rejoin's handshake rides their channels), Distributed Hogwild's syncs, the mechanics they share (requests.py) and the
# comm modules that carry them; the calibration's link probe times point-to-point messages themselves (no exchange)
TAGGED_PROTOCOLS = {"comm/dist.py", "comm/channels.py", "runtime/exchanges/requests.py", "runtime/exchanges/downpour.py",
                    "runtime/exchanges/downpour_server.py", "runtime/exchanges/downpour_stub.py",
                    "runtime/exchanges/downpour_mirror.py", "runtime/exchanges/hogwild.py", "runtime/exchanges/hogwild_group.py",
                    "runtime/exchanges/hogwild_master.py", "runtime/exchanges/hogwild_recovery.py", "runtime/calibrate.py"}
POINT_TO_POINT = {"isend", "irecv", "send", "recv"}


def tagged_messages(paths: list[Path]) -> list[str]:
    """Where a file names a message tag (`tag`, `TAG_*`) or calls the comm layer's point-to-point (`comm.send`, `dist.irecv`)."""
    found = []
    for path in paths:
        where = path.relative_to(SRC) if path.is_relative_to(SRC) else path.name
        for node in ast.walk(parse(path)):
            name = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                    else node.arg if isinstance(node, (ast.arg, ast.keyword)) else None)
            if name is not None and (name in ("tag", "tags") or name.startswith("TAG")):
                found.append(f"{where}:{node.lineno} {name}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in POINT_TO_POINT
                  and isinstance(node.func.value, ast.Name) and node.func.value.id in ("comm", "dist")):
                found.append(f"{where}:{node.lineno} {node.func.value.id}.{node.func.attr}()")
    return found


def test_only_request_response_protocols_use_tagged_point_to_point():
    """Synchronous exchanges and partitioned groups' bridges match collectives by order over the plan's groups."""
    paths = [p for p in SRC.rglob("*.py") if str(p.relative_to(SRC)) not in TAGGED_PROTOCOLS]
    assert tagged_messages(paths) == []


def test_the_tag_check_sees_a_tag(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from shoal.comm import dist as comm\nTAG_BASE = 1 << 20\ncomm.isend(t, 1, 5)\ndef f(x, tag): pass\n"
                   "group.broadcast(t, src=0)\n")
    assert tagged_messages([bad]) == ["bad.py:2 TAG_BASE", "bad.py:3 comm.isend()", "bad.py:4 tag"]


# the request/response protocols' shared mechanics live once (issue 41 point 1): receives posted on a link, a knock's
# handshake, a thread left blocked on a stalled peer
REQUEST_MECHANICS = {"runtime/exchanges/requests.py"}


def request_mechanics(paths: list[Path]) -> list[str]:
    """Where a file posts a receive on a link (`<link>.irecv`, not the comm layer's own), runs a channel's handshake
    (`authenticate`) or leaves a thread blocked on a peer (`heartbeat.abandon`)."""
    found = []
    for path in paths:
        where = path.relative_to(SRC) if path.is_relative_to(SRC) else path.name
        for node in ast.walk(parse(path)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            owner = node.func.value.id if isinstance(node.func.value, ast.Name) else None
            if ((node.func.attr == "irecv" and owner not in ("comm", "dist")) or node.func.attr == "authenticate"
                    or (node.func.attr == "abandon" and owner == "heartbeat")):
                found.append(f"{where}:{node.lineno} {ast.unparse(node.func)}()")
    return found


def test_the_request_response_mechanics_live_once():
    paths = [p for p in SRC.rglob("*.py") if not p.is_relative_to(SRC / "comm") and str(p.relative_to(SRC)) not in REQUEST_MECHANICS
             and any(word in p.read_text() for word in ("irecv", "authenticate", "abandon"))]  # (parse only those)
    assert request_mechanics(paths) == []


def test_the_request_mechanics_check_sees_them(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("a = channel.irecv(t, 5)\nb = comm.irecv(t, 1, 5)\nchannels.authenticate(c, n, 0, s)\nheartbeat.abandon()\n"
                   "self.meeting.abandon()\n")
    assert request_mechanics([bad]) == ["bad.py:1 channel.irecv()", "bad.py:3 channels.authenticate()",
                                        "bad.py:4 heartbeat.abandon()"]


# where code may decide by framework: the strategies, their base and the cost model's table of frameworks (issue 41:
# a framework's cost terms are in planning/framework_costs/, found by the plan's Framework)
STRATEGY_HOMES = [SRC / "strategies", SRC / "planning" / "strategy.py", SRC / "planning" / "framework_costs" / "__init__.py"]
EXCHANGES = SRC / "runtime" / "exchanges"  # defines the concrete exchanges (and may use its own), never a Framework


def _concrete_exchanges() -> set[str]:
    """The classes runtime/exchanges/ defines that an assembly would build: exchanges, servers, meetings."""
    names = set()
    for path in (SRC / "runtime" / "exchanges").glob("*.py"):
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.ClassDef) and node.name.endswith(("Exchange", "Server", "Meeting")):
                names.add(node.name)
    return names


def framework_branches(path: Path, members: set[str], concrete: set[str]) -> list[str]:
    """Where a file decides by framework: a Framework member named, a `match` on a framework, an isinstance of a
    concrete exchange (what the framework built), or such a class imported."""
    found = []
    name = path.relative_to(SRC) if path.is_relative_to(SRC) else path.name  # once a file, not once a node
    for node in ast.walk(parse(path)):
        where = f"{name}:{getattr(node, 'lineno', 0)}"
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
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Attribute) and node.attr == "cluster":
            base = node.value
            if (isinstance(base, ast.Name) and base.id == "job") or (isinstance(base, ast.Attribute) and base.attr == "job"):
                found.append(f"{path.relative_to(SRC) if path.is_relative_to(SRC) else path.name}:{node.lineno} {ast.unparse(node)}")
    return found


# launcher-side files that resolve settings before there is a plan (moving to launcher/: issue 29 point 5)
BEFORE_THE_PLAN = {"launcher/run_job.py"}


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


def any_cluster_reads(path: Path) -> list[str]:
    """`<anything>.cluster` in a file: the plan's frozen copy (`plan.cluster`, `placement.cluster`) counts too."""
    return [f"{path.relative_to(SRC) if path.is_relative_to(SRC) else path.name}:{node.lineno} {ast.unparse(node)}"
            for node in ast.walk(parse(path)) if isinstance(node, ast.Attribute) and node.attr == "cluster"]


def plan_cluster_reads(path: Path) -> list[str]:
    """`plan.cluster` / `<x>.plan.cluster` in a file: the job's layout read from the plan's frozen copy of the cluster
    section, where planning should have handed down the fact (issue 41 point 2)."""
    found = []
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Attribute) and node.attr == "cluster":
            base = node.value
            if (isinstance(base, ast.Name) and base.id == "plan") or (isinstance(base, ast.Attribute) and base.attr == "plan"):
                found.append(f"{path.relative_to(SRC) if path.is_relative_to(SRC) else path.name}:{node.lineno} {ast.unparse(node)}")
    return found


def test_only_planning_reads_the_plans_cluster_section():
    """Planning computes the layout's facts and the plan carries them (issue 41 point 2: `plan.nworkers_per_group`,
    `plan.compression`, `plan.asynchrony`, `plan.meetings`, `plan.sync_freq`, ...; planning/cluster_facts.py): outside
    planning, nothing reads `plan.cluster`."""
    assert [hit for path in sorted(SRC.rglob("*.py")) if path.relative_to(SRC).parts[0] != "planning"
            for hit in plan_cluster_reads(path)] == []


def test_the_plan_cluster_rule_sees_a_read(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(plan, run, job):\n    return plan.cluster.local_steps + run.plan.cluster.nworker_groups + job.name\n")
    assert [h.split(" ", 1)[1] for h in plan_cluster_reads(bad)] == ["plan.cluster", "run.plan.cluster"]


# environment variables that override a job field (docs/cluster.md): read once, where the plan is made
FIELD_OVERRIDES = ("SHOAL_COMM_TIMEOUT", "SHOAL_STALL_TIMEOUT", "SHOAL_JOIN_TIMEOUT", "SHOAL_BUCKET_MB", "SHOAL_MAX_RESTARTS")


def test_only_planning_reads_the_overrides_of_job_fields():
    """The plan decides (issue 29 point 6): timeouts, the bucket cap and restarts are plan fields; their environment
    overrides are read by plan_job (planning/), and every other package is handed the plan's values."""
    readers = [hit for path in SRC.rglob("*.py") if path.relative_to(SRC).parts[0] != "planning"
               for hit in naming(path, FIELD_OVERRIDES)]
    assert readers == []


def test_the_override_rule_sees_a_read(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('"""Reads SHOAL_COMM_TIMEOUT (a docstring: not a read)."""\nimport os\n'
                   'def f():\n    return float(os.environ.get("SHOAL_STALL_TIMEOUT", "10"))\n')
    assert naming(bad, FIELD_OVERRIDES) == ["bad.py:4"]


def test_the_runtime_reads_typed_values_not_the_cluster_section():
    """The plan decides (issue 29 point 6): the step engine and its exchanges get typed values (plan fields, or
    constructor arguments from the framework's strategy), never the cluster section, not even the plan's copy."""
    assert [hit for path in (SRC / "runtime").rglob("*.py") for hit in any_cluster_reads(path)] == []


def test_the_runtime_cluster_rule_sees_a_read(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(plan, placement):\n    return plan.cluster.overlap_push or placement.cluster.warmup_steps\n")
    assert len(any_cluster_reads(bad)) == 2


# estimates name their framework (a string of the JSON `shoal plan --estimate` prints): recommend asks the installed
# registry (planning.strategy.install: the one its caller planned with) for its strategy's flags
THROUGH_THE_DEFAULT_REGISTRY = {"planning/recommend.py"}


def default_registry_lookups(path: Path) -> list[str]:
    """`<x>.framework.strategy` / `<x>.framework.synchronous` / `Framework(...).strategy`: a strategy found through the
    installed registry (an import by name, hidden) where the code holds the plan, which carries its strategy."""
    found = []
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Attribute) and node.attr in ("strategy", "synchronous"):
            base = node.value
            if ((isinstance(base, ast.Attribute) and base.attr == "framework")
                    or (isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "Framework")):
                found.append(f"{path.relative_to(SRC) if path.is_relative_to(SRC) else path.name}:{node.lineno} {ast.unparse(node)}")
    return found


def test_code_holding_a_plan_asks_its_strategy_not_the_default_registry():
    found = [hit for path in SRC.rglob("*.py") if str(path.relative_to(SRC)) not in THROUGH_THE_DEFAULT_REGISTRY
             for hit in default_registry_lookups(path)]
    assert found == []


def test_the_registry_check_sees_a_lookup(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(plan, name):\n    return plan.framework.synchronous or Framework(name).strategy.meets\n")
    assert [h.split(" ", 1)[1] for h in default_registry_lookups(bad)] == ["plan.framework.synchronous", "Framework(name).strategy"]


# every process group a collective runs on is one the plan names (planning/process_groups.py, JobPlan.process_groups):
# comm.collectives.create makes them, from the plan's list. Besides: the quorum's re-formed meeting groups (comm/quorum.py:
# a meeting without a dead group), the request/response protocols' two-process channels (comm/channels.py:
# point-to-point, no collective) and the calibration's link probe (a world of two processes of its own, no job)
GROUP_MAKERS = {("comm/collectives.py", "create"), ("comm/quorum.py", "MeetingGroup.formed.make"),
                ("comm/channels.py", "open_channel"), ("comm/regroup.py", "form_afresh")}  # (a plan's group, re-formed)
CREATES_UNPLANNED = {("runtime/calibrate.py", "_probe_rank")}
MAKES_A_GROUP = {"new_group", "ProcessGroupGloo", "ProcessGroupNCCL"}


def group_makings(path: Path) -> list[str]:
    """Where a file makes a process group (`new_group`, a `ProcessGroupGloo`/`ProcessGroupNCCL`) outside GROUP_MAKERS, or
    calls `collectives.create` with anything but a plan's `.process_groups`; each as 'file:line function what'."""
    where = str(path.relative_to(SRC)) if path.is_relative_to(SRC) else path.name
    found = []

    def visit(node: ast.AST, scope: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = f"{scope}.{node.name}" if scope else node.name
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in MAKES_A_GROUP and (where, scope) not in GROUP_MAKERS:
                found.append(f"{where}:{node.lineno} {scope or '<module>'} {name}()")
            elif (name == "create" and (where, scope) not in CREATES_UNPLANNED and isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
                  and func.value.id == "collectives"
                  and not (node.args and isinstance(node.args[0], ast.Attribute) and node.args[0].attr == "process_groups")):
                found.append(f"{where}:{node.lineno} {scope or '<module>'} collectives.create({ast.unparse(node.args[0]) if node.args else ''})")
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(parse(path), "")
    return found


def test_every_process_group_is_one_the_plan_names():
    """No exchange or strategy makes a group of its own at run time: it asks the plan's (`run.process_groups[name]`)."""
    assert [hit for path in sorted(SRC.rglob("*.py")) for hit in group_makings(path)] == []


def test_the_group_check_sees_a_group_of_its_own(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from shoal.comm import collectives, dist as comm\nclass S:\n    def attach(self, run):\n"
                   "        g = comm.new_group([0, 1])\n        collectives.create(mine)\n"
                   "def f(store):\n    return dist.ProcessGroupGloo(store, 0, 2)\nok = collectives.create(plan.process_groups)\n")
    assert group_makings(bad) == ["bad.py:4 S.attach new_group()", "bad.py:5 S.attach collectives.create(mine)",
                                  "bad.py:7 f ProcessGroupGloo()"]


# issue 41 point 3: the cost model lives in planning (planning/framework_costs/ per framework, and the modules below),
# so a reader of the strategies never meets a cost term
COST_MODEL = ["shoal.planning.framework_costs", "shoal.planning.costs", "shoal.planning.module_costs", "shoal.planning.estimate",
              "shoal.planning.alternatives", "shoal.planning.recommend", "shoal.planning.measured_tradeoffs", "shoal.runtime.calibrate"]


def cost_terms() -> set[str]:
    """The cost model's per-framework terms by name: every function and method planning/framework_costs/ defines at
    its top level or in a class (traffic, messages, phases, served_elements, encoded_parts, exchange_buckets, ...)."""
    names = set()
    for path in (SRC / "planning" / "framework_costs").glob("*.py"):
        for node in parse(path).body:
            bodies = node.body if isinstance(node, ast.ClassDef) else [node]
            names.update(f.name for f in bodies if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)))
    return names


def cost_model_uses(path: Path, terms: set[str]) -> list[str]:
    """Where a file imports the cost model (COST_MODEL), or defines or calls a function or method named as one of its
    `terms`; each as 'file:line what'."""
    where = str(path.relative_to(SRC)) if path.is_relative_to(SRC) else path.name
    found = [f"{where} imports {name}" for name in sorted(imports_of(path))
             if any(name == m or name.startswith(m + ".") for m in COST_MODEL)]
    uses = []
    for node in ast.walk(parse(path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in terms:
            uses.append((node.lineno, f"defines {node.name}"))
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in terms:
                uses.append((node.lineno, f"calls {name}()"))
    return found + [f"{where}:{line} {what}" for line, what in sorted(uses)]


def test_the_strategies_hold_no_cost_model():
    """A strategy recognises its layout and builds its exchanges; what they move and cost is planning's
    (planning/framework_costs/, issue 41): no module of shoal/strategies/, nor the Strategy base, imports the cost model
    or defines or calls one of its terms."""
    terms = cost_terms()
    assert {"traffic", "messages", "phases", "served_elements", "extra_param_bytes", "encoded_parts", "meetings_per_step"} <= terms
    assert [hit for path in files_of("strategies") + [SRC / "planning" / "strategy.py"] for hit in cost_model_uses(path, terms)] == []


def test_the_cost_rule_sees_a_cost_term(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from shoal.planning.framework_costs.base import Phases\nclass S:\n    def traffic(self, model, move):\n"
                   "        move(0, 1, encoded_parts(model.plan.compression))\n"
                   "    def attach_exchanges(self, run):\n        from shoal.planning import estimate\n        return self.phases(run)\n")
    assert cost_model_uses(bad, cost_terms()) == [
        "bad.py imports shoal.planning.estimate", "bad.py imports shoal.planning.framework_costs.base",
        "bad.py imports shoal.planning.framework_costs.base.Phases", "bad.py:3 defines traffic", "bad.py:4 calls encoded_parts()",
        "bad.py:7 calls phases()"]


# issue 41: the launcher reaches a framework through the plan (`plan.strategy`), the store's doors at which it
# announces restarts are comm's (comm/channels.py: DOWNPOUR_DOOR, MEETING_DOOR, STEP_DOOR, HOGWILD_DOOR), and the
# errors that say how a process's part ended are runtime/endings.py's, so it imports nothing of runtime/exchanges/
EXCHANGES_PACKAGE = "shoal.runtime.exchanges"


def exchange_names_taken(paths: list[Path]) -> list[str]:
    """What each file imports from shoal.runtime.exchanges: a module, a constant (a door's key), an exchange, an
    error; each as 'file imports name', at the top or inside a function."""
    found = []
    for path in paths:
        where = path.relative_to(SRC) if path.is_relative_to(SRC) else path.name
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.Import):
                found += [f"{where} imports {a.name}" for a in node.names
                          if a.name == EXCHANGES_PACKAGE or a.name.startswith(EXCHANGES_PACKAGE + ".")]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                    node.module == EXCHANGES_PACKAGE or node.module.startswith(EXCHANGES_PACKAGE + ".")
                    or (node.module == "shoal.runtime" and any(a.name == "exchanges" for a in node.names))):
                found += [f"{where} imports {node.module}.{alias.name}" for alias in node.names]
    return sorted(found)


def test_the_launcher_imports_nothing_of_the_exchanges():
    assert exchange_names_taken(files_of("launcher")) == []


def test_the_exchange_import_check_sees_a_door(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from shoal.runtime.exchanges.downpour import DOOR, JobOver\nfrom shoal.runtime.exchanges import periodic\n"
                   "def f():\n    import shoal.runtime.exchanges.replicated\n"
                   "    from shoal.runtime.exchanges.periodic import MeetingsOver\n")
    assert exchange_names_taken([bad]) == ["bad.py imports shoal.runtime.exchanges.downpour.DOOR",
                                           "bad.py imports shoal.runtime.exchanges.downpour.JobOver",
                                           "bad.py imports shoal.runtime.exchanges.periodic",
                                           "bad.py imports shoal.runtime.exchanges.periodic.MeetingsOver",
                                           "bad.py imports shoal.runtime.exchanges.replicated"]
