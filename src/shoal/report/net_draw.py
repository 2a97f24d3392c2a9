"""`shoal viz`: draw a partitioned net, one column per worker, so a reader sees which worker computes what.

Every node is coloured by its worker (legend at the top) and labelled with its name,
type and per-sample shape. Layers that compute are filled boxes; the connection layers
the partitioner inserted are white: slice, concate and split with a dashed border,
bridge_src / bridge_dst as arrows pointing at the worker on the other end. A blob
crossing workers is a thick dashed arrow between the columns. With the norms of a
debug file (fp-/bp-step<N>-loc<W>.json) each node of that worker also shows them.
Drawn on a bare matplotlib Figure with the Agg canvas (no pyplot), as `shoal plot`.
"""
from __future__ import annotations

from pathlib import Path

from shoal.report.errors import ReportError
from shoal.report.net_layout import Layout, layout
from shoal.report.plot import COLOURS

FORMATS = (".png", ".svg", ".pdf")
SLOT_INCHES = 1.95  # width of one node's slot
ROW_INCHES = 0.5  # height of one row of nodes (a third line of norms adds to it)
BRIDGES = ("kBridgeSrc", "kBridgeDst")
FONT_SIZE = 6.5
BOX_WIDTH = 0.9  # slots
# the three kinds of node: filled boxes compute; the partitioner's connection layers are white
LAYER_LOOK = dict(boxstyle="square,pad=0.02", linewidth=1.4, linestyle="solid")
CONNECTION_LOOK = dict(boxstyle="round,pad=0.02,rounding_size=0.25", facecolor="white", linewidth=1.2, linestyle=(0, (3, 2)))
BRIDGE_LOOK = dict(boxstyle="sawtooth,pad=0.0,tooth_size=0.07", facecolor="white", linewidth=1.1, linestyle="solid")


def worker_colour(worker: int) -> str:
    return COLOURS[worker % len(COLOURS)]


def _tint(colour: str, amount: float) -> tuple[float, float, float]:
    """`colour` mixed with white (amount 0: white, 1: the colour), for fills that dark text stays readable on."""
    rgb = [int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    return tuple(1 - amount * (1 - c) for c in rgb)


def _shape_text(shape: list[int]) -> str:
    return "×".join(str(d) for d in shape) if shape else "scalar"


def _norm_lines(norms: dict) -> list[str]:
    """A debug file's norms of one node: the output's (data or gradient), then each param's."""
    lines = []
    outputs = [f"{sign} {norms[key]:.3g}" for key, sign in (("data_l1", "|x|"), ("grad_l1", "|∇x|")) if key in norms]
    if outputs:
        lines.append("  ".join(outputs))
    params = []
    for p in norms.get("params", []):
        value = f"|{p['name']}| {p['value_l1']:.3g}" if "value_l1" in p else ""
        grad = f"|∇{p['name']}| {p['grad_l1']:.3g}" if "grad_l1" in p else ""
        params.append(" ".join(x for x in (value, grad) if x))
    if params:
        lines.append("  ".join(params))
    return lines


def node_lines(node: dict) -> list[str]:
    """A node's label: its name, then its type and per-sample shape (and L1 norms, in a debug file)."""
    kind = str(node.get("type", "")).removeprefix("k")
    return [node["id"], f"{kind} {_shape_text(node.get('shape', []))}".strip()] + _norm_lines(node.get("norms") or {})


def _debug_title(graph: dict) -> str | None:
    """A debug file says which step, pass and worker its norms are of."""
    if graph.get("pass") not in ("fp", "bp"):
        return None
    what = "outputs and params" if graph["pass"] == "fp" else "gradients of outputs and params"
    return f"L1 norms of the {what} on worker {graph.get('worker', '?')}, step {graph.get('step', '?')} ({graph['pass']})"


def draw_graph(data: dict, out: Path, title: str | None = None) -> Path:
    """Draw node-link `data` (checked) into `out` (.png, .svg or .pdf); return out."""
    from matplotlib import rc_context
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out = Path(out)
    if out.suffix.lower() not in FORMATS:
        raise ReportError(f"{out}: the picture's name must end in {', '.join(FORMATS)}")
    if not out.parent.is_dir():
        raise ReportError(f"{out}: folder {out.parent} does not exist")
    placed = layout(data)
    nodes = {n["id"]: n for n in data["nodes"]}
    title = title or _debug_title(data.get("graph") or {})
    extra_lines = max((len(node_lines(n)) for n in data["nodes"]), default=2) - 2  # norms, in a debug file
    row_inches = ROW_INCHES * (1 + 0.35 * extra_lines)
    slot_inches = SLOT_INCHES * (1.3 if extra_lines else 1.0)
    header, footer = 0.75 + (0.3 if title else 0.0), 0.15
    width = max(placed.width * slot_inches + 0.5, 6.0)
    height = placed.rows * row_inches + header + footer
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    # data units: x in slots, y in rows (down); the axes fill the figure below the header
    ax = fig.add_axes((0.2 / width, footer / height, placed.width * slot_inches / width, (placed.rows * row_inches) / height))
    ax.set_xlim(-0.03, placed.width + 0.03)  # the columns' borders stay inside
    ax.set_ylim(placed.rows - 0.5, -0.5)
    ax.axis("off")
    _draw_columns(ax, placed)
    box_height = 0.62 + 0.08 * extra_lines
    # characters of FONT_SIZE that fit across a box (DejaVu Sans averages ~0.6 em), less the bridges' teeth
    fit_chars = 0.85 * BOX_WIDTH * slot_inches * 72 / (0.6 * FONT_SIZE)
    _draw_edges(ax, placed, box_height)
    for node_id, (x, y) in placed.positions.items():
        _draw_node(ax, nodes[node_id], x, y, box_height, fit_chars)
    _legend(fig, sorted(c.worker for c in placed.columns), title)
    if out.suffix.lower() == ".png":
        _save_png(fig, out)
    else:
        with rc_context({"svg.fonttype": "none"}):  # SVG text stays text: searchable, and small
            fig.savefig(out)
    return out


def _save_png(fig, out: Path) -> None:
    """A palette PNG: the picture has few colours, so it is a third of the size of a full-colour one."""
    from PIL import Image

    fig.canvas.draw()
    image = Image.frombuffer("RGBA", fig.canvas.get_width_height(), fig.canvas.buffer_rgba(), "raw", "RGBA", 0, 1)
    image.convert("RGB").quantize(colors=128, method=Image.Quantize.MEDIANCUT).save(out, optimize=True)


def _draw_columns(ax, placed: Layout) -> None:
    from matplotlib.patches import Rectangle

    for c in placed.columns:
        colour = worker_colour(c.worker)
        ax.add_patch(Rectangle((c.left, -0.5), c.right - c.left, placed.rows, facecolor=_tint(colour, 0.07),
                               edgecolor=_tint(colour, 0.35), linewidth=0.8, zorder=0))
        ax.text((c.left + c.right) / 2, -0.52, f"worker {c.worker}", ha="center", va="bottom", fontsize=9,
                fontweight="bold", color=colour, zorder=5)


def _draw_edges(ax, placed: Layout, box_height: float) -> None:
    from matplotlib.patches import FancyArrowPatch

    for edge in placed.edges:
        pts = list(edge.points)
        # leave the source's box and end on the target's, so the arrowhead shows
        pts[0] = _border(pts[0], pts[1], box_height)
        pts[-1] = _border(pts[-1], pts[-2], box_height)
        colour, style, width = ("#222222", (0, (4, 2)), 1.5) if edge.crosses_workers else ("#8a8a8a", "solid", 0.9)
        if len(pts) > 2:  # down the gutter: the bends as a line, the last leg as the arrow
            xs, ys = zip(*pts[:-1])
            ax.plot(xs, ys, color=colour, linewidth=width, linestyle=style, zorder=1, solid_joinstyle="round")
        ax.add_patch(FancyArrowPatch(pts[-2], pts[-1], arrowstyle="-|>", mutation_scale=9, color=colour, linewidth=width,
                                     linestyle=style, shrinkA=0, shrinkB=1.5, zorder=2))


def _border(centre: tuple[float, float], towards: tuple[float, float], box_height: float) -> tuple[float, float]:
    """Where the segment from a box's centre towards a point leaves the box."""
    (x, y), (tx, ty) = centre, towards
    dx, dy = tx - x, ty - y
    half_w, half_h = BOX_WIDTH / 2 + 0.02, box_height / 2 + 0.03
    t = min(half_w / abs(dx) if dx else float("inf"), half_h / abs(dy) if dy else float("inf"), 1.0)
    return (x + dx * t, y + dy * t)


def _draw_node(ax, node: dict, x: float, y: float, height: float, fit_chars: float) -> None:
    from matplotlib.patches import FancyBboxPatch

    colour = worker_colour(int(node.get("worker", 0)))
    kind = node.get("type", "")
    connection = bool(node.get("connection")) or kind in ("kSlice", "kConcate", "kSplit", *BRIDGES)
    w, h = BOX_WIDTH, height
    if kind in BRIDGES:  # a torn edge: the blob leaves or enters this worker here
        look = BRIDGE_LOOK
    elif connection:
        look = CONNECTION_LOOK
    else:
        look = dict(LAYER_LOOK, facecolor=_tint(colour, 0.28))
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, edgecolor=colour, zorder=3, **look))
    lines = node_lines(node)
    weight = "normal" if connection else "bold"
    step = h / (len(lines) + 0.6)
    top = y - step * (len(lines) - 1) / 2
    for i, line in enumerate(lines):
        size = FONT_SIZE if i == 0 else FONT_SIZE - 0.5
        size *= min(1.0, fit_chars / max(len(line), 1))  # long names (bridges of slices) shrink to fit their box
        ax.text(x, top + i * step, line, ha="center", va="center", zorder=4, color="#1a1a1a", fontsize=size,
                fontweight=weight if i == 0 else "normal")


def _legend(fig, workers: list[int], title: str | None) -> None:
    from matplotlib.legend_handler import HandlerPatch
    from matplotlib.lines import Line2D
    from matplotlib.patches import FancyBboxPatch

    grey = "#555555"
    looks = {f"worker {w}": dict(LAYER_LOOK, facecolor=_tint(worker_colour(w), 0.28), edgecolor=worker_colour(w)) for w in workers}
    looks.update({"layer (computes)": dict(LAYER_LOOK, facecolor="#dddddd"), "slice / concate / split": CONNECTION_LOOK,
                  "bridge_src / bridge_dst": BRIDGE_LOOK})

    # legend entries are in points: the same shapes, with their rounding and teeth at that scale
    legend_styles = {label: look["boxstyle"].replace("rounding_size=0.25", "rounding_size=3").replace("tooth_size=0.07", "tooth_size=2")
                     for label, look in looks.items()}

    def box(legend, orig_handle, xdescent, ydescent, width, height, fontsize):
        return FancyBboxPatch((-xdescent, -ydescent), width, height, boxstyle=legend_styles[orig_handle.get_label()])

    handles: list = [FancyBboxPatch((0, 0), 1, 1, label=label, **{"edgecolor": grey, **look}) for label, look in looks.items()]
    handles.append(Line2D([], [], color="#222222", linestyle=(0, (4, 2)), linewidth=1.5, label="blob moving to another worker"))
    y = 1 - (0.3 / fig.get_figheight() if title else 0.0)
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, y), ncol=min(len(handles), 4), fontsize=7.5,
               frameon=False, handlelength=2.4, handleheight=1.1, columnspacing=1.6, handler_map={FancyBboxPatch: HandlerPatch(patch_func=box)})
    if title:
        fig.suptitle(title, fontsize=10, y=1 - 0.05 / fig.get_figheight(), va="top")
