"""Where `shoal viz` puts each node of a partitioned net: a column per worker, a row per topological depth.

Pure: node-link data in, positions and edge routes out (in layout units: one slot per
node side by side, one row per depth, y growing downwards). A node's row is its longest
path from an input, so a blob that crosses to another worker (bridge_src -> bridge_dst)
goes one row down and across the columns. Inside a worker's column a node keeps the lane
of its source when it can, so chains of layers stay straight. A link that skips rows and
would cross other nodes runs down the gutter at the right of its column.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from shoal.report.errors import ReportError

COLUMN_GAP = 0.6  # slots between two workers' columns
GUTTER_STEP = 0.14  # slots between two links running down one gutter
NODE_HALF_WIDTH = 0.46  # a node's box, in slots: a straight link closer than this to a node crosses it


@dataclass
class Edge:
    source: str
    target: str
    points: list[tuple[float, float]]  # a polyline, from the source's centre to the target's centre
    crosses_workers: bool  # a bridge: the blob moves to another worker


@dataclass
class Column:
    worker: int
    left: float
    right: float  # including its gutter


@dataclass
class Layout:
    positions: dict[str, tuple[float, float]]  # node id -> (x, row)
    rows: int
    columns: list[Column]
    edges: list[Edge] = field(default_factory=list)

    @property
    def width(self) -> float:
        return max((c.right for c in self.columns), default=1.0)


def depths(node_ids: list[str], links: list[tuple[str, str]]) -> dict[str, int]:
    """Longest path from a node without sources; ReportError when the links form a cycle."""
    preds: dict[str, list[str]] = {n: [] for n in node_ids}
    succs: dict[str, list[str]] = {n: [] for n in node_ids}
    for s, t in links:
        preds[t].append(s)
        succs[s].append(t)
    waiting = {n: len(preds[n]) for n in node_ids}
    ready = [n for n in node_ids if waiting[n] == 0]
    depth = dict.fromkeys(ready, 0)
    done = 0
    while ready:
        n = ready.pop(0)
        done += 1
        for t in succs[n]:
            depth[t] = max(depth.get(t, 0), depth[n] + 1)
            waiting[t] -= 1
            if waiting[t] == 0:
                ready.append(t)
    if done < len(node_ids):
        stuck = next(n for n in node_ids if waiting[n] > 0)
        raise ReportError(f"links: the net has a cycle through {stuck!r}")
    return depth


def _lanes(order: list[str], worker: dict[str, int], depth: dict[str, int], preds: dict[str, list[str]]) -> dict[str, int]:
    """Each node's lane in its worker's column: its first same-worker source's lane, or the next free one."""
    lane: dict[str, int] = {}
    rows: dict[tuple[int, int], list[str]] = {}
    for n in order:
        rows.setdefault((worker[n], depth[n]), []).append(n)
    for key in sorted(rows, key=lambda k: k[1]):
        def wanted(n: str) -> int:
            local = [lane[p] for p in preds[n] if worker[p] == worker[n] and p in lane]
            return local[0] if local else 0

        free = 0
        for n in sorted(rows[key], key=lambda n: (wanted(n), order.index(n))):
            lane[n] = max(wanted(n), free)
            free = lane[n] + 1
    return lane


def layout(data: dict) -> Layout:
    """Positions and edge routes of a node-link net (checked by report.node_link.check_node_link)."""
    order = [n["id"] for n in data["nodes"]]
    worker = {n["id"]: int(n.get("worker", 0)) for n in data["nodes"]}
    links = [(link["source"], link["target"]) for link in data["links"]]
    preds: dict[str, list[str]] = {n: [] for n in order}
    for s, t in links:
        preds[t].append(s)
    depth = depths(order, links)
    lane = _lanes(order, worker, depth, preds)

    workers = sorted(set(worker.values()) | set(range(int(data.get("graph", {}).get("nworkers", 1)))))
    lanes_of = {w: 1 + max((lane[n] for n in order if worker[n] == w), default=0) for w in workers}
    # first pass: which same-worker links skip rows over other nodes (they need a gutter)
    left, provisional = 0.0, {}
    for w in workers:
        provisional[w] = left
        left += lanes_of[w] + COLUMN_GAP
    positions = {n: (provisional[worker[n]] + lane[n] + 0.5, float(depth[n])) for n in order}
    by_row: dict[int, list[str]] = {}
    for n in order:
        by_row.setdefault(depth[n], []).append(n)
    detours = [(s, t) for s, t in links if _blocked(positions[s], positions[t], by_row, positions)]
    gutters = {w: [(s, t) for s, t in detours if worker[s] == w] for w in workers}

    # second pass: columns wide enough for their gutters
    columns, left = [], 0.0
    for w in workers:
        right = left + lanes_of[w] + (0.15 + GUTTER_STEP * len(gutters[w]) if gutters[w] else 0.0)
        columns.append(Column(w, left, right))
        left = right + COLUMN_GAP
    start = {c.worker: c.left for c in columns}
    positions = {n: (start[worker[n]] + lane[n] + 0.5, float(depth[n])) for n in order}
    gutter_x = {}
    for c in columns:
        for j, link in enumerate(gutters[c.worker]):
            gutter_x[link] = c.left + lanes_of[c.worker] + 0.1 + GUTTER_STEP * (j + 1)
    edges = []
    for s, t in links:
        (xs, ys), (xt, yt) = positions[s], positions[t]
        if (s, t) in gutter_x:
            gx = gutter_x[(s, t)]
            points = [(xs, ys), (gx, ys + 0.5), (gx, yt - 0.5), (xt, yt)]
        else:
            points = [(xs, ys), (xt, yt)]
        edges.append(Edge(s, t, points, worker[s] != worker[t]))
    return Layout(positions, 1 + max(depth.values(), default=0), columns, edges)


def _blocked(a: tuple[float, float], b: tuple[float, float], by_row: dict[int, list[str]], positions: dict[str, tuple[float, float]]) -> bool:
    """Whether the straight line from a to b passes through a node of a row in between."""
    (xa, ya), (xb, yb) = a, b
    for row in range(int(ya) + 1, int(yb)):
        x = xa + (xb - xa) * (row - ya) / (yb - ya)
        if any(abs(positions[n][0] - x) < NODE_HALF_WIDTH for n in by_row.get(row, [])):
            return True
    return False
