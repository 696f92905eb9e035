"""Model shapes (transformers config dicts) shared by the benchmark scripts.

Models are built from these with seeded random weights (`AutoConfig.for_model(**SHAPES[name])`):
speed does not depend on the values, and no model hub is needed.
"""

from __future__ import annotations

__all__ = ["SHAPES"]

SHAPES = {
    "llama-3.1-8b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    # For the smoke tests of the scripts (tests/unit/engines/native/test_engine.py runs decode.py).
    "tiny": {
        "model_type": "llama",
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 512,
        "vocab_size": 1024,
        "max_position_embeddings": 2048,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "eos_token_id": 2,
    },
}
