"""The memory math: weights, KV cache, the reserve beside them, and what fits.

`memory_plan` is the one computation. The serving plan calls it per tensor/pipeline split; the
optimizer's plan.json summarizes it per dtype with `memory_table`. Per GPU of one replica split
tp x pp ways (the whole RAM for a CPU target):

    usable    = memory x utilization (vLLM's --gpu-memory-utilization; 0.90 GPU, 0.80 CPU RAM)
    weights   = parameters x bytes per weight / (tp x pp); quantized formats keep the embedding
                (and an untied LM head) in 16 bits, as vLLM and compressed-tensors do
    reserve   = runtime (1 GiB; + 0.5 GiB NCCL buffers when a replica spans GPUs)
                + activations of one step at max_num_batched_tokens + fp32 logits of max_num_seqs
    KV budget = usable - weights - reserve, in whole blocks of `block_size` tokens
    KV/token  = layers x KV heads x head_dim x 2 (K and V) x bytes per KV element
    KV of one sequence of L tokens = KV/token per layer x (full layers x L
                + sliding-window layers x min(L, window)): a local layer holds at most its window

>>> from llmopt.model.info import info_from_config
>>> info = info_from_config({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
...     "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
...     "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256})
>>> m = memory_plan(info, 143771 * 2**20)
>>> m.weights_total_bytes, m.kv_bytes_per_token, m.kv_tokens
(16060522496, 131072, 898048)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from llmopt.core.units import dtype_bytes

if TYPE_CHECKING:
    from llmopt.hardware.target import Target
    from llmopt.model.info import ModelInfo

__all__ = [
    "MemoryPlan",
    "memory_plan",
    "memory_table",
    "default_limits",
    "WEIGHT_DTYPES",
    "KV_DTYPES",
    "GiB",
]

GiB = 2**30
WEIGHT_DTYPES = ("float32", "bfloat16", "float16", "fp8", "int8", "int4")  # planned precisions
KV_DTYPES = ("float32", "bfloat16", "float16", "fp8")  # KV-cache element types engines offer
RUNTIME_BYTES = 1 * GiB  # CUDA context, cuBLAS workspaces, CUDA graphs (vLLM captures ~0.5 GiB)
NCCL_BYTES = GiB // 2  # communication buffers once a replica spans GPUs
TABLE_DTYPES = ("float32", "bfloat16", "int8")  # weights listed in the optimizer's plan.json


@dataclass
class MemoryPlan:
    """Per-GPU memory budget of one replica (tp x pp GPUs). Bytes unless named otherwise."""

    precision: str
    kv_dtype: str
    tp: int
    pp: int
    gpu_memory_bytes: int
    utilization: float
    usable_bytes: int  # gpu_memory_bytes * utilization, what the engine may take
    weights_total_bytes: int
    weights_per_gpu_bytes: int
    runtime_bytes: int
    activation_bytes: int  # one step's live activations at max_num_batched_tokens
    logits_bytes: int  # fp32 logits of max_num_seqs sequences for sampling
    kv_budget_bytes: int
    kv_bytes_per_token: int  # whole model, all layers and KV heads
    kv_bytes_per_token_per_gpu: int
    kv_tokens: int  # tokens the KV cache holds per replica, whole blocks, every layer full
    block_size: int
    num_layers: int = 0
    sliding_layers: int = 0  # layers that attend only within `sliding_window` tokens
    sliding_window: int | None = None

    @property
    def reserve_bytes(self) -> int:
        return self.runtime_bytes + self.activation_bytes + self.logits_bytes

    def kv_bytes_per_sequence(self, tokens: int) -> int:
        """KV bytes (per GPU) one sequence of `tokens` tokens holds: a sliding-window layer
        keeps at most its window, a full-attention layer every token."""
        if not self.sliding_layers or not self.sliding_window or not self.num_layers:
            return self.kv_bytes_per_token_per_gpu * tokens
        per_layer = self.kv_bytes_per_token_per_gpu / self.num_layers
        full = self.num_layers - self.sliding_layers
        held = full * tokens + self.sliding_layers * min(tokens, self.sliding_window)
        return math.ceil(per_layer * held)

    def sequences_at(self, tokens: int) -> int:
        """Concurrent sequences of `tokens` tokens each the KV cache holds (window-aware)."""
        if tokens <= 0:
            return 0
        if not self.sliding_layers or not self.sliding_window:
            return self.kv_tokens // tokens
        return max(0, self.kv_budget_bytes) // max(1, self.kv_bytes_per_sequence(tokens))

    def to_dict(self) -> dict[str, Any]:
        d = {**asdict(self), "reserve_bytes": self.reserve_bytes}
        if not self.sliding_layers:  # full attention everywhere: the layer split adds nothing
            for k in ("num_layers", "sliding_layers", "sliding_window"):
                d.pop(k)
        return d


def weights_bytes(
    info: ModelInfo,
    precision: str,
    *,
    embeddings_16bit: bool = True,
    embed_dtype: str = "bfloat16",
) -> int:
    """All weights of `info` stored in `precision`.

    Args:
        embeddings_16bit: quantized formats keep the embedding (and an untied LM head) in
            float (`embed_dtype`), as vLLM and compressed-tensors do (they quantize the linear
            layers only); False: every weight in `precision`.
        embed_dtype: the float type those embeddings stay in (bfloat16 for a served model;
            float32 for llmopt's w8a16 artifacts, built from the fp32 reference).

    >>> from llmopt.model.info import info_from_config
    >>> info = info_from_config({"architectures": ["Gemma3ForCausalLM"],
    ...     "model_type": "gemma3_text", "hidden_size": 640, "num_hidden_layers": 18,
    ...     "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
    ...     "intermediate_size": 2048, "vocab_size": 262144, "tie_word_embeddings": True})
    >>> round(weights_bytes(info, "int8", embed_dtype="float32") / 2**20)  # 168M float32 embed
    736
    """
    width = dtype_bytes(precision)
    if width >= 2 or not embeddings_16bit:
        return int(info.num_parameters * width)
    embed = info.vocab_size * info.hidden_size * (1 if info.tied_embeddings else 2)
    return int((info.num_parameters - embed) * width + embed * dtype_bytes(embed_dtype))


def default_limits(target: Target) -> dict[str, Any]:
    """Memory share and scheduler step budget for `target`, as the engines default them.

    vLLM takes 0.90 of a GPU; on CPU RAM is shared with the OS, so 0.80. Its step budget
    (max_num_batched_tokens) is 8192 on large GPUs (70 GiB+) and CPUs, 2048 on smaller GPUs.
    """
    gpu = target.kind == "gpu"
    big = target.memory_bytes >= 70 * GiB
    return {
        "utilization": 0.90 if gpu else 0.80,
        "max_num_batched_tokens": 8192 if big or not gpu else 2048,
    }


def memory_plan(
    info: ModelInfo,
    gpu_memory_bytes: int,
    *,
    tp: int = 1,
    pp: int = 1,
    precision: str = "bfloat16",
    kv_dtype: str = "bfloat16",
    utilization: float = 0.90,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 256,
    block_size: int = 16,
    act_bytes: int = 2,
    embeddings_16bit: bool = True,
) -> MemoryPlan:
    """The per-GPU memory budget for one replica split `tp` x `pp` ways.

    Args:
        info: the model (from `inspect_model`, with weights or from config.json alone).
        gpu_memory_bytes: one GPU's total memory (or the RAM for a CPU plan).
        tp, pp: tensor and pipeline parallel degrees.
        precision: weight precision ("bfloat16", "fp8", "int8", "int4", ...).
        kv_dtype: KV-cache element type ("bfloat16", "fp8", ...).
        utilization: share of the memory the engine may take (vLLM's --gpu-memory-utilization).
        max_num_batched_tokens, max_num_seqs: scheduler limits that size activations and logits.
        block_size: tokens per KV-cache block (the cache is allocated in whole blocks).
        act_bytes: bytes per activation element.
        embeddings_16bit: see `weights_bytes`.
    """
    weights = weights_bytes(info, precision, embeddings_16bit=embeddings_16bit)
    weights_gpu = math.ceil(weights / (tp * pp))
    layers_stage = math.ceil(info.num_layers / pp)  # the fullest pipeline stage bounds the cache
    kv_heads_gpu = max(1, info.num_kv_heads // tp)  # replicated when tp > KV heads
    kv_width = dtype_bytes(kv_dtype)
    kv_tok = int(info.num_layers * info.num_kv_heads * info.head_dim * 2 * kv_width)
    kv_tok_gpu = int(layers_stage * kv_heads_gpu * info.head_dim * 2 * kv_width)
    inter = info.intermediate_size or 4 * info.hidden_size
    # Live per token in one layer: residual + normed input (2H), Q/K/V, gate and up (2I),
    # sharded by TP.
    qkv = (info.num_heads + 2 * info.num_kv_heads) * info.head_dim
    act = max_num_batched_tokens * (2 * info.hidden_size + qkv // tp + 2 * inter // tp) * act_bytes
    logits = max_num_seqs * info.vocab_size * 4
    runtime = RUNTIME_BYTES + (NCCL_BYTES if tp * pp > 1 else 0)
    usable = int(gpu_memory_bytes * utilization)
    budget = usable - weights_gpu - runtime - act - logits
    tokens = max(0, budget) // kv_tok_gpu // block_size * block_size if kv_tok_gpu else 0
    return MemoryPlan(
        precision=precision,
        kv_dtype=kv_dtype,
        tp=tp,
        pp=pp,
        gpu_memory_bytes=gpu_memory_bytes,
        utilization=utilization,
        usable_bytes=usable,
        weights_total_bytes=weights,
        weights_per_gpu_bytes=weights_gpu,
        runtime_bytes=runtime,
        activation_bytes=act,
        logits_bytes=logits,
        kv_budget_bytes=budget,
        kv_bytes_per_token=kv_tok,
        kv_bytes_per_token_per_gpu=kv_tok_gpu,
        kv_tokens=tokens,
        block_size=block_size,
        num_layers=int(info.num_layers),
        sliding_layers=int(getattr(info, "sliding_layers", 0) or 0),
        sliding_window=getattr(info, "sliding_window", None),
    )


def memory_table(info: ModelInfo, target: Target, context: int | None = None) -> dict[str, Any]:
    """`memory_plan` on one device of `target` per dtype: the "memory" section of plan.json.

    Keys: `weights_bytes` (every weight in that dtype), `kv_bytes_per_token` (per KV dtype), and
    for a decoder `context` and `max_sequences_at_context` (per KV dtype, beside weights of the
    same width, bf16 weights for fp8/fp16 KV), plus `notes` saying how it was computed.
    """
    limits = {**default_limits(target), "embeddings_16bit": False}
    # Quantized rows keep the embeddings (and an untied head) in float32, as llmopt's
    # weight-only recipes build them from the fp32 reference: the artifact's real size.
    weights = {dt: weights_bytes(info, dt, embed_dtype="float32") for dt in TABLE_DTYPES}
    out: dict[str, Any] = {
        "weights_bytes": weights,
        "kv_bytes_per_token": dict(info.kv_bytes_per_token),
    }
    notes = []
    if info.task == "causal-lm":
        notes.append(
            "int8 weights: linear layers in int8, the embeddings and an untied LM head in "
            "float32 (weight-only recipes leave them in float)"
        )
    if info.task == "causal-lm" and info.kv_bytes_per_token:
        ctx = int(context or info.max_context or 2048)
        fits, plan = {}, None
        for dt in info.kv_bytes_per_token:
            wdt = dt if dt in TABLE_DTYPES else "bfloat16"
            plan = memory_plan(info, target.memory_bytes, precision=wdt, kv_dtype=dt, **limits)
            fits[dt] = plan.sequences_at(ctx)
        out["context"] = ctx
        out["max_sequences_at_context"] = fits
        reserve = plan.reserve_bytes / GiB if plan else 0.0
        if getattr(info, "sliding_layers", 0):
            notes.append(
                f"attention: {info.attention_pattern}; a sliding-window layer's cache holds at "
                "most its window, so sequences that fit count it per layer type"
            )
        notes.append(
            f"KV cache per token (float32) {info.kv_bytes_per_token.get('float32', 0)} B; "
            f"{ctx}-token sequences that fit in {limits['utilization']:.0%} of "
            f"{target.memory_bytes / GiB:.1f} GiB beside the weights and a {reserve:.1f} GiB "
            f"reserve (runtime, activations, logits): {fits}"
        )
    out["notes"] = notes
    return out
