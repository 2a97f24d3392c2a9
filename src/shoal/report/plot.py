"""`shoal plot`: every metric of several runs (loss, accuracy, perplexity, ...), against step and wall-clock time.

One colour per run, labelled with its framework and layout; training windows
are lines, tests are marked points joined by a dashed line, validations
squares joined by a dotted line. Drawn on a bare
matplotlib Figure with the Agg canvas: no pyplot, no global backend switch,
so the API is safe to call from a notebook or a training script.
"""
from __future__ import annotations

from collections.abc import Sequence
import math
from pathlib import Path

from shoal.report.errors import ReportError
from shoal.report.metrics import RECORD_KEYS
from shoal.report.runs import Run, load_runs

X_AXES = {"step": "training step", "time": "wall-clock time (s)"}
# colour-blind-safe and distinct in greyscale order (Okabe & Ito)
COLOURS = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#F0E442"]
DEFAULT_SIZE = (1400, 900)  # pixels


def _series(records: list[dict], x: str, metric: str) -> tuple[list[float], list[float]]:
    points = [(r[x], r[metric]) for r in records if isinstance(r.get(metric), (int, float)) and isinstance(r.get(x), (int, float))]
    return [p[0] for p in points], [p[1] for p in points]


# record keys that are not metrics of the model (timings, byte counts, staleness: metrics.RECORD_KEYS)
NOT_PLOTTED = frozenset(RECORD_KEYS) - {"loss", "accuracy", "perplexity"}
PHASES = ("train", "test", "validate")


def _metrics_of(runs: list[Run]) -> list[str]:
    """Every metric some record of a run has: loss and accuracy first, the rest by name."""
    present = {k for run in runs for r in run.records if r.get("phase") in PHASES and r.get("mode") != "test-only"
               for k, v in r.items() if k not in NOT_PLOTTED and isinstance(v, (int, float)) and not isinstance(v, bool)}
    metrics = sorted(present, key=lambda m: (m != "loss", m != "accuracy", m))
    if not metrics:
        raise ReportError("no metric (loss, accuracy, ...) in the runs' metrics: nothing to plot")
    return metrics


def plot_runs(
    paths: Sequence[str | Path],
    out: str | Path,
    x: Sequence[str] = ("step", "time"),
    size: tuple[int, int] = DEFAULT_SIZE,
    title: str | None = None,
) -> Path:
    """Draw the runs in `paths` into `out` (format from its suffix: .png, .svg, .pdf); return out."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, PercentFormatter

    out = Path(out)
    for axis in x:
        if axis not in X_AXES:
            raise ReportError(f"--x {axis}: expected one of {', '.join(X_AXES)}")
    if not out.parent.is_dir():
        raise ReportError(f"{out}: folder {out.parent} does not exist")
    runs = load_runs([Path(p) for p in paths])
    metrics = _metrics_of(runs)

    dpi = 100
    fig = Figure(figsize=(size[0] / dpi, size[1] / dpi), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(metrics), len(x), squeeze=False)
    for i, metric in enumerate(metrics):
        for j, axis in enumerate(x):
            ax = axes[i][j]
            for k, run in enumerate(runs):
                colour = COLOURS[k % len(COLOURS)]
                # synchronous layouts compute the same numbers per step: against steps, earlier runs
                # are drawn wider underneath, so curves that coincide show as stripes, not one line
                under = len(runs) - 1 - k if axis == "step" else 0
                tx, ty = _series(run.phase("train"), axis, metric)
                ax.plot(tx, ty, color=colour, linewidth=1.6 + 1.1 * under, alpha=0.9, zorder=2 + k / 10, solid_capstyle="round")
                for phase, line, marker in (("test", "--", "o"), ("validate", ":", "s")):
                    sx, sy = _series(run.phase(phase), axis, metric)
                    ax.plot(sx, sy, color=colour, linestyle=line, linewidth=1.0, marker=marker, markersize=6 + 2.2 * under,
                            markeredgecolor="white", markeredgewidth=0.8, zorder=3 + k / 10)
            ax.set_xlabel(X_AXES[axis])
            ax.set_ylabel(metric)
            ax.grid(True, alpha=0.3)
            ax.set_xlim(left=0)
            if metric == "accuracy":
                ax.yaxis.set_major_formatter(PercentFormatter(1.0))
                ax.set_ylim(top=1.0)
            elif _wide_positive(runs, metric):
                ax.set_yscale("log")
                ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 0.2, not 2×10⁻¹
                ax.yaxis.set_minor_formatter(FuncFormatter(_minor_log_label))
            ax.set_title(f"{metric} vs {axis}", fontsize=11)

    run_handles = [Line2D([], [], color=COLOURS[k % len(COLOURS)], linewidth=3) for k in range(len(runs))]
    styles = [("train (display windows)", Line2D([], [], color="grey", linewidth=1.4))]
    for phase, line, marker in (("test", "--", "o"), ("validate", ":", "s")):
        if any(run.phase(phase) for run in runs):
            styles.append((phase, Line2D([], [], color="grey", linestyle=line, marker=marker, markersize=6, markeredgecolor="white")))
    fig.legend(run_handles + [h for _, h in styles], [r.label for r in runs] + [name for name, _ in styles],
               loc="outside lower center", ncols=min(3, len(runs) + len(styles)), frameon=False, fontsize=10)
    axes_named = " and ".join(X_AXES[a].removesuffix(" (s)") for a in x)
    fig.suptitle(title or f"{' and '.join(metrics)} against {axes_named}", fontsize=13)
    try:
        fig.savefig(out, dpi=dpi)
    except (OSError, ValueError) as err:
        raise ReportError(f"{out}: cannot write the plot: {str(err).splitlines()[0]}") from None
    return out


def _wide_positive(runs: list[Run], metric: str) -> bool:
    """Loss spans more than a decade: a log axis keeps the late, small differences visible."""
    values = [r[metric] for run in runs for r in run.records if isinstance(r.get(metric), (int, float))]
    return bool(values) and min(values) > 0 and max(values) / min(values) > 10


def _minor_log_label(value: float, _position) -> str:
    """Label the 2, 3 and 5 of each decade: enough to read values, few enough not to collide."""
    if value <= 0:
        return ""
    mantissa = value / 10 ** math.floor(math.log10(value))
    return f"{value:g}" if round(mantissa) in (2, 3, 5) else ""
