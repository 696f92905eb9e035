"""`scoring.window_logits`: a window scored in three pieces (prefill, paged chunk, one-token
steps) gives the logits of one prefill over the whole window."""

from __future__ import annotations

import pytest
import torch

from llmopt.engines.native.config import NativeConfig
from llmopt.engines.native.scoring import window_logits
from llmopt.engines.native.weights import random_model


def _model():
    cfg = NativeConfig.from_hf(
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 128,
            "max_position_embeddings": 256,
        }
    )
    return random_model(cfg, "cpu", torch.float32, seed=3)


@pytest.mark.parametrize("prefill,decode", [(8, 5), (40, 0), (1, 39)])
def test_pieces_match_one_prefill(prefill, decode):
    model = _model()
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(0))
    got = window_logits(model, ids, prefill, decode, torch.float32, "cpu")
    whole = window_logits(model, ids, 40, 0, torch.float32, "cpu")
    assert got.shape == whole.shape == (40, 128)
    assert torch.allclose(got, whole, atol=1e-4, rtol=1e-4), float((got - whole).abs().max())


def test_window_too_short_is_refused():
    with pytest.raises(ValueError, match="cannot hold prefill=30, decode=20"):
        window_logits(_model(), torch.zeros(40, dtype=torch.long), 30, 20, torch.float32, "cpu")
