"""Per-metric gates: the thresholds a candidate must meet, with defaults, and the gate table.

`max_quality_drop` sets the primary gate (relative perplexity increase for LMs, 1 - mean cosine for
embeddings); the others catch defects the primary number can hide: a candidate may keep its
perplexity and still change its greedy picks (top-1 agreement, KL), or keep the mean cosine while a
few sentences collapse (minimum cosine), or retrieve different passages (recall@k).

>>> Gates.preset("strict").min_top1_agreement
0.97
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from llmopt.core.schema import Metric, VerifyResult

__all__ = ["Gates", "GATE_PRESETS", "gate_rows", "failures"]


@dataclass(frozen=True)
class Gates:
    """Thresholds of the verification gates. None disables a gate (the metric is reported only).

    Args:
        max_quality_drop: primary budget: relative perplexity increase (LMs) or 1 - mean cosine.
        min_top1_agreement: share of positions where the candidate's greedy pick equals the
            reference's.
        max_kl: mean KL(reference || candidate) per position, in nats.
        min_cosine: smallest per-sentence cosine to the reference allowed (catches a few broken
            sentences that the mean hides).
        max_recall_drop: largest absolute drop of retrieval recall@k allowed.
        max_task_accuracy_drop: largest absolute drop of multiple-choice accuracy allowed.
        min_decision_agreement: embedders: smallest share of pairs the candidate must decide as
            the reference does at the recalibrated threshold (out of sample); applied when the
            user gives a threshold or pairs (`--threshold`, `--pairs`), reported otherwise.
        min_index_recall: embedders: smallest share of the reference's exact top k that the
            candidate's FAISS index must return (`index_recall@k`).
    """

    max_quality_drop: float = 0.01
    min_top1_agreement: float | None = 0.90
    max_kl: float | None = 0.10
    min_cosine: float | None = 0.90
    max_recall_drop: float | None = 0.05
    max_task_accuracy_drop: float | None = 0.05
    min_decision_agreement: float | None = 0.95
    min_index_recall: float | None = 0.80

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_quality_drop < 1.0:
            raise ValueError(
                f"max_quality_drop={self.max_quality_drop} must be a fraction in [0, 1), "
                "e.g. 0.01 for 1%"
            )
        if self.min_top1_agreement is not None and not 0 <= self.min_top1_agreement <= 1:
            raise ValueError("min_top1_agreement must be in [0, 1], e.g. 0.9")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> Gates:
        """A named preset ("default", "strict", "loose") with optional overrides."""
        if name not in GATE_PRESETS:
            raise ValueError(f"unknown gate preset {name!r}; choose one of {sorted(GATE_PRESETS)}")
        return replace(GATE_PRESETS[name], **overrides)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


GATE_PRESETS: dict[str, Gates] = {
    "default": Gates(),
    # Near-lossless recipes (fp8, int8 weight-only) should meet these.
    "strict": Gates(max_quality_drop=0.005, min_top1_agreement=0.97, max_kl=0.02, min_cosine=0.98),
    # Aggressive recipes (4-bit): only gross defects fail.
    "loose": Gates(max_quality_drop=0.05, min_top1_agreement=0.80, max_kl=0.30, min_cosine=0.80),
}


def gate_rows(result: VerifyResult) -> list[dict[str, Any]]:
    """One row per metric: metric, reference, candidate, delta, CI, noise, threshold, pass/fail.

    >>> from llmopt.core.schema import Metric, VerifyResult
    >>> r = VerifyResult("c", "causal-lm", [Metric("perplexity", 10.0, 10.05, False, 10.1, True)],
    ...                  True, 0.005)
    >>> gate_rows(r)[0]["status"]
    'pass'
    """
    rows = []
    for m in result.metrics:
        status = "report" if m.passed is None else ("pass" if m.passed else "FAIL")
        rows.append(
            {
                "metric": m.name,
                "reference": m.reference,
                "candidate": m.candidate,
                "delta": m.delta,
                "ci": None if m.ci_low is None else [m.ci_low, m.ci_high],
                "noise": m.noise,
                "threshold": m.threshold,
                "status": status,
                "n": m.n,
                "note": m.note,
            }
        )
    return rows


def failures(result: VerifyResult) -> list[Metric]:
    """The metrics whose gate failed."""
    return [m for m in result.metrics if m.passed is False]
