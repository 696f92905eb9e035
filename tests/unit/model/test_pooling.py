"""The embedding head read from sentence-transformers files: pooling, normalization, prompts."""

from __future__ import annotations

import json

import pytest

from llmopt.core.errors import UnsupportedModelError
from llmopt.model.info import inspect_model
from llmopt.model.pooling import read_embedding_head


def test_mean_cls_and_last_token_folders(tiny_bert_dir, tiny_bert_cls_dir, tiny_last_token_dir):
    mean = inspect_model(str(tiny_bert_dir))
    assert (mean.task, mean.pooling, mean.normalize, mean.max_seq_length) == (
        "embedding",
        "mean",
        True,
        128,
    )
    assert mean.query_prompt is None and mean.document_prompt is None
    cls = inspect_model(str(tiny_bert_cls_dir))
    assert (cls.pooling, cls.query_prompt, cls.document_prompt) == ("cls", "query: ", "passage: ")
    last = inspect_model(str(tiny_last_token_dir))
    # A CausalLM architecture with sentence-transformers files is an embedder.
    assert (last.task, last.pooling, last.normalize) == ("embedding", "last", True)
    assert last.query_prompt.startswith("Instruct:") and last.document_prompt is None
    # The fields survive the JSON round trip (model.json of a run).
    assert type(last).from_dict(last.to_dict()).query_prompt == last.query_prompt


def test_defaults_without_sentence_transformers_files(tmp_path):
    assert read_embedding_head(tmp_path, encoder=True).pooling == "mean"
    assert read_embedding_head(tmp_path, encoder=False).pooling == "last"
    assert read_embedding_head(tmp_path, encoder=False).normalize is False


def test_unsupported_and_damaged_files_say_what_to_do(tiny_bert_dir):
    cfg = tiny_bert_dir / "1_Pooling" / "config.json"
    body = json.loads(cfg.read_text())
    body.update(pooling_mode_mean_tokens=False, pooling_mode_max_tokens=True)
    cfg.write_text(json.dumps(body))
    with pytest.raises(UnsupportedModelError, match="max_tokens.*not supported") as e:
        read_embedding_head(tiny_bert_dir, encoder=True)
    assert "pooling_mode_lasttoken" in e.value.hint
    body.update(pooling_mode_max_tokens=False, pooling_mode_mean_tokens=True)
    body["pooling_mode_cls_token"] = True  # two modes at once: concatenation, not supported
    cfg.write_text(json.dumps(body))
    with pytest.raises(UnsupportedModelError, match="not supported"):
        read_embedding_head(tiny_bert_dir, encoder=True)
    (tiny_bert_dir / "modules.json").write_text("{not json")
    with pytest.raises(UnsupportedModelError, match="not readable JSON") as e:
        read_embedding_head(tiny_bert_dir, encoder=True)
    assert "restore modules.json" in e.value.hint
