"""`optimize --threshold/--pairs`: options checked up front, the threshold into launch.json."""

from __future__ import annotations

import json

import pytest

from llmopt.core.schema import Metric, VerifyResult
from llmopt.optimize.job import _embedding_threshold, _retrieval_options
from llmopt.verify.pairs import PairsFileError


def test_options_resolve_paths_and_fail_early(tmp_path, monkeypatch):
    pairs = tmp_path / "p.jsonl"
    pairs.write_text("".join(json.dumps({"a": f"x{i}", "b": "y"}) + "\n" for i in range(10)))
    monkeypatch.chdir(tmp_path)
    out = _retrieval_options({"pairs": "p.jsonl", "threshold": 0.8, "corpus": None})
    assert out["pairs"] == str(pairs.resolve()) and out["threshold"] == 0.8
    with pytest.raises(PairsFileError, match="does not exist"):
        _retrieval_options({"pairs": "missing.jsonl"})
    with pytest.raises(ValueError, match=r"\[-1, 1\]"):
        _retrieval_options({"threshold": 1.5})


def test_launch_gets_the_recalibrated_threshold_with_its_interval():
    metrics = [
        Metric("decision_agreement", 1.0, 0.94, True),
        Metric("recalibrated_threshold", 0.85, 0.81, True, ci_low=-0.05, ci_high=-0.03),
        Metric("recalibrated_agreement", 1.0, 0.99, True, 0.95, True),
        Metric("percentile_threshold", 0.85, 0.815, True),
    ]
    v = VerifyResult("c", "embedding", metrics, True, 0.0).to_dict()
    t = _embedding_threshold(v)
    assert t["threshold"] == 0.81 and t["reference_threshold"] == 0.85
    assert t["ci95"] == pytest.approx([0.80, 0.82])
    assert (t["agreement"], t["agreement_as_is"], t["percentile_threshold"]) == (0.99, 0.94, 0.815)
    # No threshold study in verify.json (an older run, or a causal LM): nothing is written.
    assert _embedding_threshold({"metrics": []}) is None and _embedding_threshold(None) is None
