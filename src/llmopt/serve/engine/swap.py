"""When swapping a preempted sequence's KV cache to host memory beats recomputing it.

Recomputing a sequence of T tokens costs a prefill: about 2 * P FLOPs per token, P the decoder
layers' parameters. Swapping it costs moving its keys and values out and back: 2 * kv bytes per
token over the host link. Both grow with T, so the verdict is per model and device, not per
sequence: swapping pays when the model's recompute intensity (P / kv, FLOPs per byte moved) is
above the device's balance (peak FLOP/s over host-link bytes/s). For Llama-3.1-8B in bf16 (7.0 G
layer parameters, 128 KiB of KV per token: 53,000 FLOP/B) on an H200 (989 TFLOP/s over ~50 GB/s
of PCIe 5: 19,800 FLOP/B) swapping pays; for SmolLM2-135M (106 M, 23 KiB in bf16: 4,600) on the
same GPU it does not. On a CPU the "host" is the same memory, a copy runs at memory speed, and
swapping pays for any transformer.

The figures are datasheet peaks and typical link speeds, so the verdict is a coarse guide (real
prefills run below peak, which favours swapping further); it is logged with its numbers.
"""

from __future__ import annotations

from llmopt.engines.generation import BatchGenerator
from llmopt.hardware.specs import match_gpu

__all__ = ["swap_pays", "device_balance"]

# Host link bytes/s: PCIe 5 x16 (Hopper and newer), PCIe 4 x16 otherwise; usable, not line rate.
PCIE5_BPS = 50e9
PCIE4_BPS = 25e9
# A CPU "swaps" with a memory copy; FLOP/s per thread for fp32 GEMMs with AVX-512 (2 FMA units).
CPU_COPY_BPS = 10e9
CPU_FLOPS_PER_THREAD = 100e9


def device_balance(device: str) -> tuple[float, str]:
    """(peak FLOP/s over host-copy bytes/s, how it was estimated) for `device`."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        spec = match_gpu(name)
        major, _ = torch.cuda.get_device_capability()
        link = PCIE5_BPS if major >= 9 else PCIE4_BPS
        flops = (spec.bf16_tflops if spec and spec.bf16_tflops else 300.0) * 1e12
        src = f"{name}: {flops / 1e12:.0f} TFLOP/s" + ("" if spec else " (assumed)")
        return flops / link, f"{src} over {link / 1e9:.0f} GB/s to the host"
    threads = torch.get_num_threads()
    flops = CPU_FLOPS_PER_THREAD * threads
    return flops / CPU_COPY_BPS, (
        f"CPU, {threads} threads: ~{flops / 1e9:.0f} GFLOP/s over ~{CPU_COPY_BPS / 1e9:.0f} GB/s "
        "of memory copy"
    )


def swap_pays(gen: BatchGenerator) -> tuple[bool, str]:
    """(whether swapping beats recomputing for `gen`'s model on its device, the reason)."""
    params = gen.layer_parameters()
    kv = gen.kv_bytes_per_token()
    intensity = params / kv  # 2P FLOPs recomputed vs 2 kv bytes moved, per token
    balance, how = device_balance(str(gen.device))
    verdict = intensity > balance
    why = (
        f"recomputing costs {intensity:,.0f} FLOP per KV byte swapped ({params / 1e6:,.0f} M "
        f"layer parameters, {kv / 1024:.1f} KiB of KV per token); the device does "
        f"{balance:,.0f} FLOP in the time it moves one byte ({how}): "
        f"{'swap' if verdict else 'recompute'}"
    )
    return verdict, why
