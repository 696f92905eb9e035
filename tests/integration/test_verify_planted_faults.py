"""Planted faults in the real built-ins must fail their gates; the unmodified models must pass.

SmolLM2-135M: one decoder block's weights scaled by 1.5 (perplexity gate fails, attribution names
the block), a zeroed quantization scale in the w8a16 artifact (integrity fails), a tokenizer that
is not SmolLM2's (integrity fails). all-MiniLM-L6-v2: a shuffled block of embedding rows (cosine
gate fails). Sizes are kept small (4 x 128-token windows, 400 sentences) so the file runs in
about two minutes on a 2-core CPU.
"""

from __future__ import annotations

import time

import pytest
import torch

from llmopt.assets import prepare_builtin
from llmopt.assets.text import evaluation_sentences, evaluation_text, token_windows, wordsim353
from llmopt.verify.api import load_runner
from llmopt.verify.attribution import layer_sqnr
from llmopt.verify.embedding import reference_outputs, verify_embedding
from llmopt.verify.gates import Gates, failures, gate_rows
from llmopt.verify.integrity import check_tokenizers, check_weights
from llmopt.verify.lm import verify_causal_lm

pytestmark = pytest.mark.integration

# At import, before torch starts its thread pool (the flag is per thread and inherited): SmolLM2's
# fp32 forward makes denormals that slow it 6-15x on CPU (docs/verify.md). `llmopt verify` does
# the same first thing.
torch.set_flush_denormal(True)

FAULT_LAYER = 12


@pytest.fixture(scope="module")
def smol():
    ref = load_runner("smollm2-135m", "fp32")[0]
    windows = token_windows(ref.tokenizer, evaluation_text(), 128, 4)
    return ref, windows


@pytest.mark.slow
def test_smollm2_unmodified_passes(smol):
    ref, windows = smol
    cand = load_runner("smollm2-135m", "fp32")[0]
    t0 = time.perf_counter()
    r = verify_causal_lm("same", cand, windows, ref, 0.01, generation_prompts=1, gates=Gates())
    print(f"smollm2 fp32 vs fp32: {time.perf_counter() - t0:.1f} s")
    assert r.passed, gate_rows(r)
    assert r.metric("perplexity").noise is True and r.metric("top1_agreement").candidate == 1.0


@pytest.mark.slow
def test_smollm2_scaled_layer_fails_and_is_named(smol):
    ref, windows = smol
    cand = load_runner("smollm2-135m", "fp32")[0]
    with torch.no_grad():
        for name, p in cand.model.model.layers[FAULT_LAYER].named_parameters():
            if name.endswith("proj.weight"):
                p.mul_(1.5)
    r = verify_causal_lm("scaled", cand, windows, ref, 0.01, generation_prompts=1)
    failed = {m.name for m in failures(r)}
    assert "perplexity" in failed and r.metric("perplexity").noise is False, gate_rows(r)
    a = layer_sqnr(ref.model, cand.model, {"input_ids": windows[:1]})
    assert a.first_jump_name == f"model.layers.{FAULT_LAYER}", a.to_dict()


@pytest.mark.slow
def test_smollm2_zeroed_scale_fails_integrity_and_quality(smol, tmp_path):
    from safetensors.torch import load_file, save_file

    from llmopt.core.recipes import get_recipe
    from llmopt.engines import get_engine
    from llmopt.model.info import inspect_model

    ref, windows = smol
    src = prepare_builtin("smollm2-135m")
    out = tmp_path / "w8a16"
    out.mkdir()
    get_engine("hf").build(src, inspect_model(src), get_recipe("w8a16"), out)
    assert check_weights(out) == []
    good = load_runner(out)[0]
    r = verify_causal_lm("w8a16", good, windows, ref, 0.02, generation_prompts=0)
    assert r.passed, gate_rows(r)  # the real recipe passes its gates
    key = "model.layers.3.self_attn.o_proj.weight_scale"
    state = load_file(out / "model.safetensors")
    state[key].zero_()
    save_file(state, out / "model.safetensors", {"format": "pt"})
    assert check_weights(out) == [f"model.safetensors: quantization scale {key} is all zero"]
    broken = load_runner(out)[0]
    r = verify_causal_lm("zeroed", broken, windows, ref, 0.02, generation_prompts=0)
    assert not r.passed, gate_rows(r)


def test_smollm2_tokenizer_mismatch(smol):
    from transformers import AutoTokenizer

    ref, _ = smol
    other = AutoTokenizer.from_pretrained(prepare_builtin("minilm-l6"))
    msg = check_tokenizers(ref.tokenizer, other)
    assert msg and msg.startswith("tokenizer mismatch")


@pytest.mark.slow
def test_minilm_shuffled_rows_fail_unmodified_passes():
    sentences = evaluation_sentences(400)
    ref = load_runner("minilm-l6", "fp32")[0]
    ref_emb = reference_outputs(ref, sentences)
    pairs = wordsim353()[:100]
    base = verify_embedding("ref", ref, sentences, None, pairs, None)
    scores = {m.name: m.candidate for m in base.metrics}
    cand = load_runner("minilm-l6", "fp32")[0]
    t0 = time.perf_counter()
    ok = verify_embedding(
        "same",
        cand,
        sentences,
        ref_emb,
        pairs,
        scores["wordsim353_spearman"],
        reference_scores=scores,
    )
    print(f"minilm fp32 vs fp32 (400 sentences): {time.perf_counter() - t0:.1f} s")
    assert ok.passed, gate_rows(ok)
    emb = cand.model.embeddings.word_embeddings.weight
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        emb[2000:6000] = emb[2000:6000][torch.randperm(4000, generator=g)]
    bad = verify_embedding(
        "shuffled",
        cand,
        sentences,
        ref_emb,
        pairs,
        scores["wordsim353_spearman"],
        reference_scores=scores,
        gates=Gates(),
    )
    failed = {m.name for m in failures(bad)}
    assert {"cosine_mean", "cosine_min"} <= failed, gate_rows(bad)
    # Retrieval stays self-consistent (queries and passages go through the same broken table):
    # the reason the direct cosine to the reference is the primary embedding gate.
    a = layer_sqnr(
        ref.model, cand.model, ref.tokenizer(sentences[:4], padding=True, return_tensors="pt").data
    )
    assert a.first_jump == 0
