"""The torch engine on the real SmolLM2-135M: greedy decoding matches transformers, recipes verify."""

from __future__ import annotations

import pytest
import torch

from llmopt.assets import prepare_builtin
from llmopt.assets.text import evaluation_text, token_windows
from llmopt.core.recipes import get_recipe
from llmopt.core.settings import EngineSettings
from llmopt.engines import get_engine
from llmopt.model.info import inspect_model
from llmopt.verify.lm import verify_causal_lm

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    src = prepare_builtin("smollm2-135m")
    info = inspect_model(src)
    engine = get_engine("hf")
    runners = {}
    for name in ("fp32", "w8a16"):
        out = tmp_path_factory.mktemp(name) / "artifact"
        out.mkdir()
        engine.build(src, info, get_recipe(name), out)
        runners[name] = engine.load(out, info, get_recipe(name), EngineSettings())
    return src, info, runners


def test_greedy_decode_matches_transformers_generate(smollm2):
    from transformers import AutoModelForCausalLM

    src, _, runners = smollm2
    runner = runners["fp32"]
    msgs = [{"role": "user", "content": "Write a long story about a dragon who learns to read."}]
    prompt = runner.tokenizer.apply_chat_template(
        msgs, add_generation_prompt=True, return_tensors="pt"
    )
    prompt = prompt["input_ids"] if not isinstance(prompt, torch.Tensor) else prompt
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = hf.generate(prompt, max_new_tokens=64, do_sample=False)[0, prompt.shape[1] :]
    logits, state = runner.prefill(prompt)
    got = []
    for _ in range(64):
        tok = logits.argmax(-1, keepdim=True)
        got.append(int(tok))
        if int(tok) == runner.tokenizer.eos_token_id:
            break
        logits, state = runner.decode(tok, state)
    assert len(want) == 64, "the prompt should make the model write past 64 tokens"
    assert got == want.tolist()
    assert "dragon" in runner.tokenizer.decode(got).lower()


@pytest.mark.slow
def test_w8a16_keeps_perplexity_within_one_percent(smollm2):
    _, _, runners = smollm2
    windows = token_windows(runners["fp32"].tokenizer, evaluation_text(), 256, 2)
    res = verify_causal_lm(
        "w8a16", runners["w8a16"], windows, runners["fp32"], max_quality_drop=0.01
    )
    ppl = res.metric("perplexity")
    assert 5 < ppl.reference < 60, "held-out Wikipedia perplexity of SmolLM2-135M is ~20"
    assert res.passed and abs(res.quality_drop) < 0.01
    assert res.metric("top1_agreement").candidate > 0.9
    assert 0 < res.metric("kl_divergence_mean").candidate < 0.05
