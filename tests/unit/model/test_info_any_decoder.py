"""Any decoder transformers ships is a causal LM llmopt takes; custom code still is not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmopt.core.errors import UnsupportedModelError
from llmopt.model.info import inspect_model


def _gpt2(folder: Path, **extra) -> Path:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    )
    model.save_pretrained(folder)
    if extra:
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, **extra}))
    return folder


def test_gpt2_is_a_causal_lm_with_full_attention(tmp_path):
    info = inspect_model(str(_gpt2(tmp_path / "gpt2")))
    assert (info.task, info.architecture) == ("causal-lm", "GPT2LMHeadModel")
    assert (info.num_layers, info.hidden_size, info.max_context) == (2, 32, 32)
    assert info.attention_pattern == "full attention in all 2 layers"


def test_custom_code_decoder_is_still_refused(tmp_path):
    folder = _gpt2(tmp_path / "remote", auto_map={"AutoModelForCausalLM": "m.Fancy"})
    with pytest.raises(UnsupportedModelError, match="custom code"):
        inspect_model(str(folder))
