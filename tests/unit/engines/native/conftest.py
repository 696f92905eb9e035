"""Shared pieces of the native engine's tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from llmopt.engines.native.config import NativeConfig
from llmopt.engines.native.model import Transformer
from llmopt.engines.native.weights import random_model

TINY_LLAMA = {
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


@pytest.fixture
def tiny_native() -> Callable[..., Transformer]:
    """A maker of seeded random fp32 CPU models of a tiny Llama shape (2 layers, GQA)."""

    def make(seed: int = 3) -> Transformer:
        return random_model(NativeConfig.from_hf(TINY_LLAMA), "cpu", torch.float32, seed=seed)

    return make
