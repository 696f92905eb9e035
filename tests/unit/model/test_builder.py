"""The one ModelInfo builder: from a folder, from config.json alone, with --params."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmopt.model.info import CONFIG_ONLY, inspect_model


def test_one_modelinfo_builder_from_folder_and_from_config(tiny_llama_dir, tmp_path):
    weights = inspect_model(tiny_llama_dir)
    assert weights.weight_format == "safetensors" and weights.bytes_on_disk > 0
    # the same folder's config alone: same shape, parameter count from the config formula
    config_only = tmp_path / "cfg"
    config_only.mkdir()
    (config_only / "config.json").write_bytes((Path(tiny_llama_dir) / "config.json").read_bytes())
    info = inspect_model(config_only, config_only="auto")
    assert info.weight_format == CONFIG_ONLY and info.weight_files == []
    for key in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size"):
        assert getattr(info, key) == getattr(weights, key)
    assert info.kv_bytes_per_token == weights.kv_bytes_per_token
    forced = inspect_model(tiny_llama_dir, config_only=True, params=1e6)
    assert forced.weight_format == CONFIG_ONLY and forced.num_parameters == 1_000_000
    assert inspect_model(tiny_llama_dir, params=2e6).num_parameters == 2_000_000
    with pytest.raises(Exception, match="no weights"):
        inspect_model(config_only)  # runs need the weights
    with pytest.raises(ValueError, match="config_only"):
        inspect_model(config_only, config_only="yes")
