"""Objectives: what "best" means, read from a candidate's `BenchResult`.

    latency     ms per request: prompt / prefill rate + new tokens x p90 ms per token (LMs);
                ms per sentence at batch 1 (embedders). Lower is better.
    throughput  decode tokens/s at the largest batch measured (LMs); sentences/s at batch 32
                (embedders). Higher is better.
    memory      peak resident memory of the benchmark process. Lower is better.
    cost        price per million tokens (or sentences) at the throughput above, for
                `price_per_hour` of the target (1.0 = relative units). Lower is better.

Screen and full fidelities measure with different lengths, so values are compared across
fidelities only as a `score`: the value relative to the reference measured at the same fidelity,
oriented so that higher is better (2.0 = twice as good as the reference).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmopt.core.schema import BenchResult

__all__ = ["Objective", "OBJECTIVES", "get_objective"]


def _largest_batch(bench: BenchResult) -> tuple[str, int]:
    best = ("decode_tokens_per_s", 1)
    for name in bench.metrics:
        m = re.fullmatch(r"decode_tokens_per_s_b(\d+)", name)
        if m and int(m.group(1)) > best[1]:
            best = (name, int(m.group(1)))
    return best


def _throughput(b: BenchResult, _: dict[str, Any]) -> float | None:
    if b.task == "embedding":
        s = b.metrics.get("sentences_per_s_b32") or b.metrics.get(b.primary)
        return s.median if s else None
    name, _batch = _largest_batch(b)
    return b.metrics[name].median if name in b.metrics else None


def _latency(b: BenchResult, _: dict[str, Any]) -> float | None:
    if b.task == "embedding":
        s = b.metrics.get("sentences_per_s_b1")
        return 1000.0 / s.median if s and s.median else None
    pre, dec = b.metrics.get("prefill_tokens_per_s"), b.metrics.get("decode_ms_per_token")
    if pre is None or dec is None or not pre.median:
        return None
    p, n = b.settings.get("prompt_tokens", 0), b.settings.get("new_tokens", 0)
    return 1000.0 * p / pre.median + n * dec.p90


def _memory(b: BenchResult, _: dict[str, Any]) -> float | None:
    return float(b.peak_rss_bytes) if b.peak_rss_bytes else None


def _cost(b: BenchResult, ctx: dict[str, Any]) -> float | None:
    tput = _throughput(b, ctx)
    price = float(ctx.get("price_per_hour") or 1.0)
    return price / 3600.0 / tput * 1e6 if tput else None


@dataclass(frozen=True)
class Objective:
    """A named way to rank benchmarked candidates.

    Args:
        name: latency, throughput, memory or cost.
        unit: of `value`.
        higher_is_better: orientation of `value`.
        measure: BenchResult, context -> value (None when the bench lacks the numbers).
    """

    name: str
    unit: str
    higher_is_better: bool
    measure: Callable[[BenchResult, dict[str, Any]], float | None]
    description: str = ""

    def value(self, bench: BenchResult, context: dict[str, Any] | None = None) -> float | None:
        return self.measure(bench, context or {})

    def score(self, value: float | None, reference: float | None) -> float | None:
        """`value` relative to the reference's at the same fidelity, higher is better."""
        if value is None or reference is None or value <= 0 or reference <= 0:
            return None
        return value / reference if self.higher_is_better else reference / value

    def unit_for(self, task: str) -> str:
        if self.name == "throughput":
            return "sentences/s" if task == "embedding" else "tokens/s"
        if self.name == "latency":
            return "ms/sentence" if task == "embedding" else "ms/request"
        if self.name == "cost":
            return "per 1M sentences" if task == "embedding" else "per 1M tokens"
        return self.unit


OBJECTIVES: dict[str, Objective] = {
    o.name: o
    for o in (
        Objective("latency", "ms", False, _latency, "time per request (p90 per-token decode)"),
        Objective("throughput", "/s", True, _throughput, "tokens or sentences per second"),
        Objective("memory", "bytes", False, _memory, "peak resident memory"),
        Objective("cost", "per 1M", False, _cost, "price per million tokens or sentences"),
    )
}


def get_objective(name: str | Objective) -> Objective:
    """The objective named `name` (or `name` itself if it is one).

    >>> get_objective("latency").higher_is_better
    False
    """
    if isinstance(name, Objective):
        return name
    try:
        return OBJECTIVES[name]
    except KeyError:
        raise ValueError(
            f"unknown objective {name!r}; choose one of: {', '.join(OBJECTIVES)}"
        ) from None
