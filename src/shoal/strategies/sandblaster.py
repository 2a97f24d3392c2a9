"""Sandblaster: AllReduce's exchange with the servers in processes of their own (cluster.server_worker_separate)."""
from __future__ import annotations

from shoal.planning.strategy import Framework
from shoal.strategies.allreduce import AllReduce


class Sandblaster(AllReduce):
    framework = Framework.SANDBLASTER
    separate_servers = True


STRATEGY = Sandblaster()
