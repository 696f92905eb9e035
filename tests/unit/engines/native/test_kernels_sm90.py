"""Every Triton kernel of the native engine compiles for the H200 (sm_90), on any machine.

Triton compiles ahead of time without a GPU (its wheel carries ptxas), so the type checks, layout
conversions and register allocation that only a real compile runs are tested here, where the
interpreter tests (`test_attention.py`, `test_engine.py`, `test_linear_int4.py`) check the
arithmetic: a variant that fails here would otherwise first fail on a lent GPU. Each kernel is
compiled with the argument types it gets in the engine, including those of a compiled step,
where Inductor passes Python floats as fp64.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from llmopt.engines.native import triton_kernels as T  # noqa: E402


def _compile(kernel, types: dict[str, str], const: dict, num_warps=4, num_stages=3):
    """Compile `kernel` (a `triton.jit` function, or an autotuner over one) for sm_90:
    `types` maps each runtime argument to its Triton type, `const` each constexpr to its value
    (a constexpr with a default may be left out). Returns the compiled kernel; None without
    ptxas on the host, where the front end (parsing, type checks, Triton IR) still ran."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(kernel, "fn", kernel)
    const = {p.name: p.default for p in fn.params if p.has_default} | const
    names = fn.arg_names
    missing = [n for n in names if n not in types and n not in const]
    assert not missing, f"the test gives no type or value for {missing}"
    sig = {n: "constexpr" if n in const else types[n] for n in names}
    src = ASTSource(fn, sig, constexprs={n: const[n] for n in names if n in const})
    try:
        return triton.compile(
            src,
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": num_warps, "num_stages": num_stages},
        )
    except RuntimeError as e:  # no ptxas on this host: the front end (the type check) ran
        if "ptxas" not in str(e).lower():
            raise
        return None


def _config(cfg) -> tuple[dict, int, int]:
    return dict(cfg.kwargs), cfg.num_warps, cfg.num_stages


# Argument types as `linear.wo_mm` / `linear.int4_mm` launch them: bf16 activations and outputs,
# fp32 scales, int32 counters; scalars i32, and `eps` fp64 (inside a compiled step).
_GEMV_TYPES = {"x_ptr": "*bf16", "s_ptr": "*fp32", "y_ptr": "*bf16", "r_ptr": "*bf16"}
_GEMV_TYPES |= {"eps": "fp64", "N": "i32"}
_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


_W = {"fp8": "*fp8e4nv", "int8": "*i32", "bf16": "*bf16"}  # int8: read as words of four


def _w(fmt: str, even: bool) -> str:
    # as `linear.wo_mm` passes the weights: masked FP8 as its bytes (a 0 for the masked loads)
    return "*u8" if fmt == "fp8" and not even else _W[fmt]


@pytest.mark.parametrize("fmt", ["fp8", "int8", "bf16"])
def test_gemv_every_variant_compiles(fmt):
    """wo8_gemv with each switch (SiLU x up, no masks, RMSNorm folded in, residual add) alone and
    together, at the first autotune config, with its weights loaded one step ahead (AHEAD,
    `linear.GEMV_PREFETCH`) and not; bf16 weights as `DenseLinear` gives them."""
    tile, warps, stages = _config(T.wo8_gemv.configs[0])
    for gated, even, norm, resid in [
        (False, False, False, False),
        (True, False, False, False),
        (False, True, False, False),
        (False, False, True, False),
        (False, False, False, True),
        (True, True, False, True),
        (False, True, True, True),
    ]:
        const = {"K": 4096, "WORDS": fmt == "int8", "GATED": gated, "EVEN": even}
        const |= {"NORM": norm, "RESID": resid} | tile
        types = _GEMV_TYPES | {"w_ptr": _w(fmt, even)}
        _compile(T.wo8_gemv, types, const, warps, stages)
        _compile(T.wo8_gemv, types, const | {"AHEAD": True}, warps, stages)
        if fmt == "int8":  # bytes made floats through half precision (inline PTX: ptxas checks)
            _compile(T.wo8_gemv, types, const | {"F16": True}, warps, stages)


@pytest.mark.parametrize("fmt", ["fp8", "int8", "bf16"])
def test_gemv_pdl_loads_weights_before_it_waits(fmt):
    """With `PDL` (`linear.GEMV_PDL`) the GEMV waits for the kernel before it
    (griddepcontrol.wait) after its first weight loads, and lets the next start once its own
    loads are issued; without, neither instruction is there. Masked and unmasked, with the
    norm and the residual (the reads that must come after the wait), with the weights loaded one
    step ahead (AHEAD) and not."""
    tile, warps, stages = _config(T.wo8_gemv.configs[0])
    for even, prefetch in ((True, False), (False, False), (True, True), (False, True)):
        types = _GEMV_TYPES | {"w_ptr": _w(fmt, even)}
        const = {"K": 4096, "WORDS": fmt == "int8", "GATED": False, "EVEN": even}
        const |= {"NORM": True, "RESID": True} | tile | {"AHEAD": prefetch}
        plain = _compile(T.wo8_gemv, types, const, warps, stages)
        pdl = _compile(T.wo8_gemv, types, const | {"PDL": True}, warps, stages)
        if pdl is None:
            pytest.skip("no ptxas here: the PTX was not made")
        assert "griddepcontrol" not in plain.asm["ptx"]
        ptx = pdl.asm["ptx"]
        wait = ptx.index("griddepcontrol.wait")
        assert "ld.global" in ptx[:wait]  # the first weight tile, before the wait
        assert "griddepcontrol.launch_dependents" in ptx[wait:]


def test_masked_fp8_gemv_has_no_select_per_weight():
    """Masked FP8 weights are read as bytes with 0 for the masked ones (`linear.wo_mm`), so the
    kernel needs no select per weight to zero them (`benchmarks/gemv_ptx.py` counts it)."""
    tile, warps, stages = _config(T.wo8_gemv.configs[0])
    const = {"K": 576, "WORDS": False, "GATED": False, "EVEN": False, "NORM": False}
    const |= {"RESID": False} | tile
    k = _compile(T.wo8_gemv, _GEMV_TYPES | {"w_ptr": _w("fp8", False)}, const, warps, stages)
    if k is None:
        pytest.skip("no ptxas here: the PTX was not made")
    assert "selp" not in k.asm["ptx"]


def test_gemv_every_config_compiles():
    """Every autotune config of wo8_gemv, on the int8 word path with no masks (the default at
    one row; also each with AHEAD, as `wo8_gemv_ahead` tries them for int8) and on FP8 with
    masks, at the down projection's K."""
    assert T.wo8_gemv_ahead.configs[: len(T.wo8_gemv.configs)] == T.wo8_gemv.configs
    for cfg in T.wo8_gemv_ahead.configs:
        tile, warps, stages = _config(cfg)
        formats = (("int8", True),) if tile["AHEAD"] else (("int8", True), ("fp8", False))
        for fmt, even in formats:
            types = _GEMV_TYPES | {"w_ptr": _w(fmt, even)}
            const = {"K": _8B["down"][1], "WORDS": fmt == "int8", "GATED": False, "EVEN": even}
            _compile(
                T.wo8_gemv, types, const | {"NORM": False, "RESID": True} | tile, warps, stages
            )


@pytest.mark.parametrize("fmt,k", [("fp8", 4000), ("int8", 4096)])
def test_dot_every_config_compiles(fmt, k):
    """wo8_dot (tensor cores, K split) at every config: FP8 on a K that no split divides into
    whole tiles, int8 on one they all do."""
    types = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv" if fmt == "fp8" else "*i8", "s_ptr": "*fp32"}
    types |= {"y_ptr": "*bf16", "ws_ptr": "*fp32", "sem_ptr": "*i32"}
    types |= {"M": "i32", "N": "i32", "M_BUCKET": "i32"}
    for cfg in T.wo8_dot.configs:
        tile, warps, stages = _config(cfg)
        _compile(T.wo8_dot, types, {"K": k} | tile, warps, stages)


@pytest.mark.parametrize("group,has_zero", [(128, False), (32, True), (256, False)])
def test_int4_kernels_compile(group, has_zero):
    """int4_dot (decode and prompt tiles) and int4_gemv: every config at the engine's group of
    128, the first of each kernel at the other groups and with zero points."""
    types = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16"}
    types |= {"y_ptr": "*bf16", "M": "i32", "N": "i32", "M_BUCKET": "i32"}
    types |= {"ws_ptr": "*fp32", "sem_ptr": "*i32"}  # the GEMV's K split
    # the GEMV's norm weight, residual, sums of squares; `eps` fp64 as in a compiled step
    types |= {"g_ptr": "*bf16", "r_ptr": "*bf16", "sq_ptr": "*fp32", "eps": "fp64"}
    shape = {"K": 4096, "KP": 4096, "G": group, "HAS_ZERO": has_zero}
    plain = {"NORM": False, "RESID": False}
    for kernel in (T.int4_dot, T.int4_dot_prompt, T.int4_gemv):
        flags = {"EVEN_N": True, "ASM": True, "HALF": True} | plain if kernel is T.int4_gemv else {}
        for cfg in kernel.configs if group == 128 else kernel.configs[:1]:
            tile, warps, stages = _config(cfg)
            _compile(kernel, types, shape | flags | tile, warps, stages)
    # the GEMV with masks (rows, a split that is not whole tiles, SmolLM2's padded K)
    masked = {"K": 576, "KP": 768, "G": 64, "HAS_ZERO": has_zero, "EVEN_N": False}
    for cfg in T.int4_gemv.configs[-2:]:
        tile, warps, stages = _config(cfg)
        for half in (False, True):  # (at G = 64 both take the fp32 products)
            flags = {"ASM": True, "HALF": half} | plain
            _compile(T.int4_gemv, types, masked | flags | tile, warps, stages)
    # the fp32 products at the engine's group (the half-precision ones are its default there)
    tile, warps, stages = _config(T.int4_gemv.configs[0])
    flags = {"EVEN_N": True, "ASM": True, "HALF": False} | plain
    _compile(T.int4_gemv, types, shape | flags | tile, warps, stages)
    # the RMSNorm and the residual fused (`linear.norm_linear`, `linear_add`), each alone and
    # together, launched as a programmatic dependent and not; unsplit, split, and masked
    for cfg in (T.int4_gemv.configs[0], T.int4_gemv.configs[3], T.int4_gemv.configs[-1]):
        tile, warps, stages = _config(cfg)
        for norm, resid, pdl in ((True, False, True), (False, True, True), (True, True, False)):
            for half in (False, True):
                flags = {"ASM": True, "HALF": half, "NORM": norm, "RESID": resid, "PDL": pdl}
                _compile(T.int4_gemv, types, shape | flags | {"EVEN_N": True} | tile, warps, stages)
                _compile(T.int4_gemv, types, masked | flags | tile, warps, stages)


def test_decode_kernels_compile_with_an_fp64_scale():
    """Inside a compiled step Inductor passes `sm_scale` as fp64: both split kernels must still
    compile. The fused-RoPE kernel once failed here: its new-position branch made the running
    maximum fp64."""
    const = {"H": 32, "G": 4, "N_KV": 8, "BLOCK_H": 16, "D": 128, "BLOCK_D": 128, "PAGE": 16}
    const |= {"SPLIT": 256, "NUM_SPLITS": 4, "DYNAMIC": False, "BLOCK_N": 32}
    floats = {"po_ptr", "pl_ptr"}
    for kernel in (T.decode_split, T.decode_split_rope):
        types = {
            n: "fp64"
            if n == "sm_scale"
            else ("*fp32" if n in floats else "*i32" if n in ("tab_ptr", "pos_ptr") else "*bf16")
            if n.endswith("_ptr")
            else "i32"
            for n in getattr(kernel, "fn", kernel).arg_names
        }
        _compile(kernel, types, const)
