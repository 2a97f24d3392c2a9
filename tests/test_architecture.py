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


ALLOCATORS = {"zeros", "empty", "full", "ones", "tensor", "arange", "rand", "randn", "randint", "eye", "linspace", "as_tensor"}


def unplaced_allocations(paths: list[Path]) -> list[str]:
    """`torch.<allocator>(...)` calls that name no device (a `*_like` call takes its argument's)."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
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
