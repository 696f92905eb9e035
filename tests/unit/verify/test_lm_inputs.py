"""Verification scores text as the model reads it: BOS first where the tokenizer adds one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llmopt.assets.text import special_prefix, token_windows, window_convention
from llmopt.core.recipes import get_recipe
from llmopt.core.settings import EngineSettings
from llmopt.engines import get_engine
from llmopt.model.info import inspect_model
from llmopt.verify.lm import verify_causal_lm

TEXT = (
    "The river rises in the northern hills and flows south through farmland and two market "
    "towns before it reaches the sea. In the nineteenth century a canal joined it to the "
    "capital, and mills were built along its banks. "
) * 12
BOS = 257  # the tiny Llama's <|im_start|>, its bos_token


def _add_bos(folder: Path) -> Path:
    """Make the tiny Llama's tokenizer prepend its BOS, as Llama 3 / Gemma tokenizers do."""
    path = folder / "tokenizer.json"
    tok = json.loads(path.read_text())
    tok["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [
            {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [BOS], "tokens": []}},
    }
    path.write_text(json.dumps(tok))
    return folder


def _runner(folder: Path):
    info = inspect_model(str(folder))
    return get_engine("hf").load(folder, info, get_recipe("fp32"), EngineSettings(threads=1))


def test_windows_start_with_bos_only_where_the_tokenizer_adds_it(tiny_llama_dir):
    plain = _runner(tiny_llama_dir).tokenizer
    assert special_prefix(plain) == []
    w = token_windows(plain, TEXT, 64, 4)
    ids = plain(TEXT, add_special_tokens=False)["input_ids"]
    assert w.flatten().tolist() == ids[: 4 * 64]  # consecutive text, nothing added
    assert "adds none" in window_convention(plain)

    bos_tok = _runner(_add_bos(tiny_llama_dir)).tokenizer
    assert bos_tok("hi")["input_ids"][0] == BOS  # the fixture really adds BOS
    assert special_prefix(bos_tok) == [BOS]
    wb = token_windows(bos_tok, TEXT, 64, 4)
    assert wb.shape == (4, 64)
    assert (wb[:, 0] == BOS).all()
    assert wb[:, 1:].flatten().tolist() == ids[: 4 * 63]  # the text continues window to window
    assert str(BOS) in window_convention(bos_tok)


def test_verify_records_the_convention_and_flags_windows_without_bos(tiny_llama_dir):
    runner = _runner(_add_bos(tiny_llama_dir))
    with_bos = token_windows(runner.tokenizer, TEXT, 64, 4)
    r = verify_causal_lm("ref", runner, with_bos, None, generation_prompts=0)
    assert str(BOS) in r.inputs and "BOS" in r.inputs
    assert not any("do not start" in n for n in r.notes)
    assert r.to_dict()["inputs"] == r.inputs  # recorded in the result's JSON

    # The old way (no special tokens): the same text, scored without the BOS the model expects.
    ids = runner.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    without = torch.tensor(ids[: 4 * 63]).view(4, 63)
    old = verify_causal_lm("ref", runner, without, None, generation_prompts=0)
    assert "without the tokenizer's prefix" in old.inputs
    assert any("do not start with the tokenizer's prefix" in n for n in old.notes)
    # The same text with and without the BOS before it: the model conditions on it.
    ppl_bos = r.metric("perplexity").candidate
    ppl_old = old.metric("perplexity").candidate
    assert ppl_bos != pytest.approx(ppl_old, rel=1e-6)
