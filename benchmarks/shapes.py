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
    # The built-in SmolLM2-135M's config (tied embeddings, 3 KV heads of 64): a small model,
    # launch-bound on a GPU, for speed without its GGUF.
    "smollm2-135m": {
        "model_type": "llama",
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "intermediate_size": 1536,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # Gemma 3 270M's published config: 5 sliding-window (512) layers to each global one, one KV
    # head of 256, query/key norms, tied embeddings. Its 262k vocabulary needs Gemma's tokenizer;
    # with another tokenizer pass --vocab (the tokenizer's size).
    "gemma-3-270m": {
        "model_type": "gemma3_text",
        "hidden_size": 640,
        "num_hidden_layers": 18,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "intermediate_size": 2048,
        "vocab_size": 262144,
        "max_position_embeddings": 32768,
        "sliding_window": 512,
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
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
