"""benchmarks/random_model.py: a folder of a shape is written once, then reused."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "benchmarks"))

import random_model  # noqa: E402


def test_written_once_even_with_rope_scaling(tmp_path, tiny_llama_dir, monkeypatch):
    # Llama-3.1's rope_scaling, on a tiny model: transformers adds keys to that nested dict when
    # it builds the config, which once made every call rewrite the folder.
    shape = copy.deepcopy(random_model.SHAPES["tiny"]) | {
        "rope_scaling": copy.deepcopy(random_model.SHAPES["llama-3.1-8b"]["rope_scaling"])
    }
    monkeypatch.setitem(random_model.SHAPES, "tiny-rope", shape)
    before = copy.deepcopy(shape)
    out = random_model.write_random_model("tiny-rope", tmp_path / "m", str(tiny_llama_dir))
    assert (out / "config.json").is_file() and random_model.SHAPES["tiny-rope"] == before

    def no_write(*a, **k):
        raise AssertionError("the folder was written again")

    monkeypatch.setattr("safetensors.torch.save_file", no_write)
    assert random_model.write_random_model("tiny-rope", tmp_path / "m", str(tiny_llama_dir)) == out
