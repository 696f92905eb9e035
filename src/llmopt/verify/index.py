"""A real vector index over the candidate's embeddings: same neighbours as the reference's?

A retrieval service keeps its corpus in a FAISS index in host memory and answers each query with
the index's top k. `index_metrics` builds that index from the reference's embeddings and from the
candidate's, queries both, and scores the candidate's neighbours against the reference's exact
ones:

- `index_recall@k`: share of the reference's exact top k that the candidate's exact (flat) index
  returns; gated by `Gates.min_index_recall`;
- `index_ndcg@k`: the same with rank mattering (graded relevance k - reference rank);
- `hnsw_recall@k`: an approximate index (HNSW, the usual in-memory choice) over the candidate's
  vectors against that candidate's own exact neighbours: what the approximation costs by itself.

Build and query throughput of both index types are reported in the notes (wall-clock on this
machine's load; they are not gates). Vectors are L2-normalized and searched by inner product,
i.e. cosine, as retrieval services configure FAISS for normalized embedders.
"""

from __future__ import annotations

import time

import numpy as np

from llmopt.core.errors import EngineUnavailableError
from llmopt.core.schema import Metric
from llmopt.verify.stats import DEFAULT_RESAMPLES, DEFAULT_SEED, bootstrap_ci, is_noise

__all__ = ["faiss_available", "index_metrics", "exact_neighbours", "ndcg_at_k", "overlap_at_k"]

FAISS_INSTALL = "pip install faiss-cpu  (or: pip install 'llmopt[faiss]')"
HNSW_M, HNSW_EF_CONSTRUCTION, HNSW_EF_SEARCH = 32, 80, 64


def faiss_available() -> bool:
    """Whether faiss-cpu is importable."""
    try:
        import faiss  # noqa: F401
    except ImportError:
        return False
    return True


def _faiss():
    try:
        import faiss
    except ImportError as e:
        raise EngineUnavailableError(
            "the vector-index check needs faiss-cpu, which is not installed",
            hint=FAISS_INSTALL,
        ) from e
    return faiss


def _unit32(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return np.ascontiguousarray(x / np.clip(np.linalg.norm(x, axis=1, keepdims=True), 1e-12, None))


def exact_neighbours(
    corpus: np.ndarray, queries: np.ndarray, k: int, exclude_self: bool = False
) -> tuple[np.ndarray, float, float]:
    """Top-k corpus ids of each query by cosine, through a FAISS flat (exact) index.

    Args:
        corpus: (N, D) embeddings; queries: (Q, D).
        k: neighbours per query.
        exclude_self: the queries are the corpus itself (query i is corpus row i): drop it.

    Returns:
        ((Q, k) ids, build seconds, search seconds).

    >>> ids, _, _ = exact_neighbours(np.eye(3), np.array([[1.0, 0.2, 0.0]]), 2)
    >>> ids.tolist()
    [[0, 1]]
    """
    faiss = _faiss()
    c, q = _unit32(corpus), _unit32(queries)
    t0 = time.perf_counter()
    index = faiss.IndexFlatIP(c.shape[1])
    index.add(c)
    t1 = time.perf_counter()
    _, ids = index.search(q, k + 1 if exclude_self else k)
    t2 = time.perf_counter()
    return _drop_self(ids, k) if exclude_self else ids, t1 - t0, t2 - t1


def _hnsw_neighbours(corpus, queries, k, exclude_self, seed):
    faiss = _faiss()
    c, q = _unit32(corpus), _unit32(queries)
    faiss.omp_set_num_threads(1)  # deterministic graph: one insertion order
    t0 = time.perf_counter()
    index = faiss.IndexHNSWFlat(c.shape[1], HNSW_M, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
    index.hnsw.efSearch = HNSW_EF_SEARCH
    index.add(c)
    t1 = time.perf_counter()
    _, ids = index.search(q, k + 1 if exclude_self else k)
    t2 = time.perf_counter()
    return (_drop_self(ids, k) if exclude_self else ids), t1 - t0, t2 - t1


def _drop_self(ids: np.ndarray, k: int) -> np.ndarray:
    out = np.empty((len(ids), k), dtype=np.int64)
    for i, row in enumerate(ids):
        row = row[row != i]
        out[i] = row[:k]
    return out


def overlap_at_k(found: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """Per query: share of `truth`'s ids (Q, k) among `found`'s (Q, k).

    >>> overlap_at_k(np.array([[1, 2]]), np.array([[2, 3]])).tolist()
    [0.5]
    """
    k = truth.shape[1]
    return np.array([len(set(f) & set(t)) / k for f, t in zip(found, truth, strict=True)])


def ndcg_at_k(found: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """Per query nDCG@k of `found` with graded relevance k - rank in `truth` (0 outside).

    >>> ndcg_at_k(np.array([[5, 7]]), np.array([[5, 7]])).tolist()
    [1.0]
    >>> round(float(ndcg_at_k(np.array([[7, 5]]), np.array([[5, 7]]))[0]), 4)
    0.8597
    """
    k = truth.shape[1]
    discount = 1.0 / np.log2(np.arange(2, k + 2))
    ideal = float(((k - np.arange(k)) * discount).sum())
    out = np.empty(len(truth))
    for i, (f, t) in enumerate(zip(found, truth, strict=True)):
        rel = {int(d): k - r for r, d in enumerate(t)}
        out[i] = sum(rel.get(int(d), 0) * discount[r] for r, d in enumerate(f)) / ideal
    return out


def index_metrics(
    ref_corpus: np.ndarray,
    ref_queries: np.ndarray | None,
    cand_corpus: np.ndarray,
    cand_queries: np.ndarray | None,
    k: int = 10,
    *,
    min_recall: float | None = None,
    source: str = "",
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
) -> tuple[list[Metric], list[str]]:
    """Index recall@k / nDCG@k of the candidate against the reference, and HNSW's own recall.

    Args:
        ref_corpus, cand_corpus: (N, D) corpus embeddings by each model (same texts, same order).
        ref_queries, cand_queries: (Q, D) query embeddings; None: every corpus text is a query
            and its own row is left out of its neighbours.
        k: neighbours per query (k < N).
        min_recall: gate on `index_recall@k` (None: reported only).
        source: where the corpus came from (for the notes).
        resamples, seed: bootstrap settings (over queries).

    Raises:
        EngineUnavailableError: faiss-cpu is not installed (its install command in the hint).
    """
    self_query = ref_queries is None
    rq = ref_corpus if self_query else ref_queries
    cq = cand_corpus if self_query else cand_queries
    assert ref_corpus.shape[0] == cand_corpus.shape[0], "both models embed the same corpus"
    k = min(k, ref_corpus.shape[0] - (2 if self_query else 1))
    truth, _, _ = exact_neighbours(ref_corpus, rq, k, self_query)
    exact, build_s, search_s = exact_neighbours(cand_corpus, cq, k, self_query)
    approx, hbuild_s, hsearch_s = _hnsw_neighbours(cand_corpus, cq, k, self_query, seed)
    rec, nd, hn = overlap_at_k(exact, truth), ndcg_at_k(exact, truth), overlap_at_k(approx, exact)
    nq = len(rec)

    def delta_ci(x):
        lo, hi = bootstrap_ci(lambda i: float(x[i].mean()), nq, resamples, seed=seed)
        d = (lo - 1.0, hi - 1.0)
        return {"ci_low": d[0], "ci_high": d[1], "noise": is_noise(d)}

    value = float(rec.mean())
    n_corpus = ref_corpus.shape[0]
    what = f"{nq} queries over {n_corpus} corpus texts" + (f" ({source})" if source else "")
    metrics = [
        Metric(
            f"index_recall@{k}",
            1.0,
            value,
            True,
            min_recall,
            None if min_recall is None else bool(value >= min_recall),
            nq,
            note=f"FAISS flat index: the reference's exact top {k} found by the candidate; {what}",
            **delta_ci(rec),
        ),
        Metric(
            f"index_ndcg@{k}",
            1.0,
            float(nd.mean()),
            True,
            n=nq,
            note="graded relevance: k - the reference's rank",
            **delta_ci(nd),
        ),
        Metric(
            f"hnsw_recall@{k}",
            1.0,
            float(hn.mean()),
            True,
            n=nq,
            note=f"HNSW (M={HNSW_M}, efSearch={HNSW_EF_SEARCH}) vs the candidate's exact index",
            **delta_ci(hn),
        ),
    ]
    notes = [
        f"index over {n_corpus} vectors: flat build {build_s * 1e3:.1f} ms, "
        f"{nq / max(search_s, 1e-9):.0f} queries/s; HNSW build {hbuild_s * 1e3:.1f} ms, "
        f"{nq / max(hsearch_s, 1e-9):.0f} queries/s (one process, this machine's load)"
    ]
    return metrics, notes
