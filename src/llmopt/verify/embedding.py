"""Verification of embedding candidates: do they embed sentences as the reference does?

Two kinds of evidence, one gated and one reported:

- cosine between each sentence's candidate and reference embedding (mean gated, 1st percentile
  and minimum reported): the direct "same function?" check, with no labels needed;
- Spearman correlation with human word-similarity judgements (WordSim353): a task score,
  reported next to the reference's so a drop shows up in the report's row.

The reference candidate's embeddings are computed once with `reference_outputs` and stored by
the caller (as .npy); every other candidate is compared against them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np

from llmopt.engines.base import EmbeddingRunner
from llmopt.schema import Metric, VerifyResult

__all__ = ["reference_outputs", "verify_embedding", "word_similarity_spearman"]

log = logging.getLogger(__name__)

# Below this many sentences the 1st percentile rests on fewer than 10 samples.
_FEW_SENTENCES = 1000


def reference_outputs(
    runner: EmbeddingRunner, sentences: Sequence[str], batch_size: int = 32
) -> np.ndarray:
    """Embed `sentences` with the reference runner; the caller stores the result (.npy).

    Args:
        runner: the reference candidate's runner.
        sentences: the verification sentences, in the order every candidate will see them.
        batch_size: sentences per batch.

    Returns:
        (N, D) float32.

    >>> ref = reference_outputs(runner, ["a sentence"])  # doctest: +SKIP
    >>> np.save(run_dir / "reference_embeddings.npy", ref)  # doctest: +SKIP
    """
    return np.asarray(runner.embed(list(sentences), batch_size=batch_size), dtype=np.float32)


def word_similarity_spearman(
    runner: EmbeddingRunner, word_pairs: Sequence[tuple[str, str, float]], batch_size: int = 32
) -> float:
    """Spearman rank correlation of cosine(emb(w1), emb(w2)) with the human scores.

    Args:
        runner: any embedding runner.
        word_pairs: (word1, word2, human score) triples, e.g. `llmopt.assets.text.wordsim353()`.
        batch_size: words per batch.

    >>> word_similarity_spearman(runner, [("cat", "tiger", 7.35), ("cup", "food", 5.0)])  # doctest: +SKIP
    1.0
    """
    from scipy.stats import spearmanr

    words = sorted({w for a, b, _ in word_pairs for w in (a, b)})
    emb = _unit(runner.embed(words, batch_size=batch_size))  # (W, D), each word embedded once
    index = {w: i for i, w in enumerate(words)}
    a = emb[[index[p[0]] for p in word_pairs]]
    b = emb[[index[p[1]] for p in word_pairs]]
    cos = (a * b).sum(1)
    return float(spearmanr(cos, [float(p[2]) for p in word_pairs]).statistic)


def verify_embedding(
    candidate_id: str,
    runner: EmbeddingRunner,
    sentences: Sequence[str],
    reference_embeddings: np.ndarray | None,
    word_pairs: Sequence[tuple[str, str, float]],
    reference_spearman: float | None,
    min_mean_cosine: float = 0.99,
    batch_size: int = 32,
) -> VerifyResult:
    """Compare a candidate's embeddings with the reference's and score word similarity.

    Args:
        candidate_id: the candidate's id (for the result).
        runner: the candidate's runner.
        sentences: the same sentences `reference_embeddings` was computed on, same order.
        reference_embeddings: (N, D) reference embeddings, or None when this candidate IS the
            reference (its cosine metrics are then 1.0 by definition, noted "reference").
        word_pairs: (word1, word2, human score) triples (WordSim353); empty to skip the metric.
        reference_spearman: the reference's word-similarity Spearman (None for the reference).
        min_mean_cosine: the gate on the mean cosine to the reference.
        batch_size: sentences per batch.

    Returns:
        A VerifyResult with metrics cosine_mean (gated), cosine_p1, cosine_min and
        wordsim353_spearman (reported); quality_drop = 1 - cosine_mean.

    >>> ref = reference_outputs(torch_runner, sentences)  # doctest: +SKIP
    >>> r = verify_embedding("ort-int8", ort_runner, sentences, ref, pairs, 0.82)  # doctest: +SKIP
    >>> r.passed, r.metric("cosine_mean").candidate  # doctest: +SKIP
    (True, 0.9931)
    """
    t0 = time.perf_counter()
    sentences = list(sentences)
    n = len(sentences)
    notes: list[str] = []
    if reference_embeddings is None:
        # The reference against itself: 1.0 by definition, no need to embed the sentences.
        cos_mean = cos_p1 = cos_min = 1.0
        note = "reference"
    else:
        assert reference_embeddings.shape[0] == n, (
            f"{reference_embeddings.shape[0]} reference embeddings for {n} sentences"
        )
        cand = runner.embed(sentences, batch_size=batch_size)
        assert cand.shape == reference_embeddings.shape, (
            f"candidate embeddings {cand.shape} vs reference {reference_embeddings.shape}"
        )
        cos = (_unit(cand) * _unit(reference_embeddings)).sum(1)  # (N,)
        cos_mean = float(cos.mean())
        cos_p1 = float(np.percentile(cos, 1))
        cos_min = float(cos.min())
        note = ""
        if not np.isfinite(cand).all():
            notes.append("candidate produced non-finite embeddings")
            cos_mean = cos_p1 = cos_min = float("nan")
    # NaN compares False, so a candidate with NaN embeddings fails the gate.
    mean_ok = bool(cos_mean >= min_mean_cosine)
    metrics = [
        Metric("cosine_mean", 1.0, cos_mean, True, min_mean_cosine, mean_ok, n, "", note),
        Metric("cosine_p1", 1.0, cos_p1, True, None, None, n, "", note or "1st percentile"),
        Metric("cosine_min", 1.0, cos_min, True, None, None, n, "", note),
    ]
    if word_pairs:
        rho = word_similarity_spearman(runner, word_pairs, batch_size=batch_size)
        if reference_spearman is None and reference_embeddings is None:
            reference_spearman = rho  # this candidate is the reference
        metrics.append(
            Metric("wordsim353_spearman", reference_spearman, rho, True, n=len(word_pairs))
        )
    else:
        notes.append("no word pairs given: wordsim353_spearman skipped")
    if n < _FEW_SENTENCES:
        notes.append(f"only {n} sentences (< {_FEW_SENTENCES}): cosine_p1 and cosine_min are noisy")
    passed = all(m.passed for m in metrics if m.passed is not None)
    result = VerifyResult(
        candidate_id=candidate_id,
        task="embedding",
        metrics=metrics,
        passed=passed,
        quality_drop=1.0 - cos_mean,
        seconds=time.perf_counter() - t0,
        notes=notes,
    )
    log.info("verified %s: cosine_mean=%.5f passed=%s", candidate_id, cos_mean, passed)
    return result


def _unit(x: np.ndarray) -> np.ndarray:
    # Normalize here too: a model configured without normalization still gets a true cosine.
    x = np.asarray(x, dtype=np.float64)
    return x / np.clip(np.linalg.norm(x, axis=1, keepdims=True), 1e-12, None)
