"""Integrity checks: planted faults in a w8a16 artifact, a tokenizer mismatch, degenerate output,
and `llmopt verify` failing fast on them (non-zero exit, clear message)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmopt.cli.main import app
from llmopt.core.recipes import get_recipe
from llmopt.engines import get_engine
from llmopt.model.info import inspect_model
from llmopt.verify.integrity import (
    IntegrityError,
    check_loaded,
    check_tokenizers,
    check_weights,
    degenerate,
    raise_on_problems,
)


def _w8a16(src: Path, out: Path) -> Path:
    out.mkdir()
    get_engine("hf").build(src, inspect_model(str(src)), get_recipe("w8a16"), out)
    return out


def _edit(folder: Path, fn) -> None:
    from safetensors.torch import load_file, save_file

    f = folder / "model.safetensors"
    state = load_file(f)
    fn(state)
    save_file(state, f, {"format": "pt"})


SCALE = "model.layers.0.mlp.down_proj.weight_scale"


def test_sound_artifact_has_no_problems(tiny_llama_dir, tmp_path):
    art = _w8a16(tiny_llama_dir, tmp_path / "w8")
    assert check_weights(art) == []
    assert check_weights(tiny_llama_dir) == []


def test_zeroed_scale_is_caught(tiny_llama_dir, tmp_path):
    art = _w8a16(tiny_llama_dir, tmp_path / "w8")
    _edit(art, lambda s: s[SCALE].zero_())
    assert check_weights(art) == [f"model.safetensors: quantization scale {SCALE} is all zero"]


def test_missing_scale_is_caught(tiny_llama_dir, tmp_path):
    art = _w8a16(tiny_llama_dir, tmp_path / "w8")
    _edit(art, lambda s: s.pop(SCALE))
    assert check_weights(art) == [f"quantization scale {SCALE} is missing"]


def test_nan_weight_is_caught(tiny_llama_dir):
    import torch

    def plant(s):
        s["model.norm.weight"][3] = torch.nan

    _edit(tiny_llama_dir, plant)
    (problem,) = check_weights(tiny_llama_dir)
    assert "model.norm.weight has 1 NaN/Inf values" in problem


def test_parameters_that_did_not_load(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert check_loaded(model, tiny_llama_dir) == []
    _edit(tiny_llama_dir, lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    assert check_loaded(model, tiny_llama_dir) == [
        "parameter model.layers.1.mlp.up_proj.weight is not in the checkpoint (randomly initialized)"
    ]


def _permuted_tokenizer(folder: Path) -> None:
    # Same vocabulary size, different ids: the silent kind of tokenizer mismatch.
    tj = json.loads((folder / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    letters = sorted(k for k, v in vocab.items() if v < 256)
    ids = [vocab[k] for k in letters]
    for k, v in zip(letters, reversed(ids), strict=True):
        vocab[k] = v
    (folder / "tokenizer.json").write_text(json.dumps(tj))


def test_tokenizer_mismatch_is_caught(tiny_llama_dir, tmp_path):
    from transformers import AutoTokenizer

    other = Path(shutil.copytree(tiny_llama_dir, tmp_path / "other-tok"))
    _permuted_tokenizer(other)
    ref, cand = AutoTokenizer.from_pretrained(tiny_llama_dir), AutoTokenizer.from_pretrained(other)
    assert check_tokenizers(ref, ref) is None
    msg = check_tokenizers(ref, cand)
    assert msg.startswith("tokenizer mismatch") and "first differing at position 0" in msg


def test_degenerate_output():
    assert degenerate([7] * 8) == "degenerate output: token 7 repeated 8 times"
    assert degenerate([2, 5], eos_token_id=2) == "degenerate output: empty (end of text at once)"
    assert degenerate([1, 2, 3, 2]) is None
    with pytest.raises(IntegrityError, match="failed integrity checks"):
        raise_on_problems(["x"], "candidate")
    raise_on_problems([], "candidate")


@pytest.mark.parametrize("fault", ["zeroed", "missing"])
def test_cli_fails_fast_on_bad_scale(tiny_llama_dir, tmp_path, fault):
    art = _w8a16(tiny_llama_dir, tmp_path / "w8")
    _edit(art, (lambda s: s[SCALE].zero_()) if fault == "zeroed" else (lambda s: s.pop(SCALE)))
    res = CliRunner().invoke(app, ["verify", str(tiny_llama_dir), str(art)])
    assert res.exit_code != 0
    assert isinstance(res.exception, IntegrityError)
    assert SCALE in str(res.exception) and "fix:" in str(res.exception)


def test_cli_fails_fast_on_tokenizer_mismatch(tiny_llama_dir, tmp_path):
    other = Path(shutil.copytree(tiny_llama_dir, tmp_path / "other-tok"))
    _permuted_tokenizer(other)
    res = CliRunner().invoke(app, ["verify", str(tiny_llama_dir), str(other)])
    assert res.exit_code != 0 and "tokenizer mismatch" in str(res.exception)
