"""`llmopt serve` of an architecture the native engine refuses (a tiny random GPT-2), as a real
process: chosen automatically, and with `--engine hf` (the flag the native engine's refusal names).
Also the refusal itself: `--engine torch` on GPT-2 exits with the fix that names `--engine hf`."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ARGS = ["--max-num-seqs", "2", "--max-seq-len", "96", "--log-level", "info"]


@pytest.fixture
def tiny_gpt2_dir(tiny_llama_dir: Path, tmp_path: Path) -> Path:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    out = tmp_path / "tiny-gpt2"
    config = GPT2Config(vocab_size=264, n_positions=128, n_embd=64, n_layer=2, n_head=4)
    config.bos_token_id, config.eos_token_id = 257, 258
    torch.manual_seed(0)
    GPT2LMHeadModel(config).eval().save_pretrained(out)
    for f in tiny_llama_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.suffix == ".jinja":
            shutil.copy2(f, out / f.name)
    return out


def _chat(server) -> str:
    r = server.client().chat.completions.create(
        model="tiny-gpt2",
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=8,
        temperature=0,
    )
    assert r.usage.completion_tokens == 8 or r.choices[0].finish_reason == "stop"
    return r.choices[0].message.content


@pytest.mark.parametrize("flag", [[], ["--engine", "hf"]], ids=["auto", "engine-hf"])
def test_gpt2_served_on_the_hf_engine(flag, tiny_gpt2_dir, tmp_path, serve_process):
    log = tmp_path / "serve.log"
    server = serve_process(str(tiny_gpt2_dir), [*ARGS, *flag], log)
    try:
        first = _chat(server)
        assert first == _chat(server)  # greedy: the same answer twice
        assert isinstance(first, str)
        stream = server.client().chat.completions.create(
            model="tiny-gpt2",
            messages=[{"role": "user", "content": "Say something."}],
            max_tokens=8,
            temperature=0,
            stream=True,
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == first
    finally:
        server.kill()
    text = log.read_text()
    if not flag:
        assert "serving with the hf engine" in text  # the automatic choice is logged


def test_native_engine_refusal_names_the_flag_that_works(tiny_gpt2_dir):
    cmd = [sys.executable, "-m", "llmopt.cli.main", "serve", str(tiny_gpt2_dir), "--engine"]
    r = subprocess.run([*cmd, "torch", *ARGS], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert "--engine hf" in r.stderr + r.stdout
    # and the other refused spelling says which engines exist
    r = subprocess.run([*cmd, "nope", *ARGS], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "torch, hf" in r.stderr + r.stdout


NATIVE = {  # the families added to the native engine, as tiny random models
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16, "sliding_window": 8}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "sliding_window": 8}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"residual_multiplier": 0.2}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": None}),
}


@pytest.mark.parametrize("family", sorted(NATIVE))
def test_new_native_families_are_served_natively(family, tiny_llama_dir, tmp_path, serve_process):
    import torch
    import transformers

    cfg_name, model_name, extra = NATIVE[family]
    config = getattr(transformers, cfg_name)(
        vocab_size=264,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=258,
        bos_token_id=257,
        eos_token_id=258,
        **extra,
    )
    out = tmp_path / family
    torch.manual_seed(0)
    getattr(transformers, model_name)(config).eval().save_pretrained(out)
    for f in tiny_llama_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.suffix == ".jinja":
            shutil.copy2(f, out / f.name)
    log = tmp_path / "serve.log"
    server = serve_process(str(out), ARGS, log)
    try:
        r = server.client().chat.completions.create(
            model=family, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        assert r.usage.completion_tokens >= 1
    finally:
        server.kill()
    assert "serving with the hf engine" not in log.read_text()
