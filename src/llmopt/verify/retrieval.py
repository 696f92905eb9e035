"""Embedding task metrics built from the held-out text: retrieval recall@k and threshold recalibration.

Retrieval: each query is a fragment of a sentence (its last words) and its passage is the whole
sentence, among all verification sentences; recall@k is the share of queries whose passage ranks in
the top k. It needs no labelled data and reacts to exactly the defect users notice in search.

Recalibration: deployments compare cosine against a decision threshold (duplicate, relevant). A
candidate whose cosines shift uniformly keeps its ranking but flips decisions at the old threshold;
`recalibrate_threshold` finds the candidate threshold that best preserves the reference's decisions
and reports the agreement before and after.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = [
    "retrieval_queries",
    "recall_at_k",
    "sentence_pairs",
    "recalibrate_threshold",
    "percentile_threshold",
    "agreement",
]


def retrieval_queries(sentences: Sequence[str], count: int = 300) -> tuple[list[str], np.ndarray]:
    """Queries (the last half of a sentence's words) and the index of each one's passage.

    >>> retrieval_queries(["one two three four five six"], 5)
    (['four five six'], array([0]))
    """
    queries, index = [], []
    for i, s in enumerate(sentences):
        words = s.split()
        if len(words) >= 6:
            queries.append(" ".join(words[len(words) // 2 :]))
            index.append(i)
        if len(queries) == count:
            break
    return queries, np.array(index, dtype=np.int64)


def recall_at_k(
    query_emb: np.ndarray, passage_emb: np.ndarray, target: np.ndarray, k: int = 10
) -> np.ndarray:
    """Per-query hit (1.0 / 0.0): is the target passage among the top-k by cosine?

    >>> p = np.eye(3); q = np.array([[1.0, 0.1, 0.0]])
    >>> recall_at_k(q, p, np.array([0]), k=1)
    array([1.])
    """
    q = _unit(query_emb)
    p = _unit(passage_emb)
    scores = q @ p.T  # (Q, P)
    target_score = scores[np.arange(len(target)), target]
    rank = (scores > target_score[:, None]).sum(1)  # passages strictly better than the target
    return (rank < k).astype(np.float64)


def sentence_pairs(n: int, seed: int = 0) -> np.ndarray:
    """(2n-1, 2) index pairs: neighbours (often related) and random pairs (mostly unrelated).

    >>> sentence_pairs(3).shape
    (5, 2)
    """
    rng = np.random.default_rng(seed)
    adjacent = np.stack([np.arange(n - 1), np.arange(1, n)], 1)
    random = np.stack([np.arange(n), rng.permutation(n)], 1)
    return np.concatenate([adjacent, random])


def recalibrate_threshold(
    reference_cos: np.ndarray, candidate_cos: np.ndarray, threshold: float
) -> tuple[float, float, float]:
    """The candidate threshold that best reproduces `reference_cos >= threshold`.

    Every cut between two distinct candidate cosines is tried (a decision only changes there),
    in O(P log P): sorted once, the agreement at each cut is a prefix count. The threshold is
    placed midway between the two cosines around the cut (the widest margin, so it carries over
    to pairs it was not fitted on); ties between equally good cuts go to the one nearest the
    old threshold.

    Args:
        reference_cos: (P,) reference cosine of each pair.
        candidate_cos: (P,) candidate cosine of the same pairs.
        threshold: the reference's decision threshold.

    Returns:
        (candidate threshold, agreement at the old threshold, agreement at the new one).

    >>> recalibrate_threshold(np.array([0.2, 0.6, 0.9]), np.array([0.1, 0.45, 0.8]), 0.5)
    (0.275, 0.6666666666666666, 1.0)
    """
    reference_cos = np.asarray(reference_cos, dtype=np.float64)
    candidate_cos = np.asarray(candidate_cos, dtype=np.float64)
    decide = reference_cos >= threshold
    before = float(((candidate_cos >= threshold) == decide).mean())
    order = np.argsort(candidate_cos, kind="stable")
    c, d = candidate_cos[order], decide[order]
    n = len(c)
    # Cut j: the pairs at sorted positions >= j say "yes" (threshold c[j]; j = n: all "no").
    pos_before = np.concatenate([[0], np.cumsum(d)])  # "yes" pairs below cut j
    neg_before = np.arange(n + 1) - pos_before
    agree = (d.sum() - pos_before + neg_before) / n
    cuts = np.concatenate([c[:1], (c[:-1] + c[1:]) / 2, [c[-1] + 1e-6]])
    valid = np.concatenate([[True], c[1:] > c[:-1], [True]])  # a cut inside a tie is not real
    score = np.where(valid, agree - 1e-9 * np.abs(cuts - threshold), -np.inf)
    best = int(np.argmax(score))
    return float(cuts[best]), before, float(agree[best])


def percentile_threshold(
    reference_cos: np.ndarray, candidate_cos: np.ndarray, threshold: float
) -> float:
    """The candidate threshold at the same percentile as `threshold` in the reference's scores.

    The alternative rule to `recalibrate_threshold`: it needs no per-pair alignment, only the
    two distributions, so the same share of pairs passes before and after.

    >>> percentile_threshold(np.array([0.1, 0.2, 0.6, 0.9]), np.array([0.0, 0.1, 0.5, 0.8]), 0.5)
    0.5
    """
    below = float((np.asarray(reference_cos) < threshold).mean())
    if below <= 0.0:
        return float(np.min(candidate_cos))
    if below >= 1.0:
        return float(np.max(candidate_cos)) + 1e-6
    return float(np.quantile(np.asarray(candidate_cos, dtype=np.float64), below, method="higher"))


def agreement(reference_cos, candidate_cos, ref_threshold: float, cand_threshold: float) -> float:
    """Share of pairs decided alike: reference at `ref_threshold`, candidate at `cand_threshold`.

    >>> agreement(np.array([0.2, 0.7]), np.array([0.3, 0.6]), 0.5, 0.65)
    0.5
    """
    ref = np.asarray(reference_cos) >= ref_threshold
    return float((ref == (np.asarray(candidate_cos) >= cand_threshold)).mean())


def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / np.clip(np.linalg.norm(x, axis=1, keepdims=True), 1e-12, None)
