"""The search's plots: latency CDF per candidate and throughput against concurrency (batch).

Inline SVG in the same style as `plots.py` (no JS, no URLs). The CDF is drawn from the quantiles a
benchmark records (min, p50, p90, p99, max of the repeated measurements), so it is a step
approximation with as many steps as quantiles, not a per-request histogram.
"""

from __future__ import annotations

import re

from llmopt.report.plots import (
    candidate_color,
    linear_scale,
    nice_ticks,
    svg_doc,
    svg_line,
    svg_text,
    x_axis,
)
from llmopt.report.view import CandidateView, RunView, fmt_num

__all__ = ["latency_cdf_svg", "throughput_concurrency_svg", "latency_quantiles"]

_W, _H, _L, _R, _T, _B = 640, 300, 56, 170, 12, 48


def latency_quantiles(cv: CandidateView) -> tuple[str, list[tuple[float, float]]] | None:
    """(unit, [(latency, cumulative share)]) of a candidate's per-token (LM) or per-sentence
    (batch 1, embedders) latency, from the recorded quantiles."""
    b = cv.bench
    if b is None:
        return None
    if "decode_ms_per_token" in b.metrics:
        s = b.metrics["decode_ms_per_token"]
        return "ms per decoded token (batch 1)", [
            (s.min, 0.0),
            (s.p50, 0.5),
            (s.p90, 0.9),
            (s.p99, 0.99),
            (s.max, 1.0),
        ]
    if "sentences_per_s_b1" in b.metrics:
        s = b.metrics["sentences_per_s_b1"]  # a rate: its slowest run is the latency's max
        inv = lambda r: 1000.0 / r if r else 0.0  # noqa: E731
        return "ms per sentence (batch 1)", [
            (inv(s.max), 0.0),
            (inv(s.p50), 0.5),
            (inv(s.min), 1.0),
        ]
    return None


def latency_cdf_svg(view: RunView) -> str | None:
    """Cumulative distribution of latency over the timed repeats, one step line per candidate."""
    series = [(cv, q) for cv in view.candidates if (q := latency_quantiles(cv))]
    if not series:
        return None
    unit = series[0][1][0]
    xs = [x for _, (_, pts) in series for x, _ in pts]
    ticks = nice_ticks(min(xs) * 0.95, max(xs) * 1.02)
    sx = linear_scale(ticks[0], ticks[-1], _L, _W - _R)
    sy = linear_scale(0.0, 1.0, _H - _B, _T)
    body = x_axis(ticks, sx, _H - _B, _T, unit)
    for f in (0.0, 0.5, 0.9, 1.0):
        body.append(svg_line(_L, sy(f), _W - _R, sy(f), "#d0d7de", ' stroke-dasharray="2,3"'))
        body.append(svg_text(_L - 6, sy(f) + 4, f"{f:.0%}", "end", ' fill="#57606a"'))
    for i, (cv, (_, pts)) in enumerate(series):
        color = candidate_color(view, cv)
        d = f"M{sx(pts[0][0]):.1f},{sy(0):.1f}"
        for x1, f1 in pts[1:]:
            d += f" H{sx(x1):.1f} V{sy(f1):.1f}"
        width = 3 if view.selection and view.selection.chosen == cv.id else 1.6
        body.append(f'<path d="{d}" fill="none" stroke="{color}" stroke-width="{width}"/>')
        ly = _T + 14 + i * 16
        body.append(
            svg_line(_W - _R + 10, ly - 4, _W - _R + 26, ly - 4, color, ' stroke-width="3"')
        )
        body.append(svg_text(_W - _R + 30, ly, cv.id))
    return svg_doc(_W, _H, "Latency CDF", body)


def _batch_points(cv: CandidateView) -> list[tuple[int, float]]:
    b = cv.bench
    if b is None:
        return []
    pts = []
    for name, st in b.metrics.items():
        m = re.fullmatch(r"(?:decode_tokens|sentences)_per_s_b(\d+)", name)
        if m:
            pts.append((int(m.group(1)), st.median))
        elif name == "decode_tokens_per_s":
            pts.append((1, st.median))
    return sorted(dict(pts).items())


def throughput_concurrency_svg(view: RunView) -> str | None:
    """Throughput against batch size (concurrent sequences), where more than one was measured."""
    series = [(cv, p) for cv in view.candidates if len(p := _batch_points(cv)) >= 2]
    if not series:
        return None
    unit = "sentences/s" if view.task == "embedding" else "decode tokens/s"
    xs = sorted({x for _, p in series for x, _ in p})
    ys = [y for _, p in series for _, y in p]
    sx = linear_scale(0, len(xs) - 1, _L + 10, _W - _R - 10)  # batch sizes evenly spaced
    yt = nice_ticks(0, max(ys) * 1.05)
    sy = linear_scale(yt[0], yt[-1], _H - _B, _T)
    body = [svg_line(_L, _H - _B, _W - _R, _H - _B, "#57606a")]
    for i, x in enumerate(xs):
        body.append(svg_text(sx(i), _H - _B + 16, str(x), "middle", ' fill="#57606a"'))
    body.append(
        svg_text((_L + _W - _R) / 2, _H - _B + 34, "batch size (concurrent sequences)", "middle")
    )
    for t in yt:
        body.append(svg_line(_L, sy(t), _W - _R, sy(t), "#d0d7de", ' stroke-dasharray="2,3"'))
        body.append(svg_text(_L - 6, sy(t) + 4, fmt_num(t), "end", ' fill="#57606a"'))
    body.append(svg_text(_L, _T - 2 + 8, unit, "start", ' fill="#57606a"'))
    for i, (cv, pts) in enumerate(series):
        color = candidate_color(view, cv)
        coords = " ".join(f"{sx(xs.index(x)):.1f},{sy(y):.1f}" for x, y in pts)
        body.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="2"/>')
        for x, y in pts:
            body.append(
                f'<circle cx="{sx(xs.index(x)):.1f}" cy="{sy(y):.1f}" r="3" fill="{color}"/>'
            )
        ly = _T + 14 + i * 16
        body.append(
            svg_line(_W - _R + 10, ly - 4, _W - _R + 26, ly - 4, color, ' stroke-width="3"')
        )
        body.append(svg_text(_W - _R + 30, ly, cv.id))
    return svg_doc(_W, _H, "Throughput vs concurrency", body)
