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
from pathlib import Path
from typing import Any

from llmopt.hardware.host import cpu_name

__all__ = ["device_sync", "time_repeated", "environment", "machine_probe", "choose_threads"]


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


def machine_probe(size: int = 192, iters: int = 40) -> dict[str, float | None]:
    """A short fixed workload timed now, with the load average and CPU clock: what a benchmark
    records before and after its timed block, so that two numbers measured minutes apart can be
    compared only when the machine was alike for both (a neighbour's busy loop shows as a slower
    probe and a higher load).

    The workload is `iters` float32 matmuls of `size` x `size` on one thread (a few milliseconds
    on an idle core); its milliseconds are the median of three tries.

    >>> p = machine_probe(size=16, iters=2)
    >>> p["probe_ms"] > 0 and "loadavg_1m" in p
    True
    """
    import torch

    a = torch.randn(size, size)
    b = torch.randn(size, size)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core's speed: independent of how many threads the bench uses
    try:
        tries = []
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(iters):
                a @ b
            tries.append((time.perf_counter() - t0) * 1e3)
    finally:
        torch.set_num_threads(threads)
    out: dict[str, float | None] = {"probe_ms": round(sorted(tries)[1], 3)}
    try:
        out["loadavg_1m"] = round(os.getloadavg()[0], 2)
    except OSError:  # not on every platform
        out["loadavg_1m"] = None
    out["cpu_mhz"] = _cpu_mhz()
    return out


def thread_probe(
    counts: list[int], rounds: int = 3, size: int = 384, iters: int = 6
) -> dict[int, float]:
    """Milliseconds a fixed parallel workload (`iters` float32 matmuls of `size` x `size`) takes
    at each thread count in `counts`, interleaved over `rounds` (A B A B ...), medians.

    On free cores more threads finish sooner; on cores other work keeps busy an OpenMP team
    waits at every barrier for its descheduled members and can run many times slower than one
    thread (docs/benchmarks.md), which is what this measures.

    >>> sorted(thread_probe([1], rounds=1, size=16, iters=1))
    [1]
    """
    import torch

    a = torch.randn(size, size)
    b = torch.randn(size, size)
    before = torch.get_num_threads()
    times: dict[int, list[float]] = {n: [] for n in counts}
    try:
        for _ in range(rounds):
            for n in counts:
                torch.set_num_threads(n)
                a @ b  # the team of this size is up before the clock starts
                t0 = time.perf_counter()
                for _ in range(iters):
                    a @ b
                times[n].append((time.perf_counter() - t0) * 1e3)
    finally:
        torch.set_num_threads(before)
    return {n: sorted(v)[len(v) // 2] for n, v in times.items()}


def choose_threads(available: int, probe: Callable[[list[int]], dict[int, float]] | None = None):
    """The thread count candidates run with when none is given: all `available` cores unless a
    probe run now finds fewer threads faster (cores busy with other work). Returns
    (threads, why) where `why` says what the probe measured when it chose fewer, else None.

    >>> choose_threads(2, lambda c: {2: 9.0, 1: 12.0})
    (2, None)
    >>> choose_threads(2, lambda c: {2: 40.0, 1: 12.0})[0]
    1
    """
    if available <= 1:
        return available, None
    counts = sorted({available, max(1, available // 2), 1}, reverse=True)
    ms = (probe or thread_probe)(counts)
    best = min(counts, key=lambda n: (ms[n], -n))
    if best == available:
        return available, None
    return best, (
        f"threads: {best} of {available}: a probe of this machine now ran {available} threads "
        f"in {ms[available]:.1f} ms and {best} in {ms[best]:.1f} ms (other work is using the "
        f"cores); --threads {available} to use them all anyway"
    )


def _cpu_mhz() -> float | None:
    """The current clock of CPU 0 in MHz where Linux exposes it (None elsewhere)."""
    for path in (
        "/sys/devices/system/cpu/cpu0/cpufreq/scaling_cur_freq",  # kHz
        "/proc/cpuinfo",
    ):
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError:
            continue
        if path.endswith("scaling_cur_freq"):
            return round(int(text.strip()) / 1000, 1)
        for line in text.splitlines():
            if line.startswith("cpu MHz"):
                return round(float(line.split(":")[1]), 1)
    return None
