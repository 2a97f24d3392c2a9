"""Which device each worker of a process computes on, and the order devices combine in. Pure.

SINGA's rule: worker k of a process runs on gpu[k], workers beyond the list on
the CPU. shoal's `device` list (overriding `gpu`) also names CPU devices:
"cpu:N" is a CPU device with a param replica of its own, as a GPU has, so a
multi-device group (replicas, tree reduction, broadcasts, balanced shares)
runs and is tested on machines without GPUs.

Caffe's multi-GPU tree (P2PSync): gradients combine in pairs (0←1, 2←3, ...),
then pairs of pairs (0←2, ...), until the root (worker 0) holds the sum; the
root updates and the new values go back down the same tree.
"""
from __future__ import annotations

from typing import Sequence

from shoal.config import job_pb2
from shoal.config.validate import DEVICE_NAME
from shoal.errors import ShoalError


class DeviceError(ShoalError, ValueError):
    """A device name shoal does not know (said with the field)."""


def check_device_name(name: str) -> str:
    if not DEVICE_NAME.match(name):
        raise DeviceError(f'device: {name!r} is not a device; use "cpu", "cpu:N" or "cuda:N"')
    return name


def worker_device_names(job: job_pb2.JobProto, count: int) -> list[str]:
    """The device of each of a process's first `count` workers (position k in the process)."""
    if job.device:
        listed = [check_device_name(d) for d in job.device]
    else:
        listed = [f"cuda:{g}" for g in job.gpu]
    return [listed[k] if k < len(listed) else "cpu" for k in range(count)]


def tree_levels(n: int) -> list[list[tuple[int, int]]]:
    """Caffe's reduction tree over n workers, leaves first: each level's (into, from) pairs.

    n = 4: [[(0, 1), (2, 3)], [(0, 2)]]; n = 3: [[(0, 1)], [(0, 2)]]. Reversed, the same pairs
    (from ← into) broadcast the root's values back down.
    """
    levels, stride = [], 1
    while stride < n:
        levels.append([(i, i + stride) for i in range(0, n, 2 * stride) if i + stride < n])
        stride *= 2
    return levels


def broadcast_order(names: Sequence[str]) -> list[tuple[str, str]]:
    """(source, destination) device copies that take the root's values to every other device.

    Workers are the tree's nodes; a copy is needed only where a pair's devices differ, and a
    device reached once is not sent to again (two workers on one GPU share its replica).
    """
    reached, copies = {names[0]}, []
    for level in reversed(tree_levels(len(names))):
        for into, frm in level:
            if names[frm] not in reached:
                reached.add(names[frm])
                copies.append((names[into], names[frm]))
    return copies
