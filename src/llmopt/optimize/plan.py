"""The target machine a plan is for, and the memory math (weights, KV cache, what fits).

The candidate list itself (`Plan`, `make_plan`) is built in `llmopt.optimize.space`.
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmopt.model.info import ModelInfo

__all__ = ["Target", "detect_target", "memory_math"]
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "avx512_fp16")


@dataclass
class Target:
    """The hardware a plan is for. `device` is "cpu" or "cuda"."""

    device: str
    threads: int
    cpu: str
    memory_bytes: int
    features: list[str] = field(default_factory=list)
    gpu: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def detect_target(device: str = "cpu", threads: int | None = None) -> Target:
    """Describe this machine for `device` ("cpu" or "cuda").

    Args:
        device: where candidates run.
        threads: CPU threads to use (default: all cores the process may use).
    """
    import psutil

    from llmopt.bench.timing import _cpu_name

    if device not in ("cpu", "cuda"):
        raise ValueError(f"unknown target {device!r}; use cpu or cuda")
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    gpu = None
    mem = psutil.virtual_memory().total
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("target cuda asked for, but torch sees no CUDA GPU; use --target cpu")
        p = torch.cuda.get_device_properties(0)
        gpu = {
            "name": p.name,
            "memory_bytes": p.total_memory,
            "compute_capability": f"{p.major}.{p.minor}",
        }
        mem = p.total_memory
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    return Target(
        device=device,
        threads=threads or cores,
        cpu=_cpu_name() or platform.processor(),
        memory_bytes=int(mem),
        features=[f for f in CPU_FLAGS if f in flags],
        gpu=gpu,
    )


def memory_math(info: ModelInfo, target: Target, context: int | None = None) -> dict[str, Any]:
    """Weights per precision, KV cache per token, and how many full-context sequences fit."""
    weights = {dt: info.num_parameters * b for dt, b in BYTES.items() if dt != "float16"}
    out: dict[str, Any] = {
        "weights_bytes": weights,
        "kv_bytes_per_token": dict(info.kv_bytes_per_token),
    }
    notes = []
    if info.task == "causal-lm" and info.kv_bytes_per_token:
        ctx = int(context or info.max_context or 2048)
        budget = int(target.memory_bytes * 0.9)  # leave 10% for activations, runtime, the OS
        fits = {}
        for dt, per_tok in info.kv_bytes_per_token.items():
            wdt = dt if dt in weights else "bfloat16"
            free = budget - weights.get(wdt, weights["bfloat16"])
            fits[dt] = max(0, free // (per_tok * ctx)) if per_tok else 0
        out["context"] = ctx
        out["max_sequences_at_context"] = fits
        notes.append(
            f"KV cache per token (float32) {info.kv_bytes_per_token.get('float32', 0)} B; "
            f"{ctx}-token sequences that fit in 90% of {target.memory_bytes / 2**30:.1f} GiB "
            f"beside the weights: {fits}"
        )
    out["notes"] = notes
    return out
