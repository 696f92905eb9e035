"""The llamacpp engine on a tiny Llama: GGUF builds, logits against transformers, batched decode,
the tokenizer check, a corrupted GGUF failing verification, and where GGUF recipes may run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from llmopt.core.errors import LlmoptError
from llmopt.core.recipes import get_recipe
from llmopt.engines import get_engine, load_runner
from llmopt.model.info import inspect_model

pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")


def _sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - x).pow(2).sum()))


@pytest.fixture(scope="module")
def built(tmp_path_factory, _tiny_llama_master, bpe_merges):
    """The tiny Llama with BPE merges (llama.cpp needs them), built as F32 and Q8_0 GGUFs once."""
    root = tmp_path_factory.mktemp("llamacpp")
    src = bpe_merges(Path(shutil.copytree(_tiny_llama_master, root / "tiny-llama")))
    info = inspect_model(src)
    out = {}
    for recipe in ("fp32", "gguf-q8_0"):
        (root / recipe).mkdir()
        get_engine("llamacpp").build(src, info, get_recipe(recipe), root / recipe)
        out[recipe] = root / recipe
    return src, info, out


def _ids(runner, text="Paris is the capital of France, and Rome of Italy.") -> torch.Tensor:
    return torch.tensor([runner.tokenizer(text)["input_ids"]])


def test_f32_gguf_computes_what_transformers_computes(built):
    src, info, art = built
    ref = load_runner("hf", src, info, "fp32", {"threads": 1})
    runner = load_runner("llamacpp", art["fp32"], info, "fp32", {"threads": 1})
    ids = _ids(ref)
    assert _sqnr(ref.logits(ids), runner.logits(ids)) > 50  # same weights, same RoPE
    q8 = load_runner("llamacpp", art["gguf-q8_0"], info, "gguf-q8_0", {"threads": 1})
    assert 15 < _sqnr(ref.logits(ids), q8.logits(ids)) < 50  # quantized, but the same model


def test_flash_attention_variations_compute_the_same_attention(built):
    """The tune rung measures them without a new verification: they must agree."""
    from llmopt.core.schema import Candidate
    from llmopt.optimize.tune import variations

    src, info, art = built
    cand = Candidate("c", "llamacpp", "fp32", {"device": "cpu", "threads": 1})
    changes = [v for v in variations(cand, info) if "flash_attn" in v]
    assert changes == [{"flash_attn": True}, {"flash_attn": False}]
    ids = _ids(load_runner("hf", src, info, "fp32", {"threads": 1}))
    on, off = (
        load_runner("llamacpp", art["fp32"], info, "fp32", {"threads": 1, **c}) for c in changes
    )
    assert _sqnr(on.logits(ids), off.logits(ids)) > 50


def test_batched_prefill_and_decode_match_full_sequence_logits(built):
    src, info, art = built
    runner = load_runner("llamacpp", art["gguf-q8_0"], info, "gguf-q8_0", {"threads": 1})
    ids = _ids(runner)
    full = runner.logits(ids)[0]
    last, state = runner.prefill(ids.expand(3, -1))
    assert last.shape == (3, runner.n_vocab)
    # Q8_0 quantizes activations per block: a batch of 3 takes another kernel path than 1, so
    # the rows agree closely (not bit for bit) with the single-sequence pass.
    for row in last:
        assert _sqnr(full[-1], row) > 35 and row.argmax() == full[-1].argmax()
    nxt = torch.tensor([[5], [6], [7]])
    step, state = runner.decode(nxt, state)
    assert state["n_past"] == ids.shape[1] + 1
    for row in range(3):  # each row is its own sequence in the shared cache
        ext = torch.cat([ids, nxt[row : row + 1]], 1)
        assert _sqnr(runner.logits(ext)[0, -1], step[row]) > 35


def test_a_tokenizer_that_encodes_differently_is_refused(built, tmp_path):
    src, info, art = built
    bad = tmp_path / "bad"
    shutil.copytree(art["gguf-q8_0"], bad)
    tok = json.loads((bad / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = "a", "e"  # swap two byte tokens: the HF tokenizer no longer matches the GGUF's
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (bad / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(LlmoptError, match="encodes text differently"):
        load_runner("llamacpp", bad, info, "gguf-q8_0", {"threads": 1})


def test_a_corrupted_gguf_block_fails_verification(built, tmp_path):
    from llmopt.assets.text import token_windows
    from llmopt.verify.lm import verify_causal_lm

    src, info, art = built
    broken = tmp_path / "broken"
    shutil.copytree(art["gguf-q8_0"], broken)
    data = bytearray((broken / "model.gguf").read_bytes())
    start = len(data) // 2  # inside the tensor data: one run of blocks becomes noise
    data[start : start + 4096] = bytes((i * 131 + 7) % 256 for i in range(4096))
    (broken / "model.gguf").write_bytes(bytes(data))
    ref = load_runner("hf", src, info, "fp32", {"threads": 1})
    windows = token_windows(ref.tokenizer, "The quick brown fox. " * 200, 64, 4)
    good = load_runner("llamacpp", art["gguf-q8_0"], info, "gguf-q8_0", {"threads": 1})
    bad = load_runner("llamacpp", broken, info, "gguf-q8_0", {"threads": 1})
    ok = verify_causal_lm("llamacpp-gguf-q8_0", good, windows, ref, 0.05, generation_prompts=0)
    res = verify_causal_lm("broken", bad, windows, ref, 0.05, generation_prompts=0)
    assert ok.passed and not res.passed
    assert res.quality_drop > ok.quality_drop


def test_gguf_recipes_run_on_llamacpp_only(tiny_llama_dir):
    from llmopt.hardware.target import Target
    from llmopt.optimize.space import candidate_space

    info = inspect_model(tiny_llama_dir)
    target = Target(device="cpu", threads=1, cpu="test", memory_bytes=8 * 2**30)
    cands, skipped = candidate_space(info, target)
    ids = {c.id for c in cands}
    assert {"llamacpp-fp32", "llamacpp-gguf-q8_0", "llamacpp-gguf-q4_k_m"} <= ids
    why = {s["id"]: s["reason"] for s in skipped}
    assert "llama.cpp's own format" in why["hf-gguf-q8_0"]
    assert "own GGUF types" in why["llamacpp-w8a16"]


def test_quantize_refuses_a_gguf_recipe(tiny_llama_dir, tmp_path):
    from llmopt.quant import quantize
    from llmopt.quant.checks import QuantConfigError

    with pytest.raises(QuantConfigError, match="llama.cpp quantizes it"):
        quantize(tiny_llama_dir, "gguf-q4_k_m", tmp_path / "out")
