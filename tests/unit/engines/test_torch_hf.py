"""The torch engine on a tiny random Llama: build each recipe, load it, check the numbers."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from llmopt.core.recipes import get_recipe
from llmopt.core.settings import EngineSettings
from llmopt.engines import get_engine
from llmopt.engines.int8 import Int8WeightOnlyLinear
from llmopt.model.info import inspect_model
from llmopt.verify.lm import verify_causal_lm


def _tree_digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _build(src: Path, tmp_path: Path, recipe: str):
    info = inspect_model(src)
    engine = get_engine("hf")
    out = tmp_path / f"artifact-{recipe}"
    out.mkdir()
    facts = engine.build(src, info, get_recipe(recipe), out)
    runner = engine.load(out, info, get_recipe(recipe), EngineSettings(threads=1))
    return info, facts, runner


def _hf_logits(src: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(ids).logits


IDS = torch.tensor([[5, 17, 99, 200, 3, 42, 42, 7, 250, 1, 64, 128]])


def test_fp32_matches_transformers_exactly(tiny_llama_dir, tmp_path):
    before = _tree_digest(tiny_llama_dir)
    _, _, runner = _build(tiny_llama_dir, tmp_path, "fp32")
    torch.testing.assert_close(
        runner.logits(IDS), _hf_logits(tiny_llama_dir, IDS), rtol=1e-5, atol=1e-5
    )
    assert _tree_digest(tiny_llama_dir) == before, "the source folder must never be written"


def test_dense_build_links_weights_already_in_the_recipe_dtype(tiny_llama_dir, tmp_path):
    from safetensors import safe_open

    src = next(tiny_llama_dir.glob("*.safetensors"))
    _, facts, _ = _build(tiny_llama_dir, tmp_path, "fp32")  # stored fp32: nothing to convert
    linked = tmp_path / "artifact-fp32" / src.name
    assert "linked" in facts["weights"] or "copied" in facts["weights"]
    assert linked.read_bytes() == src.read_bytes()
    _, facts, runner = _build(tiny_llama_dir, tmp_path, "bf16")  # a real conversion
    assert "weights" not in facts
    out = next((tmp_path / "artifact-bf16").glob("*.safetensors"))
    with safe_open(out, "pt") as st:
        assert {st.get_slice(k).get_dtype() for k in st.keys()} == {"BF16"}  # noqa: SIM118
    assert torch.isfinite(runner.logits(IDS)).all()


def test_cached_decode_equals_full_forward(tiny_llama_dir, tmp_path):
    # Logits from prefill + step-by-step decode must equal one full forward: the KV cache is right.
    _, _, runner = _build(tiny_llama_dir, tmp_path, "fp32")
    full = runner.logits(IDS)[0]  # (T, V)
    last, state = runner.prefill(IDS[:, :6])
    torch.testing.assert_close(last[0], full[5], rtol=1e-4, atol=1e-4)
    for t in range(6, IDS.shape[1]):
        last, state = runner.decode(IDS[:, t : t + 1], state)
        torch.testing.assert_close(last[0], full[t], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("recipe,min_sqnr_db", [("bf16", 25.0), ("w8a16", 25.0)])
def test_lower_precision_stays_close(tiny_llama_dir, tmp_path, recipe, min_sqnr_db):
    _, facts, runner = _build(tiny_llama_dir, tmp_path, recipe)
    ref = _hf_logits(tiny_llama_dir, IDS)
    out = runner.logits(IDS)
    sqnr = 10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean())
    assert sqnr > min_sqnr_db, f"{recipe}: SQNR {sqnr:.1f} dB"
    assert not torch.equal(ref, out), (
        "a lower-precision recipe that changes nothing was not applied"
    )


def test_w8a16_artifact_is_int8_and_reloads(tiny_llama_dir, tmp_path):
    import json

    from safetensors import safe_open

    info, facts, runner = _build(tiny_llama_dir, tmp_path, "w8a16")
    art = tmp_path / "artifact-w8a16"
    # 2 layers x (q, k, v, o, gate, up, down); lm_head is tied and ignored.
    assert facts["quantized_linears"] == 14
    with safe_open(art / "model.safetensors", "pt") as f:
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        s = f.get_tensor("model.layers.0.self_attn.q_proj.weight_scale")
    assert q.dtype == torch.int8 and s.shape == (q.shape[0], 1)
    qcfg = json.loads((art / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "compressed-tensors" and qcfg["ignore"] == ["lm_head"]
    mods = [m for m in runner.model.modules() if isinstance(m, Int8WeightOnlyLinear)]
    assert len(mods) == 14
    # Both kernel paths (1 row: int8 kernel; many rows: dequantize + GEMM) agree.
    x = torch.randn(16, mods[0].in_features)
    many = mods[0](x)
    one = torch.cat([mods[0](x[i : i + 1]) for i in range(16)])
    torch.testing.assert_close(one, many, rtol=2e-2, atol=2e-2)


def test_verify_reference_against_itself_and_bf16(tiny_llama_dir, tmp_path):
    _, _, ref = _build(tiny_llama_dir, tmp_path, "fp32")
    _, _, cand = _build(tiny_llama_dir, tmp_path, "bf16")
    windows = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    same = verify_causal_lm("ref", ref, windows, reference=ref)
    assert same.metric("top1_agreement").candidate == 1.0
    assert same.metric("kl_divergence_mean").candidate == pytest.approx(0.0, abs=1e-6)
    assert same.passed and same.quality_drop == pytest.approx(0.0, abs=1e-9)
    low = verify_causal_lm("bf16", cand, windows, reference=ref, max_quality_drop=0.01)
    assert low.metric("kl_divergence_mean").candidate > 0
    assert low.metric("perplexity").n == 2 * 31
    # A zero budget is failed by any candidate that is worse at all.
    strict = verify_causal_lm("bf16", cand, windows, reference=ref, max_quality_drop=-1e-12 + 0.0)
    assert strict.passed == (
        strict.metric("perplexity").candidate <= strict.metric("perplexity").reference
    )


def test_bench_reports_positive_rates(tiny_llama_dir, tmp_path):
    from llmopt.bench.lm import bench_causal_lm

    _, _, runner = _build(tiny_llama_dir, tmp_path, "fp32")
    stats, warm = bench_causal_lm(runner, IDS, new_tokens=4, repeats=2)
    assert stats["decode_tokens_per_s"].n == 2 and stats["decode_tokens_per_s"].median > 0
    assert stats["prefill_tokens_per_s"].median > 0 and warm > 0


def test_incompatible_reasons(tiny_llama_dir):
    info = inspect_model(tiny_llama_dir)
    engine = get_engine("hf")
    assert engine.incompatible(info, get_recipe("fp32"), "cpu") is None
    assert "bf16" in engine.incompatible(info, get_recipe("fp16"), "cpu")
    assert "w8a8-dynamic" in engine.incompatible(info, get_recipe("w8a8-dynamic"), "cpu")
