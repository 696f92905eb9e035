"""Selection: the fastest candidate whose verified quality loss is within the budget.

Every candidate gets a one-line reason (chosen / kept / dropped / failed), so the report can say
why each one did not win. Differences in speed smaller than the measured run-to-run spread are
called out as noise rather than treated as a real ranking.
"""

from __future__ import annotations

from llmopt.schema import BenchResult, Candidate, Selection, VerifyResult

__all__ = ["select", "pareto_front"]


def pareto_front(points: dict[str, tuple[float, float]]) -> list[str]:
    """Ids not dominated on (speed: higher is better, quality_drop: lower is better).

    >>> pareto_front({"a": (10, 0.0), "b": (20, 0.01), "c": (15, 0.02)})
    ['a', 'b']
    """
    front = []
    for i, (s, q) in points.items():
        dominated = any(
            (s2 >= s and q2 <= q) and (s2 > s or q2 < q) for j, (s2, q2) in points.items() if j != i
        )
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i][0])


def select(
    candidates: list[Candidate],
    verify: dict[str, VerifyResult],
    bench: dict[str, BenchResult],
    errors: dict[str, str],
    max_quality_drop: float,
) -> Selection:
    """Choose the candidate with the highest primary speed among those that pass verification.

    Args:
        candidates: all planned candidates.
        verify, bench: results by candidate id (missing ids are incomplete).
        errors: candidate id -> "stage: message" for candidates whose stage failed.
        max_quality_drop: the budget the gates were set from (recorded in the selection).
    """
    reasons: dict[str, str] = {}
    eligible: list[str] = []
    for c in candidates:
        v, b = verify.get(c.id), bench.get(c.id)
        if c.id in errors:
            reasons[c.id] = f"failed at {errors[c.id]}"
        elif v is None or b is None:
            reasons[c.id] = "incomplete: " + ("not verified" if v is None else "not benchmarked")
        elif not v.passed:
            failed = [m for m in v.metrics if m.passed is False]
            why = "; ".join(
                f"{m.name} {m.candidate:.4g} vs limit {m.threshold:.4g}" for m in failed
            )
            reasons[c.id] = f"dropped: quality gate failed ({why or 'integrity check'})"
        else:
            eligible.append(c.id)

    # Fastest first; equal speed goes to the smaller quality drop.
    ranking = sorted(eligible, key=lambda i: (-bench[i].primary_value, verify[i].quality_drop))
    chosen = ranking[0] if ranking else None
    if chosen:
        best = bench[chosen]
        ref = next((c.id for c in candidates if c.reference), None)
        speedup = (
            f", {best.primary_value / bench[ref].primary_value:.2f}x the reference"
            if ref in bench and bench[ref].primary_value
            else ""
        )
        reasons[chosen] = (
            f"chosen: fastest within the quality budget ({best.primary} "
            f"{best.primary_value:.4g}{speedup}; quality drop {verify[chosen].quality_drop:+.2%})"
        )
        for i in ranking[1:]:
            b = bench[i]
            ratio = b.primary_value / best.primary_value
            noise = max(b.metrics[b.primary].spread, best.metrics[best.primary].spread)
            tag = " (within run-to-run noise of the chosen one)" if 1 - ratio <= noise else ""
            reasons[i] = f"kept: passes the gates but slower ({ratio:.2f}x the chosen){tag}"
    points = {i: (bench[i].primary_value, verify[i].quality_drop) for i in verify if i in bench}
    return Selection(
        objective="throughput",
        chosen=chosen,
        max_quality_drop=max_quality_drop,
        reasons=reasons,
        ranking=ranking,
        pareto=pareto_front(points),
    )
