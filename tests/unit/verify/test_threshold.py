"""Threshold recalibration, its CIs and gate; the pairs files; the FAISS index check."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llmopt.verify.pairs import PairsFileError, load_pairs, load_texts
from llmopt.verify.retrieval import agreement, percentile_threshold, recalibrate_threshold
from llmopt.verify.threshold import crossfit_agreement, threshold_metrics


def _brute(ref, cand, t):
    """The definition: try every cut between distinct candidate cosines (midway), below all
    and above all."""
    decide = ref >= t
    best, best_agree = None, -1.0
    u = np.unique(cand)
    for c in [u[0], *((u[:-1] + u[1:]) / 2), u[-1] + 1e-6]:
        a = float(((cand >= c) == decide).mean())
        if a > best_agree + 1e-12 or (abs(a - best_agree) < 1e-12 and abs(c - t) < abs(best - t)):
            best, best_agree = c, a
    return best, best_agree


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fast_recalibration_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    ref = rng.uniform(-0.2, 1.0, 300)
    cand = np.round(ref * 0.93 - 0.02 + rng.normal(0, 0.03, 300), 2)  # rounded: many ties
    t, before, after = recalibrate_threshold(ref, cand, 0.6)
    bt, bagree = _brute(ref, cand, 0.6)
    assert after == pytest.approx(bagree) and t == pytest.approx(bt)
    assert before == agreement(ref, cand, 0.6, 0.6) and after >= before


def test_shifted_scores_recalibrate_to_full_agreement():
    ref = np.linspace(0.0, 1.0, 400)
    cand = ref * 0.9  # a uniform squeeze: same ranking, decisions flip near 0.85
    ms, notes = threshold_metrics(ref, cand, 0.85, min_agreement=0.95, resamples=200)
    m = {x.name: x for x in ms}
    assert m["decision_agreement"].candidate < 0.97
    assert m["recalibrated_agreement"].candidate >= 0.99 and m["recalibrated_agreement"].passed
    assert "in sample 1.0000" in m["recalibrated_agreement"].note
    assert m["recalibrated_threshold"].candidate == pytest.approx(0.765, abs=0.003)
    assert m["percentile_threshold"].candidate == pytest.approx(0.765, abs=0.003)
    # The CI of the agreement's delta excludes 0 before recalibration: a real loss.
    d = m["decision_agreement"]
    assert d.ci_high < 0 and d.noise is False
    assert "0.85 ->" in notes[1]


def test_gate_fails_when_no_threshold_can_save_the_decisions():
    rng = np.random.default_rng(0)
    ref = rng.uniform(0, 1, 500)
    cand = rng.uniform(0, 1, 500)  # unrelated scores
    ms, _ = threshold_metrics(ref, cand, 0.5, min_agreement=0.95, resamples=50)
    m = {x.name: x for x in ms}
    assert m["recalibrated_agreement"].passed is False
    # Out of sample is what the gate sees; in sample would flatter an unrelated candidate.
    assert crossfit_agreement(ref, cand, 0.5) <= recalibrate_threshold(ref, cand, 0.5)[2]


def test_labels_give_accuracy_at_both_thresholds():
    ref = np.linspace(0, 1, 100)
    labels = (ref >= 0.5).astype(float)
    ms, _ = threshold_metrics(ref, ref - 0.1, 0.5, labels=labels, resamples=50)
    acc = {x.name: x for x in ms}["label_accuracy"]
    assert acc.reference == 1.0 and acc.candidate == 1.0


def test_percentile_rule_edges():
    ref, cand = np.array([0.6, 0.7]), np.array([0.1, 0.2])
    assert percentile_threshold(ref, cand, 0.5) == 0.1  # every pair passes: still every pair
    assert percentile_threshold(ref, cand, 0.9) > 0.2  # no pair passes: none


def _write(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_pairs_file_formats_and_errors(tmp_path):
    rows = [{"text1": f"a{i}", "text2": f"b{i}", "label": i % 2} for i in range(12)]
    p = load_pairs(_write(tmp_path / "p.jsonl", rows))
    assert len(p) == 12 and p.labels.tolist() == [0.0, 1.0] * 6
    alt = [{"query": f"q{i}", "passage": "same"} for i in range(10)]
    q = load_pairs(_write(tmp_path / "q.jsonl", alt))
    assert q.labels is None and q.texts()[-1] == "same" and len(q.texts()) == 11
    with pytest.raises(PairsFileError, match=r"p2.jsonl:1: expected two texts"):
        load_pairs(_write(tmp_path / "p2.jsonl", [{"x": "a"}] * 10))
    with pytest.raises(PairsFileError, match="at least 10"):
        load_pairs(_write(tmp_path / "p3.jsonl", rows[:3]))
    with pytest.raises(PairsFileError, match="label every pair or none"):
        load_pairs(_write(tmp_path / "p4.jsonl", rows[:10] + [{"text1": "x", "text2": "y"}]))
    with pytest.raises(PairsFileError, match="does not exist"):
        load_pairs(tmp_path / "missing.jsonl")
    (tmp_path / "c.txt").write_text("first doc\n\nsecond doc\n")
    assert load_texts(tmp_path / "c.txt") == ["first doc", "second doc"]
    assert load_texts(_write(tmp_path / "c.jsonl", [{"text": "x"}])) == ["x"]
    with pytest.raises(PairsFileError, match="string 'text'"):
        load_texts(_write(tmp_path / "d.jsonl", [{"body": "x"}]))


def test_index_metrics_on_faiss():
    pytest.importorskip("faiss", reason="faiss-cpu not installed (pip install faiss-cpu)")
    from llmopt.verify.index import exact_neighbours, index_metrics

    rng = np.random.default_rng(0)
    corpus = rng.standard_normal((400, 32)).astype(np.float32)
    same, _ = index_metrics(corpus, None, corpus.copy(), None, 10, min_recall=0.9, resamples=50)
    m = {x.name: x for x in same}
    assert m["index_recall@10"].candidate == 1.0 and m["index_recall@10"].passed
    assert m["index_ndcg@10"].candidate == pytest.approx(1.0)
    assert 0.8 <= m["hnsw_recall@10"].candidate <= 1.0
    noisy = corpus + 0.5 * rng.standard_normal(corpus.shape).astype(np.float32)
    worse, notes = index_metrics(corpus, None, noisy, None, 10, min_recall=0.9, resamples=50)
    w = {x.name: x for x in worse}
    assert w["index_recall@10"].candidate < 0.9 and w["index_recall@10"].passed is False
    assert w["index_recall@10"].ci_high < 0
    assert "queries/s" in notes[0]
    # Self-queries never return themselves.
    ids, _, _ = exact_neighbours(corpus, corpus, 5, exclude_self=True)
    assert not (ids == np.arange(len(corpus))[:, None]).any()
