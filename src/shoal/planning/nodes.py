"""Which node (host) runs each rank of a job over several nodes. Pure; one rule for everyone.

`shoal run --nnodes N` starts node k's ranks as consecutive blocks of ceil(world / N) (node 0 hosts
rank 0, the chief), as torchrun numbers a node's processes; the cost model and the thread budget
ask the same rule, so a prediction for N hosts is of the placement that actually runs.
"""
from __future__ import annotations


def ranks_per_node(world: int, nnodes: int) -> int:
    return -(-world // max(1, nnodes))


def node_of_rank(world: int, nnodes: int) -> list[int]:
    """Each rank's node: blocks of ranks_per_node consecutive ranks."""
    per_node = ranks_per_node(world, nnodes)
    return [rank // per_node for rank in range(world)]


def ranks_of_node(world: int, nnodes: int, node: int) -> list[int]:
    per_node = ranks_per_node(world, nnodes)
    return list(range(node * per_node, min(world, (node + 1) * per_node)))
