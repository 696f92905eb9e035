"""Hardware counters of the one-row weight kernels, under Nsight Compute (issue 24).

`linear_kernels.py` times the GEMVs; this says why they take that long: DRAM throughput against
its peak, achieved occupancy, registers, and where warps stall (a memory-latency-bound kernel
stalls on `long_scoreboard`; an issue-bound one on `math`/`not_selected`). Every kernel is built
and autotuned first, then only one call of each runs inside the profiled range, so the
autotuner's trial launches are never profiled:

    ncu --clock-control none --profile-from-start off --cache-control all \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        --section MemoryWorkloadAnalysis --section LaunchStats -o gemv \\
        python benchmarks/ncu_gemv.py --shapes gate_up o --kernels int4-g128-gemv int8-gemv
    ncu --import gemv.ncu-rep --page details --csv > gemv.csv

(`bash benchmarks/h200_runs.sh ncu` runs both and prints a summary.) `--cache-control all`
flushes the L2 between replays, so one weight set is read from device memory. Under ncu every
launch is slowed, the autotuner's timing runs too, and it picks other configs than it does
alone: run this once without ncu and `TRITON_CACHE_AUTOTUNING=1` (Triton then keeps its
choices on disk), then under ncu with the same setting. CUDA only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from linear_kernels import SHAPES_8B, kernels  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["gate_up", "o"], choices=list(SHAPES_8B))
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument(
        "--kernels",
        nargs="+",
        default=[
            "bf16-gemv",
            "int8-gemv",
            "int8-gemv-noprefetch",
            "fp8-gemv",
            "int4-g128-gemv",
            "int4-g128-tinygemm",
        ],
        help="kernel names as linear_kernels.py prints them (exact)",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("ncu_gemv.py profiles CUDA kernels: no CUDA device here")
    cudart = torch.cuda.cudart()
    for name in args.shapes:
        n, k = SHAPES_8B[name]
        for kern, _nbytes, fn, _ref, _c in kernels(n, k, args.m, "cuda", rotate_bytes=0):
            if kern not in args.kernels:
                continue
            for _ in range(3):  # autotune and compile outside the profiled range
                fn()
            torch.cuda.synchronize()
            cudart.cudaProfilerStart()
            fn()
            torch.cuda.synchronize()
            cudart.cudaProfilerStop()
            print(f"profiled {name} {kern} ({n} x {k}, m={args.m})", flush=True)
    from llmopt.engines.native import triton_kernels as T

    for kernel in (T.wo8_gemv, T.wo8_gemv_ahead, T.int4_gemv):  # the autotuners' choices
        for key, cfg in kernel.cache.items():
            tag = "ahead " if kernel.configs[-1].kwargs.get("AHEAD") else ""
            print(f"{tag}{kernel.fn.__name__} {key}: {cfg}")


if __name__ == "__main__":
    main()
