"""Sweeps of online load runs with repeats, summarized with their run-to-run spread.

A sweep runs each `LoadSpec` point `repeats` times against one endpoint. Every headline metric of
a point is then a `Stat` over the repeats, so `llmopt bench compare` can tell a real difference
from noise: its spread (max - min) / median is the run-to-run noise of that number on this
machine. The result is one JSON document (`bench.json` of a serve run directory):

    {"kind": "serve", "label", "url", "model", "env", "workload", "slo_ms",
     "points": [{"spec", "summary": {metric: Stat}, "runs": [run_load result, ...]}]}
"""

from __future__ import annotations

import datetime as _dt
import logging
from collections.abc import Callable, Sequence
from typing import Any

from llmopt.bench.loadgen import LoadSpec, Workload, run_load
from llmopt.bench.serve_metrics import PERCENTILES, SLO
from llmopt.core.schema import SCHEMA_VERSION, summarize
from llmopt.hardware.host import cpu_name

__all__ = ["HEADLINE", "headline_for", "headline_values", "run_sweep", "parse_points"]

log = logging.getLogger(__name__)

# (metric key, unit, higher is better): what tables and comparisons show per point.
HEADLINE: tuple[tuple[str, str, bool], ...] = (
    ("request_throughput", "req/s", True),
    ("output_throughput", "tokens/s", True),
    ("total_token_throughput", "tokens/s", True),
    ("request_goodput", "req/s", True),
    ("input_throughput", "inputs/s", True),
    ("ttft_ms.median", "ms", False),
    ("ttft_ms.p95", "ms", False),
    ("ttft_ms.p99", "ms", False),
    ("tpot_ms.median", "ms", False),
    ("itl_ms.median", "ms", False),
    ("itl_ms.p99", "ms", False),
    ("e2el_ms.median", "ms", False),
    ("e2el_ms.p95", "ms", False),
    ("e2el_ms.p99", "ms", False),
    ("failed", "requests", False),
)
# The rows that mean something for an embeddings load (no tokens are generated or streamed).
EMBEDDING_HEADLINE = (
    "request_throughput",
    "input_throughput",
    "request_goodput",
    "e2el_ms.median",
    "e2el_ms.p95",
    "e2el_ms.p99",
    "failed",
)


def headline_for(endpoint: str) -> tuple[tuple[str, str, bool], ...]:
    """The headline rows for a load of `endpoint` (completions, chat or embeddings).

    >>> [k for k, _, _ in headline_for("embeddings")][:3]
    ['request_throughput', 'request_goodput', 'input_throughput']
    """
    if endpoint != "embeddings":
        return tuple(h for h in HEADLINE if h[0] != "input_throughput")
    return tuple(h for h in HEADLINE if h[0] in EMBEDDING_HEADLINE)


def headline_values(metrics: dict[str, Any]) -> dict[str, float]:
    """Flatten the headline metrics of one `serve_metrics` dict ("ttft_ms.median" -> value)."""
    out = {}
    for key, _, _ in HEADLINE:
        v: Any = metrics
        for part in key.split("."):
            v = v.get(part) if isinstance(v, dict) else None
        if v is not None:
            out[key] = float(v)
    return out


def parse_points(mode: str, values: str, **kw: Any) -> list[LoadSpec]:
    """Turn "1,2,4" into one LoadSpec per value (the sweep axis of the CLI).

    Example:
        >>> [p.label for p in parse_points("concurrency", "1,4")]
        ['concurrency 1', 'concurrency 4']
    """
    try:
        vals = [float(v) for v in values.split(",") if v.strip()]
    except ValueError:
        raise ValueError(
            f"sweep values {values!r}: give numbers separated by commas, e.g. 1,2,4"
        ) from None
    if not vals:
        raise ValueError("give at least one sweep value")
    return [LoadSpec(mode, v, **kw) for v in vals]  # type: ignore[arg-type]


def run_sweep(
    base_url: str,
    points: Sequence[LoadSpec],
    workload: Workload | None = None,
    repeats: int = 3,
    slo: SLO | None = None,
    model: str | None = None,
    label: str = "",
    allow_remote: bool = False,
    timeout_s: float = 120.0,
    on_run: Callable[[int, int, dict[str, Any]], None] | None = None,
    warmups: int = 1,
    percentiles: tuple[float, ...] = PERCENTILES,
    http2: bool = False,
) -> dict[str, Any]:
    """Run every point `repeats` times and summarize each headline metric over the repeats.

    Args:
        base_url: server root on loopback (see `loadgen.check_url`).
        points: arrival patterns, run in order.
        workload: prompts and lengths (default `Workload()`).
        repeats: runs per point (>= 2 to measure the spread compare needs).
        slo: goodput objectives.
        model: model id (default: the server's first).
        label: a name for this run in comparisons (e.g. "llama.cpp q4_1").
        allow_remote: permit a non-loopback host.
        timeout_s: per-request bound.
        on_run: progress callback (run index, total runs, run result).
        warmups: untimed requests sent one by one before each run (0: none).
        percentiles: latency percentiles each run reports (p95 is in the headline).
        http2: the client speaks HTTP/2 over one multiplexed connection (`loadgen.make_client`).

    Example:
        >>> res = run_sweep("http://127.0.0.1:8000", parse_points("concurrency", "1,2"), repeats=2)  # doctest: +SKIP
        >>> res["points"][1]["summary"]["output_throughput"]["median"]  # doctest: +SKIP
    """
    if not 1 <= repeats <= 20:
        raise ValueError(f"repeats must be in 1..20, got {repeats}")
    w = workload or Workload()
    total, k = len(points) * repeats, 0
    out_points = []
    model_seen = model
    for spec in points:
        runs = []
        for _ in range(repeats):
            r = run_load(
                base_url,
                spec,
                w,
                model_seen,
                slo,
                timeout_s,
                warmups=warmups,
                allow_remote=allow_remote,
                percentiles=percentiles,
                http2=http2,
            )
            model_seen = r["model"]
            runs.append(r)
            k += 1
            if on_run:
                on_run(k, total, r)
        vals = [headline_values(r["metrics"]) for r in runs]
        summary = {
            key: summarize([v[key] for v in vals], unit).to_dict()
            for key, unit, _ in HEADLINE
            if all(key in v for v in vals)
        }
        out_points.append({"spec": runs[0]["spec"], "summary": summary, "runs": runs})
    import os
    import platform

    return {
        "kind": "serve",
        "schema_version": SCHEMA_VERSION,
        "label": label or (model_seen or "server"),
        "url": out_points[0]["runs"][0]["url"] if out_points else base_url,
        "model": model_seen,
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "env": {
            "cpu": cpu_name(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
        },
        "workload": out_points[0]["runs"][0]["workload"] if out_points else {},
        "endpoint": w.endpoint,
        # The protocol the server answered in, and how the client connected.
        "http_version": out_points[0]["runs"][0]["http_version"] if out_points else None,
        "connections": out_points[0]["runs"][0]["connections"] if out_points else None,
        "percentiles": list(percentiles),
        "repeats": repeats,
        "slo_ms": slo.as_dict() if slo else {},
        "points": out_points,
    }
