"""Node-link JSON files of a net (WORKSPACE/visualization/*.json): written atomically, read back checked.

The schema is networkx's node-link format, as SINGA's visualization files:
{"nodes": [{"id", "worker", "type", "shape", "connection", ...}], "links": [{"source", "target"}]}.
"""
from __future__ import annotations

import json
from pathlib import Path

from shoal.report.errors import ReportError
from shoal.report.writes import replace_file


def write_json(path: Path, data: dict) -> Path:
    """Write `data` to `path` atomically: readers see the old file or the new one, never half of one. Through no
    link (shoal.report.writes.replace_file): a link at `path` or at its folder is refused in one line."""
    path = Path(path)
    replace_file(path, (json.dumps(data, indent=1) + "\n").encode())  # a full or read-only disk: one line naming the file
    return path


def read_node_link(path: Path) -> dict:
    """A node-link file, checked enough to draw; ReportError names the file and the field."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as err:
        raise ReportError(f"{path}: cannot read ({err.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ReportError(f"{path}: not JSON ({err})") from None
    check_node_link(data, str(path))
    return data


def check_node_link(data: object, where: str) -> None:
    """Raise ReportError unless `data` has nodes (unique string ids, integer workers) and links between them."""
    if not isinstance(data, dict):
        raise ReportError(f"{where}: expected a node-link object with nodes and links")
    for key in ("nodes", "links"):
        if not isinstance(data.get(key), list):
            raise ReportError(f"{where}: {key}: expected a list")
    ids: set[str] = set()
    for i, node in enumerate(data["nodes"]):
        if not isinstance(node, dict) or not isinstance(node.get("id"), str) or not node["id"]:
            raise ReportError(f"{where}: nodes[{i}].id: expected a layer name")
        worker = node.get("worker", 0)
        if not isinstance(worker, int) or isinstance(worker, bool) or worker < 0:
            raise ReportError(f"{where}: nodes[{i}].worker: expected a worker index, got {worker!r}")
        shape = node.get("shape", [])
        if not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
            raise ReportError(f"{where}: nodes[{i}].shape: expected a list of integers")
        if node["id"] in ids:
            raise ReportError(f"{where}: nodes[{i}].id: {node['id']!r} appears twice")
        ids.add(node["id"])
    for i, link in enumerate(data["links"]):
        for end in ("source", "target"):
            if not isinstance(link, dict) or link.get(end) not in ids:
                got = link.get(end) if isinstance(link, dict) else link
                raise ReportError(f"{where}: links[{i}].{end}: {got!r} is not a node")
