"""A benchmark script (benchmarks/NAME.py) as a module for a test, loaded by its path.

Registered in sys.modules before it runs (its dataclasses look their module up); benchmarks/ is not
put on sys.path, where benchmarks/gpt.py would shadow examples/gpt in spawned ranks.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"shoal_benchmarks_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
