"""Run a serving plan's numbers on the real GPU: does the memory budget fit, is the TPOT right?

`llmopt plan MODEL --target cuda --check` allocates, on cuda:0, exactly what the plan puts on one
GPU (weights share, activation and logits reserve, the KV-cache budget) with plain allocations,
reads free memory before and after, and times device-to-device copies to measure the bandwidth
the TPOT estimate assumes. No engine is needed, so it runs wherever torch sees the GPU.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from llmopt.core.errors import LlmoptError

if TYPE_CHECKING:
    from llmopt.planning.serving import ServingPlan

__all__ = ["check_plan_on_gpu"]

GiB = 2**30


def _copy_bandwidth(torch: Any, nbytes: int = 4 * GiB, repeats: int = 10) -> float:
    """Device-to-device copy, bytes read + written per second (median of `repeats`, warm-up excluded)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times)


def check_plan_on_gpu(plan: ServingPlan) -> dict[str, Any]:
    """Allocate one GPU's planned memory on cuda:0 and measure the bandwidth behind the TPOT estimate.

    Args:
        plan: from `plan_serving` for this machine's GPU (`--target cuda`).

    Returns:
        Free/total memory before, what was allocated, free after, whether it fit, the measured
        copy bandwidth and the TPOT floor recomputed with it.

    Raises:
        LlmoptError: torch sees no CUDA GPU.

    >>> check_plan_on_gpu(plan)["fits"]   # doctest: +SKIP
    True
    """
    import torch

    if not torch.cuda.is_available():
        raise LlmoptError(
            "--check needs a CUDA GPU that torch can use",
            hint="run it on the GPU machine; `llmopt doctor --target cuda` says what is missing",
        )
    m = plan.memory
    free0, total = torch.cuda.mem_get_info()
    bw = _copy_bandwidth(torch)
    parts = {
        "weights": m.weights_per_gpu_bytes,
        "activations": m.activation_bytes,
        "logits": m.logits_bytes,
        "kv_cache": max(0, m.kv_budget_bytes),
    }
    held, error = [], None
    try:
        for nbytes in parts.values():
            held.append(torch.empty(nbytes, dtype=torch.uint8, device="cuda"))
        torch.cuda.synchronize()
        free1 = torch.cuda.mem_get_info()[0]
    except torch.OutOfMemoryError as e:
        error, free1 = str(e).splitlines()[0], None
    finally:
        del held
        torch.cuda.empty_cache()
    read = m.weights_per_gpu_bytes + m.kv_bytes_per_token_per_gpu * (
        plan.workload.input_len + plan.workload.output_len
    )
    return {
        "device": torch.cuda.get_device_name(0),
        "total_bytes": total,
        "free_before_bytes": free0,
        "allocated_bytes": parts,
        "allocated_total_bytes": sum(parts.values()),
        "free_after_bytes": free1,
        "fits": error is None,
        "error": error,
        "planned_usable_bytes": m.usable_bytes,
        "copy_bandwidth_gbs": round(bw / 1e9, 1),
        # Total bytes moved per second, taken as the read rate of a decode step: a decode step
        # mostly streams weights and KV cache, so a copy's rate bounds it from above.
        "tpot_floor_ms_measured_bw": round(read / bw * 1e3, 3),
        "tpot_floor_ms_planned": plan.estimates.get("tpot_floor_ms"),
        "note": "copy bandwidth counts bytes read plus written; the measured TPOT floor takes it as "
        "the rate at which a decode step can read weights and KV cache",
    }
