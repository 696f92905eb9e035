"""Which weight-only / FP8 matmul kernels speed up decode here? Times one decode step's linears.

For each Llama-3.1-8B linear shape (N x K) and rows M (1 = batch-1 decode), times every kernel
this PyTorch offers for the weight format and reports achieved bytes/s of weight reads (weights
dominate at small M). Used to pick the kernels of `llmopt.engines.native.linear`.

    python benchmarks/linear_kernels.py            # on the GPU if there is one, else CPU shapes
    python benchmarks/linear_kernels.py --m 1 8 64

Each kernel's GB/s is also given as a share of the device-to-device copy rate measured in the
same run (bytes read + written), the ceiling a weight read can approach.
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
    """Yield (name, weight bytes, callable, fp32 reference) for each format/kernel that runs here.

    On CUDA each callable runs the layer over `copies` independent weight sets in turn (at least
    256 MB in all), so that timed replays read weights from device memory, not from the 50 MB L2;
    the bytes and time reported are per layer call.
    """
    from llmopt.engines.native import linear as L

    dt = torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)
    w = (torch.randn(n, k, generator=g) * 0.02).to(device=device, dtype=dt)
    x = torch.randn(m, k, generator=g).to(device=device, dtype=dt)
    xf = x.float()

    def rotate(nbytes: int, make):
        copies = max(1, -(-(256 << 20) // nbytes)) if device == "cuda" else 1
        layers = [make() for _ in range(copies)]
        return lambda: [f(x) for f in layers][-1], copies

    def dense():
        wc = w.clone()
        return lambda x: F.linear(x, wc)

    fn, c = rotate(n * k * 2, dense)
    yield "bf16", n * k * 2, fn, xf @ w.float().t(), c
    q, s = L.quantize_int8(w.float())
    fn, c = rotate(n * k, lambda: L.Int8Linear(q, s, None, dt))
    yield "int8-wo", n * k, fn, xf @ (q.float() * s[:, None]).t(), c
    if k % 128 == 0:
        q4, s4 = L.quantize_int4(w.float(), 128)
        deq = (q4.float().reshape(n, -1, 128) * s4[..., None]).reshape(n, k)
        L.INT4_TRITON = device == "cuda"  # the opt-in Triton kernels; tinygemm below
        fn, c = rotate(n * k // 2, lambda: L.Int4Linear(q4, s4, 128, None, dt))
        triton_ = L.Int4Linear(q4, s4, 128, None, dt).triton_kernel
        kern = "int4-g128-triton" if triton_ else "int4-g128"
        L.INT4_TRITON = False
        yield kern, n * k // 2, fn, xf @ deq.t(), c
        if device == "cuda":  # PyTorch's tinygemm, as before the Triton kernels
            u = q4.to(torch.int32) + 8
            u8 = (u[:, ::2] << 4 | u[:, 1::2]).to(torch.uint8)
            sz = torch.stack([s4.t(), torch.zeros_like(s4).t()], dim=-1).to(dt).contiguous()

            def tiny():
                pk = torch.ops.aten._convert_weight_to_int4pack(u8, 8)
                return lambda x: torch.ops.aten._weight_int4pack_mm(x, pk, 128, sz)

            fn, c = rotate(n * k // 2, tiny)
            yield "int4-g128-tinygemm", n * k // 2, fn, xf @ deq.t(), c
    if device == "cuda" and L.fp8_supported():
        qf, sf = L.quantize_fp8(w.float())
        fn, c = rotate(n * k, lambda: L.Fp8Linear(qf.clone(), sf, None, dt))
        yield "fp8-w8a8", n * k, fn, xf @ (qf.float() * sf[:, None]).t(), c


def copy_rate(device: str) -> float:
    """Bytes read + written per second of a 2 GiB device-to-device copy (median)."""
    # Timed eagerly, as decode.py times it, so that both scripts' ceilings are one measurement
    # (a copy replayed from a CUDA graph measured lower; why was not investigated).
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times.sort()
    return 2 * src.numel() * 2 / times[6]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = SHAPES_8B if device == "cuda" else SHAPES_135M
    rows = []
    bw = copy_rate(device) if device == "cuda" else float("nan")
    print(json.dumps({"device": device, "copy_GBps": bw / 1e9}))
    for m in args.m:
        for name, (n, k) in shapes.items():
            for kern, nbytes, fn, ref, copies in kernels(n, k, m, device):
                try:
                    err = float(
                        (fn().float() - ref).norm() / ref.norm()
                    )  # vs its own dequantized weight
                    t = bench(fn, device) / copies
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
                        "share_of_copy": nbytes / t / bw,
                    }
                )
                print(
                    f"m={m:3d} {name:8s} {kern:14s} {t * 1e6:9.1f} us "
                    f"{nbytes / t / 1e9:8.1f} GB/s {100 * nbytes / t / bw:5.1f}% of copy  "
                    f"rel.err {err:.1e}"
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "copy_GBps": bw / 1e9, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
