"""`shoal compare`: one row per run: layout, throughput, time to test accuracy and to any target, final
validation metrics, final accuracy, staleness."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from shoal.report.runs import load_runs
from shoal.report.summary import threshold_key
from shoal.report.targets import Target, parse_target

TABLE_THRESHOLDS = (0.90, 0.95, 0.97)
DASH = "—"


def compare_runs(paths: Sequence[str | Path], thresholds: Sequence[float] = TABLE_THRESHOLDS,
                 targets: Sequence[str | Target] = ()) -> list[dict]:
    """Rows of the comparison, numbers from each run's metrics (a crashed run counts up to its last record).

    targets: "val_loss<=1.9"-style targets (report/targets.py) besides those each run declared (shoal.fit's targets).
    """
    targets = tuple(t if isinstance(t, Target) else parse_target(t) for t in targets)
    rows = []
    for run in load_runs([Path(p) for p in paths]):
        derived = run.derived(targets)
        summary = run.summary or {}
        reached = derived["time_to_accuracy"]
        final = derived["final_test"] or {}
        rows.append({
            "run": str(run.path),
            "layout": run.label,
            "framework": summary.get("framework"),
            "workers": summary.get("workers"),
            "status": summary.get("status", "no summary"),
            "steps": derived["steps"],
            "wall_time": derived["wall_time"],
            "samples_per_sec": derived["samples_per_sec"],
            "time_to_accuracy": {threshold_key(t): reached.get(threshold_key(t)) for t in thresholds},
            "time_to_target": derived["time_to_target"],
            "validate": derived["validate"],
            "final_test_accuracy": final.get("accuracy"),
            "best_test_accuracy": (derived["best_test"] or {}).get("accuracy"),
            "staleness_mean": derived["staleness_mean"],
        })
    return rows


def seconds(t: float) -> str:
    return f"{t:.1f} s" if t >= 1 else f"{t:.2f} s"


def _reach(point) -> str:
    return DASH if point is None else f"{seconds(point['time'])} @{point['step']}"


def _num(value, fmt: str) -> str:
    return DASH if value is None else format(value, fmt)


def _union(rows: list[dict], key: str) -> list[str]:
    names: list[str] = []
    for r in rows:
        names += [n for n in r.get(key) or {} if n not in names]
    return names


def _target_header(label: str) -> str:
    return "→" + label.replace("<=", "≤").replace(">=", "≥")


def table_columns(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Header and cells of the comparison (for rich and for markdown): the accuracy thresholds and the final
    accuracy where some run tests accuracy, then any targets and the final value of each validation metric, and
    the staleness where some run is asynchronous: a language model's runs get no empty accuracy columns."""
    accuracy = any(r.get("final_test_accuracy") is not None for r in rows)
    thresholds = (list(rows[0]["time_to_accuracy"]) if rows else [threshold_key(t) for t in TABLE_THRESHOLDS]) if accuracy else []
    targets, validated = _union(rows, "time_to_target"), _union(rows, "validate")
    stale = any(r.get("staleness_mean") is not None for r in rows)
    header = (["run", "layout", "workers", "samples/s"] + [f"→{float(t):.0%}" for t in thresholds]
              + [_target_header(t) for t in targets] + [f"val {m}" for m in validated]
              + ["final acc"] * accuracy + ["staleness"] * stale)
    cells = [
        [Path(r["run"]).name, r["layout"], _num(r["workers"], "d"), _num(r["samples_per_sec"], ".0f")]
        + [_reach(r["time_to_accuracy"][t]) for t in thresholds]
        + [_reach((r.get("time_to_target") or {}).get(t)) for t in targets]
        + [_num(((r.get("validate") or {}).get(m) or {}).get("final"), ".4g") for m in validated]
        + [_num(r["final_test_accuracy"], ".2%")] * accuracy + [_num(r["staleness_mean"], ".2f")] * stale
        for r in rows
    ]
    return header, cells


def caption(header: list[str]) -> str:
    """What the table's columns mean, for the columns it has."""
    said = []
    accuracy = next((h for h in header if h.startswith("→") and h.endswith("%")), None)
    if accuracy:
        said.append(f"{accuracy}: wall-clock time @ step of the first test at ≥ {accuracy[1:]} accuracy")
    target = next((h for h in header if h.startswith("→") and not h.endswith("%")), None)
    if target:
        said.append(f"{target}: of the first evaluation that reached it")
    if any(h.startswith("val ") for h in header):
        said.append("val: at the last validation")
    return "; ".join(said)


def render_rich(rows: list[dict]):
    from rich.table import Table

    header, cells = table_columns(rows)
    table = Table(*header, caption=caption(header) or None)
    table.columns[0].min_width = 8
    table.columns[1].min_width = 18
    for column in table.columns[2:]:
        column.justify = "right"
        column.no_wrap = not column.header.startswith("→")  # times may wrap at "@ step"
    for row in cells:
        table.add_row(*row)
    return table


def render_markdown(rows: list[dict]) -> str:
    header, cells = table_columns(rows)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)
