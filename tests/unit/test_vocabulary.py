"""One vocabulary for one machine and one plan: dtype sizes, the Target, the memory math and the
ModelInfo builder, each checked against hand arithmetic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmopt.core.units import DTYPE_BYTES, dtype_bytes
from llmopt.hardware import host
from llmopt.hardware.target import NoGpuError, Target, detect_target
from llmopt.model.info import CONFIG_ONLY, info_from_config, inspect_model
from llmopt.planning.memory import memory_plan, memory_table

CONFIGS = Path(__file__).parents[1] / "fixtures" / "configs"
CFG_8B = json.loads((CONFIGS / "llama-3.1-8b" / "config.json").read_text())
GiB = 2**30


def test_dtype_bytes_and_unknown_name():
    assert dtype_bytes("float32") == 4 and dtype_bytes("bfloat16") == dtype_bytes("float16") == 2
    assert dtype_bytes("fp8") == dtype_bytes("int8") == 1 and dtype_bytes("int4") == 0.5
    with pytest.raises(ValueError, match="unknown dtype 'fp16'; known: .*bfloat16.*int4"):
        dtype_bytes("fp16")
    assert set(DTYPE_BYTES) >= {"float32", "bfloat16", "float16", "fp8", "int8", "int4"}


def test_host_probe_is_public_and_consistent():
    assert host.usable_cores() >= 1 and host.ram_bytes() > 0 and host.cpu_name()
    assert set(host.isa_features()) <= set(host.ISA_FLAGS)
    cpu = host.probe_cpu()
    assert cpu["usable_cpus"] == host.usable_cores()


def test_target_round_trip_and_old_run_files():
    for t in (
        Target("cpu", threads=2, cpu="test cpu", memory_bytes=8 * GiB, features=["avx2"]),
        Target.gpu_model("H200", 8),
        detect_target("cpu", 3),
    ):
        d = t.to_dict()
        assert Target.from_dict(json.loads(json.dumps(d))) == t
        # optimize's plan.json keys and a deploy bundle's keys are both written
        assert {"device", "threads", "cpu", "memory_bytes", "features", "gpu"} <= set(d)
        assert {"kind", "name", "count", "bandwidth_gbs", "compute_capability", "source"} <= set(d)
    h200 = Target.gpu_model("H200", 8)
    assert (h200.kind, h200.device, h200.name) == ("gpu", "cuda", "H200")
    assert h200.compute_capability == "9.0"
    assert detect_target("cpu", 3).threads == 3
    # a plan.json written before the merge (optimize's Target)
    old = {"device": "cpu", "threads": 2, "cpu": "x", "memory_bytes": 5, "features": []}
    assert Target.from_dict(old) == Target("cpu", 2, "x", 5)
    # a deploy bundle's plan.json target written before the merge (ServingTarget)
    dep = {
        "kind": "gpu",
        "name": "L4",
        "count": 2,
        "memory_bytes": 7,
        "bandwidth_gbs": 300.0,
        "compute_capability": "8.9",
        "source": "spec table",
        "threads": None,
        "features": [],
    }
    t = Target.from_dict(dep)
    assert (t.device, t.name, t.count, t.compute_capability, t.bandwidth_gbs) == (
        "cuda",
        "L4",
        2,
        "8.9",
        300.0,
    )
    with pytest.raises(ValueError, match="use cpu or cuda"):
        Target("tpu")


def test_from_doctor_without_gpu_says_why():
    class Report:
        gpus: list = []

        def get(self, _id):
            class F:
                details = {"likely_causes": [{"cause": "no NVIDIA GPU in this machine"}]}

            return F()

    with pytest.raises(NoGpuError, match="no NVIDIA GPU in this machine"):
        Target.from_doctor(Report())


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


def test_one_modelinfo_builder_from_folder_and_from_config(tiny_llama_dir, tmp_path):
    weights = inspect_model(tiny_llama_dir)
    assert weights.weight_format == "safetensors" and weights.bytes_on_disk > 0
    # the same folder's config alone: same shape, parameter count from the config formula
    config_only = tmp_path / "cfg"
    config_only.mkdir()
    (config_only / "config.json").write_bytes((Path(tiny_llama_dir) / "config.json").read_bytes())
    info = inspect_model(config_only, config_only="auto")
    assert info.weight_format == CONFIG_ONLY and info.weight_files == []
    for key in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size"):
        assert getattr(info, key) == getattr(weights, key)
    assert info.kv_bytes_per_token == weights.kv_bytes_per_token
    forced = inspect_model(tiny_llama_dir, config_only=True, params=1e6)
    assert forced.weight_format == CONFIG_ONLY and forced.num_parameters == 1_000_000
    assert inspect_model(tiny_llama_dir, params=2e6).num_parameters == 2_000_000
    with pytest.raises(Exception, match="no weights"):
        inspect_model(config_only)  # runs need the weights
    with pytest.raises(ValueError, match="config_only"):
        inspect_model(config_only, config_only="yes")
