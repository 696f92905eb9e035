"""A hand-written inline-SVG line chart for benchmark comparisons (CDFs, metric vs load).

Same reasoning as the report's charts (`llmopt.report.plots`): one self-contained HTML file, no JS,
no network, deterministic bytes. Series are drawn as polylines with point markers; each run keeps
one colour across every chart of a comparison.
"""

from __future__ import annotations

from html import escape

from llmopt.report.plots import nice_ticks

__all__ = ["PALETTE", "line_chart"]

PALETTE = ("#0969da", "#cf222e", "#1a7f37", "#8250df", "#9a6700", "#57606a", "#bf3989", "#0a3069")
_FONT = 'font-family="system-ui, -apple-system, Segoe UI, sans-serif" font-size="12"'


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def line_chart(
    title: str,
    series: list[tuple[str, list[tuple[float, float]], str]],
    x_label: str,
    y_label: str,
    step: bool = False,
    width: int = 640,
    height: int = 320,
) -> str | None:
    """An SVG line chart of `series` [(name, [(x, y), ...], colour)], or None without data.

    Args:
        title: chart title (also the accessible name).
        series: one polyline each; points are sorted by x.
        x_label / y_label: axis titles with units.
        step: draw as a step function (for empirical CDFs).
        width / height: viewBox size in px.

    Example:
        >>> svg = line_chart("t", [("a", [(0, 0), (1, 1)], "#000")], "x", "y")
        >>> svg.startswith("<svg")
        True
    """
    pts = [p for _, s, _ in series for p in s]
    if not pts:
        return None
    left, right, top, bottom = 64, width - 170, 28, height - 46
    xt = nice_ticks(min(0.0, min(x for x, _ in pts)), max(x for x, _ in pts))
    yt = nice_ticks(min(0.0, min(y for _, y in pts)), max(y for _, y in pts))

    def sx(v: float) -> float:
        return left + (v - xt[0]) / ((xt[-1] - xt[0]) or 1) * (right - left)

    def sy(v: float) -> float:
        return bottom - (v - yt[0]) / ((yt[-1] - yt[0]) or 1) * (bottom - top)

    body = [f'<text x="{left}" y="16" font-weight="600">{escape(title)}</text>']
    for t in xt:
        body.append(
            f'<line x1="{sx(t):.1f}" y1="{top}" x2="{sx(t):.1f}" y2="{bottom}" stroke="#d0d7de" stroke-dasharray="2,3"/>'
        )
        body.append(
            f'<text x="{sx(t):.1f}" y="{bottom + 16}" text-anchor="middle" fill="#57606a">{_fmt(t)}</text>'
        )
    for t in yt:
        body.append(
            f'<line x1="{left}" y1="{sy(t):.1f}" x2="{right}" y2="{sy(t):.1f}" stroke="#d0d7de" stroke-dasharray="2,3"/>'
        )
        body.append(
            f'<text x="{left - 6}" y="{sy(t) + 4:.1f}" text-anchor="end" fill="#57606a">{_fmt(t)}</text>'
        )
    body.append(
        f'<text x="{(left + right) / 2:.1f}" y="{height - 8}" text-anchor="middle">{escape(x_label)}</text>'
    )
    body.append(
        f'<text x="14" y="{(top + bottom) / 2:.1f}" text-anchor="middle" transform="rotate(-90 14 {(top + bottom) / 2:.1f})">{escape(y_label)}</text>'
    )
    for i, (name, s, colour) in enumerate(series):
        s = sorted(s)
        if not s:
            continue
        coords: list[str] = []
        for j, (x, y) in enumerate(s):
            if step and j:
                coords.append(f"{sx(x):.1f},{sy(s[j - 1][1]):.1f}")
            coords.append(f"{sx(x):.1f},{sy(y):.1f}")
        body.append(
            f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{" ".join(coords)}"/>'
        )
        if not step:
            body += [
                f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{colour}"/>' for x, y in s
            ]
        ly = top + 14 + 18 * i
        body.append(
            f'<line x1="{right + 12}" y1="{ly - 4}" x2="{right + 30}" y2="{ly - 4}" stroke="{colour}" stroke-width="3"/>'
        )
        body.append(f'<text x="{right + 36}" y="{ly}">{escape(name[:22])}</text>')
    return (
        f'<svg viewBox="0 0 {width} {height}" width="100%" style="max-width:{width}px" role="img" '
        f'aria-label="{escape(title)}" {_FONT}><title>{escape(title)}</title>'
        + "".join(body)
        + "</svg>"
    )
