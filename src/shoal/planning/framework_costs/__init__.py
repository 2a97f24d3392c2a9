"""The cost model's framework-specific part, one module per framework: what one group step of its exchanges moves
(`traffic`), the calls it makes (`messages`), its time terms (`phases`) and the params a process serves or holds
(`served_elements`, `extra_param_bytes`). Pure; planning/estimate.py hands over its model.

The strategies (shoal/strategies/) build the exchanges and never meet a cost term (tests/test_architecture.py);
this table is the one place the cost model is found by framework.
"""
from __future__ import annotations

from types import MappingProxyType

from shoal.planning.framework_costs.allreduce import AllReduceCosts
from shoal.planning.framework_costs.base import FrameworkCosts, Messages, Phases  # noqa: F401 - the cost model's terms
from shoal.planning.framework_costs.distributed_hogwild import DistributedHogwildCosts
from shoal.planning.framework_costs.downpour import DownpourCosts
from shoal.planning.framework_costs.in_memory import InMemoryDownpourCosts, InMemoryHogwildCosts
from shoal.planning.framework_costs.local_sgd import LocalSGDCosts
from shoal.planning.framework_costs.sandblaster import SandblasterCosts
from shoal.planning.strategy import Framework

_ALLREDUCE = AllReduceCosts()
COSTS = MappingProxyType({
    Framework.SINGLE_WORKER: FrameworkCosts(),
    Framework.ALLREDUCE: _ALLREDUCE,
    Framework.SANDBLASTER: SandblasterCosts(),  # AllReduce's, but where restarts are allowed (its own exchange then)
    Framework.IN_MEMORY_HOGWILD: InMemoryHogwildCosts(),
    Framework.IN_MEMORY_DOWNPOUR: InMemoryDownpourCosts(),
    Framework.DOWNPOUR: DownpourCosts(),
    Framework.DISTRIBUTED_HOGWILD: DistributedHogwildCosts(),
    Framework.LOCAL_SGD: LocalSGDCosts(),
})


def costs_of(plan) -> FrameworkCosts:
    """The cost model of `plan`'s framework."""
    return COSTS[plan.framework]
