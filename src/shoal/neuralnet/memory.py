"""The memory this machine (or container) can still give: a job that cannot fit is refused before allocating.

Without the check a `num_output: 2147483647` asks the allocator for terabytes and
dies in a traceback, or (with overcommit) gets pages it later cannot touch.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

FLOAT_BYTES = 4  # params, gradients and layer outputs are float32


def available_bytes() -> Optional[int]:
    """Bytes that can still be allocated: the kernel's MemAvailable, capped by a cgroup limit; None if unknown."""
    known = [b for b in (_meminfo_available(), _cgroup_room()) if b is not None]
    return min(known) if known else None


def describe_bytes(count: int) -> str:
    """`34.4 GB`, `512 MB`, `12 kB`: decimal units, three digits."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= size:
            return f"{count / size:.3g} {unit}"
    return f"{count} bytes"


def _meminfo_available() -> Optional[int]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room() -> Optional[int]:
    """limit - usage of this process's memory cgroup (v2, else v1), not counting file cache it can drop; None without a limit."""
    for folder, limit_name, usage_name, cache_key in (
        ("/sys/fs/cgroup", "memory.max", "memory.current", "inactive_file"),
        ("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
    ):
        try:
            limit = (Path(folder) / limit_name).read_text().strip()
            if limit == "max" or int(limit) >= 2**60:  # v1 writes "unlimited" as a huge number
                return None
            usage = int((Path(folder) / usage_name).read_text().strip())
        except (OSError, ValueError):
            continue
        return max(int(limit) - usage + _stat(Path(folder) / "memory.stat", cache_key), 0)
    return None


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0
