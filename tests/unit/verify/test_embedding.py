"""Embedding verification gates and the word-similarity Spearman, with fake runners."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from llmopt.bench.embedding import bench_embedding
from llmopt.verify.embedding import (
    reference_outputs,
    verify_embedding,
    word_similarity_spearman,
)
from llmopt.verify.gates import Gates

SENTENCES = [f"sentence number {i} about topic {i % 7}" for i in range(50)]


class HashRunner:
    """Deterministic fake: each text maps to a fixed random unit vector, plus optional noise."""

    def __init__(self, noise: float = 0.0, dim: int = 16, nan: bool = False):
        self.noise, self.dim, self.nan = noise, dim, nan
        self.calls: list[int] = []

    def embed(self, texts, batch_size=32):
        self.calls.append(batch_size)
        rows = []
        for t in texts:
            v = np.random.default_rng(zlib.crc32(t.encode())).standard_normal(self.dim)
            if self.noise:
                v = v + self.noise * np.random.default_rng(
                    zlib.crc32(t.encode()) + 1
                ).standard_normal(self.dim)
            rows.append(v / np.linalg.norm(v))
        out = np.asarray(rows, dtype=np.float32)
        if self.nan:
            out[0, 0] = np.nan
        return out


class TableRunner:
    """Fake with hand-chosen 2-D word vectors, for a Spearman value checkable by hand."""

    VECS = {"a": [1, 0], "b": [1, 0], "c": [0, 1], "d": [-1, 0]}

    def embed(self, texts, batch_size=32):
        return np.asarray([self.VECS[t] for t in texts], dtype=np.float32)


def test_identical_runner_passes():
    ref = reference_outputs(HashRunner(), SENTENCES)
    r = verify_embedding("same", HashRunner(), SENTENCES, ref, [], None)
    assert r.passed
    assert r.metric("cosine_mean").candidate == pytest.approx(1.0, abs=1e-6)
    assert r.metric("cosine_mean").threshold == 0.99
    assert r.quality_drop == pytest.approx(0.0, abs=1e-6)
    assert r.task == "embedding" and r.candidate_id == "same" and r.seconds >= 0


def test_noisy_runner_fails_gate():
    ref = reference_outputs(HashRunner(), SENTENCES)
    r = verify_embedding("noisy", HashRunner(noise=0.3), SENTENCES, ref, [], None)
    mean = r.metric("cosine_mean")
    assert not r.passed and mean.passed is False
    assert 0.8 < mean.candidate < 0.99
    assert r.quality_drop == pytest.approx(1 - mean.candidate)
    assert r.metric("cosine_min").candidate <= r.metric("cosine_p1").candidate <= mean.candidate
    # Without gates only the mean is gated (the optimize worker's call); Gates() adds the minimum.
    assert r.metric("cosine_p1").passed is None and r.metric("cosine_min").passed is None
    g = verify_embedding("noisy", HashRunner(noise=0.3), SENTENCES, ref, [], None, gates=Gates())
    assert g.metric("cosine_min").threshold == 0.9
    # Random 16-d vectors with 30% noise keep few of their FAISS neighbours: the index gate
    # catches it even where the cosine gates are loosened.
    if "index_recall@10" in [m.name for m in g.metrics]:
        idx = g.metric("index_recall@10")
        assert idx.passed is False and idx.candidate < idx.threshold
    # Looser gates let the same candidate through.
    loose = Gates(min_cosine=0.5, min_index_recall=None)
    assert verify_embedding(
        "noisy", HashRunner(noise=0.3), SENTENCES, ref, [], None, 0.8, gates=loose
    ).passed


def test_nan_embeddings_fail():
    ref = reference_outputs(HashRunner(), SENTENCES)
    r = verify_embedding("nan", HashRunner(nan=True), SENTENCES, ref, [], None)
    assert not r.passed
    assert any("non-finite" in n for n in r.notes)


def test_reference_candidate():
    pairs = [("a", "b", 10.0), ("a", "c", 5.0), ("a", "d", 1.0)]
    r = verify_embedding("ref", TableRunner(), ["a", "b"], None, pairs, None)
    assert r.passed and r.quality_drop == 0.0
    for name in ("cosine_mean", "cosine_p1", "cosine_min"):
        assert r.metric(name).candidate == 1.0 and r.metric(name).note == "reference"
    rho = r.metric("wordsim353_spearman")
    assert rho.candidate == pytest.approx(1.0) and rho.reference == rho.candidate
    assert rho.n == 3 and rho.passed is None


def test_spearman_by_hand():
    # cos(a,b)=1, cos(a,c)=0, cos(a,d)=-1  -> cosine ranks 3, 2, 1.
    assert word_similarity_spearman(
        TableRunner(), [("a", "b", 9), ("a", "c", 5), ("a", "d", 1)]
    ) == pytest.approx(1.0)
    assert word_similarity_spearman(
        TableRunner(), [("a", "b", 1), ("a", "c", 5), ("a", "d", 9)]
    ) == pytest.approx(-1.0)
    # Human ranks 2, 3, 1: d = (1, -1, 0), rho = 1 - 6 * 2 / (3 * (9 - 1)) = 0.5.
    assert word_similarity_spearman(
        TableRunner(), [("a", "b", 5), ("a", "c", 9), ("a", "d", 1)]
    ) == pytest.approx(0.5)


def test_spearman_reported_against_reference():
    pairs = [("a", "b", 5.0), ("a", "c", 9.0), ("a", "d", 1.0)]
    ref = reference_outputs(TableRunner(), ["a", "c"])
    r = verify_embedding("cand", TableRunner(), ["a", "c"], ref, pairs, 0.8)
    m = r.metric("wordsim353_spearman")
    assert (
        m.reference == 0.8 and m.candidate == pytest.approx(0.5) and m.delta == pytest.approx(-0.3)
    )
    assert r.passed  # reported, not gated


def test_notes_for_few_sentences():
    ref = reference_outputs(HashRunner(), SENTENCES)
    r = verify_embedding("c", HashRunner(), SENTENCES, ref, [], None)
    assert any("only 50 sentences" in n for n in r.notes)
    assert any("wordsim353_spearman skipped" in n for n in r.notes)
    many = [f"s{i}" for i in range(1000)]
    r = verify_embedding("c", HashRunner(), many, reference_outputs(HashRunner(), many), [], None)
    assert not any("sentences" in n and "noisy" in n for n in r.notes)


def test_shape_mismatch_is_an_error():
    ref = reference_outputs(HashRunner(dim=8), SENTENCES)
    with pytest.raises(AssertionError):
        verify_embedding("c", HashRunner(dim=16), SENTENCES, ref, [], None)


def test_bench_embedding_keys_and_subset():
    runner = HashRunner()
    metrics, warm = bench_embedding(
        runner, SENTENCES, batch_sizes=(1, 8), repeats=3, max_sentences_b1=5
    )
    assert set(metrics) == {"sentences_per_s_b1", "sentences_per_s_b8"}
    assert all(s.n == 3 and s.median > 0 and s.unit == "sentences/s" for s in metrics.values())
    assert warm >= 0
    assert runner.calls == [1] * 4 + [8] * 4  # (1 warm-up + 3 timed) per batch size


# --- planted fault on a real (tiny) encoder, retrieval, recalibration, bootstrap ---------------

WIKI = [
    f"The {w} river flows through the {v} valley and reaches the sea near the old {u} harbour."
    for w, v, u in zip(
        ["northern", "eastern", "long", "cold", "quiet", "wide", "green", "slow"] * 5,
        ["green", "deep", "broad", "narrow", "high", "low", "dry", "wet", "red", "blue"] * 4,
        ["fishing", "trading", "naval", "roman", "ancient"] * 8,
        strict=True,
    )
]


def _shuffle_rows(folder, lo: int, hi: int) -> None:
    # The planted fault: a block of embedding rows permuted (ids now point at other words).
    import torch
    from safetensors.torch import load_file, save_file

    f = folder / "model.safetensors"
    state = load_file(f)
    key = next(k for k in state if k.endswith("word_embeddings.weight"))
    g = torch.Generator().manual_seed(0)
    state[key][lo:hi] = state[key][lo:hi][torch.randperm(hi - lo, generator=g)]
    save_file(state, f, {"format": "pt"})


def test_shuffled_embedding_rows_fail_the_cosine_gate(tiny_bert_dir, tmp_path):
    import shutil

    from llmopt.verify.api import load_runner

    bad = shutil.copytree(tiny_bert_dir, tmp_path / "shuffled")
    _shuffle_rows(bad, 1000, 10000)  # the common-word block of the BERT vocabulary
    ref = load_runner(tiny_bert_dir, threads=1)[0]
    ref_emb = reference_outputs(ref, WIKI)
    same = verify_embedding(
        "same", load_runner(tiny_bert_dir, threads=1)[0], WIKI, ref_emb, [], None
    )
    assert same.passed and same.metric("cosine_mean").noise is True
    r = verify_embedding("shuffled", load_runner(bad, threads=1)[0], WIKI, ref_emb, [], None)
    assert not r.passed
    assert r.metric("cosine_mean").passed is False and r.metric("cosine_mean").noise is False


def test_retrieval_and_recalibration_metrics():
    many = [f"alpha beta gamma delta sentence {i} of topic {i % 11} ends here" for i in range(60)]
    ref_runner = HashRunner()
    ref = verify_embedding("ref", ref_runner, many, None, [], None)
    scores = {m.name: m.candidate for m in ref.metrics}
    assert "retrieval_recall@10" in scores
    ref_emb = reference_outputs(ref_runner, many)
    r = verify_embedding(
        "noisy",
        HashRunner(noise=0.2),
        many,
        ref_emb,
        [],
        None,
        reference_scores=scores,
        gates=Gates(min_cosine=None),
    )
    assert ref.metric("retrieval_recall@10").passed is None
    recall = r.metric("retrieval_recall@10")
    assert recall.reference == scores["retrieval_recall@10"] and recall.threshold is not None
    # The deployed threshold never agrees less than the old one: a fit that does not help out
    # of sample is not taken.
    assert r.metric("recalibrated_agreement").candidate >= r.metric("decision_agreement").candidate
    assert r.metric("recalibrated_threshold").reference == 0.5


def test_recall_at_k_and_recalibration_by_hand():
    from llmopt.verify.retrieval import recalibrate_threshold, recall_at_k

    p = np.eye(4)
    q = np.array([[1.0, 0.0, 0.0, 0.0], [0.9, 0.1, 0.0, 0.0]])
    assert recall_at_k(q, p, np.array([0, 1]), k=1).tolist() == [1.0, 0.0]
    assert recall_at_k(q, p, np.array([0, 1]), k=2).tolist() == [1.0, 1.0]
    # A uniform shift of -0.1 flips decisions at the old threshold; recalibration restores them.
    rc = np.linspace(0, 1, 101)
    t, before, after = recalibrate_threshold(rc, rc - 0.1, 0.5)
    assert before < 1.0 and after == 1.0 and t == pytest.approx(0.4, abs=0.011)


def test_bootstrap_helpers():
    from llmopt.verify.stats import bootstrap_ci, is_noise, paired_bootstrap

    x = np.random.default_rng(1).standard_normal(200)
    assert bootstrap_ci(lambda i: float(x[i].mean()), 200) == bootstrap_ci(
        lambda i: float(x[i].mean()), 200
    )
    assert is_noise(paired_bootstrap(x, x + 1e-9 * np.random.default_rng(2).standard_normal(200)))
    assert not is_noise(paired_bootstrap(x, x + 0.5))
    assert is_noise((float("nan"), 1.0)) is None
