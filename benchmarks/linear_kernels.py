"""Which weight-only / FP8 matmul kernels speed up decode here? Times one decode step's linears.

For each Llama-3.1-8B linear shape (N x K) and rows M (1 = batch-1 decode), times every kernel
this PyTorch offers for the weight format and reports achieved bytes/s of weight reads (weights
dominate at small M). Used to pick the kernels of `llmopt.engines.native.linear`.

    python benchmarks/linear_kernels.py            # on the GPU if there is one, else CPU shapes
    python benchmarks/linear_kernels.py --m 1 8 64
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

SHAPES_8B = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}
SHAPES_135M = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def bench(fn, device: str, iters: int = 50) -> float:
    """Median seconds per call."""
    for _ in range(5):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        try:  # graph replay removes launch gaps, as the compiled decode step does
            with torch.cuda.graph(g):
                fn()
            run = g.replay
        except Exception:
            run = fn
        times = []
        for _ in range(iters):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            run()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) / 1e3)
    else:
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def kernels(n: int, k: int, m: int, device: str):
    """Yield (name, weight bytes, callable) for each format/kernel that runs here."""
    from llmopt.engines.native import linear as L

    dt = torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)
    w = (torch.randn(n, k, generator=g) * 0.02).to(device=device, dtype=dt)
    x = torch.randn(m, k, generator=g).to(device=device, dtype=dt)
    xf = x.float()
    yield "bf16", n * k * 2, lambda: F.linear(x, w), xf @ w.float().t()
    q, s = L.quantize_int8(w.float())
    lin8 = L.Int8Linear(q, s, None, dt)
    yield "int8-wo", n * k, lambda: lin8(x), xf @ (q.float() * s[:, None]).t()
    if k % 128 == 0:
        q4, s4 = L.quantize_int4(w.float(), 128)
        lin4 = L.Int4Linear(q4, s4, 128, None, dt)
        deq = (q4.float().reshape(n, -1, 128) * s4[..., None]).reshape(n, k)
        yield "int4-wo-g128", n * k // 2, lambda: lin4(x), xf @ deq.t()
    if device == "cuda" and L.fp8_supported():
        qf, sf = L.quantize_fp8(w.float())
        linf = L.Fp8Linear(qf, sf, None, dt)
        yield "fp8-w8a8", n * k, lambda: linf(x), xf @ (qf.float() * sf[:, None]).t()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = SHAPES_8B if device == "cuda" else SHAPES_135M
    rows = []
    for m in args.m:
        for name, (n, k) in shapes.items():
            for kern, nbytes, fn, ref in kernels(n, k, m, device):
                try:
                    err = float(
                        (fn().float() - ref).norm() / ref.norm()
                    )  # vs its own dequantized weight
                    t = bench(fn, device)
                except Exception as e:  # a kernel missing on this build is a finding, not a crash
                    rows.append({"m": m, "shape": name, "kernel": kern, "error": repr(e)[:200]})
                    print(f"m={m:3d} {name:8s} {kern:14s} ERROR {e!r:.120}")
                    continue
                rows.append(
                    {
                        "m": m,
                        "shape": name,
                        "n": n,
                        "k": k,
                        "kernel": kern,
                        "us": t * 1e6,
                        "GBps": nbytes / t / 1e9,
                        "rel_err": err,
                    }
                )
                print(
                    f"m={m:3d} {name:8s} {kern:14s} {t * 1e6:9.1f} us "
                    f"{nbytes / t / 1e9:8.1f} GB/s  rel.err {err:.1e}"
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
