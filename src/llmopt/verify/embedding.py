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
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from llmopt.core.schema import Metric, VerifyResult
from llmopt.engines.base import EmbeddingRunner
from llmopt.verify.gates import Gates
from llmopt.verify.index import FAISS_INSTALL, faiss_available, index_metrics
from llmopt.verify.pairs import PairSet, load_pairs, load_texts
from llmopt.verify.retrieval import recall_at_k, retrieval_queries, sentence_pairs
from llmopt.verify.stats import DEFAULT_RESAMPLES, DEFAULT_SEED, bootstrap_ci, is_noise
from llmopt.verify.threshold import threshold_metrics

__all__ = [
    "RetrievalSpec",
    "reference_outputs",
    "reference_side",
    "verify_embedding",
    "word_similarity_spearman",
]

log = logging.getLogger(__name__)

# Below this many sentences the 1st percentile rests on fewer than 10 samples.
_FEW_SENTENCES = 1000


@dataclass(frozen=True)
class RetrievalSpec:
    """What the deployment does with the embeddings: its threshold, its pairs, its data.

    Args:
        threshold: the application's similarity threshold (`--threshold`); None: 0.5, reported
            but not gated.
        pairs: the user's sentence pairs (`--pairs`); None: pairs of the held-out sentences.
        queries: the user's queries (`--queries`); None: each corpus text queries the others.
        corpus: the user's corpus (`--corpus`); None: the held-out Wikipedia sentences.
        k: neighbours per query of the index check.
        query_prompt, document_prompt: the model's instruction prefixes (`ModelInfo`), prepended
            to queries and to corpus texts as sentence-transformers does.
        index: run the FAISS index check (skipped with a note when faiss-cpu is missing).

    >>> RetrievalSpec(threshold=0.85).gated
    True
    """

    threshold: float | None = None
    pairs: PairSet | None = None
    queries: list[str] | None = None
    corpus: list[str] | None = None
    k: int = 10
    query_prompt: str | None = None
    document_prompt: str | None = None
    index: bool = True

    @classmethod
    def from_options(
        cls,
        pairs: str | Path | None = None,
        threshold: float | None = None,
        queries: str | Path | None = None,
        corpus: str | Path | None = None,
        top_k: int = 10,
    ) -> RetrievalSpec:
        """Read the files of `--pairs`, `--queries`, `--corpus` (see `llmopt.verify.pairs`).

        Raises:
            PairsFileError: an unreadable file; ValueError: a threshold outside [-1, 1] or
                top_k < 1.

        >>> RetrievalSpec.from_options(threshold=0.85).threshold
        0.85
        """
        if threshold is not None and not -1.0 <= threshold <= 1.0:
            raise ValueError(f"threshold {threshold} is not a cosine similarity in [-1, 1]")
        if top_k < 1:
            raise ValueError(f"top_k {top_k} must be at least 1")
        return cls(
            threshold=threshold,
            pairs=None if pairs is None else load_pairs(pairs),
            queries=None if queries is None else load_texts(queries),
            corpus=None if corpus is None else load_texts(corpus),
            k=top_k,
        )

    def with_prompts(self, info) -> RetrievalSpec:
        """This spec with the instruction prompts of the model `info` describes (`ModelInfo`)."""
        return replace(
            self,
            query_prompt=getattr(info, "query_prompt", None),
            document_prompt=getattr(info, "document_prompt", None),
        )

    @property
    def gated(self) -> bool:
        """The user gave a threshold or pairs: decision agreement is gated."""
        return self.threshold is not None or self.pairs is not None

    def query_texts(self) -> list[str] | None:
        if self.queries is None:
            return None
        return [(self.query_prompt or "") + q for q in self.queries]

    def corpus_texts(self) -> list[str] | None:
        if self.corpus is None:
            return None
        return [(self.document_prompt or "") + c for c in self.corpus]


def reference_side(
    runner: EmbeddingRunner, spec: RetrievalSpec, batch_size: int = 32
) -> dict[str, np.ndarray]:
    """The reference's embeddings of the user's data (pairs' texts, queries, corpus).

    Computed once with the reference runner and passed to `verify_embedding` for every
    candidate (the optimize worker stores them as .npy next to the reference's embeddings).

    >>> side = reference_side(ref_runner, RetrievalSpec(pairs=load_pairs("p.jsonl")))  # doctest: +SKIP
    """
    out: dict[str, np.ndarray] = {}
    for name, texts in (
        ("pair_texts", spec.pairs.texts() if spec.pairs is not None else None),
        ("queries", spec.query_texts()),
        ("corpus", spec.corpus_texts()),
    ):
        if texts is not None:
            out[name] = np.asarray(runner.embed(texts, batch_size=batch_size), dtype=np.float32)
    return out


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
    *,
    gates: Gates | None = None,
    simlex_pairs: Sequence[tuple[str, str, float]] = (),
    reference_scores: dict[str, float] | None = None,
    retrieval_k: int = 10,
    decision_threshold: float | None = 0.5,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
    retrieval: RetrievalSpec | None = None,
    reference_retrieval: dict[str, np.ndarray] | None = None,
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
        gates: the other gates (minimum cosine, recall drop); None gates the mean cosine only.
        simlex_pairs: SimLex-999 triples (`llmopt.assets.text.simlex999()`); empty to skip.
        reference_scores: the reference's own values of the task metrics by name
            (wordsim353_spearman, simlex999_spearman, retrieval_recall@k), read from its
            verify.json; missing ones are reported with reference None.
        retrieval_k: k of retrieval recall@k.
        decision_threshold: a reference similarity threshold to recalibrate; None to skip.
        resamples, seed: bootstrap settings (over sentences).
        retrieval: the user's threshold, pairs, queries and corpus (`RetrievalSpec`); None: the
            built-in sentences and threshold 0.5 (reported, not gated).
        reference_retrieval: the reference's `reference_side` of `retrieval`; None for the
            reference itself (it is computed here).

    Returns:
        A VerifyResult with metrics cosine_mean (gated), cosine_p1, cosine_min (gated by
        `gates.min_cosine`), retrieval_recall@k (gated by `gates.max_recall_drop` when the
        reference's value is known), wordsim353/simlex999 Spearman and the threshold
        recalibration (reported); quality_drop = 1 - cosine_mean.

    >>> ref = reference_outputs(torch_runner, sentences)  # doctest: +SKIP
    >>> r = verify_embedding("ort-int8", ort_runner, sentences, ref, pairs, 0.82)  # doctest: +SKIP
    >>> r.passed, r.metric("cosine_mean").candidate  # doctest: +SKIP
    (True, 0.9931)
    """
    # No gates given (the optimize worker today): only the mean cosine is gated, as before.
    gates = gates or Gates(
        min_cosine=None, max_recall_drop=None, min_decision_agreement=None, min_index_recall=None
    )
    reference_scores = dict(reference_scores or {})
    is_reference = reference_embeddings is None
    t0 = time.perf_counter()
    sentences = list(sentences)
    n = len(sentences)
    notes: list[str] = []
    cand = np.asarray(runner.embed(sentences, batch_size=batch_size), dtype=np.float32)
    if is_reference:
        # The reference against itself: 1.0 by definition.
        cos = np.ones(n)
        note = "reference"
    else:
        assert reference_embeddings.shape[0] == n, (
            f"{reference_embeddings.shape[0]} reference embeddings for {n} sentences"
        )
        assert cand.shape == reference_embeddings.shape, (
            f"candidate embeddings {cand.shape} vs reference {reference_embeddings.shape}"
        )
        cos = (_unit(cand) * _unit(reference_embeddings)).sum(1)  # (N,)
        note = ""
        if not np.isfinite(cand).all():
            notes.append("candidate produced non-finite embeddings")
            cos = np.full(n, np.nan)
    cos_mean, cos_p1, cos_min = float(cos.mean()), float(np.percentile(cos, 1)), float(cos.min())
    ci = (None, None)
    if not is_reference and np.isfinite(cos).all():
        lo, hi = bootstrap_ci(lambda i: float(cos[i].mean()), n, resamples, seed=seed)
        ci = (lo - 1.0, hi - 1.0)
    noise = None if ci[0] is None else is_noise(ci)
    # NaN compares False, so a candidate with NaN embeddings fails the gates.
    min_ok = None if gates.min_cosine is None else bool(cos_min >= gates.min_cosine)
    metrics = [
        Metric(
            "cosine_mean",
            1.0,
            cos_mean,
            True,
            min_mean_cosine,
            bool(cos_mean >= min_mean_cosine),
            n,
            "",
            note,
            ci[0],
            ci[1],
            noise,
        ),
        Metric("cosine_p1", 1.0, cos_p1, True, None, None, n, "", note or "1st percentile"),
        Metric("cosine_min", 1.0, cos_min, True, gates.min_cosine, min_ok, n, "", note),
    ]
    if len(retrieval_queries(sentences)[0]) >= 10:
        metrics.append(
            _retrieval(
                runner,
                sentences,
                cand,
                retrieval_k,
                reference_scores,
                is_reference,
                gates,
                batch_size,
                resamples,
                seed,
            )
        )
    else:
        notes.append("fewer than 10 sentences of 6+ words: retrieval recall skipped")
    spec = retrieval or RetrievalSpec(threshold=None)
    if is_reference:
        ref_side = reference_side(runner, spec, batch_size)
        cand_side = ref_side
        ref_emb = cand
    else:
        ref_side = dict(reference_retrieval or {})
        cand_side = reference_side(runner, spec, batch_size)
        ref_emb = reference_embeddings
    finite = bool(np.isfinite(cos).all()) and all(np.isfinite(v).all() for v in cand_side.values())
    threshold = spec.threshold if spec.threshold is not None else decision_threshold
    if threshold is not None and finite and (spec.gated or not is_reference):
        m, extra = _threshold(spec, threshold, cand, ref_emb, cand_side, ref_side, gates, seed)
        metrics += m
        notes += extra
        if spec.gated:
            resamples_note = f"{resamples} bootstrap resamples"
            notes.append(f"decision threshold {threshold:g} from the user; CIs: {resamples_note}")
    if spec.index and finite:
        if faiss_available():
            m, extra = _index(spec, cand, ref_emb, cand_side, ref_side, gates, resamples, seed)
            metrics += m
            notes += extra
        else:
            notes.append(f"faiss-cpu not installed: vector-index check skipped ({FAISS_INSTALL})")
    for name, pairs in (("wordsim353_spearman", word_pairs), ("simlex999_spearman", simlex_pairs)):
        if not pairs:
            notes.append(f"no word pairs given: {name} skipped")
            continue
        rho = word_similarity_spearman(runner, pairs, batch_size=batch_size)
        ref = rho if is_reference else reference_scores.get(name)
        if name == "wordsim353_spearman" and not is_reference and reference_spearman is not None:
            ref = reference_spearman
        metrics.append(Metric(name, ref, rho, True, n=len(pairs)))
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


def _retrieval(
    runner,
    sentences,
    passages,
    k,
    reference_scores,
    is_reference,
    gates,
    batch_size,
    resamples,
    seed,
) -> Metric:
    queries, target = retrieval_queries(sentences)
    hits = recall_at_k(runner.embed(queries, batch_size=batch_size), passages, target, k)
    name = f"retrieval_recall@{k}"
    value = float(hits.mean())
    ref = value if is_reference else reference_scores.get(name)
    lo, hi = bootstrap_ci(lambda i: float(hits[i].mean()), len(hits), resamples, seed=seed)
    threshold = passed = None
    note = f"{len(queries)} queries (last half of a sentence) over {len(sentences)} passages"
    if ref is not None and gates.max_recall_drop is not None:
        threshold = ref - gates.max_recall_drop
        passed = bool(value >= threshold)
    elif ref is None:
        note += "; reference value unknown (pass reference_scores), so not gated"
    d = (None, None) if ref is None or is_reference else (lo - ref, hi - ref)
    return Metric(
        name,
        ref,
        value,
        True,
        threshold,
        passed,
        len(hits),
        "",
        note,
        d[0],
        d[1],
        None if d[0] is None else is_noise(d),
    )


def _threshold(spec, threshold, cand, ref_emb, cand_side, ref_side, gates, seed):
    if spec.pairs is not None:
        texts = {t: i for i, t in enumerate(spec.pairs.texts())}
        a = [texts[t] for t in spec.pairs.first]
        b = [texts[t] for t in spec.pairs.second]
        rp, cp = ref_side["pair_texts"], cand_side["pair_texts"]
        rc = (_unit(rp[a]) * _unit(rp[b])).sum(1)
        cc = (_unit(cp[a]) * _unit(cp[b])).sum(1)
        labels, source = spec.pairs.labels, spec.pairs.source
    else:
        # No pairs given: neighbouring held-out sentences (often related) and random ones.
        pairs = sentence_pairs(min(len(cand), 1000), seed)
        rc = (_unit(ref_emb[pairs[:, 0]]) * _unit(ref_emb[pairs[:, 1]])).sum(1)
        cc = (_unit(cand[pairs[:, 0]]) * _unit(cand[pairs[:, 1]])).sum(1)
        labels, source = None, "held-out sentence pairs"
    min_agreement = gates.min_decision_agreement if spec.gated else None
    return threshold_metrics(
        rc, cc, threshold, labels=labels, min_agreement=min_agreement, source=source, seed=seed
    )


def _index(spec, cand, ref_emb, cand_side, ref_side, gates, resamples, seed):
    if spec.corpus is not None:
        rc, cc, source = ref_side["corpus"], cand_side["corpus"], "the user's corpus"
    else:
        rc, cc, source = ref_emb, cand, "held-out Wikipedia sentences"
    rq = ref_side.get("queries")
    cq = cand_side.get("queries")
    if rc.shape[0] <= spec.k + 1:
        return [], [f"corpus of {rc.shape[0]} texts is too small for an index check at k={spec.k}"]
    return index_metrics(
        rc,
        rq,
        cc,
        cq,
        spec.k,
        min_recall=gates.min_index_recall,
        source=source,
        resamples=resamples,
        seed=seed,
    )


def _unit(x: np.ndarray) -> np.ndarray:
    # Normalize here too: a model configured without normalization still gets a true cosine.
    x = np.asarray(x, dtype=np.float64)
    return x / np.clip(np.linalg.norm(x, axis=1, keepdims=True), 1e-12, None)
