"""Serving plans against hand calculation: Llama-3.1-8B on one H200, Llama-3.1-70B on 8 GPUs.

The models are built from their public config.json values (tests/fixtures/configs/); every
expected number below is written out as arithmetic, not taken from the code under test.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmopt.doctor import diagnose
from llmopt.hardware.target import Target
from llmopt.model.config import estimate_parameters
from llmopt.model.info import CONFIG_ONLY, info_from_config, inspect_model
from llmopt.planning.memory import memory_plan
from llmopt.planning.serving import plan_serving
from llmopt.planning.workload import Workload

ROOT = Path(__file__).parents[3]
CONFIGS = ROOT / "tests" / "fixtures" / "configs"
CFG_8B = json.loads((CONFIGS / "llama-3.1-8b" / "config.json").read_text())
CFG_70B = json.loads((CONFIGS / "llama-3.1-70b" / "config.json").read_text())
GiB = 2**30
H200_BYTES = 143771 * 2**20  # nvidia-smi's total on the H200 (recorded)
H100_BYTES = 81559 * 2**20


@pytest.fixture(scope="module")
def info_8b():
    return info_from_config(CFG_8B, name="Llama-3.1-8B")


@pytest.fixture(scope="module")
def info_70b():
    return info_from_config(CFG_70B, name="Llama-3.1-70B")


def test_parameter_counts_and_kv_per_token(info_8b, info_70b):
    # 8B: embeddings and LM head 2*V*H; per layer q,o H*H, k,v H*1024, MLP 3*H*I, two norms.
    layer_8b = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    assert estimate_parameters(CFG_8B) == 2 * 128256 * 4096 + 32 * layer_8b + 4096 == 8_030_261_248
    layer_70b = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192
    assert (
        estimate_parameters(CFG_70B) == 2 * 128256 * 8192 + 80 * layer_70b + 8192 == 70_553_706_496
    )
    assert info_8b.kv_bytes_per_token["bfloat16"] == 32 * 8 * 128 * 2 * 2 == 131_072
    assert info_8b.kv_bytes_per_token["fp8"] == 65_536
    assert info_70b.kv_bytes_per_token["bfloat16"] == 80 * 8 * 128 * 2 * 2 == 327_680


def test_llama_8b_on_one_h200_by_hand(info_8b):
    p = plan_serving(info_8b, Target.gpu_model("H200"))
    m = p.memory
    usable = int(H200_BYTES * 0.90)  # 135,679,338,086
    weights = 8_030_261_248 * 2  # bf16
    act = 8192 * (2 * 4096 + (32 + 2 * 8) * 128 + 2 * 14336) * 2  # tokens/step x live values x 2 B
    logits = 256 * 128256 * 4  # max-num-seqs fp32 rows of the vocabulary
    runtime = 1 * GiB
    budget = usable - weights - runtime - act - logits
    tokens = budget // 131_072 // 16 * 16
    assert (m.tp, m.pp, p.replicas, p.fits) == (1, 1, 1, True)
    assert m.usable_bytes == usable == 135_679_338_086
    assert m.weights_per_gpu_bytes == weights == 16_060_522_496
    assert (
        (m.activation_bytes, m.logits_bytes, m.runtime_bytes)
        == (act, logits, runtime)
        == (704_643_072, 131_334_144, GiB)
    )
    assert m.kv_budget_bytes == budget == 117_709_096_550
    assert m.kv_tokens == tokens == 898_048
    assert m.sequences_at(131072) == 6 and m.sequences_at(1024 + 256) == 701
    assert p.max_model_len == 131072  # one full-context sequence fits, so the model's own limit
    assert p.engine == "vllm"
    # Batch-1 decode reads the weights and one 1280-token sequence's KV per token at 4.8 TB/s.
    assert p.estimates["tpot_floor_ms"] == round((weights + 131_072 * 1280) / 4800e9 * 1e3, 3)


def test_llama_70b_on_eight_h100_by_hand(info_70b):
    p = plan_serving(info_70b, Target.gpu_model("H100", 8), Workload(concurrency=64))
    usable = int(H100_BYTES * 0.90)
    weights = 70_553_706_496 * 2
    runtime = GiB + GiB // 2  # + NCCL buffers once a replica spans GPUs
    logits = 64 * 128256 * 4
    need = 64 * (1024 + 256)  # 81,920 tokens of KV for the concurrency
    # tp=2: 8 KV heads -> 4 per GPU; not enough room left for 81,920 tokens.
    act2 = 8192 * (2 * 8192 + (64 + 16) * 128 // 2 + 2 * 28672 // 2) * 2
    tokens2 = (usable - weights // 2 - runtime - act2 - logits) // (80 * 4 * 128 * 2 * 2) // 16 * 16
    assert tokens2 == 24_096 < need
    # tp=4: 2 KV heads per GPU.
    act4 = 8192 * (2 * 8192 + (64 + 16) * 128 // 4 + 2 * 28672 // 4) * 2
    budget4 = usable - weights // 4 - runtime - act4 - logits
    m = p.memory
    assert (m.tp, m.pp, p.replicas) == (4, 1, 2), "smallest split that fits, two replicas on 8 GPUs"
    assert m.weights_per_gpu_bytes == weights // 4 == 35_276_853_248
    assert m.activation_bytes == act4 and m.kv_budget_bytes == budget4 == 39_503_169_945
    assert m.kv_bytes_per_token_per_gpu == 80 * 2 * 128 * 2 * 2 == 81_920
    assert m.kv_tokens == budget4 // 81_920 // 16 * 16 == 482_208
    assert p.max_num_seqs == 64
    vllm = p.launch["vllm"].argv
    assert vllm[vllm.index("--tensor-parallel-size") + 1] == "4"
    assert vllm[vllm.index("--data-parallel-size") + 1] == "2"


def test_llama_70b_forced_tp8_on_eight_h200_by_hand(info_70b):
    p = plan_serving(info_70b, Target.gpu_model("H200", 8), tp=8)
    m = p.memory
    act8 = 8192 * (2 * 8192 + (64 + 16) * 128 // 8 + 2 * 28672 // 8) * 2
    budget = (
        int(H200_BYTES * 0.90)
        - 70_553_706_496 * 2 // 8
        - (GiB + GiB // 2)
        - act8
        - 256 * 128256 * 4
    )
    assert (m.tp, p.replicas) == (8, 1)
    assert m.kv_bytes_per_token_per_gpu == 80 * 1 * 128 * 2 * 2 == 40_960  # one KV head per GPU
    assert m.kv_tokens == budget // 40_960 // 16 * 16


def test_fp8_weights_keep_embeddings_in_16_bits(info_8b):
    m = memory_plan(info_8b, H200_BYTES, precision="fp8", kv_dtype="fp8")
    embed = 2 * 128256 * 4096  # embedding + untied LM head stay bf16
    assert m.weights_total_bytes == (8_030_261_248 - embed) * 1 + embed * 2
    assert m.kv_bytes_per_token == 65_536
    p = plan_serving(info_8b, Target.gpu_model("H200"), precision="fp8", kv_dtype="fp8")
    argv = p.launch["vllm"].argv
    assert argv[argv.index("--quantization") :][:2] == ["--quantization", "fp8"]
    assert "fp8_e4m3" in p.launch["sglang"].argv
    assert '"dtype": "fp8"' in p.launch["tensorrt-llm"].files["trtllm-extra.yaml"]
    a100 = plan_serving(info_8b, Target.gpu_model("A100"), precision="fp8")
    assert any("no FP8 tensor cores" in n for n in a100.notes)


def test_layouts_engines_and_limits(info_8b, info_70b):
    l4 = plan_serving(info_70b, Target.gpu_model("L4"))
    assert not l4.fits and "does not fit" in l4.notes[0]
    static = plan_serving(
        info_8b,
        Target.gpu_model("H200"),
        Workload(
            static_shapes=True, batch_size=8, input_len=512, output_len=64, max_model_len=2048
        ),
    )
    assert static.engine == "tensorrt"
    trt = static.launch["tensorrt"].argv
    assert (
        "--optShapes=input_ids:8x512,attention_mask:8x512" in trt
        and "--maxShapes=input_ids:8x2048,attention_mask:8x2048" in trt
    )
    cpu = Target("cpu", threads=2, cpu="test cpu", memory_bytes=64 * GiB, source="test")
    assert plan_serving(info_8b, cpu).engine == "llama.cpp"
    assert plan_serving(info_8b, cpu, Workload(concurrency=8)).engine == "vllm-cpu"
    v100 = plan_serving(info_8b, Target.gpu_model("V100"))
    assert "--dtype float16" in v100.launch["vllm"].command  # no bf16 below compute capability 8.0
    llama = (
        plan_serving(info_8b, Target.gpu_model("H200"), Workload(concurrency=4))
        .launch["llama.cpp"]
        .argv
    )
    assert llama[llama.index("-c") + 1] == str(2048 * 4) and llama[llama.index("-np") + 1] == "4"
    odd = info_from_config(
        dict(CFG_8B, num_attention_heads=6, num_key_value_heads=2, head_dim=128), name="odd"
    )
    assert plan_serving(odd, Target.gpu_model("L4", 8)).memory.tp in (1, 2)  # 6 heads: no tp=4/8


def test_rate_becomes_concurrency_by_littles_law(info_8b):
    p = plan_serving(info_8b, Target.gpu_model("H200"), Workload(request_rate=10))
    floor_ms = (16_060_522_496 + 131_072 * 1280) / 4800e9 * 1e3
    seconds = 256 * floor_ms / 0.7 / 1e3
    assert p.workload.concurrency == -(-10 * seconds // 1) == 13


def test_workload_validation():
    with pytest.raises(ValueError, match="max-model-len"):
        Workload(input_len=4096, output_len=256, max_model_len=2048)
    with pytest.raises(ValueError, match="concurrency"):
        Workload(concurrency=0)


def test_recorded_h200_plan_matches_the_code(info_8b):
    """docs/h200-plan-llama-3.1-8b.json was made on the real H200; the code still computes it."""
    recorded = json.loads((ROOT / "docs" / "h200-plan-llama-3.1-8b.json").read_text())
    facts = json.loads(
        (ROOT / "tests" / "fixtures" / "doctor" / "recorded_h200_facts.json").read_text()
    )
    target = Target.from_doctor(diagnose(facts, "cuda"))
    info = info_from_config(CFG_8B, name="llama-3.1-8b")
    p = plan_serving(info, target)
    assert p.memory.to_dict() == recorded["serving"]["memory"]
    check = recorded["check"]
    assert check["fits"] and check["allocated_total_bytes"] == sum(
        check["allocated_bytes"].values()
    )
    assert check["allocated_bytes"]["kv_cache"] == p.memory.kv_budget_bytes


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llmopt.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def test_cli_plan_config_only_folder_on_a_gpu_by_name():
    proc = _run("plan", str(CONFIGS / "llama-3.1-8b"), "--gpu", "H200", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    d = json.loads(proc.stdout)
    assert d["model_source"] == "config" and d["candidates"][0]["id"] == "hf-fp32"
    assert d["serving"]["memory"]["kv_tokens"] == 898_048 and d["serving"]["engine"] == "vllm"
    over = _run("plan", str(CONFIGS / "llama-3.1-8b"), "--gpu", "H200", "--params", "8e9", "--json")
    assert json.loads(over.stdout)["serving"]["memory"]["weights_total_bytes"] == 16 * 10**9
    unknown = _run("plan", str(CONFIGS / "llama-3.1-8b"), "--gpu", "GTX480")
    assert unknown.returncode == 2 and "fix:" in unknown.stderr


def test_inspect_model_config_only_and_weights(tiny_llama_dir):
    info = inspect_model(str(CONFIGS / "llama-3.1-70b"), config_only="auto")
    assert info.weight_format == CONFIG_ONLY and info.num_parameters == 70_553_706_496
    info = inspect_model(str(tiny_llama_dir), config_only="auto")
    assert info.weight_format == "safetensors"


def _vllm_python() -> str | None:
    if importlib.util.find_spec("vllm"):
        return sys.executable
    for cand in (os.environ.get("LLMOPT_VLLM_PYTHON"), "/tmp/vllm-venv/bin/python"):
        if (
            cand
            and Path(cand).exists()
            and subprocess.run(
                [cand, "-c", "import vllm"], capture_output=True, timeout=120, check=False
            ).returncode
            == 0
        ):
            return cand
    return None


def test_vllm_own_parser_accepts_generated_flags(info_8b, info_70b):
    """vLLM's server parser + AsyncEngineArgs on our flags (skipped where vLLM is not installed;
    LLMOPT_VLLM_PYTHON may name an interpreter that has it, e.g. a separate vllm-cpu venv)."""
    py = _vllm_python()
    if py is None:
        pytest.skip(
            "vLLM not importable (set LLMOPT_VLLM_PYTHON to a python with vllm or vllm-cpu)"
        )
    gpu = plan_serving(
        info_70b,
        Target.gpu_model("H100", 8),
        Workload(concurrency=64),
        precision="fp8",
        kv_dtype="fp8",
    )
    cpu = Target("cpu", threads=2, cpu="test cpu", memory_bytes=64 * GiB, source="test")
    cpu_plan = plan_serving(info_8b, cpu, Workload(concurrency=8))
    script = (
        "import json, sys\nfrom llmopt.planning.launch import check_vllm_args\n"
        "print(json.dumps([check_vllm_args(a) for a in json.load(sys.stdin)], default=str))"
    )
    argvs = [gpu.launch["vllm"].argv, cpu_plan.launch["vllm"].argv]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    proc = subprocess.run(
        [py, "-c", script],
        input=json.dumps(argvs),
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    g, c = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (
        g["tensor_parallel_size"],
        g["data_parallel_size"],
        g["kv_cache_dtype"],
        g["quantization"],
    ) == (2, 4, "fp8", "fp8")  # fp8 halves the weights: tp=2 fits
    assert (
        g["max_num_seqs"] == 64
        and g["enable_prefix_caching"] is True
        and g["gpu_memory_utilization"] == 0.9
    )
    assert c["model"] == "/models/model" and c["dtype"] == "float32" and c["max_num_seqs"] == 8
    bad = subprocess.run(
        [py, "-c", script],
        input=json.dumps([["vllm", "serve", "/m", "--no-such-flag", "1"]]),
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert bad.returncode != 0 and "no-such-flag" in bad.stderr
