"""Where a decode step's device time goes, from torch.profiler's kernel rows: per family of
kernels (the CUDA and Triton GEMVs, cuBLAS, decode attention, Inductor's fused kernels), ms
per step and share of the step; and each CUDA GEMV kernel attributed to the weight shapes
whose per-shape timing chose its configuration (`cuda_gemv.tuned_configs()`), with the bytes
those shapes read per call and the rate that gives in the step, against the copy rate.

`benchmarks/decode.py --profile` prints and records it. Pure functions over (name, total us,
calls) rows, so that the attribution is tested without a GPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# families, first match wins: (label, pattern in the kernel's name)
FAMILIES = (
    ("int4 GEMV (CUDA)", "int4_gemv_kernel"),
    ("1-byte GEMV (CUDA)", "wo8_gemv_kernel"),
    ("GEMV/GEMM (Triton)", r"^(int4|wo8)_\w+"),
    ("decode attention", r"decode_(split|combine)"),
    # (before cuBLAS: Inductor names its kernels after the ops they fuse, "int4_gemv" included)
    ("Inductor", r"^triton_"),
    ("cuBLAS", r"nvjet|gemm|gemv|cutlass|xmma"),
)


@dataclass
class Kernel:
    name: str
    us: float  # device time over all calls
    calls: int


def family(name: str) -> str:
    """The family of a kernel, by its name.

    >>> family("void (anonymous namespace)::int4_gemv_kernel<__nv_bfloat16, 4, 4, 1, 8, 1, false, 4, 1>(...)")
    'int4 GEMV (CUDA)'
    >>> family("nvjet_sm90_tst_384x8_64x4_2x1_v_bz_TNT"), family("triton_poi_fused_mul_silu_2")
    ('cuBLAS', 'Inductor')
    """
    for label, pattern in FAMILIES:
        if re.search(pattern, name):
            return label
    return "other"


def template_args(name: str) -> tuple[int, ...] | None:
    """The integer and bool template arguments of a CUDA GEMV kernel's demangled name, after its
    activation type (bools as 0/1), or None for a name without them.

    >>> template_args("void (anonymous namespace)::wo8_gemv_kernel<__nv_bfloat16, true, 2, 8, 1>(x)")
    (1, 2, 8, 1)
    """
    m = re.search(r"_gemv_kernel<[^,>]+,([^>]*)>", name)
    if not m:
        return None
    out = []
    for arg in m.group(1).split(","):
        arg = re.sub(r"^\(\w+\)", "", arg.strip())  # a demangler's "(int)4"
        if arg in ("true", "false"):
            out.append(int(arg == "true"))
        elif re.fullmatch(r"-?\d+", arg):
            out.append(int(arg))
        else:
            return None
    return tuple(out)


def shapes_of(name: str, tuned: list[dict]) -> list[dict]:
    """The timed shapes (`cuda_gemv.tuned_configs()` rows) whose chosen configuration this CUDA
    GEMV kernel is: int4 by (rows, warps, unroll, chunks, split, early, variant), the 1-byte
    kernel by (FP8 or not, rows, warps, unroll)."""
    args = template_args(name)
    if args is None:
        return []
    if "int4_gemv_kernel" in name:
        found = [t for t in tuned if t["kernel"] == "int4" and tuple(t["config"]) == args[:7]]
    else:
        fp8, cfg = args[0], args[1:4]
        found = [
            t
            for t in tuned
            if t["kernel"] == "wo8"
            and tuple(t["config"]) == cfg
            and ("float8" in t["weight"]) == bool(fp8)
        ]
    # once per shape: the points of an A/B time the same shape under their own switches
    return list({(t["n"], t["k"], t["weight"]): t for t in found}.values())


def weight_bytes(t: dict) -> int:
    """Bytes a one-row GEMV of a timed shape reads: int4 codes and 16-bit group scales, or one
    byte per weight and an fp32 scale per row."""
    n, k = t["n"], t["k"]
    if t["kernel"] == "int4":
        return n * k // 2 + 2 * n * (k // int(t["weight"]))
    return n * k + 4 * n


def summary(kernels: list[Kernel], steps: int, tuned: list[dict], copy_gbps: float) -> dict:
    """Per family, ms per step and share of the profiled device time; per CUDA GEMV kernel, the
    shapes it ran, us per call, and (where every call of it is one of those shapes' calls, as
    the calls per step say) GB/s and % of `copy_gbps`.

    >>> ks = [Kernel("int4_gemv_kernel<__nv_bfloat16, 4, 4, 1, 8, 1, false, 4, 1>", 600.0, 20),
    ...       Kernel("nvjet_x", 400.0, 20)]
    >>> t = [{"kernel": "int4", "n": 28672, "k": 4096, "weight": "128",
    ...       "config": [4, 4, 1, 8, 1, 0, 4]}]
    >>> s = summary(ks, 20, t, 3000.0)
    >>> s["families"]["int4 GEMV (CUDA)"], s["gemvs"][0]["pct_copy"]
    ({'ms_per_step': 0.03, 'share': 0.6}, 67.3)
    """
    total = sum(k.us for k in kernels) or 1.0
    families: dict[str, dict] = {}
    for k in kernels:
        f = families.setdefault(family(k.name), {"ms_per_step": 0.0, "share": 0.0})
        f["ms_per_step"] += k.us / steps / 1e3
        f["share"] += k.us / total
    for f in families.values():
        f["ms_per_step"], f["share"] = round(f["ms_per_step"], 4), round(f["share"], 4)
    gemvs = []
    for k in sorted(kernels, key=lambda k: -k.us):
        if family(k.name) not in ("int4 GEMV (CUDA)", "1-byte GEMV (CUDA)"):
            continue
        shapes = shapes_of(k.name, tuned)
        row = {"kernel": k.name[:120], "us_per_call": round(k.us / k.calls, 2)}
        row |= {"calls_per_step": k.calls / steps, "shapes": [f"{t['n']}x{t['k']}" for t in shapes]}
        if shapes and k.calls % steps == 0:
            # the calls of a step, spread evenly over the shapes that chose this config (a
            # decoder's layers each call every shape once)
            per_shape = k.calls // steps / len(shapes)
            nbytes = per_shape * sum(weight_bytes(t) for t in shapes) * steps
            gbps = nbytes / (k.us * 1e3)
            row |= {"gbps": round(gbps, 1), "pct_copy": round(100 * gbps / copy_gbps, 1)}
        gemvs.append(row)
    return {"steps": steps, "device_ms_per_step": round(total / steps / 1e3, 4)} | {
        "families": families,
        "gemvs": gemvs,
    }


def lines(s: dict) -> list[str]:
    """`summary` as printed."""
    out = [f"device time per step {s['device_ms_per_step']:.3f} ms over {s['steps']} steps"]
    for name, f in sorted(s["families"].items(), key=lambda kv: -kv[1]["ms_per_step"]):
        out.append(f"  {name:<22} {f['ms_per_step']:7.3f} ms  {100 * f['share']:5.1f}%")
    for g in s["gemvs"]:
        rate = f"  {g['gbps']:7.1f} GB/s {g['pct_copy']:5.1f}% of copy" if "gbps" in g else ""
        shapes = ", ".join(g["shapes"]) or "no timed shape"
        out.append(
            f"  GEMV {g['us_per_call']:7.2f} us x {g['calls_per_step']:g}/step  [{shapes}]{rate}"
        )
    return out
