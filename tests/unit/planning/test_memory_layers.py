"""Memory math per layer type: sliding-window layers hold at most their window; embeddings that
weight-only recipes leave in float are counted in float."""

from __future__ import annotations

import pytest

from llmopt.model.config import attention_layers
from llmopt.model.info import info_from_config
from llmopt.planning.memory import GiB, memory_plan, memory_table, weights_bytes

# A 270M decoder with interleaved local/global attention, a 262k vocabulary, tied embeddings.
GEMMA3 = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_size": 640,
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "intermediate_size": 2048,
    "vocab_size": 262144,
    "tie_word_embeddings": True,
    "sliding_window": 512,
    "max_position_embeddings": 32768,
}


@pytest.mark.parametrize(
    ("cfg", "want"),
    [
        ({"sliding_window_pattern": 6}, (512, 15)),  # 5 local : 1 global
        ({"layer_types": ["sliding_attention"] * 10 + ["full_attention"] * 8}, (512, 10)),
        ({"model_type": "gemma2", "num_hidden_layers": 26}, (512, 13)),  # alternating
        ({"model_type": "mistral"}, (512, 18)),  # every layer
        ({"model_type": "qwen2", "use_sliding_window": False}, (None, 0)),
        ({"model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 12}, (512, 6)),
        ({"sliding_window": None}, (None, 0)),
    ],
)
def test_attention_layers_follow_each_family_rule(cfg, want):
    assert attention_layers({**GEMMA3, **cfg}) == want


def test_sliding_layers_hold_at_most_the_window():
    info = info_from_config(GEMMA3)
    assert (info.sliding_window, info.sliding_layers) == (512, 15)
    assert (
        info.attention_pattern == "15 sliding-window layers (512 tokens) + 3 full-attention layers"
    )
    m = memory_plan(info, 8 * GiB)
    per_layer = m.kv_bytes_per_token_per_gpu // 18
    # Short sequences: every layer holds every token; long ones: 15 layers stop at 512.
    assert m.kv_bytes_per_sequence(256) == per_layer * 18 * 256
    assert m.kv_bytes_per_sequence(8192) == per_layer * (3 * 8192 + 15 * 512)
    full = info_from_config({**GEMMA3, "sliding_window": None})
    mf = memory_plan(full, 8 * GiB)
    assert m.sequences_at(8192) > 4 * mf.sequences_at(8192)  # ~ (18 x 8192) / (3 x 8192 + 15 x 512)
    assert m.sequences_at(8192) == m.kv_budget_bytes // m.kv_bytes_per_sequence(8192)
    assert m.to_dict()["sliding_layers"] == 15 and "sliding_layers" not in mf.to_dict()


def test_int8_weights_keep_float_embeddings():
    info = info_from_config(GEMMA3)
    embed = 262144 * 640
    linear = info.num_parameters - embed
    assert weights_bytes(info, "int8", embed_dtype="float32") == linear + 4 * embed
    assert weights_bytes(info, "int8") == linear + 2 * embed  # served: bf16 embeddings
    assert weights_bytes(info, "int8", embeddings_16bit=False) == info.num_parameters
    from llmopt.hardware.target import Target

    table = memory_table(info, Target(device="cpu", threads=2, memory_bytes=16 * GiB))
    assert table["weights_bytes"]["int8"] == linear + 4 * embed
    assert any("sliding-window" in n for n in table["notes"])
