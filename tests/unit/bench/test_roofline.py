"""Roofline: measured ceilings, verdicts on known numbers, and the swept in-process benchmark."""

from __future__ import annotations

import pytest
import torch

from llmopt.bench.roofline import Ceilings, PhaseWork, attribute, attribute_lm, measure_ceilings
from llmopt.core.schema import summarize
from llmopt.core.settings import EngineSettings

# 10 GB/s copy, 100 GFLOP/s fp32: ridge at 10 FLOP/byte.
C = Ceilings(10e9, {"float32": 100e9, "bfloat16": 400e9}, "cpu", 2, 0.0)


def test_batch1_decode_is_memory_bound_and_says_so():
    # 100M params fp32: 400 MB per step, 0.2 GFLOP; at 0.05 s -> 8 GB/s (80% of copy).
    w = PhaseWork.decode(1e8, 4e8, 0, batch=1, context=0)
    row = attribute(w, 0.05, C)
    assert row["verdict"] == "memory-bound" and row["bandwidth_share"] == pytest.approx(0.8)
    assert "weight-only" in row["implication"]


def test_long_prefill_is_compute_bound():
    w = PhaseWork.prefill(1e8, 4e8, 0, tokens=512)  # intensity 256 FLOP/byte > ridge 10
    row = attribute(w, 2 * 1e8 * 512 / 80e9, C)  # 80 GFLOP/s -> 80% of peak
    assert row["verdict"] == "compute-bound" and row["flops_share"] == pytest.approx(0.8)


def test_far_from_both_ceilings_is_overhead_bound():
    row = attribute(PhaseWork.decode(1e8, 4e8, 0, 1, 0), 1.0, C)  # 0.4 GB/s: 4% of copy
    assert row["verdict"] == "overhead-bound" and row["roofline_bound"] == "memory-bound"


def test_dtype_picks_its_own_ceiling():
    w = PhaseWork.prefill(1e8, 2e8, 0, tokens=512, dtype="bfloat16")
    assert attribute(w, 1.0, C)["ridge_flops_per_byte"] == pytest.approx(40.0)


def test_attribute_lm_reads_metric_names():
    stats = {
        "prefill_tokens_per_s": summarize([1000.0]),
        "prefill_tokens_per_s_p32": summarize([500.0]),
        "decode_tokens_per_s": summarize([20.0]),
        "decode_tokens_per_s_b4": summarize([60.0]),
        "decode_ms_per_token": summarize([50.0]),
    }
    rows = attribute_lm(stats, 100, 32, 1e8, 4e8, 1000, C)
    assert [r["metric"] for r in rows] == [k for k in stats if "ms" not in k]
    b4 = rows[-1]
    # 4 sequences per step at 60 tokens/s -> 1/15 s per step; FLOPs 2*1e8*4.
    assert b4["seconds"] == pytest.approx(4 / 60) and b4["achieved_flops_per_s"] == pytest.approx(
        8e8 * 15
    )


def test_measure_ceilings_is_quick_and_positive():
    c = measure_ceilings(copy_mib=32, matmul_n=256, repeats=2)
    assert c.copy_bytes_per_s > 1e8 and c.matmul_flops_per_s["float32"] > 1e8
    assert set(c.matmul_flops_per_s) == {"float32", "bfloat16"} and c.seconds < 30


def test_swept_lm_bench_keeps_historic_names(tiny_llama_dir, tmp_path):
    from llmopt.bench.lm import bench_causal_lm
    from llmopt.core.recipes import get_recipe
    from llmopt.engines import get_engine
    from llmopt.model.info import inspect_model

    info, engine, recipe = inspect_model(tiny_llama_dir), get_engine("hf"), get_recipe("fp32")
    out = tmp_path / "a"
    out.mkdir()
    engine.build(tiny_llama_dir, info, recipe, out)
    runner = engine.load(out, info, recipe, EngineSettings(threads=1))
    prompt = torch.arange(3, 19).unsqueeze(0)  # (1, 16)
    stats, warm = bench_causal_lm(runner, prompt, 4, 2, batch_sizes=(1, 3), prompt_lengths=(8, 16))
    assert set(stats) == {
        "prefill_tokens_per_s",
        "prefill_tokens_per_s_p8",
        "decode_tokens_per_s",
        "decode_ms_per_token",
        "decode_tokens_per_s_b3",
        "decode_ms_per_step_b3",
    }
    assert all(s.n == 2 and s.median > 0 for s in stats.values()) and warm > 0
