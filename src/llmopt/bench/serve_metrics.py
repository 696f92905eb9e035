"""Online serving metrics, defined exactly as vLLM's `vllm bench serve` defines them.

Source of the definitions: vllm/benchmarks/serve.py (`calculate_metrics`) and
vllm/benchmarks/lib/endpoint_request_func.py. Per request, on the client's clock:

- TTFT: first streamed chunk that carries text, minus the moment the request was sent.
- ITL: the gaps between successive text-carrying chunks (all requests' gaps pooled).
- TPOT: (E2EL - TTFT) / (output_tokens - 1), only for requests with more than one output token;
  for goodput a request with <= 1 token counts TPOT as 0, as vLLM does.
- E2EL: last chunk minus send time.
- Throughputs divide by the whole benchmark's wall duration (first send to last completion):
  request throughput = completed / duration; output = sum(output tokens) / duration;
  total token throughput = (sum(prompt tokens) + sum(output tokens)) / duration;
  request goodput = requests meeting every SLO / duration.
- Embeddings requests (`/v1/embeddings`, not streamed): E2EL is the response time, TTFT and TPOT
  are 0 (so an E2EL SLO is the one that applies), and input throughput = sum(texts) / duration.

Percentiles use numpy's default (linear interpolation), means and std are numpy's; all in ms.
Failed requests count in `failed` and nowhere else. This module is pure arithmetic on timestamps,
so it is tested on recorded ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["RequestRecord", "SLO", "serve_metrics", "PERCENTILES"]

PERCENTILES = (50.0, 90.0, 95.0, 99.0)


@dataclass
class RequestRecord:
    """What the client saw for one request (times in seconds on `time.perf_counter`).

    `output_tokens` comes from the server's usage report when it sends one, else from the count
    of text chunks (`tokens_source` says which); `error` is set when `success` is False.
    """

    success: bool
    start_time: float = 0.0
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""
    tokens_source: str = ""  # "usage" or "chunks"
    finish_reason: str = ""  # the server's last one: "length", "stop"... (a cut stream shows here)
    generated_text: str = ""
    inputs: int = 0  # embeddings: texts in the request (the batch size a client sent)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "generated_text"}


@dataclass(frozen=True)
class SLO:
    """Service-level objectives for goodput, in milliseconds (None: not constrained).

    Example:
        >>> SLO(ttft_ms=500, tpot_ms=50).as_dict()
        {'ttft': 500, 'tpot': 50}
    """

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms", "e2el_ms"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"SLO {name} must be > 0 ms, got {v}; leave it unset instead")

    def as_dict(self) -> dict[str, float]:
        d = {"ttft": self.ttft_ms, "tpot": self.tpot_ms, "e2el": self.e2el_ms}
        return {k: v for k, v in d.items() if v is not None}


def _dist_ms(values_s: list[float], percentiles: tuple[float, ...]) -> dict[str, float]:
    import numpy as np

    # vLLM reports 0 for an empty list (e.g. no streaming): `np.mean(x or 0)`.
    v = np.asarray(values_s or [0.0], dtype=float) * 1000.0
    d = {
        "mean": float(v.mean()),
        "median": float(np.median(v)),
        "std": float(v.std()),
        "n": len(values_s),
    }
    for p in percentiles:
        d[f"p{p:g}"] = float(np.percentile(v, p))
    return d


def serve_metrics(
    records: list[RequestRecord],
    duration_s: float,
    slo: SLO | None = None,
    percentiles: tuple[float, ...] = PERCENTILES,
) -> dict[str, Any]:
    """Aggregate per-request records into vLLM-defined serving metrics.

    Args:
        records: one per request sent, failed ones included.
        duration_s: wall time from the first send to the last completion.
        slo: goodput objectives; without one, `request_goodput` is None.
        percentiles: which percentiles of each latency distribution to report.

    Returns:
        A plain dict: counts, token totals, throughputs (per second), and `ttft_ms`, `tpot_ms`,
        `itl_ms`, `e2el_ms` distributions ({mean, median, std, n, p50, p90, p95, p99} by
        default), and `input_throughput` (embedding texts per second).

    Example:
        >>> r = RequestRecord(True, prompt_len=10, output_tokens=3, ttft=0.1, itl=[0.05, 0.05], latency=0.2)
        >>> m = serve_metrics([r], duration_s=0.2)
        >>> round(m["tpot_ms"]["mean"], 3), m["output_throughput"]
        (50.0, 15.0)
    """
    assert duration_s > 0, "duration must be positive"
    ttfts: list[float] = []
    tpots: list[float] = []
    all_tpots: list[float] = []
    itls: list[float] = []
    e2els: list[float] = []
    total_in = total_out = completed = inputs = 0
    for r in records:
        if not r.success:
            continue
        completed += 1
        total_in += r.prompt_len
        total_out += r.output_tokens
        inputs += r.inputs
        tpot = 0.0
        if r.output_tokens > 1:
            tpot = (r.latency - r.ttft) / (r.output_tokens - 1)
            tpots.append(tpot)
        all_tpots.append(tpot)
        itls.extend(r.itl)
        ttfts.append(r.ttft)
        e2els.append(r.latency)
    good = None
    if slo is not None and slo.as_dict():
        limits = slo.as_dict()
        good = 0
        for ttft, tpot, e2el in zip(ttfts, all_tpots, e2els, strict=True):
            seen = {"ttft": ttft, "tpot": tpot, "e2el": e2el}
            # vLLM: good when every SLO (ms -> s) >= the request's value.
            if all(limits[k] / 1000.0 >= seen[k] for k in limits):
                good += 1
    return {
        "completed": completed,
        "failed": len(records) - completed,
        "duration_s": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": completed / duration_s,
        "request_goodput": None if good is None else good / duration_s,
        "good_requests": good,
        "slo_ms": slo.as_dict() if slo else {},
        "output_throughput": total_out / duration_s,
        "total_inputs": inputs,
        "input_throughput": inputs / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "ttft_ms": _dist_ms(ttfts, percentiles),
        "tpot_ms": _dist_ms(tpots, percentiles),
        "itl_ms": _dist_ms(itls, percentiles),
        "e2el_ms": _dist_ms(e2els, percentiles),
    }
