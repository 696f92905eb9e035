"""The one memory math, checked against hand arithmetic on a Llama-8B config."""

from __future__ import annotations

import json
from pathlib import Path

from llmopt.hardware.target import Target
from llmopt.model.info import info_from_config
from llmopt.planning.memory import memory_plan, memory_table

CONFIGS = Path(__file__).parents[2] / "fixtures" / "configs"

CFG_8B = json.loads((CONFIGS / "llama-3.1-8b" / "config.json").read_text())

GiB = 2**30


def test_memory_math_on_llama_8b_by_hand():
    info = info_from_config(CFG_8B, name="Llama-3.1-8B")
    m = memory_plan(info, 143771 * 2**20)
    assert m.weights_total_bytes == 8_030_261_248 * 2  # bf16
    assert m.kv_bytes_per_token == 32 * 8 * 128 * 2 * 2 == 131_072
    assert m.kv_tokens == 898_048
    cpu = Target("cpu", threads=2, cpu="test", memory_bytes=64 * GiB)
    table = memory_table(info, cpu, context=8192)
    assert table["weights_bytes"]["bfloat16"] == 16_060_522_496
    assert table["weights_bytes"]["float32"] == 8_030_261_248 * 4
    assert table["kv_bytes_per_token"]["bfloat16"] == 131_072 and table["context"] == 8192
    # the same memory_plan, on the CPU target's defaults (0.80 of RAM, 8192-token steps)
    same = memory_plan(info, 64 * GiB, utilization=0.80, max_num_batched_tokens=8192)
    assert table["max_sequences_at_context"]["bfloat16"] == same.kv_tokens // 8192
