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
    # Reported, not gated.
    assert r.metric("cosine_min").passed is None and r.metric("cosine_p1").passed is None
    # A looser gate lets the same candidate through.
    assert verify_embedding("noisy", HashRunner(noise=0.3), SENTENCES, ref, [], None, 0.8).passed


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
