"""`shoal plan --estimate`: the prediction as text a user reads at a glance, and the scaling plot.

Works on the dict `shoal.estimate` returns (the same as `--json` prints), so nothing is recomputed.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from shoal.report.errors import ReportError

COLOURS = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9"]


def mb(n: float) -> str:
    """Bytes in the unit that shows them: 104 B, 3.2 kB, 47.9 MB, 1.20 GB."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.{2 if unit == 'GB' else 1}f} {unit}"
    return f"{n:.0f} B"


def flop(n: float) -> str:
    for unit, size in (("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} FLOP"


def ms(s: float) -> str:
    return f"{s * 1000:.1f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} µs"


def render(result: dict) -> str:
    """Every section the result holds: estimate, compare, suggest, scaling; each with the calibration's age and load."""
    calibrated = "  " + result["calibration"]["calibrated"]
    lines = [render_estimate(result["estimate"], result["calibration"])]
    sections = (("compare", render_compare), ("suggest", render_suggest), ("scaling", render_scaling), ("recommend", render_recommend))
    for key, section in sections:
        if key in result:
            first, *rest = section(result[key]).split("\n")
            lines += ["", first, calibrated, *rest]
    return "\n".join(lines)


def age(seconds: float) -> str:
    """3 s, 12 min, 3 h, 4 days (hours up to two days)."""
    for unit, size, from_s in (("days", 86400, 2 * 86400), ("h", 3600, 3600), ("min", 60, 60)):
        if seconds >= from_s:
            return f"{seconds / size:.0f} {unit}"
    return f"{max(0.0, seconds):.0f} s"


def calibrated_line(calib: dict) -> str:
    """One line: how old the calibration is and how busy the machine was then (docs/planning.md)."""
    if calib.get("age_s") is None:
        when = "at an unknown time"
    else:
        when = f"{age(calib['age_s'])} ago"
    if calib["contended"]:
        how = "contended: estimates may be low; measured again by itself at the next estimate on a quiet machine"
    elif calib["load"] <= calib["cores"] / 2:
        how = "idle"
    else:
        how = f"busy, but its timings undisturbed: CPU {calib['cpu_share']:.0%} of wall"
    dirty = len(calib.get("contended_kernels", ()))
    kernels = f"; {dirty} kernel timing(s) taken under contention" if dirty else ""
    return f"calibrated {when} at load {calib['load']:.1f} on {calib['cores']} cores ({how}){kernels}"


def render_estimate(e: dict, calib: dict) -> str:
    gemm = ", ".join(f"{v:.0f} GFLOP/s at {t} thread(s)" for t, v in calib["gemm_gflops"].items())
    lines = [
        f"calibration of {calib['host']} ({calib['cores']} cores, {calib['cpu_model'] or 'unknown CPU'}, torch {calib['torch']}; "
        f"taken {calib['taken_at']} in {calib['took_s']:.1f} s): GEMM {gemm}; "
        f"memory {max(calib['mem_gbps'].values()):.1f} GB/s; loopback {calib['link_gbps']:.2f} GB/s each way, "
        f"{calib['link_latency_s'] * 1e6:.0f} µs, {calib.get('collective_s', 0) * 1e6:.0f} µs a collective; {calib['kernels']} kernel(s) measured",
        f"{e['label']}: predicted {e['samples_per_s']:.0f} samples/s, {ms(e['step_s'])} per step of {e['global_batch']} samples"
        + (f" per group ({e['ngroups']} groups)" if e["ngroups"] > 1 else "") + f"; bottleneck: {e['bottleneck']}",
        "  " + calib["calibrated"],
        "  step: " + ", ".join(f"{k} {ms(v)}" for k, v in e["phases"].items() if v > 0),
    ]
    for t in e.get("step_terms", ()):  # the step's measured terms, one line per term
        if "factor" in t:
            lines.append(f"  {t['kind']}: ×{t['factor']:.2f} on the kernels' {ms(t['alone_s'])} for {t['rows']} rows "
                         f"(+{ms(t['seconds'])}: {t['what']})")
        else:
            lines.append(f"  {t['kind']}: {ms(t['seconds'])} per step ({t['what']})")
    for f in e.get("fixed_costs", ()):  # what the exchange's fixed costs are made of, one line per term
        per = f"{f['count']:.0f}" if f["count"] >= 1 and float(f["count"]).is_integer() else f"{f['count']:.2g}"
        lines.append(f"  {f['kind']}s: {per} per step × {ms(f['each_s'])} = {ms(f['seconds'])} ({f['what']})")
    if calib.get("load_now", 0) > calib["cores"]:
        lines.append(f"  note: this machine is busy now (load average {calib['load_now']:.1f} on {calib['cores']} cores); "
                     "the prediction is for the machine to itself: expect less")
    for w in e["workers"]:
        lines.append(
            f"  worker (group {w['group']}, id {w['id']}) in process {w['rank']} on {w['device']}, {w['threads']} thread(s), "
            f"{w['rows']} rows: forward {flop(w['fwd_flops'])} in {ms(w['fwd_s'])}, "
            f"backward {flop(w['bwd_flops'])} in {ms(w['bwd_s'])}"
        )
    for p in e["processes"]:
        links = ", ".join(f"→{q} {mb(v[0])} / ←{q} {mb(v[1])}" for q, v in p["links"].items()) or "no messages"
        lines.append(
            f"  process {p['rank']} (host {p['host']}): sends {mb(p['sent'])}, receives {mb(p['received'])} per step ({links}); "
            f"memory {mb(p['memory'])}: params {mb(p['params'])}, gradients {mb(p['gradients'])}, "
            f"updater state {mb(p['updater_state'])}, activations {mb(p['activations'])}"
        )
    if e["staleness"]:
        lines.append(f"  staleness: {e['staleness']}")
    lines += [f"  note: {note}" for note in e["notes"]]
    return "\n".join(lines)


def render_compare(rows: list[dict]) -> str:
    lines = ["layouts ranked by predicted samples/s:", f"  {'#':>2} {'layout':<22} {'samples/s':>9} {'step':>9} {'MB/step':>8}  bottleneck"]
    for i, r in enumerate(rows, 1):
        e = r["estimate"]
        if e is None:
            lines.append(f"  {'–':>2} {r['layout']:<22} refused: {r['refused']}")
            continue
        moved = max((p["sent"] for p in e["processes"]), default=0)
        note = f"; staleness {e['staleness']}" if e["staleness"] else ""
        lines.append(f"  {i:>2} {r['layout']:<22} {e['samples_per_s']:>9.0f} {ms(e['step_s']):>9} {moved / 1e6:>8.1f}  {e['bottleneck']}{note}")
    return "\n".join(lines)


def render_suggest(s: dict) -> str:
    best, batch = s["best"], s["batch_split"]
    dims = s["partition_dim"]
    cut = [name for name, d in dims.items() if d == 1]
    lines = [f"suggested partitioning for a group of {s['workers']} workers ({s['tried']} candidates estimated):"]
    if not cut:
        lines.append("  keep the batch split (partition_dim 0 everywhere): no layer cut on features predicts a shorter step")
    else:
        lines.append("  paste into these layers of the job (or --set neuralnet.layer[name=NAME].partition_dim=1):")
        lines += [f"    layer {{ name: \"{name}\" ... partition_dim: 1 }}" for name in cut]
    lines.append(f"  predicted: {ms(best['step_s'])} per step, {best['samples_per_s']:.0f} samples/s, {mb(best['bytes'])} between workers; "
                 f"batch split: {ms(batch['step_s'])}, {batch['samples_per_s']:.0f} samples/s, {mb(batch['bytes'])}")
    return "\n".join(lines)


def render_recommend(r: dict) -> str:
    """The recommended settings as lines to paste before `shoal run`, each with its reason."""
    if not r["timeouts"]:
        lines = [f"recommended timeouts for {r['label']}: none (one process: no heartbeat, collective or rendezvous)"]
    else:
        lines = [f"recommended timeouts for {r['label']} over {r['nprocs']} processes (predicted step {ms(r['step_s'])}); "
                 "paste into `shoal run` (or set them in the job's cluster section):"]
        for t in r["timeouts"]:
            default = "the default" if t["value"] == t["default"] else f"default {t['default']:g}"
            lines.append(f"  --set {t['setting']}={t['value']:g}  ({default}) {t['reason']}")
    if r.get("settings"):
        lines += ["", f"recommended settings for {r['workers']} workers on {r['links']}:"]
        for s in r["settings"]:
            sets = " ".join(f"--set {x}" for x in s["sets"])
            predicted = f"predicted {s['samples_per_s']:.0f} samples/s, {mb(s['bytes_per_sample'])}/sample; " if s["samples_per_s"] else ""
            lines.append(f"  {s['setting']}: {s['value']}" + (f"  ({sets})" if sets else ""))
            lines.append(f"    {predicted}{s['reason']}")
            lines += [f"    measured: {m}" for m in s["measured"]]
    return "\n".join(lines)


def render_scaling(s: dict) -> str:
    h = s["hosts"]
    names = list(dict.fromkeys(p["framework"] for p in s["points"]))
    counts = sorted({p["hosts"] for p in s["points"]})
    by = {(p["framework"], p["hosts"]): p for p in s["points"]}
    link = f"{h['link_gbps'] * 8:g} Gbit/s" if h["link_gbps"] else "this host's loopback"
    lines = [f"predicted samples/s on 1..{h['count']} hosts of {h['cores'] or 'these'} cores"
             + (f" and {h['gpus']} GPU(s)" if h["gpus"] else "") + f", {link} links (extrapolated: see docs/planning.md):",
             "  " + f"{'hosts':>5} " + " ".join(f"{n:>20}" for n in names)]
    for n in counts:
        lines.append("  " + f"{n:>5} " + " ".join(f"{by[(f, n)]['samples_per_s']:>20.0f}" if not by[(f, n)]["refused"] else f"{'refused':>20}" for f in names))
    for name, stop in s["stops"].items():
        if stop["stopped"]:
            lines.append(f"  {name}: stops scaling at {stop['hosts']} host(s) (one more adds < 5 %): {stop['bottleneck']}")
        else:
            lines.append(f"  {name}: still scaling at {stop['hosts']} host(s); bottleneck there: {stop['bottleneck']}")
    return "\n".join(lines)


def plot_scaling(s: dict, out: Path, title: Optional[str] = None, measured: Optional[list[dict]] = None) -> Path:
    """Predicted samples/s against hosts, one line per framework, where it stops scaling marked; `measured`
    (framework, hosts, samples_per_s: benchmarks/shaped_links.py's runs) drawn on the curves as crosses."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if out.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise ReportError(f"{out}: the picture's suffix must be .png, .svg or .pdf")
    fig = Figure(figsize=(8, 5), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    names = list(dict.fromkeys(p["framework"] for p in s["points"]))
    for colour, name in zip(COLOURS, names):
        pts = [p for p in s["points"] if p["framework"] == name and not p["refused"]]
        ax.plot([p["hosts"] for p in pts], [p["samples_per_s"] for p in pts], "o-", color=colour, label=name)
        stop = s["stops"].get(name)
        if stop and stop["stopped"]:
            at = next(p for p in pts if p["hosts"] == stop["hosts"])
            ax.annotate("stops", (at["hosts"], at["samples_per_s"]), textcoords="offset points", xytext=(4, 6), fontsize=8, color=colour)
        ran = [m for m in measured or () if m["framework"] == name]
        ax.plot([m["hosts"] for m in ran], [m["samples_per_s"] for m in ran], "x", color=colour, markersize=10, markeredgewidth=2)
    ax.set_xlabel("hosts")
    ax.set_xticks(sorted({p["hosts"] for p in s["points"]}))
    ax.set_ylabel("predicted samples/s")
    if measured:  # frameworks an order of magnitude apart (Local SGD) share the picture
        ax.set_yscale("log")
        ax.set_ylabel("samples/s: predicted (lines), measured (crosses)")
        ax.plot([], [], "x", color="black", markersize=10, markeredgewidth=2, label="measured")
    ax.set_title(title or "predicted samples/s")
    ax.grid(alpha=0.3)
    ax.legend()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out)
    except OSError as err:
        raise ReportError(f"{out}: cannot write the picture ({err.strerror})") from None
    return out
