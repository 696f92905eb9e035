"""Every configuration of the CUDA int4 GEMV alone, per linear shape of a model: microseconds
per call and GB/s of weights and scales read, each config timed in ROUNDS interleaved rounds
(Triton's `do_bench`, the L2 flushed between calls; median and range), so that a design's
configs (`cuda_gemv.INT4_CONFIGS`: rows per group, warps, groups per block, teams of warps,
the early step) can be compared shape by shape. A config that fails to launch at a shape is
reported with its error and left out (run with CUDA_LAUNCH_BLOCKING=1 to pin the failure to
its launch), as is one whose output is not the fp32 reference's (relative error above 1e-2).
Each shape is timed plain (`--fusions plain`) and as the decode step calls it (`decode`: q/k/v
and gate/up with the RMSNorm inside, o and down with the residual added), since the fused
work is part of what a block does before and after its weights.

    python benchmarks/int4_gemv_configs.py --shape llama-3.1-8b --rounds 3 --json out.json

Needs a CUDA GPU with nvcc and ninja (the extension builds on first use).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from shapes import SHAPES  # noqa: E402

from llmopt.engines.native import cuda_gemv as C  # noqa: E402
from llmopt.engines.native import linear as L  # noqa: E402

EPS = 1e-5  # the RMSNorm's, in the decode fusion


def linear_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(N, K) of a decoder layer's four projections, q/k/v and gate/up fused as the engine
    fuses them."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim", h // heads)
    return {
        "qkv": ((heads + 2 * kv) * d, h),
        "o": (h, heads * d),
        "gate_up": (2 * i, h),
        "down": (h, i),
    }


def time_configs(run, want, name, n, k, group, fusion, nbytes, rounds) -> list[dict]:
    """Every runnable config checked against `want`, then timed in `rounds` interleaved rounds;
    printed fastest first; the rows the JSON records."""
    configs, failed, rows = [], {}, []
    for c in C.int4_runnable(0, k, group):
        try:
            err = float((run(c).float() - want).norm() / want.norm())
            torch.cuda.synchronize()
        except RuntimeError as e:
            failed[c] = str(e).splitlines()[0][:200]
            continue
        if err > 1e-2:
            failed[c] = f"wrong result (relative error {err:.2e} against fp32)"
        else:
            configs.append(c)
    ms = C.interleaved_times(run, configs, rounds, warmup=5, rep=25)
    times = {c: [t * 1e3 for t in ts] for c, ts in ms.items()}
    tag = f"{name} {n}x{k} {fusion}"
    for c, msg in failed.items():
        print(f"{tag} config {c} {C.INT4_CONFIGS[c]}: FAILED {msg}")
    for c in sorted(configs, key=lambda c: statistics.median(times[c])):
        us = statistics.median(times[c])
        row = {"shape": name, "n": n, "k": k, "fusion": fusion, "config": c}
        row |= {"tuple": C.INT4_CONFIGS[c], "us": us, "us_range": [min(times[c]), max(times[c])]}
        row["gbps"] = nbytes / us / 1e3
        rows.append(row)
        print(
            f"{tag} config {c:2d} {C.INT4_CONFIGS[c]}: {us:7.2f} us "
            f"[{min(times[c]):.2f}-{max(times[c]):.2f}] {row['gbps']:7.1f} GB/s"
        )
    return rows + [
        {"shape": name, "n": n, "k": k, "fusion": fusion, "config": c, "failed": m}
        for c, m in failed.items()
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--fusions", nargs="+", choices=["plain", "decode"], default=["plain", "decode"]
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    reason = L.prepare_cuda_gemv("cuda", int4=True)
    if reason:
        raise SystemExit(f"the CUDA int4 GEMV does not run here: {reason}")
    mod = C._int4_module(C._arch(0))
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    print(f"{torch.cuda.get_device_name(0)}, {args.shape}, group {args.group}, one activation row")
    for name, (n, k) in linear_shapes(SHAPES[args.shape]).items():
        if k % 256 or k % args.group:
            print(f"{name} {n}x{k}: not a shape the kernel takes")
            continue
        q, s = L.quantize_int4(torch.randn(n, k, device="cuda", generator=g) * 0.05, args.group)
        packed, sc = L.pack_int4_planar(q), s.to(torch.bfloat16).contiguous()
        deq = (q.float().reshape(n, -1, args.group) * s[..., None]).reshape(n, k)
        x = torch.randn(1, k, device="cuda", generator=g, dtype=torch.bfloat16)
        nw = (1 + 0.1 * torch.randn(k, device="cuda", generator=g)).to(torch.bfloat16)
        r = torch.randn(1, n, device="cuda", generator=g, dtype=torch.bfloat16)
        nbytes = packed.numel() * 4 + sc.numel() * 2
        for fusion in args.fusions:
            # the decode step's use: the norm before q/k/v and gate/up, the residual after o, down
            norm = fusion == "decode" and name in ("qkv", "gate_up")
            resid = fusion == "decode" and not norm

            def run(c, x=x, packed=packed, sc=sc, nw=nw, r=r, norm=norm, resid=resid):
                return mod.int4_gemv(x, packed, sc, nw, r, args.group, EPS, norm, resid, c, False)

            xf = x.float()
            if norm:
                xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * nw.float()
            want = xf @ deq.t() + (r.float() if resid else 0)
            rows += time_configs(run, want, name, n, k, args.group, fusion, nbytes, args.rounds)
    for line in summary(rows):
        print(line)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "rows": rows}))


# the families a summary line compares, by a config's variant bits
FAMILIES = {
    "base": lambda v: v == 0,
    "variants": lambda v: v & (C.VEC_STAGE | C.ONE_BARRIER) and not v & C.FIT,
    "fitted": lambda v: v & C.FIT,
}


def summary(rows: list[dict]) -> list[str]:
    """Per shape and fusion, the fastest config of each family (no variant bits; bit 1 or 2;
    bit 4) and its time against the fastest base config's.

    >>> rows = [{"shape": "o", "fusion": "plain", "config": c, "us": us}
    ...         for c, us in ((9, 11.0), (20, 10.0), (28, 12.1), (0, 13.0))]
    >>> summary(rows)
    ['o plain: base 9 11.00 us, variants 20 10.00 us (x0.909), fitted 28 12.10 us (x1.100)']
    """
    out = []
    for shape, fusion in dict.fromkeys((r["shape"], r["fusion"]) for r in rows):
        timed = [r for r in rows if (r["shape"], r["fusion"]) == (shape, fusion) and "us" in r]
        best = {}
        for family, member in FAMILIES.items():
            mine = [r for r in timed if member(C.INT4_CONFIGS[r["config"]][6])]
            if mine:
                best[family] = min(mine, key=lambda r: r["us"])
        base = best.get("base")
        cells = []
        for family, r in best.items():
            ratio = f" (x{r['us'] / base['us']:.3f})" if base and family != "base" else ""
            cells.append(f"{family} {r['config']} {r['us']:.2f} us{ratio}")
        out.append(f"{shape} {fusion}: {', '.join(cells)}")
    return out


if __name__ == "__main__":
    main()
