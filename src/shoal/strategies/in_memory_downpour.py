"""In-memory Downpour: asynchronous groups as threads of one process, each computing on its own copy of the params,
pulling from and pushing to one Server (cluster.share_memory: false)."""
from __future__ import annotations

from shoal.planning.strategy import Framework
from shoal.strategies.in_memory_hogwild import InMemoryGroups


class InMemoryDownpour(InMemoryGroups):
    framework = Framework.IN_MEMORY_DOWNPOUR
    share_memory = False


STRATEGY = InMemoryDownpour()
