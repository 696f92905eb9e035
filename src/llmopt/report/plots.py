"""Small inline-SVG charts for the HTML report, written by hand.

Why not matplotlib or a JS chart library: the report must be one self-contained file that opens
anywhere (no network, no JS, no extra install), and hand-written SVG keeps it a few KB, crisp at any
zoom and deterministic byte for byte. Each function returns an `<svg>` string, or None when the run
has too little data for the chart. All text is escaped.
"""

from __future__ import annotations

import math
from html import escape

from llmopt.report.view import CandidateView, RunView, fmt_bytes, fmt_num, fmt_pct, fmt_x

__all__ = ["COLORS", "memory_bars_svg", "nice_ticks", "quality_speed_svg", "speed_bars_svg"]

# Status kind -> colour (GitHub's palette: readable on white, distinct for the colour-blind
# with the shapes and labels that go with them).
COLORS = {
    "reference": "#57606a",
    "chosen": "#1a7f37",
    "kept": "#0969da",
    "dropped": "#cf222e",
    "failed": "#8250df",
    "cut": "#bc4c00",
    "incomplete": "#9a6700",
}
_FONT = 'font-family="system-ui, -apple-system, Segoe UI, sans-serif" font-size="12"'


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About `n` round tick values (steps of 1, 2, 2.5 or 5 x 10^k) covering [lo, hi].

    Args:
        lo: smallest value to cover.
        hi: largest value to cover.
        n: wanted number of intervals.

    >>> nice_ticks(0, 97)
    [0.0, 20.0, 40.0, 60.0, 80.0, 100.0]
    """
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / max(n, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.floor(lo / step) * step
    ticks = []
    k = 0
    while True:
        v = float(round(start + k * step, 12))
        ticks.append(v)
        if v >= hi - 1e-12 * abs(hi):
            return ticks
        k += 1


def candidate_color(view: RunView, cv: CandidateView) -> str:
    kind = view.status(cv).kind
    if cv.reference and kind not in ("chosen", "failed"):
        return COLORS["reference"]
    return COLORS.get(kind, COLORS["incomplete"])


def svg_doc(w: int, h: int, title: str, body: list[str]) -> str:
    # No xmlns: inline SVG in HTML5 does not need it, and the report then holds no URL at all.
    return (
        f'<svg viewBox="0 0 {w} {h}" width="100%" style="max-width:{w}px" role="img" '
        f'aria-label="{escape(title)}" {_FONT}><title>{escape(title)}</title>'
        + "".join(body)
        + "</svg>"
    )


def svg_text(x: float, y: float, s: str, anchor: str = "start", extra: str = "") -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}"{extra}>{escape(s)}</text>'


def svg_line(x1: float, y1: float, x2: float, y2: float, stroke: str, extra: str = "") -> str:
    return (
        f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{stroke}"{extra}/>'
    )


def linear_scale(lo: float, hi: float, p0: float, p1: float):
    span = (hi - lo) or 1.0
    return lambda v: p0 + (v - lo) / span * (p1 - p0)


def x_axis(ticks: list[float], sx, y: float, top: float, label: str, fmt=fmt_num) -> list[str]:
    out = [svg_line(sx(ticks[0]), y, sx(ticks[-1]), y, "#57606a")]
    for t in ticks:
        out.append(svg_line(sx(t), top, sx(t), y, "#d0d7de", ' stroke-dasharray="2,3"'))
        out.append(svg_line(sx(t), y, sx(t), y + 4, "#57606a"))
        out.append(svg_text(sx(t), y + 16, fmt(t), "middle", ' fill="#57606a"'))
    mid = (sx(ticks[0]) + sx(ticks[-1])) / 2
    out.append(svg_text(mid, y + 34, label, "middle"))
    return out


def quality_speed_svg(view: RunView) -> str | None:
    """Scatter of quality drop (y, lower is better) against primary speed (x, higher is better).

    The reference is a diamond, the chosen candidate is ringed, the Pareto front is a dashed line
    and the quality budget a red horizontal line.

    Args:
        view: the loaded run.
    """
    name = view.primary_metric
    pts = []
    for cv in view.candidates:
        speed = view.speed(cv, name)
        drop = cv.verify.quality_drop if cv.verify else (0.0 if cv.reference else None)
        if speed is not None and drop is not None and math.isfinite(speed + drop):
            pts.append((cv, speed, drop * 100))
    if not pts:
        return None
    w, h, left, right, top, bottom = 600, 340, 64, 24, 16, 52
    budget = view.max_quality_drop
    ys = [p[2] for p in pts] + ([budget * 100] if budget is not None else [])
    xt = nice_ticks(0, max(p[1] for p in pts) * 1.08)
    yt = nice_ticks(min(0.0, *ys), max(max(ys) * 1.15, 1e-6))
    sx, sy = (
        linear_scale(xt[0], xt[-1], left, w - right),
        linear_scale(yt[0], yt[-1], h - bottom, top),
    )
    unit = pts[0][0].bench.metrics[name].unit if name else ""
    body = x_axis(xt, sx, h - bottom, top, f"{name} median {unit} (higher is better)".strip())
    for t in yt:
        body.append(svg_line(left, sy(t), w - right, sy(t), "#d0d7de", ' stroke-dasharray="2,3"'))
        body.append(svg_text(left - 6, sy(t) + 4, f"{fmt_num(t)}%", "end", ' fill="#57606a"'))
    body.append(svg_line(left, top, left, h - bottom, "#57606a"))
    body.append(
        svg_text(
            14,
            (top + h - bottom) / 2,
            "quality drop (lower is better)",
            "middle",
            f' transform="rotate(-90 14 {(top + h - bottom) / 2:.1f})"',
        )
    )
    if budget is not None:
        yb = sy(budget * 100)
        body.append(svg_line(left, yb, w - right, yb, COLORS["dropped"], ' stroke-dasharray="6,4"'))
        body.append(
            svg_text(
                w - right - 4,
                yb - 5,
                f"budget {fmt_pct(budget)}",
                "end",
                f' fill="{COLORS["dropped"]}"',
            )
        )
    front = sorted((p for p in pts if view.on_pareto(p[0])), key=lambda p: p[1])
    if len(front) > 1:
        path = " ".join(f"{sx(s):.1f},{sy(q):.1f}" for _, s, q in front)
        body.append(
            f'<polyline points="{path}" fill="none" stroke="#0969da" '
            'stroke-dasharray="4,3" stroke-width="1.5"/>'
        )
    # Boxes labels must avoid: every point, then each label once drawn.
    placed = [(sx(s) - 11, sy(q) - 11, sx(s) + 11, sy(q) + 11) for _, s, q in pts]
    for cv, s, q in pts:
        x, y, c = sx(s), sy(q), candidate_color(view, cv)
        if cv.reference:
            body.append(f'<path d="M{x:.1f},{y - 7:.1f} l7,7 l-7,7 l-7,-7 z" fill="{c}"/>')
        else:
            body.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="6" fill="{c}"/>')
        if view.status(cv).kind == "chosen":
            body.append(
                f'<circle cx="{x:.1f}" cy="{y:.1f}" r="11" fill="none" stroke="{c}" '
                'stroke-width="2"/>'
            )
        label = cv.id + (" (reference)" if cv.reference else "")
        lx, ly, anchor = _place_label(placed, x, y, 6.5 * len(label), left, w - 2)
        body.append(svg_text(lx, ly, label, anchor))
    return svg_doc(w, h, "Quality drop vs speed", body)


def _place_label(
    placed: list[tuple[float, float, float, float]],
    x: float,
    y: float,
    tw: float,
    lo: float,
    hi: float,
) -> tuple[float, float, str]:
    """(x, y, text-anchor) for a point's label: beside it, above or below, on the side that keeps
    it inside [lo, hi] and off the labels and points already drawn (`placed`, updated), so that
    candidates of equal quality (the reference and a bf16 copy, both at 0%) stay readable."""
    options = [(side, dy) for dy in (-8, 18, -22, 32, -36, 46) for side in (1, -1)]
    for side, dy in [*options, options[0]]:
        lx = x + 13 * side
        box = (lx if side > 0 else lx - tw, y + dy - 11, lx + tw if side > 0 else lx, y + dy + 3)
        inside = lo <= box[0] and box[2] <= hi
        if inside and not any(
            b[0] < box[2] and box[0] < b[2] and b[1] < box[3] and box[1] < b[3] for b in placed
        ):
            break
    placed.append(box)
    return lx, y + dy, "start" if side > 0 else "end"


def _hbars(
    view: RunView,
    rows: list[tuple[CandidateView, list[tuple[float, str, float, float]], str]],
    title: str,
    axis_label: str,
    fmt,
    legend: list[tuple[str, str]] | None = None,
) -> str:
    """Horizontal bars: each row is (candidate, [(value, colour, whisker_lo, whisker_hi)], label)."""
    sub = 14
    row_h = max(28, sub * len(rows[0][1]) + 12)
    label_w = min(220, 16 + 7 * max(len(cv.id) for cv, _, _ in rows))
    w, right, top = 640, 150, 24 if legend else 8
    h = top + row_h * len(rows) + 44
    vmax = max(max(v, hi) for _, bars, _ in rows for v, _, _, hi in bars)
    ticks = nice_ticks(0, vmax * 1.02 if vmax > 0 else 1.0)
    sx = linear_scale(ticks[0], ticks[-1], label_w, w - right)
    body = x_axis(ticks, sx, h - 44, top, axis_label, fmt)
    for i, (label, color) in enumerate(legend or []):
        lx = label_w + i * 140
        body.append(f'<rect x="{lx}" y="4" width="10" height="10" fill="{color}"/>')
        body.append(svg_text(lx + 14, 13, label))
    for r, (cv, bars, text) in enumerate(rows):
        y0 = top + r * row_h + (row_h - sub * len(bars)) / 2
        body.append(svg_text(label_w - 8, y0 + sub * len(bars) / 2 + 4, cv.id, "end"))
        for b, (v, color, lo, hi) in enumerate(bars):
            y = y0 + b * sub
            body.append(
                f'<rect x="{sx(0):.1f}" y="{y + 1:.1f}" width="{max(sx(v) - sx(0), 1):.1f}"'
                f' height="{sub - 2}" fill="{color}"/>'
            )
            if hi > lo:  # the whisker: spread of the repeated measurements
                ym = y + sub / 2
                body.append(svg_line(sx(lo), ym, sx(hi), ym, "#24292f", ' stroke-width="1.2"'))
                body.append(svg_line(sx(lo), ym - 4, sx(lo), ym + 4, "#24292f"))
                body.append(svg_line(sx(hi), ym - 4, sx(hi), ym + 4, "#24292f"))
        body.append(
            svg_text(w - right + 8, y0 + sub * len(bars) / 2 + 4, text, "start", ' fill="#24292f"')
        )
    return svg_doc(w, h, title, body)


def speed_bars_svg(view: RunView) -> str | None:
    """Median of the primary speed metric per candidate, with min..max whiskers and speedup.

    Args:
        view: the loaded run.
    """
    name = view.primary_metric
    rows = []
    for cv in view.candidates:
        if cv.bench is None or name not in cv.bench.metrics:
            continue
        st = cv.bench.metrics[name]
        label = f"{fmt_num(st.median)} ({fmt_x(view.speedup(cv))})"
        rows.append((cv, [(st.median, candidate_color(view, cv), st.min, st.max)], label))
    if not rows or not name:
        return None
    unit = rows[0][0].bench.metrics[name].unit  # type: ignore[union-attr]
    return _hbars(view, rows, f"Speed: {name}", f"{name} {unit} (median, min..max)", fmt_num)


def memory_bars_svg(view: RunView) -> str | None:
    """Peak resident memory of the benchmark and the artifact size on disk, per candidate.

    Args:
        view: the loaded run.
    """
    benches = [(cv, cv.bench) for cv in view.candidates if cv.bench is not None]
    if not benches:
        return None
    # Ticks in one binary unit (MiB, GiB) so they land on round numbers of that unit.
    vmax = max(max(b.peak_rss_bytes, b.artifact_bytes) for _, b in benches)
    k = max(0, min(4, int(math.log(vmax, 1024)) if vmax > 0 else 0))
    div, unit = 1024.0**k, ("B", "KiB", "MiB", "GiB", "TiB")[k]
    rows = []
    for cv, b in benches:
        bars = [(b.peak_rss_bytes / div, "#0969da", 0.0, 0.0)]
        bars.append((b.artifact_bytes / div, "#8c959f", 0.0, 0.0))
        rows.append((cv, bars, f"{fmt_bytes(b.peak_rss_bytes)} / {fmt_bytes(b.artifact_bytes)}"))
    legend = [("peak RSS", "#0969da"), ("artifact on disk", "#8c959f")]
    return _hbars(view, rows, "Memory", unit, fmt_num, legend)
