"""CLS and last-token pooling end to end on tiny random models: the runners' vectors are the
ones computed by hand from the transformer's hidden states, whatever the batch and padding."""

from __future__ import annotations

import numpy as np
import pytest

from llmopt.engines import load_runner
from llmopt.engines.pooling import encoder_feeds
from llmopt.model.info import inspect_model

TEXTS = ["a short one", "a much longer sentence about the tokenizer and padding", "mid size text"]


def _by_hand(folder, texts, pick):
    """Each text alone (no padding at all), the pooled token picked by `pick`, normalized."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    rows = []
    with torch.inference_mode():
        for t in texts:
            hidden = model(**tok([t], return_tensors="pt")).last_hidden_state[0].numpy()
            v = hidden[pick]
            rows.append(v / np.linalg.norm(v))
    return np.asarray(rows)


def test_cls_pooling_matches_hand_computation(tiny_bert_cls_dir):
    info = inspect_model(str(tiny_bert_cls_dir))
    runner = load_runner("hf", tiny_bert_cls_dir, info, "fp32", {"threads": 1})
    got = runner.embed(TEXTS, batch_size=3)  # one padded batch
    np.testing.assert_allclose(got, _by_hand(tiny_bert_cls_dir, TEXTS, 0), atol=1e-5)
    # Another token's state is another vector: the CLS position is really the one taken.
    assert not np.allclose(got, _by_hand(tiny_bert_cls_dir, TEXTS, 1), atol=1e-3)
    assert np.linalg.norm(got, axis=1) == pytest.approx(1.0, abs=1e-5)


def test_last_token_pooling_with_left_padding(tiny_last_token_dir):
    info = inspect_model(str(tiny_last_token_dir))
    runner = load_runner("hf", tiny_last_token_dir, info, "fp32", {"threads": 1})
    assert runner.tokenizer.padding_side == "left"  # as Qwen3-Embedding's tokenizer
    batched = runner.embed(TEXTS, batch_size=3)
    alone = np.concatenate([runner.embed([t], batch_size=1) for t in TEXTS])
    hand = _by_hand(tiny_last_token_dir, TEXTS, -1)
    np.testing.assert_allclose(alone, hand, atol=1e-5)
    # Left padding shifts positions only through the mask, so the batch matches closely; the
    # old "sum of mask - 1" index would have picked a padding token here instead.
    np.testing.assert_allclose(batched, hand, atol=1e-4)
    wrong = runner.tokenizer(TEXTS, padding=True, return_tensors="np")["attention_mask"]
    assert (wrong[:, 0] == 0).any(), "the texts differ in length, so some rows are padded"


def test_encoder_feeds_zero_segments_and_unknown_inputs(tiny_bert_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_bert_dir)
    feeds, mask = encoder_feeds(tok, TEXTS, 16, ["input_ids", "attention_mask", "token_type_ids"])
    assert feeds["input_ids"].dtype == np.int64 and mask.shape == feeds["input_ids"].shape
    assert mask.shape[1] <= 16
    with pytest.raises(KeyError, match="pixel_values"):
        encoder_feeds(tok, TEXTS, 16, ["input_ids", "pixel_values"])


def test_onnxruntime_runs_cls_pooling_as_torch_does(tiny_bert_cls_dir, tmp_path):
    from llmopt.core.recipes import get_recipe
    from llmopt.engines import get_engine

    engine = get_engine("onnxruntime")
    if engine.missing():
        pytest.skip(engine.missing())
    info = inspect_model(str(tiny_bert_cls_dir))
    out = tmp_path / "ort"
    out.mkdir()
    engine.build(tiny_bert_cls_dir, info, get_recipe("fp32"), out)
    ort = load_runner("onnxruntime", out, info, "fp32", {"threads": 1}).embed(TEXTS, 3)
    hf = load_runner("hf", tiny_bert_cls_dir, info, "fp32", {"threads": 1}).embed(TEXTS, 3)
    np.testing.assert_allclose(ort, hf, atol=1e-4)
    np.testing.assert_allclose(ort, _by_hand(tiny_bert_cls_dir, TEXTS, 0), atol=1e-4)
