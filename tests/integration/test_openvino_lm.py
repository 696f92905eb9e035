"""The openvino engine on the real SmolLM2-135M: NNCF int8 weights (w8a16) build, run on the CPU
plugin's int8 kernels and keep perplexity within the default 1% budget, through the same
verification every engine gets (same token ids as the hf fp32 reference)."""

from __future__ import annotations

import pytest

from llmopt.assets import prepare_builtin
from llmopt.assets.text import evaluation_text, token_windows
from llmopt.core.recipes import get_recipe
from llmopt.engines import get_engine, load_runner
from llmopt.model.info import inspect_model
from llmopt.verify.lm import verify_causal_lm

pytestmark = pytest.mark.integration
pytest.importorskip("openvino")
pytest.importorskip("nncf")


def test_w8a16_keeps_perplexity_within_one_percent(tmp_path):
    src = prepare_builtin("smollm2-135m")
    info = inspect_model(src)
    out = tmp_path / "artifact"
    out.mkdir()
    facts = get_engine("openvino").build(src, info, get_recipe("w8a16"), out)
    assert facts["int_linears"] == 30 * 7  # every decoder linear; embeddings and head float
    runner = load_runner("openvino", out, info, "w8a16", {"threads": 2})
    assert runner.linear_kernels().get("i8") == 30 * 7
    ref = load_runner("hf", src, info, "fp32", {"threads": 2})
    windows = token_windows(ref.tokenizer, evaluation_text(), 256, 2)
    res = verify_causal_lm("openvino-w8a16", runner, windows, ref, max_quality_drop=0.01)
    ppl = res.metric("perplexity")
    assert 5 < ppl.reference < 60, "held-out Wikipedia perplexity of SmolLM2-135M is ~20"
    assert res.passed and abs(res.quality_drop) < 0.01
    assert res.metric("top1_agreement").candidate > 0.9
    assert 0 < res.metric("kl_divergence_mean").candidate < 0.05
