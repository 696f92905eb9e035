"""The search space: the reference first, every other candidate or the reason it is skipped."""

from __future__ import annotations

import pytest

from llmopt.hardware.target import Target
from llmopt.model.info import inspect_model
from llmopt.optimize.space import make_plan

CPU = Target(device="cpu", threads=2, cpu="test cpu", memory_bytes=8 * 2**30)


def test_plan_lists_reference_first_and_skips_with_reasons(tiny_llama_dir):
    plan = make_plan(inspect_model(tiny_llama_dir), CPU)
    ids = [c.id for c in plan.candidates]
    assert ids[0] == "hf-fp32" and plan.candidates[0].reference
    assert {"hf-bf16", "hf-w8a16"} <= set(ids)
    skipped = {s["id"]: s["reason"] for s in plan.skipped}
    assert "bf16" in skipped["hf-fp16"]  # fp16 on CPU: use bf16
    assert "causal-lm" in skipped["onnxruntime-fp32"]
    info = inspect_model(tiny_llama_dir)
    embed = info.vocab_size * info.hidden_size  # tied: one matrix, kept in float32 by int8 recipes
    assert plan.memory["weights_bytes"]["float32"] == 4 * info.num_parameters
    assert plan.memory["weights_bytes"]["int8"] == info.num_parameters - embed + 4 * embed
    assert plan.memory["max_sequences_at_context"]["float32"] > 0


def test_plan_only_and_unknown_ids(tiny_llama_dir):
    info = inspect_model(tiny_llama_dir)
    plan = make_plan(info, CPU, only=["hf-bf16"])
    assert [c.id for c in plan.candidates] == ["hf-fp32", "hf-bf16"]
    with pytest.raises(ValueError, match="torch-int3"):
        make_plan(info, CPU, only=["torch-int3"])
