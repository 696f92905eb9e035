"""Process-level runtime facts and settings: this process's memory (current and peak resident set)
and the floating-point mode its CPU math runs in.

They sit below every stage that measures or runs a model (quantization, verification, benchmarks),
so each reads memory the same way and runs its CPU forwards under the same denormal mode.
"""

from __future__ import annotations

import os
import resource
import sys
from contextlib import contextmanager

__all__ = ["rss_bytes", "peak_rss_bytes", "flush_denormals"]


def rss_bytes() -> int:
    """Current resident set size of this process."""
    import psutil

    return int(psutil.Process(os.getpid()).memory_info().rss)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far.

    On Linux this reads VmHWM from /proc: `ru_maxrss` survives exec(), so a worker started by a
    parent that once held a large model would report the parent's peak, not its own.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return int(peak if sys.platform == "darwin" else peak * 1024)


@contextmanager
def flush_denormals():
    """Flush denormal floats to zero on CPU inside the block, then restore the previous mode.

    Why: SmolLM2's fp32 forward on CPU produces denormal activations; with them a 32-token greedy
    decode took 24 s instead of ~1.5 s on a 2-core Xeon. Values below 1.2e-38 do not move any
    metric, and reference and candidate run under the same mode. The flag is per thread: torch's
    worker threads inherit it only when it is set before the thread pool starts (the CLI does
    that first thing); here it covers the calling thread. Also usable as a decorator (the whole
    call runs in that mode).
    """
    import torch

    # set_flush_denormal returns False where unsupported; the previous mode cannot be read, so
    # restore the default (off).
    enabled = torch.set_flush_denormal(True)
    try:
        yield
    finally:
        if enabled:
            torch.set_flush_denormal(False)
