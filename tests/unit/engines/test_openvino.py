"""The openvino engine on a tiny BERT: float32 IR computes what transformers computes, NNCF's
static int8 really quantizes and stays close, bf16 is refused where the CPU has no bf16."""

from __future__ import annotations

import numpy as np
import pytest

from llmopt.core.recipes import get_recipe
from llmopt.engines import get_engine, load_runner
from llmopt.engines import openvino as ov_engine
from llmopt.model.info import inspect_model

pytest.importorskip("openvino")
pytest.importorskip("nncf")

SENTENCES = [
    "The cat sat on the mat.",
    "A quick brown fox jumps over the lazy dog near the river bank.",
    "Paris is the capital of France.",
    "short",
    "Quantized models trade a little accuracy for a lot of speed on small machines.",
]


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.fixture(scope="module")
def built(tmp_path_factory, _tiny_bert_master):
    root = tmp_path_factory.mktemp("openvino")
    info = inspect_model(_tiny_bert_master)
    out = {}
    for recipe in ("fp32", "w8a8-static"):
        (root / recipe).mkdir()
        facts = get_engine("openvino").build(
            _tiny_bert_master, info, get_recipe(recipe), root / recipe
        )
        out[recipe] = (root / recipe, facts)
    return _tiny_bert_master, info, out


def test_float32_ir_embeds_as_transformers_does(built):
    src, info, art = built
    ref = load_runner("hf", src, info, "fp32", {"threads": 1}).embed(SENTENCES)
    runner = load_runner("openvino", art["fp32"][0], info, "fp32", {"threads": 1})
    got = runner.embed(SENTENCES, batch_size=2)  # padded batches of different lengths
    assert got.shape == ref.shape and _cos(ref, got).min() > 0.9999


def test_static_int8_quantizes_and_stays_close(built):
    src, info, art = built
    folder, facts = art["w8a8-static"]
    xml = (folder / ov_engine.IR_FILE).read_text()
    assert xml.count('type="FakeQuantize"') + xml.count('type="FakeConvert"') > 4
    assert facts["calibration_sentences"] == ov_engine.CALIBRATION_SENTENCES
    ref = load_runner("hf", src, info, "fp32", {"threads": 1}).embed(SENTENCES)
    got = load_runner("openvino", folder, info, "w8a8-static", {"threads": 1}).embed(SENTENCES)
    cos = _cos(ref, got)
    assert cos.min() > 0.9 and cos.mean() < 0.99999  # close, and not the float model


def test_recipes_and_devices_it_refuses(built, monkeypatch):
    _, info, _ = built
    eng = get_engine("openvino")
    assert "runs recipes" in eng.incompatible(info, get_recipe("w8a16"), "cpu")
    assert "CPU" in eng.incompatible(info, get_recipe("fp32"), "cuda")
    monkeypatch.setattr(ov_engine, "isa_features", lambda: ["avx2"])
    assert "no native bf16" in eng.incompatible(info, get_recipe("bf16"), "cpu")
    monkeypatch.setattr(ov_engine, "isa_features", lambda: ["avx512_bf16"])
    assert eng.incompatible(info, get_recipe("bf16"), "cpu") is None


def test_quantize_refuses_static_int8(tiny_llama_dir, tmp_path):
    from llmopt.quant import quantize
    from llmopt.quant.checks import QuantConfigError

    with pytest.raises(QuantConfigError, match="the openvino engine builds it"):
        quantize(tiny_llama_dir, "w8a8-static", tmp_path / "out")
