"""The frameworks shoal runs: one strategy module each (shoal.planning.strategy.Strategy). Adding a framework
is one module beside these and one row here; every layout must be recognised by exactly one of them."""
from __future__ import annotations

from shoal.planning.strategy import install, make_registry
from shoal.strategies import (allreduce, distributed_hogwild, downpour, in_memory_downpour, in_memory_hogwild, local_sgd, sandblaster,
                              single_worker)

REGISTRY = make_registry(
    single_worker.STRATEGY,
    allreduce.STRATEGY,
    sandblaster.STRATEGY,
    in_memory_hogwild.STRATEGY,
    in_memory_downpour.STRATEGY,
    downpour.STRATEGY,
    distributed_hogwild.STRATEGY,
    local_sgd.STRATEGY,
)
install(REGISTRY)  # planning's default where a caller passes none (planning never imports this package)
