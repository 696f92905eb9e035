"""The native torch engine on the real SmolLM2-135M: same logits and greedy text as transformers."""

from __future__ import annotations

import pytest
import torch

from llmopt.assets import prepare_builtin
from llmopt.engines.native import SamplingParams, load_generator

pytestmark = pytest.mark.integration


def test_greedy_64_tokens_identical_to_transformers_generate():
    from transformers import AutoModelForCausalLM

    src = prepare_builtin("smollm2-135m")
    gen = load_generator(src, "fp32", max_batch=2, max_seq_len=256)
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    msgs = [{"role": "user", "content": "Write a long story about a dragon who learns to read."}]
    text = gen.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    prompt = gen.tokenizer.encode(text, add_special_tokens=False)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        want = hf.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False)[0]
        ref_logits = hf(ids).logits
    got, timing = gen.generate(prompt, SamplingParams(max_tokens=64, ignore_eos=True))
    assert got == want[len(prompt) :].tolist()
    assert timing["decode_tokens"] == 63
    from llmopt.engines.native.engine import NativeCausalLMRunner

    mine = NativeCausalLMRunner(gen).logits(ids)
    torch.testing.assert_close(mine, ref_logits, atol=1e-4, rtol=1e-4)
