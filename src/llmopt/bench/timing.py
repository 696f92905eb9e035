"""Timing primitives shared by the benchmarks (memory: `llmopt.hardware.runtime`).

Rules: synchronize the device before reading the clock, run
warm-up iterations that are timed separately and excluded, repeat, and summarize with the median
and percentiles rather than a single number. An unsynchronized clock measures the launch of
asynchronous kernels rather than their work, and a single run mixes in caches warming up.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from typing import Any

from llmopt.hardware.host import cpu_name

__all__ = ["device_sync", "time_repeated", "environment"]


def device_sync(device: str = "cpu") -> None:
    """Wait for queued device work (CUDA kernels are asynchronous; CPU work is not)."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def time_repeated(
    fn: Callable[[], Any], repeats: int, warmup: int = 1, device: str = "cpu"
) -> tuple[list[float], float]:
    """Call `fn` `warmup` times (timed together, excluded), then `repeats` times, each timed.

    Returns (seconds per timed call, total warm-up seconds).

    >>> times, warm = time_repeated(lambda: None, repeats=3)
    >>> len(times)
    3
    """
    assert repeats >= 1, "repeats must be >= 1"
    t0 = time.perf_counter()
    for _ in range(warmup):
        fn()
    device_sync(device)
    warm = time.perf_counter() - t0
    out = []
    for _ in range(repeats):
        device_sync(device)
        t = time.perf_counter()
        fn()
        device_sync(device)
        out.append(time.perf_counter() - t)
    return out, warm


def environment() -> dict[str, Any]:
    """The facts every recorded number needs next to it."""
    import torch

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover - a core dependency
        pass
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    return env
