"""Honest statistics for verification: paired bootstrap intervals with a fixed seed.

Every comparison metric is a statistic over samples (token windows, sentences, word pairs) that the
reference and the candidate both saw. Resampling those samples *together* (paired bootstrap) gives
an interval for the delta; when it contains 0 the delta is labelled noise: a different sample of
text could have flipped its sign, so it says nothing about the candidate.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["DEFAULT_SEED", "DEFAULT_RESAMPLES", "paired_bootstrap", "bootstrap_ci", "is_noise"]

DEFAULT_SEED = 0
DEFAULT_RESAMPLES = 1000


def bootstrap_ci(
    stat: Callable[[np.ndarray], float],
    n: int,
    resamples: int = DEFAULT_RESAMPLES,
    level: float = 0.95,
    seed: int = DEFAULT_SEED,
) -> tuple[float, float]:
    """Percentile bootstrap interval of `stat(indices)` over `n` samples.

    Args:
        stat: maps an index array (resampled with replacement) to the statistic.
        n: number of samples.
        resamples: bootstrap resamples.
        level: coverage of the interval.
        seed: fixed so the same inputs give the same interval on every run.

    >>> x = np.arange(10.0)
    >>> lo, hi = bootstrap_ci(lambda i: float(x[i].mean()), 10)
    >>> lo < 4.5 < hi
    True
    """
    assert n > 0, "bootstrap needs at least one sample"
    rng = np.random.default_rng(seed)
    values = np.array([stat(rng.integers(0, n, n)) for _ in range(resamples)], dtype=np.float64)
    values = values[np.isfinite(values)]
    if values.size == 0:
        return float("nan"), float("nan")
    tail = (1.0 - level) / 2 * 100
    lo, hi = np.percentile(values, [tail, 100 - tail])
    return float(lo), float(hi)


def paired_bootstrap(
    reference: np.ndarray,
    candidate: np.ndarray,
    stat: Callable[[np.ndarray], float] | None = None,
    resamples: int = DEFAULT_RESAMPLES,
    level: float = 0.95,
    seed: int = DEFAULT_SEED,
) -> tuple[float, float]:
    """Interval of stat(candidate) - stat(reference), resampling the paired samples together.

    Args:
        reference: (N, ...) per-sample values of the reference.
        candidate: (N, ...) per-sample values of the candidate, same samples, same order.
        stat: maps an (M, ...) array to a number; the mean by default.
        resamples, level, seed: as in `bootstrap_ci`.

    >>> r = np.ones(50); c = np.ones(50) + 0.001 * np.arange(50)
    >>> lo, hi = paired_bootstrap(r, c)
    >>> 0 < lo < hi
    True
    """
    reference, candidate = np.asarray(reference), np.asarray(candidate)
    assert len(reference) == len(candidate), "paired samples must have the same length"
    f = stat or (lambda a: float(np.mean(a)))
    return bootstrap_ci(
        lambda i: f(candidate[i]) - f(reference[i]), len(reference), resamples, level, seed
    )


def is_noise(ci: tuple[float, float]) -> bool | None:
    """True when the interval of a delta contains 0 (the delta is within sampling noise).

    >>> is_noise((-0.1, 0.2)), is_noise((0.05, 0.2))
    (True, False)
    """
    lo, hi = ci
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return None
    return bool(lo <= 0.0 <= hi)
