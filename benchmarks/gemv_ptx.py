"""Count the instructions of the one-row GEMVs (`triton_kernels.wo8_gemv`, `int4_gemv`) for sm_90.

Runs on any host with Triton (no GPU: Triton compiles for a named target with its bundled
ptxas, and disassembles with its bundled cuobjdump). A kernel that reads 1-byte weights at one
row is bound by its instructions per weight as much as by its bytes (docs/native-engine.md),
so a change to the GEMV can be weighed here before a GPU times it. Prints, per format and
masking, for each autotune config asked for: the PTX instructions in all, the selects (`selp`)
and conversions (`cvt`) among them, and the machine code (SASS) of the main loop: its
instructions per iteration and per weight (a thread's share of the tile), and the most
frequent opcodes.

    python benchmarks/gemv_ptx.py                       # K = 576 (SmolLM2's hidden size)
    python benchmarks/gemv_ptx.py --k 4096 --configs 0 6
    python benchmarks/gemv_ptx.py --k 4096 --formats int4 int4-f32 --configs 0 4
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

# pointer types as `linear.wo_mm` passes the weights (masked FP8 as its bytes, int8 as words)
WEIGHT_TYPES = {
    ("fp8", True): "*fp8e4nv",
    ("fp8", False): "*u8",
    ("int8", True): "*i32",
    ("int8", False): "*i32",
    ("bf16", True): "*bf16",
    ("bf16", False): "*bf16",
}  # (int4: int32 words of eight codes)


def count(
    fmt: str, even: bool, k: int, config: int, f16: bool = False, prefetch: bool = False
) -> dict:
    from llmopt.engines.native import triton_kernels as T

    if fmt == "int4":  # `int4_gemv`, groups of 128; f16: its half-precision products
        cfg = T.int4_gemv.configs[config]
        kp = -(-k // 256) * 256
        const = {"K": k, "KP": kp, "G": 128 if k % 128 == 0 else 64, "HAS_ZERO": False}
        const |= {"EVEN_N": even, "ASM": True, "HALF": f16} | cfg.kwargs
        types = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16"}
        types |= {"y_ptr": "*bf16", "ws_ptr": "*fp32", "sem_ptr": "*i32", "N": "i32"}
        tile = cfg.kwargs["BLOCK_N"] * 256 * cfg.kwargs["TILES"]
        return _compile_count(T.int4_gemv.fn, cfg, const, types, tile) | {
            "format": fmt + ("" if f16 else "-f32"),
            "masked": not even,
            "K": k,
            "config": config,
            "tile": cfg.kwargs,
        }
    cfg = _twin(T.wo8_gemv_ahead.configs, config, prefetch)
    const = {"K": k, "WORDS": fmt == "int8", "GATED": False, "EVEN": even, "NORM": False}
    const |= {"RESID": False, "PDL": False, "F16": f16} | cfg.kwargs
    types = {"x_ptr": "*bf16", "w_ptr": WEIGHT_TYPES[fmt, even], "s_ptr": "*fp32"}
    types |= {"y_ptr": "*bf16", "r_ptr": "*bf16", "eps": "fp32", "N": "i32"}
    tile = cfg.kwargs["BLOCK_N"] * cfg.kwargs["BLOCK_K"]
    return {
        "format": fmt + ("-f16" if f16 else ""),
        "masked": not even,
        "K": k,
        "config": config,
        "tile": cfg.kwargs,
        "prefetch": prefetch,
    } | _compile_count(T.wo8_gemv.fn, cfg, const, types, tile)


def _twin(configs, i: int, ahead: bool):
    """Config `i` of the first half (AHEAD off), or its twin with AHEAD on."""
    return configs[i + len(configs) // 2 if ahead else i]


def _compile_count(fn, cfg, const: dict, types: dict, tile: int) -> dict:
    """Compile `fn` for sm_90 with `const` and `types`; its PTX and main-loop SASS counts
    (`tile`: weights per program per loop step)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {n: "constexpr" if n in const else types[n] for n in fn.arg_names}
    # as Triton specializes a launch: 16-byte aligned pointers, N a multiple of 16 (the 8B
    # shapes'); without these hints every load is one element wide
    aligned = [i for i, n in enumerate(fn.arg_names) if n.endswith("_ptr") or n == "N"]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    src = ASTSource(
        fn, sig, constexprs={n: const[n] for n in fn.arg_names if n in const}, attrs=attrs
    )
    opts = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    ptx = kernel.asm["ptx"]
    skip = ("//", ".", "$", "{", "}")  # comments, directives, labels, braces
    ins = [line.strip() for line in ptx.splitlines()]
    ins = [line for line in ins if line and not line.startswith(skip)]
    return {
        "instructions": len(ins),
        "selp": sum(line.startswith("selp") for line in ins),
        "cvt": sum(line.startswith("cvt") for line in ins),
    } | loop_sass(kernel.asm["cubin"], tile, cfg.num_warps)


def loop_sass(cubin: bytes, tile: int, warps: int) -> dict:
    """The SASS of the kernel's longest loop (the K loop): instructions per iteration and per
    weight of a thread's share of the `tile`, and the opcodes by count."""
    import collections
    import os
    import re
    import subprocess
    import tempfile

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        sass = subprocess.run(
            [str(tool), "-sass", f.name], capture_output=True, text=True, check=True
        ).stdout
    finally:
        os.unlink(f.name)
    # lines like "/*02e0*/  @!P0 BRA 0x2e0 ;": address, optional predicate, opcode, operands
    code = []
    for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][\w.]*)([^;]*);", sass):
        code.append((int(m.group(1), 16), m.group(3), m.group(4)))
    loops = [
        (int(t.group(1), 16), addr)
        for addr, op, args in code
        if op.startswith("BRA") and (t := re.search(r"0x([0-9a-f]+)", args))
        if int(t.group(1), 16) < addr
    ]
    if not loops:
        return {"loop_sass": None}
    start, end = max(loops, key=lambda se: se[1] - se[0])
    body = [op.split(".")[0] for addr, op, _ in code if start <= addr <= end]
    spills = sum(op.startswith(("STL", "LDL")) for _addr, op, _ in code)
    per_thread = tile / (32 * warps)
    return {
        "loop_sass": len(body),
        "loop_sass_per_weight": round(len(body) / per_thread, 2),
        "loop_opcodes": dict(collections.Counter(body).most_common(8)),
        "local_memory_ops": spills,  # register spills (STL/LDL), anywhere in the kernel
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=576, help="the input width (K) compiled for")
    ap.add_argument(
        "--formats",
        nargs="+",
        default=["fp8", "int8", "int8-f16", "bf16", "int4", "int4-f32"],
        help="int8-f16: int8 made floats through half precision (`linear.GEMV_INT8_F16`); "
        "int4: `int4_gemv` with its products in half precision (`linear.INT4_GEMV_HALF`), "
        "int4-f32 with them in fp32 (configs index `int4_gemv`'s own list)",
    )
    ap.add_argument(
        "--configs",
        nargs="+",
        type=int,
        default=[0],
        help="autotune config indices (of the configs without AHEAD)",
    )
    ap.add_argument(
        "--ahead",
        action="store_true",
        help="each wo8_gemv config's twin with AHEAD (weights loaded one loop step ahead; "
        "`linear.GEMV_PREFETCH`); int4 has no such configs",
    )
    args = ap.parse_args()
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.exit("needs Triton: pip install triton==3.6.0 (Linux x86-64)")
    from llmopt.engines.native import linear as L

    for fmt in args.formats:  # unmasked only where the largest tiles divide K, as in `wo_mm`
        base, _, variant = fmt.partition("-")
        evens = (False, True) if args.k % L.GEMV_TILE_K == 0 else (False,)
        if base == "int4":  # (K is padded to whole tiles; EVEN is about the rows)
            evens, variant = (False, True), "f16" if variant != "f32" else ""
        for even in evens:
            for c in args.configs:
                f16, prefetch = variant == "f16", args.ahead
                print(json.dumps(count(base, even, args.k, c, f16, prefetch)))


if __name__ == "__main__":
    main()
