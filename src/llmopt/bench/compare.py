"""`llmopt bench compare RUN...`: runs side by side, with differences inside the noise labelled.

A RUN is a serve run (a `bench.json` written by `llmopt bench serve`, or its folder) or an
`llmopt optimize` run directory (its candidates' `bench.json`). Each number is a median over
repeats with a min and max; its relative spread (max - min) / median is the run-to-run noise
measured on that machine. A difference to the first RUN (the baseline) whose size is not larger
than the bigger of the two spreads is labelled "noise"; with a single repeat the spread is unknown
and the difference is labelled "1 repeat" rather than claimed.
"""

from __future__ import annotations

import json
from html import escape
from pathlib import Path
from typing import Any

from llmopt.bench.svg import PALETTE, line_chart
from llmopt.bench.sweep import HEADLINE
from llmopt.core.errors import LlmoptError

__all__ = ["CompareInputError", "load_run", "compare_runs", "to_markdown", "to_html"]

_DIRECTION = {k: hib for k, _, hib in HEADLINE}


class CompareInputError(LlmoptError):
    """A RUN given to compare is missing or holds no benchmark results."""


def load_run(path: str | Path) -> dict[str, Any]:
    """Read a RUN into {"label", "kind", "stats": {(row, metric): stat dict}, "doc"}.

    Example:
        >>> run = load_run("runs/llamacpp-q4_1")  # doctest: +SKIP
    """
    p = Path(path)
    if p.is_dir() and (p / "bench.json").is_file():
        p = p / "bench.json"
    if p.is_file():
        doc = json.loads(p.read_text(encoding="utf-8"))
        if doc.get("kind") != "serve":
            raise CompareInputError(
                f"{p} is not a serve benchmark", "pass `llmopt bench serve` output"
            )
        stats = {
            (pt["spec"]["label"], key): st
            for pt in doc["points"]
            for key, st in pt["summary"].items()
        }
        return {
            "label": doc.get("label") or p.parent.name,
            "kind": "serve",
            "stats": stats,
            "doc": doc,
        }
    benches = sorted(p.glob("candidates/*/bench.json")) if p.is_dir() else []
    if not benches:
        raise CompareInputError(
            f"{p}: no bench.json found",
            "pass a run directory of `llmopt optimize` or the output of `llmopt bench serve`",
        )
    stats = {}
    for b in benches:
        d = json.loads(b.read_text(encoding="utf-8"))
        for key, st in d.get("metrics", {}).items():
            stats[(d["candidate_id"], key)] = st
    return {"label": p.name, "kind": "optimize", "stats": stats, "doc": None}


def _spread(st: dict[str, Any]) -> float | None:
    if st.get("n", 1) < 2:
        return None
    return (st["max"] - st["min"]) / abs(st["median"]) if st["median"] else 0.0


def _verdict(
    base: dict[str, Any], st: dict[str, Any], higher_is_better: bool
) -> tuple[float | None, str]:
    b, v = base["median"], st["median"]
    if b == v:
        return 0.0, "same"
    if b == 0:
        return None, "worse" if (v > b) != higher_is_better else "better"
    rel = (v - b) / abs(b)
    spreads = [s for s in (_spread(base), _spread(st)) if s is not None]
    if len(spreads) < 2:
        return rel, "1 repeat"
    if abs(rel) <= max(spreads):
        return rel, "noise"
    return rel, "better" if (rel > 0) == higher_is_better else "worse"


def compare_runs(paths: list[str | Path]) -> dict[str, Any]:
    """Side-by-side rows (baseline = first RUN) and inline-SVG charts.

    Args:
        paths: two or more RUNs (see the module docstring).

    Returns:
        {"labels", "rows": [{"row", "metric", "unit", "medians", "spreads", "deltas",
        "verdicts"}], "charts": {name: svg}}.

    Example:
        >>> cmp = compare_runs(["runs/a", "runs/b"])  # doctest: +SKIP
        >>> [r["verdicts"] for r in cmp["rows"]][:1]  # doctest: +SKIP
        [['baseline', 'noise']]
    """
    if len(paths) < 2:
        raise CompareInputError("compare needs at least two RUNs", "pass two or more run paths")
    runs = [load_run(p) for p in paths]
    base = runs[0]
    rows = []
    for key, bst in base["stats"].items():
        row, metric = key
        hib = _DIRECTION.get(metric, bst.get("unit") not in ("ms", "s"))
        meds, spreads, deltas, verdicts = [bst["median"]], [_spread(bst)], [0.0], ["baseline"]
        for r in runs[1:]:
            st = r["stats"].get(key)
            if st is None:
                (
                    meds.append(None),
                    spreads.append(None),
                    deltas.append(None),
                    verdicts.append("missing"),
                )
                continue
            d, v = _verdict(bst, st, hib)
            (
                meds.append(st["median"]),
                spreads.append(_spread(st)),
                deltas.append(d),
                verdicts.append(v),
            )
        rows.append(
            {
                "row": row,
                "metric": metric,
                "unit": bst.get("unit", ""),
                "medians": meds,
                "spreads": spreads,
                "deltas": deltas,
                "verdicts": verdicts,
            }
        )
    return {"labels": [r["label"] for r in runs], "rows": rows, "charts": _charts(runs)}


def _charts(runs: list[dict[str, Any]]) -> dict[str, str]:
    serve = [(i, r) for i, r in enumerate(runs) if r["kind"] == "serve"]
    if not serve:
        return {}
    charts: dict[str, str | None] = {}
    mode = serve[0][1]["doc"]["points"][0]["spec"]["mode"]
    x_label = (
        "concurrency (requests in flight)" if mode == "concurrency" else "offered rate (req/s)"
    )

    def vs_load(key: str) -> list[tuple[str, list[tuple[float, float]], str]]:
        return [
            (
                r["label"],
                [
                    (pt["spec"]["value"], pt["summary"][key]["median"])
                    for pt in r["doc"]["points"]
                    if key in pt["summary"]
                ],
                PALETTE[i % len(PALETTE)],
            )
            for i, r in serve
        ]

    charts["throughput_vs_load"] = line_chart(
        "Output throughput against load", vs_load("output_throughput"), x_label, "tokens/s"
    )
    charts["ttft_vs_load"] = line_chart(
        "Median TTFT against load", vs_load("ttft_ms.median"), x_label, "ms"
    )
    for metric, field in (("ttft", "ttft"), ("e2el", "latency")):
        series = []
        for i, r in serve:
            pt = r["doc"]["points"][-1]  # the heaviest point of each run
            vals = sorted(
                1000 * q[field] for run in pt["runs"] for q in run["requests"] if q["success"]
            )
            cdf = [(v, (k + 1) / len(vals)) for k, v in enumerate(vals)]
            series.append((f"{r['label']} ({pt['spec']['label']})", cdf, PALETTE[i % len(PALETTE)]))
        charts[f"{metric}_cdf"] = line_chart(
            f"{metric.upper()} CDF at the heaviest load",
            series,
            f"{metric.upper()} (ms)",
            "fraction of requests",
            step=True,
        )
    return {k: v for k, v in charts.items() if v}


def _cell(v: float | None) -> str:
    return "-" if v is None else (f"{v:,.1f}" if abs(v) >= 10 else f"{v:.3g}")


def _table(cmp: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    labels = cmp["labels"]
    head = ["row", "metric"] + [f"{lab}" for lab in labels]
    body = []
    for r in cmp["rows"]:
        cells = [r["row"], f"{r['metric']} ({r['unit']})" if r["unit"] else r["metric"]]
        for j, m in enumerate(r["medians"]):
            s, d, v = r["spreads"][j], r["deltas"][j], r["verdicts"][j]
            txt = _cell(m) + (f" ±{100 * s / 2:.0f}%" if s is not None else "")
            if j and d is not None:
                txt += f" ({100 * d:+.1f}%, {v})"
            elif j:
                txt += f" ({v})"
            cells.append(txt)
        body.append(cells)
    return head, body


def to_markdown(cmp: dict[str, Any]) -> str:
    """A markdown table: median ±half-spread per RUN, change vs the first and its verdict."""
    head, body = _table(cmp)
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in body]
    return "\n".join(lines) + "\n"


def to_html(cmp: dict[str, Any]) -> str:
    """One self-contained HTML page: the table and the inline-SVG charts."""
    head, body = _table(cmp)
    rows = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in r) + "</tr>" for r in body)
    th = "".join(f"<th>{escape(h)}</th>" for h in head)
    charts = "".join(f"<figure>{svg}</figure>" for svg in cmp["charts"].values())
    return (
        "<!doctype html><meta charset='utf-8'><title>llmopt bench compare</title>"
        "<style>body{font-family:system-ui,sans-serif;margin:2em}td,th{border:1px solid #d0d7de;"
        "padding:3px 8px;font-size:13px}table{border-collapse:collapse}</style>"
        f"<h1>Benchmark comparison</h1><p>Baseline: {escape(cmp['labels'][0])}. "
        "'noise': the change is within the run-to-run spread (max-min over repeats).</p>"
        f"<table><tr>{th}</tr>{rows}</table>{charts}"
    )
