"""Does a deployment's similarity threshold still decide as it did? Recalibrated, with CIs.

A retrieval or deduplication service compares cosine similarity against a threshold the
application hard-codes (say 0.85). A candidate that shifts every score a little keeps its
ranking but flips decisions near the threshold. Given the reference's and the candidate's
cosines over the same pairs, this module reports:

- the two score distributions and their mean shift;
- `decision_agreement`: pairs decided alike at the user's threshold, candidate as is;
- `recalibrated_threshold`: the candidate threshold that best preserves the reference's
  decisions (`recalibrate_threshold`), and `recalibrated_agreement`, its agreement measured out
  of sample (2-fold cross-fitting: fitted on one half of the pairs, scored on the other), which
  is what the gate sees: an in-sample fit would flatter itself. When the fitted threshold does
  no better out of sample than the user's, the user's is kept (and its agreement gated);
- `percentile_threshold`: the alternative rule (same share of pairs passing) and its agreement;
- with labelled pairs, the accuracy of the reference at its threshold and of the candidate at
  the recalibrated one.

Each value has a percentile-bootstrap 95% CI over pairs (`llmopt.verify.stats.bootstrap_ci`).
"""

from __future__ import annotations

import numpy as np

from llmopt.core.schema import Metric
from llmopt.verify.retrieval import agreement, percentile_threshold, recalibrate_threshold
from llmopt.verify.stats import DEFAULT_RESAMPLES, DEFAULT_SEED, bootstrap_ci, is_noise

__all__ = ["threshold_metrics", "crossfit_agreement"]


def crossfit_agreement(
    ref_cos: np.ndarray,
    cand_cos: np.ndarray,
    threshold: float,
    seed: int = DEFAULT_SEED,
    groups: np.ndarray | None = None,
) -> float:
    """Agreement of the recalibrated threshold on pairs it was not fitted on (2 folds).

    Args:
        ref_cos, cand_cos: (P,) cosines of each pair.
        threshold: the reference's threshold.
        seed: the fold assignment.
        groups: (P,) the original pair of each entry when entries repeat (a bootstrap resample):
            copies of one pair go to the same fold, so no pair is scored by a fit that saw it.

    >>> r = np.linspace(0, 1, 40)  # held-out pairs between a fold's cut and 0.4 flip
    >>> crossfit_agreement(r, r - 0.1, 0.5)
    0.95
    """
    n = len(ref_cos)
    g = np.arange(n) if groups is None else np.asarray(groups)
    size = int(g.max()) + 1
    first_fold = (np.random.default_rng(seed).permutation(size) < size // 2)[g]
    folds = (np.flatnonzero(first_fold), np.flatnonzero(~first_fold))
    if min(len(f) for f in folds) == 0:  # too few distinct pairs to split
        t, _, _ = recalibrate_threshold(ref_cos, cand_cos, threshold)
        return agreement(ref_cos, cand_cos, threshold, t)
    hits = 0.0
    for fit, score in (folds, folds[::-1]):
        t, _, _ = recalibrate_threshold(ref_cos[fit], cand_cos[fit], threshold)
        hits += agreement(ref_cos[score], cand_cos[score], threshold, t) * len(score)
    return hits / n


def threshold_metrics(
    ref_cos: np.ndarray,
    cand_cos: np.ndarray,
    threshold: float,
    *,
    labels: np.ndarray | None = None,
    min_agreement: float | None = None,
    source: str = "",
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
) -> tuple[list[Metric], list[str]]:
    """The threshold study of one candidate over P pairs: metrics (one gated) and notes.

    Args:
        ref_cos, cand_cos: (P,) cosine of each pair under the reference and the candidate.
        threshold: the user's (reference) decision threshold.
        labels: (P,) 1.0 / 0.0 ground truth, if the pairs file had labels.
        min_agreement: gate on `recalibrated_agreement` (None: reported only).
        source: where the pairs came from (for the notes).
        resamples, seed: bootstrap settings.

    >>> r = np.linspace(0, 1, 400)
    >>> ms, _ = threshold_metrics(r, r * 0.9, 0.5, min_agreement=0.9, resamples=50)
    >>> m = {m.name: round(m.candidate, 3) for m in ms}
    >>> m["decision_agreement"], m["recalibrated_threshold"], m["recalibrated_agreement"]
    (0.945, 0.45, 0.998)
    """
    ref_cos = np.asarray(ref_cos, dtype=np.float64)
    cand_cos = np.asarray(cand_cos, dtype=np.float64)
    assert ref_cos.shape == cand_cos.shape and ref_cos.ndim == 1, "one cosine per pair, both"
    n = len(ref_cos)

    def ci(stat, ref_value=None):
        lo, hi = bootstrap_ci(stat, n, resamples, seed=seed)
        if ref_value is None:
            return lo, hi, None
        d = (lo - ref_value, hi - ref_value)
        return d[0], d[1], is_noise(d)

    t_fit, before, in_sample = recalibrate_threshold(ref_cos, cand_cos, threshold)
    t_pct = percentile_threshold(ref_cos, cand_cos, threshold)
    held_out = crossfit_agreement(ref_cos, cand_cos, threshold, seed)
    # Recalibrate only when it helps on pairs it was not fitted on; else keep the threshold
    # (its agreement involves no fitting, so it needs no cross-fitting either).
    keep = held_out <= before
    t_new, deployed = (threshold, before) if keep else (t_fit, held_out)
    passed = None if min_agreement is None else bool(deployed >= min_agreement)

    def deployed_agreement(i: np.ndarray) -> float:
        # Copies of a pair in a resample stay in one fold (groups=i): never scored by a fit that
        # saw them. A kept threshold involves no fit: its plain agreement.
        if keep:
            return agreement(ref_cos[i], cand_cos[i], threshold, threshold)
        return crossfit_agreement(ref_cos[i], cand_cos[i], threshold, seed, i)

    where = f"{n} pairs" + (f" from {source}" if source else "")
    metrics = [
        Metric(
            "similarity_mean",
            float(ref_cos.mean()),
            float(cand_cos.mean()),
            True,
            n=n,
            note="mean cosine over the pairs (the score shift)",
            **_ci(ci(lambda i: float((cand_cos[i] - ref_cos[i]).mean()), 0.0)),
        ),
        Metric(
            "decision_agreement",
            1.0,
            before,
            True,
            n=n,
            note=f"at threshold {threshold:g}, candidate as is ({where})",
            **_ci(ci(lambda i: agreement(ref_cos[i], cand_cos[i], threshold, threshold), 1.0)),
        ),
        Metric(
            "recalibrated_threshold",
            threshold,
            t_new,
            True,
            n=n,
            note=(
                f"kept: the fitted {t_fit:.4f} agrees no better out of sample"
                if keep
                else "candidate threshold that best preserves the reference's decisions"
            ),
            **_ci(
                ci(
                    lambda i: recalibrate_threshold(ref_cos[i], cand_cos[i], threshold)[0],
                    threshold,
                )
            ),
        ),
        Metric(
            "recalibrated_agreement",
            1.0,
            deployed,
            True,
            min_agreement,
            passed,
            n,
            note=f"at recalibrated_threshold, out of sample (2-fold cross-fit {held_out:.4f}; "
            f"in sample {in_sample:.4f})",
            **_ci(ci(deployed_agreement, 1.0)),
        ),
        Metric(
            "percentile_threshold",
            threshold,
            t_pct,
            True,
            n=n,
            note="alternative rule: the same share of pairs at or above the threshold",
            **_ci(
                ci(lambda i: percentile_threshold(ref_cos[i], cand_cos[i], threshold), threshold)
            ),
        ),
        Metric(
            "percentile_agreement",
            1.0,
            agreement(ref_cos, cand_cos, threshold, t_pct),
            True,
            n=n,
            note="agreement at percentile_threshold (in sample)",
            **_ci(
                ci(
                    lambda i: agreement(
                        ref_cos[i],
                        cand_cos[i],
                        threshold,
                        percentile_threshold(ref_cos[i], cand_cos[i], threshold),
                    ),
                    1.0,
                )
            ),
        ),
    ]
    if labels is not None:
        y = np.asarray(labels, dtype=bool)
        ref_acc = float(((ref_cos >= threshold) == y).mean())
        cand_acc = float(((cand_cos >= t_new) == y).mean())
        metrics.append(
            Metric(
                "label_accuracy",
                ref_acc,
                cand_acc,
                True,
                n=n,
                note=f"labelled pairs: reference at {threshold:g}, candidate at {t_new:.4f}",
                **_ci(
                    ci(
                        lambda i: (
                            float(((cand_cos[i] >= t_new) == y[i]).mean())
                            - float(((ref_cos[i] >= threshold) == y[i]).mean())
                            + ref_acc
                        ),
                        ref_acc,
                    )
                ),
            )
        )
    notes = [
        f"similarity over {where}: reference {_summary(ref_cos)}; candidate {_summary(cand_cos)}",
        f"threshold {threshold:g} -> {t_new:.4f} (recalibrated) or {t_pct:.4f} (percentile): "
        f"agreement {before:.2%} as is, {held_out:.2%} recalibrated (out of sample)"
        + ("; the threshold is kept" if keep else ""),
    ]
    return metrics, notes


def _ci(t: tuple[float, float, bool | None]) -> dict:
    return {"ci_low": t[0], "ci_high": t[1], "noise": t[2]}


def _summary(x: np.ndarray) -> str:
    p5, p50, p95 = np.percentile(x, [5, 50, 95])
    return f"mean {x.mean():.4f}, p5 {p5:.4f}, median {p50:.4f}, p95 {p95:.4f}"
