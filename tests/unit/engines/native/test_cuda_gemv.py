"""The one-row int8/FP8 GEMV in CUDA C++ (`cuda_gemv`, `csrc/wo8_gemv.cu`): it compiles for
sm_90 wherever nvcc is (kernels alone: a CPU-only PyTorch has no CUDA headers), it says why
it does not run where it cannot, and on a GPU every configuration, format and fused variant
matches the dequantized reference and the Triton GEMV, through `linear.wo_mm` and a decode."""

from __future__ import annotations

import re
import shutil
import subprocess
import sysconfig

import pytest
import torch

from llmopt.engines.native import cuda_gemv as C
from llmopt.engines.native import linear as L

# Skipped only where a GPU or the build tools are missing: where both are there, a failed build
# or check is a test failure (`built` below), not a skip.
needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or C.missing_tools() is not None,
    reason="needs a CUDA GPU with nvcc and ninja (the CUDA GEMVs build on first use)",
)


@pytest.fixture
def built():
    """The 1-byte CUDA GEMV built and checked on this GPU (else the test fails, with why)."""
    assert L.prepare_cuda_gemv("cuda") == ""


@pytest.fixture
def built_int4():
    """The int4 CUDA GEMV built and checked on this GPU (else the test fails, with why)."""
    assert L.prepare_cuda_gemv("cuda", int4=True) == ""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize(
    "source, define, per_config, max_spill",
    [
        # int8 and FP8 per config, no spills
        (C.SOURCE, "LLMOPT_WO8_KERNELS_ONLY", 2, 0),
        # groups of 128+, 64, 32 per config; a few bytes of spill allowed (ptxas spills 8 in
        # one of the group-32 kernels, outside the weight loads)
        (C.INT4_SOURCE, "LLMOPT_INT4_KERNELS_ONLY", 3, 16),
    ],
    ids=["wo8", "int4"],
)
def test_kernels_compile_for_sm90(tmp_path, source, define, per_config, max_spill):
    """Every configuration compiles for sm_90 (bf16 activations; the kernels alone, as a
    CPU-only PyTorch has no CUDA headers), with at most `max_spill` bytes spilled to local
    memory per kernel (a spill in the main loop would put a memory round trip beside each
    weight load)."""
    out = subprocess.run(
        [
            "nvcc",
            "-std=c++17",
            "-O3",
            "-gencode=arch=compute_90,code=sm_90",
            f"-D{define}",
            "-Xptxas",
            "-v",
            "-c",
            str(source),
            "-o",
            str(tmp_path / "k.o"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    configs = C.CONFIGS if source == C.SOURCE else C.INT4_CONFIGS
    used = re.findall(r"Used (\d+) registers", out.stderr)
    assert len(used) == per_config * len(configs), out.stderr[-3000:]
    spills = [int(b) for b in re.findall(r"(\d+) bytes spill stores", out.stderr)]
    assert len(spills) == len(used) and max(spills) <= max_spill, out.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("source", [C.SOURCE, C.INT4_SOURCE], ids=["wo8", "int4"])
def test_extensions_compile_with_torch_headers(tmp_path, source):
    """The whole extension (its PyTorch-facing half too) compiles with this PyTorch's headers.
    A CPU-only PyTorch lacks one generated header of its CUDA build (CMake's macros for
    c10/cuda), stubbed here; the CUDA runtime's own headers come with nvcc."""
    from torch.utils import cpp_extension

    stub = tmp_path / "inc" / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    includes = [f"-I{p}" for p in [tmp_path / "inc", *cpp_extension.include_paths()]]
    includes.append(f"-I{sysconfig.get_paths()['include']}")
    out = subprocess.run(
        ["nvcc", "-std=c++17", "-O1", "-gencode=arch=compute_90,code=sm_90", *includes]
        + ["-DTORCH_EXTENSION_NAME=check", "-c", str(source), "-o", str(tmp_path / "x.o")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer without a GPU")
def test_unavailable_without_gpu_says_why():
    assert not C.available(0, L._wo8_cuda_cases)
    assert not C.ready(0)
    assert C.unavailable_reason(0, L._wo8_cuda_cases) == "no CUDA GPU"
    assert L.prepare_cuda_gemv("cpu") == "not a GPU"


def test_supports_only_what_the_kernel_reads():
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    assert C.supports(x, torch.zeros(8, 64, dtype=torch.int8))
    assert C.supports(x.half(), torch.zeros(8, 64, dtype=torch.float8_e4m3fn))
    assert not C.supports(x, torch.zeros(8, 64, dtype=torch.bfloat16))  # 16-bit: Triton's
    assert not C.supports(x.float(), torch.zeros(8, 64, dtype=torch.int8))
    x48 = torch.zeros(1, 48 + 8, dtype=torch.bfloat16)
    assert not C.supports(x48, torch.zeros(8, 56, dtype=torch.int8))  # K % 16


def _reference(x, q, s, eps=None, r=None):
    y = x.float() @ (q.float() * s.float().reshape(-1)[:, None]).t()
    if eps is not None:
        y = y * torch.rsqrt(x.float().pow(2).mean(dim=1, keepdim=True) + eps)
    if r is not None:
        y = y + r.float()
    return y


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("wdtype", ["int8", "fp8"])
@pytest.mark.parametrize("adtype", [torch.bfloat16, torch.float16])
@pytest.mark.usefixtures("built")
def test_every_config_matches_reference_on_gpu(wdtype, adtype):
    """Each configuration, N not a multiple of any block's rows, K a few loop steps or one
    partial step, one and three activation rows, plain / normalized / residual: within bf16
    rounding of the fp32 product of the dequantized weights."""
    if wdtype == "fp8" and not L.fp8_supported():
        pytest.skip("FP8 conversion needs compute capability 8.9")
    mod = C._module(C._arch(0))
    g = torch.Generator(device="cuda").manual_seed(0)
    for n, k in ((1000, 2048), (37, 144), (4096, 14336)):
        w = torch.randn(n, k, device="cuda", generator=g) * 0.05
        w[0, :8] = torch.linspace(-1, 1, 8, device="cuda")  # int8 codes reach -127 and 127
        q, s = L.quantize_int8(w) if wdtype == "int8" else L.quantize_fp8(w)
        s = s.float().contiguous()
        for m in (1, 3):
            x = torch.randn(m, k, device="cuda", generator=g).to(adtype)
            r = torch.randn(m, n, device="cuda", generator=g).to(adtype)
            for eps, res in ((None, None), (1e-5, None), (None, r)):
                want = _reference(x, q, s, eps, res)
                for c in range(len(C.CONFIGS)):
                    for scale in (s, s.to(adtype)):
                        got = mod.wo8_gemv(
                            x, q, scale, r, eps or 0.0, eps is not None, res is not None, c, False
                        )
                        err = float((got.float() - want).norm() / want.norm())
                        assert err < 1e-2, (n, k, m, eps, res is not None, c, err)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.usefixtures("built")
def test_wo_mm_routes_to_cuda_and_matches_triton_on_gpu(monkeypatch):
    """`GEMV_CUDA`: `wo_mm`'s one-row GEMV goes to the CUDA kernel (a `llmopt::wo8_gemv_cuda`
    call) and gives the Triton GEMV's outputs in every variant it takes, through the plain and
    the dependent launch; the SiLU x up input stays Triton's."""
    g = torch.Generator(device="cuda").manual_seed(1)
    calls = []
    real = C._module(C._arch(0)).wo8_gemv

    class Spy:
        configs = len(C.CONFIGS)

        def wo8_gemv(self, *args):
            calls.append(args[-1])
            return real(*args)

    monkeypatch.setattr(C, "_module", lambda arch: Spy())
    for quant in (L.quantize_int8, L.quantize_fp8):
        n, k = 1024, 2048
        q, s = quant(torch.randn(n, k, device="cuda", generator=g) * 0.05)
        s = s.float().contiguous()
        x = torch.randn(1, k, device="cuda", generator=g, dtype=torch.bfloat16)
        r = torch.randn(1, n, device="cuda", generator=g, dtype=torch.bfloat16)
        for kw in ({}, {"norm_eps": 1e-5}, {"residual": r}):
            monkeypatch.setattr(L, "GEMV_CUDA", False)
            want = L.wo_mm(x, q, s, "gemv", **kw)
            monkeypatch.setattr(L, "GEMV_CUDA", True)
            L.wo_mm(x, q, s, "gemv", **kw)  # (the first call of a shape times every config)
            for pdl in (False, True):
                monkeypatch.setattr(L, "GEMV_PDL", pdl)
                before = len(calls)
                got = L.wo_mm(x, q, s, "gemv", **kw)
                assert len(calls) == before + 1 and calls[-1] is pdl
                torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
        x2 = torch.randn(1, 2 * k, device="cuda", generator=g, dtype=torch.bfloat16)
        before = len(calls)
        L.wo_mm(x2, q, s, "gemv", gated=True)
        assert len(calls) == before


@pytest.mark.gpu
@needs_gpu
@pytest.mark.usefixtures("built")
def test_decode_with_cuda_gemv_matches_triton_on_gpu(tiny_llama_dir, monkeypatch):
    """A compiled int8 and FP8 decode (CUDA graphs, the norm and residual fused into the GEMVs)
    gives the Triton GEMV's greedy tokens with the CUDA GEMV (the first ones: the two sum in
    another order, and a random tiny model has near ties), and runs the CUDA kernel."""
    from llmopt.engines.generation import SamplingParams
    from llmopt.engines.native import load_generator

    monkeypatch.setattr(L, "GEMV_PICK", False)  # (every shape to the CUDA kernel: it is tested)
    tuned = len(C._TUNED)
    for rec in ("w8a16", "fp8-dynamic")[: 1 + L.fp8_supported()]:
        got = {}
        for on in (False, True):
            monkeypatch.setattr(L, "GEMV_CUDA", on)
            gen = load_generator(tiny_llama_dir, rec, device="cuda", compile=True)
            got[on], _ = gen.generate([5, 6, 7, 8], SamplingParams(max_tokens=8, ignore_eos=True))
            del gen
            torch._dynamo.reset()
        assert len(got[True]) == 8 and got[True][:4] == got[False][:4], rec
    assert len(C._TUNED) > tuned  # the CUDA kernel ran (timed its configs for the new shapes)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.usefixtures("built")
@pytest.mark.parametrize("replay", [False, True], ids=["do_bench", "replay"])
def test_pick_times_each_shape_once_and_routes_by_it(monkeypatch, replay):
    """`GEMV_PICK`: the first layer of a shape times the CUDA and the Triton GEMV (five
    interleaved rounds each: single launches, or CUDA-graph replays with
    `GEMV_PICK_REPLAY`), a second layer of that shape does not; the layer's one-row forward
    then goes where the table says (forced both ways here), with the same outputs; a shape no
    layer timed takes the CUDA kernel."""
    monkeypatch.setattr(L, "_CUDA_PICKED", {})
    monkeypatch.setattr(L, "_PICK_TIMES", {})
    monkeypatch.setattr(L, "GEMV_CUDA", True)
    monkeypatch.setattr(L, "GEMV_PICK", True)
    monkeypatch.setattr(L, "GEMV_PICK_REPLAY", replay)
    benched = []
    name = "_replayed_ms" if replay else "_launched_ms"  # (the configs' own timing not counted)
    real_bench = getattr(L, name)
    monkeypatch.setattr(L, name, lambda *a, **k: benched.append(1) or real_bench(*a, **k))
    calls, real = [], C._module(C._arch(0)).wo8_gemv

    class Spy:
        configs = len(C.CONFIGS)

        def wo8_gemv(self, *args):
            calls.append(1)
            return real(*args)

    monkeypatch.setattr(C, "_module", lambda arch: Spy())
    g = torch.Generator(device="cuda").manual_seed(3)
    q, s = L.quantize_int8(torch.randn(1024, 2048, device="cuda", generator=g) * 0.05)
    lin = L.Int8Linear(q, s, None, torch.bfloat16)
    key = ("wo8", 1024, 2048, torch.int8, torch.bfloat16, 0)
    assert key in L._CUDA_PICKED and len(benched) == 10
    (pick,) = L.gemv_picks()  # what benchmarks record
    assert pick["shape"] == [1024, 2048] and pick["cuda_us"] > 0 and pick["triton_us"] > 0
    assert pick["picked"] == ("cuda" if L._CUDA_PICKED[key] else "triton")
    timed = len(benched)
    L.Int8Linear(q, s, None, torch.bfloat16)
    assert len(benched) == timed
    x = torch.randn(1, 2048, device="cuda", generator=g, dtype=torch.bfloat16)
    out = {}
    for cuda in (False, True):
        L._CUDA_PICKED[key] = cuda
        before = len(calls)
        out[cuda] = lin(x)
        assert len(calls) == before + cuda
    torch.testing.assert_close(out[True], out[False], rtol=1e-2, atol=1e-2)
    q2, s2 = L.quantize_int8(torch.randn(512, 2048, device="cuda", generator=g) * 0.05)
    before = len(calls)
    L.wo_mm(x, q2, s2.float(), "gemv")  # (no layer of this shape: not in the table)
    assert len(calls) > before


def _table(text: str, macro: str) -> list[tuple[int, ...]]:
    body = text.split(f"#define {macro}(X)", 1)[1].split("\n\n", 1)[0]
    return [
        tuple(int(v) for v in row.split(", ")) for row in re.findall(r"X\((\d+(?:, \d+)+)\)", body)
    ]


@pytest.mark.parametrize("which", ["wo8", "int4"])
def test_configs_match_the_kernel_table(which):
    """`CONFIGS` (`INT4_CONFIGS`) index the .cu file's config list by position: they must
    agree, and the kernel's count with them."""
    source, configs, macro = (
        (C.SOURCE, C.CONFIGS, "LLMOPT_WO8_CONFIGS")
        if which == "wo8"
        else (C.INT4_SOURCE, C.INT4_CONFIGS, "LLMOPT_INT4_CONFIGS")
    )
    text = source.read_text()
    rows = _table(text, macro)
    assert tuple(tuple(cfg) for _, *cfg in rows) == configs
    assert f"kConfigs = {len(rows)};" in text
    assert [i for i, *_ in rows] == list(range(len(rows)))
    assert 0 <= C.DEFAULT_CONFIG < len(configs)


def test_int4_supports_only_what_the_kernel_reads():
    x = torch.zeros(1, 512, dtype=torch.bfloat16)
    packed = torch.zeros(8, 64, dtype=torch.int32)
    assert all(C.int4_supports(x, packed, g, None) for g in (32, 64, 128, 256, 512))
    assert not C.int4_supports(x, packed, 128, torch.zeros(8, 4))  # zero points: Triton's
    assert not C.int4_supports(x, packed, 96, None)  # not a power of two
    assert not C.int4_supports(x, packed, 16, None)
    assert not C.int4_supports(x.float(), packed, 128, None)
    x576 = torch.zeros(1, 576, dtype=torch.bfloat16)  # K padded to 768 in the layout
    assert not C.int4_supports(x576, torch.zeros(8, 96, dtype=torch.int32), 64, None)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("adtype", [torch.bfloat16, torch.float16])
@pytest.mark.usefixtures("built_int4")
def test_int4_every_config_matches_reference_on_gpu(adtype):
    """Each configuration and group size, N not a multiple of any block's rows, K one tile and
    many (a row its threads hold in registers and one they read in batches), one and three
    rows, plain and (group 128) normalized / residual: within f16/bf16 rounding of the fp32
    product of the dequantized weights, and codes reaching -8 and 7. N = 20,000 at K = 256
    gives the fitted configs (variant bit 4) many groups per block and a last block cut short."""
    mod = C._int4_module(C._arch(0))
    g = torch.Generator(device="cuda").manual_seed(0)
    eps = 1e-5
    for n, k in ((1000, 2048), (37, 256), (4096, 14336), (20000, 256)):
        w = torch.randn(n, k, device="cuda", generator=g) * 0.05
        w[0, :16] = torch.linspace(-1, 1, 16, device="cuda")
        gw = (1 + 0.5 * torch.randn(k, device="cuda", generator=g)).to(adtype)
        for group in (32, 64, 128, 256):
            q, s = L.quantize_int4(w, group)
            deq = (q.float().reshape(n, -1, group) * s[..., None]).reshape(n, k)
            packed, sc = L.pack_int4_planar(q), s.to(adtype).contiguous()
            runnable = C.int4_runnable(0, k, group)
            assert runnable == list(range(len(C.INT4_CONFIGS)))  # (all fit at these K)
            for m in (1, 3):
                x = 20 * torch.randn(m, k, device="cuda", generator=g).to(adtype)
                r = torch.randn(m, n, device="cuda", generator=g).to(adtype)
                xf = x.float()
                normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * gw.float()
                cases = [(False, False, xf @ deq.t())]
                if group == 128:
                    cases += [(True, False, normed @ deq.t()), (False, True, xf @ deq.t() + r)]
                for norm, resid, want in cases:
                    for c in runnable:
                        got = mod.int4_gemv(x, packed, sc, gw, r, group, eps, norm, resid, c, False)
                        err = float((got.float() - want).norm() / want.norm())
                        assert err < 1e-2, (n, k, group, m, norm, resid, c, err)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.usefixtures("built_int4")
def test_int4_fitted_configs_launch_one_wave_on_gpu():
    """A fitted config (variant bit 4) takes as few groups of rows per block as let the whole
    launch be resident at once: a whole number of teams, more with more rows to cover, the
    fewest for a small matrix, and never more blocks than the GPU's multiprocessors hold (at
    least one block each); the other configs keep their CHUNKS."""
    mod = C._int4_module(C._arch(0))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    fitted = [c for c, cfg in enumerate(C.INT4_CONFIGS) if cfg[6] & C.FIT]
    assert fitted
    for c in range(len(C.INT4_CONFIGS)):
        rows, warps, _, chunks, split, *_ = C.INT4_CONFIGS[c]
        seen = []
        for m, n in ((1, 37), (1, 28672), (3, 28672), (1, 200000)):
            x = torch.zeros(m, 4096, device="cuda", dtype=torch.bfloat16)
            w = torch.zeros(n, 512, device="cuda", dtype=torch.int32)
            got = mod.int4_chunks(x, w, 128, c)
            if c not in fitted:
                assert got == chunks
                continue
            blocks = -(-n // (rows * got)) * m
            assert got % split == 0 and got >= split, (c, m, n, got)
            # (a multiprocessor holds at most 2,048 threads)
            assert blocks <= sms * (2048 // (32 * warps)), (c, m, n, got)
            seen.append(got)
        if c in fitted:
            assert seen[0] == split and seen == sorted(seen) and seen[-1] > seen[1], (c, seen)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.usefixtures("built_int4")
def test_int4_mm_routes_to_cuda_and_matches_triton_on_gpu(monkeypatch):
    """`INT4_GEMV_CUDA`: `int4_mm`'s one-row GEMV gives the Triton GEMV's outputs through the
    CUDA kernel, plain and as a dependent launch; zero points stay Triton's."""
    g = torch.Generator(device="cuda").manual_seed(2)
    n, k = 1024, 4096
    q, s = L.quantize_int4(torch.randn(n, k, device="cuda", generator=g) * 0.05, 128)
    packed, sc = L.pack_int4_planar(q), s.to(torch.bfloat16).contiguous()
    x = torch.randn(1, k, device="cuda", generator=g, dtype=torch.bfloat16)
    monkeypatch.setattr(L, "INT4_GEMV_CUDA", False)
    want = L.int4_mm(x, packed, sc, None, 128, "gemv")
    tuned = len(C._TUNED)
    monkeypatch.setattr(L, "INT4_GEMV_CUDA", True)
    for pdl in (False, True):
        monkeypatch.setattr(L, "GEMV_PDL", pdl)
        got = L.int4_mm(x, packed, sc, None, 128, "gemv")
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    assert len(C._TUNED) == tuned + 1  # the CUDA kernel ran (it timed its configs once)
    # neither teams nor the early step: the shape is timed again, among the rest only
    monkeypatch.setattr(L, "INT4_GEMV_TEAMS", False)
    monkeypatch.setattr(L, "INT4_GEMV_EARLY", False)
    got = L.int4_mm(x, packed, sc, None, 128, "gemv")
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    plain = [t for t in C.tuned_configs() if t["n"] == n and not (t["teams"] or t["early"])]
    assert len(plain) == 1 and plain[0]["config"][4:6] == [1, 0]
    assert [u is None for u in plain[0]["us"]] == [
        c not in C.int4_configs(False, False) for c in range(len(C.INT4_CONFIGS))
    ]
    zero = torch.zeros_like(sc)
    before = len(C._TUNED)
    L.int4_mm(x, packed, sc, zero, 128, "gemv")
    assert len(C._TUNED) == before


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("adtype", [torch.bfloat16, torch.float16])
@pytest.mark.usefixtures("built_int4")
def test_int4_cuda_gemv_fuses_the_norm_and_residual_as_triton_does_on_gpu(monkeypatch, adtype):
    """The CUDA int4 GEMV with the RMSNorm before it and the residual add after it (as
    `norm_linear` and `linear_add` call it) gives the Triton GEMV's fused outputs and the
    reference's, on a residual stream of entries in the hundreds (the kernel normalizes
    before it stages x in f16), every config, 1 and 2 rows."""
    g = torch.Generator(device="cuda").manual_seed(4)
    n, k, eps = 1000, 2048, 1e-5
    q, s = L.quantize_int4(torch.randn(n, k, device="cuda", generator=g) * 0.05, 64)
    packed, sc = L.pack_int4_planar(q), s.to(adtype).contiguous()
    deq = (q.float().reshape(n, -1, 64) * s[..., None]).reshape(n, k)
    gw = (1 + 0.3 * torch.randn(k, device="cuda", generator=g)).to(adtype)
    mod = C._int4_module(C._arch(0))
    for m in (1, 2):
        x = (torch.randn(m, k, device="cuda", generator=g) * 300).to(adtype)
        r = torch.randn(m, n, device="cuda", generator=g).to(adtype)
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(adtype)
        want = (normed * gw).float() @ deq.t() + r.float()
        for c in C.int4_runnable(0, k, 64):
            got = mod.int4_gemv(x, packed, sc, gw, r, 64, eps, True, True, c, False)
            err = float((got.float() - want).norm() / want.norm())
            assert err < 1e-2, (m, c, err)
        monkeypatch.setattr(L, "INT4_GEMV_CUDA", False)
        triton = L.int4_mm(x, packed, sc, None, 64, "gemv", norm=(gw, eps), residual=r)
        monkeypatch.setattr(L, "INT4_GEMV_CUDA", True)
        cuda = L.int4_mm(x, packed, sc, None, 64, "gemv", norm=(gw, eps), residual=r)
        torch.testing.assert_close(cuda, triton, rtol=3e-2, atol=3e-2)
        only_resid = L.int4_mm(normed, packed, sc, None, 64, "gemv", residual=r)
        torch.testing.assert_close(
            only_resid.float(), normed.float() @ deq.t() + r.float(), rtol=3e-2, atol=3e-2
        )


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("adtype", [torch.bfloat16, torch.float16])
@pytest.mark.usefixtures("built_int4")
def test_int4_cuda_gemv_stages_massive_activations_scaled_down_on_gpu(adtype):
    """A row with a few entries far beyond what f16 sums of raw products hold (30,000 and
    -60,000; through the norm, ~11,000 where its weight is 200) gives the fp32 reference's
    output in every config, and the rest of the row keeps its precision: with the weights of
    the massive entries' columns zeroed, the output is the reference of the ordinary entries."""
    g = torch.Generator(device="cuda").manual_seed(5)
    n, k, eps = 512, 4096, 1e-5
    w = torch.randn(n, k, device="cuda", generator=g) * 0.05
    big = torch.tensor([7, 300, 2049], device="cuda")
    mod = C._int4_module(C._arch(0))
    for zeroed in (False, True):
        if zeroed:
            w[:, big] = 0.0
        q, s = L.quantize_int4(w, 128)
        deq = (q.float().reshape(n, -1, 128) * s[..., None]).reshape(n, k)
        packed, sc = L.pack_int4_planar(q), s.to(adtype).contiguous()
        x = torch.randn(2, k, device="cuda", generator=g)
        x[:, big] = torch.tensor([30000.0, -60000.0, 12000.0], device="cuda")
        x = x.to(adtype)
        gw = torch.ones(k, device="cuda", dtype=adtype)
        gw[big] = 200.0
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)) * gw.float()
        for fused, want in ((False, xf @ deq.t()), (True, normed @ deq.t())):
            for c in C.int4_runnable(0, k, 128):
                got = mod.int4_gemv(x, packed, sc, gw, x, 128, eps, fused, False, c, False)
                assert torch.isfinite(got).all(), (zeroed, fused, c)
                err = float((got.float() - want).norm() / want.norm())
                assert err < 1e-2, (zeroed, fused, c, err)


@pytest.mark.parametrize(
    "cuda_ms, triton_ms, picked",
    [(1.0, 1.0, True), (1.0, 0.99, True), (1.0, 0.95, False), (0.9, 1.0, True)],
)
def test_pick_keeps_cuda_unless_triton_wins_by_the_margin(monkeypatch, cuda_ms, triton_ms, picked):
    """`_pick_one_row`'s decision from its timings (medians of five interleaved rounds, one
    outlier per kernel ignored): the CUDA kernel keeps a shape unless Triton's is faster by
    more than `GEMV_PICK_MARGIN` (2%). Timings stand in for the GPU here; the kernels
    themselves are timed by the GPU test above."""
    import triton.testing

    monkeypatch.setattr(L, "_CUDA_PICKED", {})
    monkeypatch.setattr(L, "_PICK_TIMES", {})
    monkeypatch.setattr(L, "GEMV_PICK", True)
    monkeypatch.setattr(L, "GEMV_PICK_REPLAY", False)
    rounds = {"cuda": [cuda_ms, cuda_ms, 50.0, cuda_ms, cuda_ms], "triton": [triton_ms] * 5}
    rounds["triton"][1] = 0.001  # an outlier the median ignores

    def fake_bench(fn, **kw):
        return rounds[fn()].pop(0)

    monkeypatch.setattr(triton.testing, "do_bench", fake_bench)
    w = torch.zeros(64, 128, dtype=torch.int8)
    L._pick_one_row(
        "wo8", (w,), w.dtype, torch.bfloat16, lambda x, w: "cuda", lambda x, w: "triton"
    )
    (pick,) = L.gemv_picks()
    assert pick["picked"] == ("cuda" if picked else "triton")
    assert pick["cuda_us"] == pytest.approx(1e3 * cuda_ms)
    assert L._CUDA_PICKED[("wo8", 64, 128, torch.int8, torch.bfloat16, 0)] is picked


def test_tuned_configs_name_each_shapes_config(monkeypatch):
    """`tuned_configs()` (what `decode.py` records) reads a timed key's config index back as
    the row of its kernel's table."""
    monkeypatch.setattr(C, "_TUNED", {})
    monkeypatch.setattr(C, "_TIMES", {})
    C._TUNED[("int4", 4096, 512, 128, torch.bfloat16, 1, True, False, True, False)] = 6
    C._TIMES[("int4", 4096, 512, 128, torch.bfloat16, 1, True, False, True, False)] = {
        0: 0.0123,
        6: 0.0101,
    }
    C._TUNED[("wo8", 6144, 4096, torch.int8, torch.bfloat16, 1)] = 2
    int4, wo8 = C.tuned_configs()
    assert int4["config"] == list(C.INT4_CONFIGS[6]) and int4["weight"] == "128"
    assert [int4[s] for s in C.INT4_SWITCHES] == [True, False, True, False]
    assert "teams" not in wo8
    assert int4["us"][0] == 12.3 and int4["us"][6] == 10.1 and int4["us"][1] is None
    assert len(int4["us"]) == len(C.INT4_CONFIGS) and wo8["us"] == [None] * len(C.CONFIGS)
    assert wo8["config"] == list(C.CONFIGS[2]) and (wo8["n"], wo8["k"]) == (6144, 4096)


def test_decode_benchmark_prints_each_shapes_configs(monkeypatch, benchmark_script):
    """`benchmarks/decode.py` prints `tuned_configs()`: the set a point allowed, and '-' for a
    config it left out of the timing (not a crash on the missing time)."""
    decode = benchmark_script("decode")
    monkeypatch.setattr(C, "_TUNED", {})
    monkeypatch.setattr(C, "_TIMES", {})
    key = ("int4", 4096, 512, 128, torch.bfloat16, 1, False, True, True, True)
    C._TUNED[key] = 0
    C._TIMES[key] = {c: 0.01 + c / 1e4 for c in C.int4_configs(teams=False)}
    C._TUNED[("wo8", 6144, 4096, torch.int8, torch.bfloat16, 1)] = 2  # timed under capture
    head, times, wo8 = decode.config_lines(C.tuned_configs())
    assert "(teams False, early True, variants True, fit True)" in head and "teams" not in wo8
    cells = times.split(": ")[1].split()
    assert len(cells) == len(C.INT4_CONFIGS) and cells[0] == "10.0"
    assert [c == "-" for c in cells] == [
        c not in C.int4_configs(teams=False) for c in range(len(C.INT4_CONFIGS))
    ]


@pytest.mark.parametrize("teams", [True, False])
@pytest.mark.parametrize("early", [True, False])
def test_int4_timing_chooses_only_among_the_allowed_configs(monkeypatch, teams, early):
    """`linear.INT4_GEMV_TEAMS` / `INT4_GEMV_EARLY` off: the per-shape timing runs and may choose
    only configs without teams of warps / without the early second step, and a shape timed
    under one set is timed again under another (the set is part of the key), so that each
    point of an end-to-end A/B gets its own choice. The fastest config is made a team one with
    an early step, so that excluding either must change the choice."""
    import triton.testing

    monkeypatch.setattr(C, "_TUNED", {})
    monkeypatch.setattr(C, "_TIMES", {})
    fastest = C.INT4_CONFIGS.index((4, 16, 1, 8, 4, 1, 0))
    ran = []

    def fake_bench(fn, **kw):
        c = fn()
        ran.append(c)
        return 1.0 if c == fastest else 2.0 + c / 100  # then the lowest index wins

    monkeypatch.setattr(triton.testing, "do_bench", fake_bench)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # (CPU torch)
    allowed = C.int4_configs(teams, early)
    key = ("int4", 4096, 4096, 128, torch.bfloat16, 1, teams, early, True, True)
    got = C._tuned(key, allowed, lambda c: c)
    assert ran == allowed * C.TUNE_ROUNDS  # (interleaved: each round times every config)
    assert all(C.INT4_CONFIGS[c][4] == 1 or teams for c in ran)
    assert all(C.INT4_CONFIGS[c][5] == 0 or early for c in ran)
    assert got == (fastest if teams and early else 0)
    other = key[:-4] + (not teams, early, True, True)
    C._tuned(other, C.int4_configs(not teams, early), lambda c: c)
    assert len(C._TUNED) == 2
    assert C._tuned(key, allowed, lambda c: pytest.fail("timed twice")) == got


def test_tuning_takes_the_median_of_interleaved_rounds(monkeypatch):
    """The per-shape timing keeps the config with the lowest median over its rounds: one slow
    round (a clock dip, another process) does not cost a config the shape, and one lucky round
    does not win it."""
    import triton.testing

    monkeypatch.setattr(C, "_TUNED", {})
    monkeypatch.setattr(C, "_TIMES", {})
    monkeypatch.setattr(C, "TUNE_ROUNDS", 3)
    rounds = {0: [1.0, 9.0, 1.0], 1: [1.2, 1.2, 1.2], 2: [0.5, 2.0, 2.0]}

    def fake_bench(fn, **kw):
        return rounds[fn()].pop(0)

    monkeypatch.setattr(triton.testing, "do_bench", fake_bench)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # (CPU torch)
    key = ("wo8", 64, 128, torch.int8, torch.bfloat16, 1)
    assert C._tuned(key, [0, 1, 2], lambda c: c) == 0  # (the means would pick 1)
    assert C._TIMES[key] == {0: 1.0, 1: 1.2, 2: 2.0}
    assert all(not r for r in rounds.values())
