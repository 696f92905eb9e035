"""Which weight-only / FP8 matmul kernels speed up decode here? Times one decode step's linears.

For each Llama-3.1-8B linear shape (N x K) and rows M (1 = batch-1 decode), times every kernel
this PyTorch offers for the weight format and reports achieved bytes/s of weight reads (weights
dominate at small M). Used to pick the kernels of `llmopt.engines.native.linear`.

    python benchmarks/linear_kernels.py            # on the GPU if there is one, else CPU shapes
    python benchmarks/linear_kernels.py --m 1 8 64
    python benchmarks/linear_kernels.py --m 1 4 16 --sweep   # every Triton config, CUDA only

Each kernel's GB/s is also given as a share of the device-to-device copy rate measured in the
same run (bytes read + written), the ceiling a weight read can approach.
"""

from __future__ import annotations

import argparse
import functools
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


def kernels(
    n: int, k: int, m: int, device: str, gated: bool = False, rotate_bytes: int = 256 << 20
):
    """Yield (name, weight bytes, callable, fp32 reference) for each format/kernel that runs here.
    `gated` (CUDA, one row): also the one-row GEMV reading a gate/up output, SiLU x up as a
    kernel of its own before it (`-gemv+silu`, the unfused step) against inside it (`-gemv-gated`,
    `linear.silu_down`); the layer's input is then 2K wide.

    On CUDA each callable runs the layer over `copies` independent weight sets in turn (at least
    256 MB in all), so that timed replays read weights from device memory, not from the 50 MB L2;
    the bytes and time reported are per layer call. `rotate_bytes=0` gives one weight set (a
    profiler that flushes the caches between replays, `ncu_gemv.py`, needs no more).
    """
    from llmopt.engines.native import linear as L

    # the `int8-gemv`/`fp8-gemv` columns (and the layers') are Triton's GEMV; the `-cuda`
    # columns switch the CUDA GEMV on for their own launches
    L.GEMV_CUDA = False
    dt = torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)
    w = (torch.randn(n, k, generator=g) * 0.02).to(device=device, dtype=dt)
    x = torch.randn(m, k, generator=g).to(device=device, dtype=dt)
    xf = x.float()

    def rotate(nbytes: int, make):
        copies = max(1, -(-rotate_bytes // nbytes)) if device == "cuda" else 1
        layers = [make() for _ in range(copies)]
        return lambda: [f(x) for f in layers][-1], copies

    def dense():
        wc = w.clone()
        return lambda x: F.linear(x, wc)

    fn, c = rotate(n * k * 2, dense)
    yield "bf16", n * k * 2, fn, xf @ w.float().t(), c
    q, s = L.quantize_int8(w.float())
    ref8 = xf @ (q.float() * s[:, None]).t()
    if device == "cuda" and m <= L.TRITON_M:  # the Triton kernels, each format
        # (and bf16 weights through the tensor-core kernel with unit scales: can it beat cuBLAS
        # on the narrow shapes, where cuBLAS reads at 60-75% of copy?)
        ones = torch.ones(n, device=device, dtype=dt)
        fn, c = rotate(n * k * 2, lambda: _raw(L.wo_mm, w.clone(), ones, "dot"))
        yield "bf16-dot", n * k * 2, fn, xf @ w.float().t(), c
        if m == 1:  # and through the one-row GEMV, as `DenseLinear` runs them under FUSE_NORM
            ones32 = torch.ones(n, device=device)
            fn, c = rotate(n * k * 2, lambda: _raw(L.wo_mm, w.clone(), ones32, "gemv"))
            yield "bf16-gemv", n * k * 2, fn, xf @ w.float().t(), c
        qf, sf = L.quantize_fp8(w.float())
        sfc = sf.to(device=device, dtype=dt)
        for kern in ("dot", "dot1", "gemv"):
            sc = s.to(device=device, dtype=dt)
            fn, c = rotate(n * k, lambda kern=kern, sc=sc: _raw(L.wo_mm, q.clone(), sc, kern))
            yield f"int8-{kern}", n * k, fn, ref8, c
            fn, c = rotate(n * k, lambda kern=kern: _raw(L.wo_mm, qf.clone(), sfc, kern))
            yield f"fp8-{kern}", n * k, fn, xf @ (qf.float() * sf[:, None]).t(), c
        if m == 1:  # the GEMV's variants (`linear.GEMV_*` switches) against its default
            sc = s.to(device=device, dtype=dt)
            reff = xf @ (qf.float() * sf[:, None]).t()
            for name, wq, ws, ref, flags in (
                ("int8-gemv-masked", q, sc, ref8, {"GEMV_EVEN": False}),
                ("fp8-gemv-masked", qf, sfc, reff, {"GEMV_EVEN": False}),
                ("int8-gemv-noprefetch", q, sc, ref8, {"GEMV_PREFETCH": False}),
                ("int8-gemv-cuda", q, sc, ref8, {"GEMV_CUDA": True}),
                ("fp8-gemv-cuda", qf, sfc, reff, {"GEMV_CUDA": True}),
            ):
                if flags.get("GEMV_CUDA") and _cuda_gemv_reason():
                    continue
                fn, c = rotate(
                    n * k, lambda wq=wq, ws=ws, flags=flags: _variant(wq.clone(), ws, flags)
                )
                yield name, n * k, fn, ref, c
        if gated and m == 1:
            gu = torch.randn(m, 2 * k, generator=g).to(device=device, dtype=dt) * 3
            gl, ul = gu.chunk(2, dim=-1)
            act = (F.silu(gl) * ul).float()  # rounded as the two ops round
            sc = s.to(device=device, dtype=dt)
            for kind, wq, ws, deq in (
                ("int8", q, sc, q.float() * s[:, None]),
                ("fp8", qf, sfc, qf.float() * sf[:, None]),
            ):
                ref = act @ deq.t()
                fn, c = rotate(n * k, lambda wq=wq, ws=ws: _gated(wq.clone(), ws, gu, False))
                yield f"{kind}-gemv+silu", n * k, fn, ref, c
                fn, c = rotate(n * k, lambda wq=wq, ws=ws: _gated(wq.clone(), ws, gu, True))
                yield f"{kind}-gemv-gated", n * k, fn, ref, c
    else:
        fn, c = rotate(n * k, lambda: L.Int8Linear(q, s, None, dt))
        yield "int8-wo", n * k, fn, ref8, c
    if k % 128 == 0:
        q4, s4 = L.quantize_int4(w.float(), 128)
        deq = (q4.float().reshape(n, -1, 128) * s4[..., None]).reshape(n, k)
        default = L.INT4_TRITON
        L.INT4_TRITON = device == "cuda"  # the Triton layout; tinygemm's below
        fn, c = rotate(n * k // 2, lambda: L.Int4Linear(q4, s4, 128, None, dt))
        kern = "int4-g128-triton" if L.Int4Linear(q4, s4, 128, None, dt).triton_kernel else "int4"
        L.INT4_TRITON = default
        yield kern, n * k // 2, fn, xf @ deq.t(), c
        if device == "cuda" and m == 1:  # the Triton layout's CUDA-core GEMV: its products
            # in half precision (the default) and in fp32
            pk, s4b = L.pack_int4_planar(q4.to(device)), s4.to(device=device, dtype=dt)
            for name, half in (("int4-g128-gemv", True), ("int4-g128-gemv-f32", False)):

                def gemv(half=half):
                    p, cnt = pk.clone(), L.gemv_counters(n, 1, device)
                    return lambda x: L.int4_mm(x, p, s4b, None, 128, "gemv", cnt, half)

                fn, c = rotate(n * k // 2, gemv)
                yield name, n * k // 2, fn, xf @ deq.t(), c
            if k % 256 == 0 and not _cuda_gemv_reason(int4=True):  # and the CUDA C++ one

                def gemv_cuda():
                    p = pk.clone()
                    return lambda x: _with(
                        {"INT4_GEMV_CUDA": True}, lambda: L.int4_mm(x, p, s4b, None, 128, "gemv")
                    )

                fn, c = rotate(n * k // 2, gemv_cuda)
                yield "int4-g128-gemv-cuda", n * k // 2, fn, xf @ deq.t(), c
        if device == "cuda":  # PyTorch's tinygemm, the CUDA default
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
        yield "fp8", n * k, fn, xf @ (qf.float() * sf[:, None]).t(), c


@functools.cache
def _cuda_gemv_reason(int4: bool = False) -> str:
    """Why the CUDA GEMV columns (`int4`: the int4 one) are left out ('' when they run),
    printed once."""
    from llmopt.engines.native import linear as L

    reason = L.prepare_cuda_gemv("cuda", int4=int4)
    if reason:
        print(f"CUDA {'int4 ' if int4 else ''}GEMV columns left out: {reason}")
    return reason


def _gated(w, scale, gu, fused: bool):
    """The down projection of gate/up output `gu`: SiLU x up inside the GEMV, or before it."""
    from llmopt.engines.native import linear as L

    if fused:
        return lambda x: L.wo_mm(gu, w, scale, "gemv", gated=True)
    g, u = gu.chunk(2, dim=-1)
    return lambda x: L.wo_mm(F.silu(g) * u, w, scale, "gemv")


def _with(flags: dict, call):
    """`call()` with some of `linear`'s module switches set (captured into the benchmark's CUDA
    graph with them), restored after."""
    from llmopt.engines.native import linear as L

    old = {name: getattr(L, name) for name in flags}
    for name, value in flags.items():
        setattr(L, name, value)
    try:
        return call()
    finally:
        for name, value in old.items():
            setattr(L, name, value)


def _variant(w, scale, flags: dict):
    """The one-row GEMV with some of `linear`'s GEMV switches set for its launch (`_with`)."""
    from llmopt.engines.native import linear as L

    return lambda x: _with(flags, lambda: L.wo_mm(x, w, scale, "gemv"))


def _raw(mm, w, scale, kern):
    from llmopt.engines.native import linear as L

    counters = L.tile_counters(w.shape[0], L.TRITON_M, w.device)  # as a layer holds its own
    return lambda x: mm(x, w, scale, kern, counters)


# --sweep: every config of each Triton kernel, launched directly (no autotuner), to choose the
# autotune lists of `triton_kernels`. Configs: (BLOCK_N, BLOCK_K or TILES, warps, stages).
SWEEP_WO8 = [  # (BLOCK_N, BLOCK_K, warps, stages, SPLIT_K)
    (bn, bk, w, st, sk)
    for bn in (32, 64)
    for bk in (256, 512, 1024)
    for w, st in ((4, 3), (4, 5))
    for sk in (1, 2, 4, 8)
    if bn * bk <= 32768
]
SWEEP_INT4 = [
    (bn, t, w, st)
    for bn in (16, 32, 64, 128)
    for t in (1, 2, 4)
    for w, st in ((4, 3), (4, 5), (8, 4))
    if bn * t <= 256
]


def _precompile(jobs) -> None:
    """Compile the sweep's kernels in parallel worker processes (Triton's on-disk cache then
    serves the timing process): one config compiles in about a second, and a sweep is hundreds."""
    import concurrent.futures as cf
    import multiprocessing as mp
    import os

    t0 = time.perf_counter()
    workers = max(1, min(12, (os.cpu_count() or 2) - 2))
    try:
        with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
            list(ex.map(_warm, jobs, chunksize=4))
    except Exception as e:  # compiling in the timing process instead is only slower
        print(f"precompile failed ({e!r:.200}); compiling as the sweep runs")
    print(f"precompiled {len(jobs)} kernels in {time.perf_counter() - t0:.0f} s", flush=True)


def _warm(job) -> None:
    import contextlib

    kind, n, k, m, cfg = job
    with contextlib.suppress(Exception):  # the timing process reports it
        _sweep_call(kind, n, k, m, cfg, *_sweep_tensors(kind, n, k, m))


def _sweep_tensors(kind: str, n: int, k: int, m: int):
    from llmopt.engines.native import linear as L

    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(m, k, device=dev, dtype=dt)
    w = torch.randn(n, k, device=dev) * 0.02
    if kind == "int4":
        q, s = L.quantize_int4(w, 128)
        return x, L.pack_int4_planar(q), s.to(dt).contiguous()
    if kind == "bf16":  # dense weights through the same kernel, unit scales
        return x, w.to(dt), torch.ones(n, device=dev, dtype=dt)
    q, s = L.quantize_int8(w) if kind == "int8" else L.quantize_fp8(w)
    return x, q.contiguous(), s.to(dt).contiguous()


def _sweep_call(kind, n, k, m, cfg, x, w, s):
    import triton

    from llmopt.engines.native import linear as L
    from llmopt.engines.native import triton_kernels as T

    bn, b2, warps, stages = cfg[:4]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    opts = {"num_warps": warps, "num_stages": stages, "BLOCK_M": 16, "BLOCK_N": bn}
    grid = (triton.cdiv(n, bn), triton.cdiv(m, 16))
    if kind == "int4":
        T.int4_dot.fn[grid](
            *(x, w, s, s, y, m, n, L._m_bucket(m)),
            K=k,
            KP=w.shape[1] * 8,
            G=128,
            HAS_ZERO=False,
            TILES=b2,
            **opts,
        )
    else:
        sk = cfg[4]
        ws = torch.empty(sk, m, n, device=x.device, dtype=torch.float32)
        cnt = _COUNTERS.setdefault(n, L.tile_counters(n, 16, x.device))
        T.wo8_dot.fn[(*grid, sk)](
            *(x, w, s, y, ws, cnt, m, n, L._m_bucket(m)), K=k, BLOCK_K=b2, SPLIT_K=sk, **opts
        )
    return y


_COUNTERS: dict = {}  # the K-split kernel's per-tile counters, one set per output width


def sweep(ms, bw: float, kinds=("int8", "fp8", "int4")) -> list[dict]:
    """GB/s of every sweep config per (format, shape, rows); prints the best per point."""
    shapes = SHAPES_8B
    spaces = {"int8": SWEEP_WO8, "fp8": SWEEP_WO8, "bf16": SWEEP_WO8, "int4": SWEEP_INT4}
    jobs = [
        (kind, n, k, m, cfg)
        for kind in kinds
        for (n, k) in shapes.values()
        for m in ms
        for cfg in spaces[kind]
        if kind == "int4" or k % (cfg[4] * cfg[1]) == 0  # K splits of whole tiles only
    ]
    _precompile(jobs)
    rows = []
    for kind, n, k, m, cfg in jobs:
        tensors = _sweep_tensors(kind, n, k, m)
        nbytes = tensors[1].numel() * tensors[1].element_size()
        copies = max(1, -(-(256 << 20) // nbytes))
        x, w, s = tensors
        sets = [tensors] + [(x, w.clone(), s) for _ in range(copies - 1)]

        def run(job=(kind, n, k, m, cfg), sets=sets):
            return [_sweep_call(*job, *ts) for ts in sets][-1]

        try:
            t = bench(run, "cuda")
        except Exception as e:
            rows.append({"kind": kind, "n": n, "k": k, "m": m, "cfg": cfg, "error": repr(e)[:200]})
            continue
        t /= copies
        rows.append(
            {"kind": kind, "n": n, "k": k, "m": m, "cfg": cfg, "us": t * 1e6,
             "GBps": nbytes / t / 1e9, "share_of_copy": nbytes / t / bw}
        )  # fmt: skip
    for kind in kinds:
        for n, k in shapes.values():
            for m in ms:
                pts = [r for r in rows if (r["kind"], r["n"], r["k"], r["m"]) == (kind, n, k, m)]
                ok = sorted((r for r in pts if "us" in r), key=lambda r: r["us"])
                if ok:
                    b = ok[0]
                    print(
                        f"sweep {kind:5s} m={m:2d} {n:5d}x{k:5d} best {b['cfg']} "
                        f"{b['GBps']:7.1f} GB/s ({100 * b['share_of_copy']:4.1f}%); "
                        f"2nd {ok[1]['cfg'] if len(ok) > 1 else '-'}; failed "
                        f"{len(pts) - len(ok)}",
                        flush=True,
                    )
    return rows


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
    ap.add_argument(
        "--sweep", action="store_true", help="time every config of the Triton kernels (CUDA)"
    )
    ap.add_argument(
        "--sweep-kinds",
        nargs="+",
        default=["int8", "fp8", "int4"],
        choices=["int8", "fp8", "bf16", "int4"],
        help="weight formats the sweep covers (bf16: dense weights through the int8/FP8 kernel)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="time a shape's kernels this many times, interleaved (A B C A B C); the median "
        "and the range across rounds are reported",
    )
    ap.add_argument(
        "--shapes", nargs="+", default=None, help="only these shapes (qkv o gate_up down)"
    )
    ap.add_argument(
        "--kernels",
        nargs="+",
        default=None,
        help="only the kernels whose names start with one of these (e.g. int8-gemv fp8)",
    )
    ap.add_argument(
        "--gated",
        action="store_true",
        help="CUDA, one row: also SiLU x up before the int8/FP8 GEMV against inside it",
    )
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = SHAPES_8B if device == "cuda" else SHAPES_135M
    if args.shapes:
        unknown = set(args.shapes) - set(shapes)
        if unknown:
            ap.error(f"unknown shapes {sorted(unknown)}; known: {', '.join(shapes)}")
        shapes = {name: shapes[name] for name in args.shapes}
    rows = []
    bw = copy_rate(device) if device == "cuda" else float("nan")
    print(json.dumps({"device": device, "copy_GBps": bw / 1e9}))
    if args.sweep:
        rows = sweep(args.m, bw, tuple(args.sweep_kinds))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": device, "copy_GBps": bw / 1e9, "sweep": rows}, f, indent=1)
        return
    for m in args.m:
        for name, (n, k) in shapes.items():
            ks, times = [], {}
            for kern, nbytes, fn, ref, copies in kernels(n, k, m, device, args.gated):
                if args.kernels and not kern.startswith(tuple(args.kernels)):
                    continue
                try:
                    err = float((fn().float() - ref).norm() / ref.norm())  # vs its own weights
                except Exception as e:  # a kernel missing on this build is a finding, not a crash
                    rows.append({"m": m, "shape": name, "kernel": kern, "error": repr(e)[:200]})
                    print(f"m={m:3d} {name:8s} {kern:14s} ERROR {e!r:.120}")
                    continue
                ks.append((kern, nbytes, fn, err, copies))
                times[kern] = []
            for _ in range(args.rounds):  # interleaved: every kernel once per round
                for kern, _nb, fn, _err, copies in ks:
                    times[kern].append(bench(fn, device) / copies)
            for kern, nbytes, _fn, err, _c in ks:
                ts = sorted(times[kern])
                t = ts[len(ts) // 2]
                rows.append(
                    {
                        "m": m,
                        "shape": name,
                        "n": n,
                        "k": k,
                        "kernel": kern,
                        "us": t * 1e6,
                        "us_range": [ts[0] * 1e6, ts[-1] * 1e6],
                        "rounds": len(ts),
                        "GBps": nbytes / t / 1e9,
                        "rel_err": err,
                        "share_of_copy": nbytes / t / bw,
                    }
                )
                spread = f" ({ts[0] * 1e6:.1f}-{ts[-1] * 1e6:.1f})" if len(ts) > 1 else ""
                print(
                    f"m={m:3d} {name:8s} {kern:14s} {t * 1e6:9.1f} us{spread} "
                    f"{nbytes / t / 1e9:8.1f} GB/s {100 * nbytes / t / bw:5.1f}% of copy  "
                    f"rel.err {err:.1e}"
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "copy_GBps": bw / 1e9, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
