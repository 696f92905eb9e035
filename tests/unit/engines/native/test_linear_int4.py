"""The Triton int4 kernels of `engines/native/linear.py` (fused dequant GEMV and GEMM).

CPU: the packing, and the kernel under Triton's interpreter (subprocess, TRITON_INTERPRET=1).
GPU: `Int4Linear` takes the Triton path and matches its own dequantized weights; tinygemm, the
CUDA default, takes widths that are not multiples of 128.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from llmopt.engines.native import linear as L


def test_pack_int4_planar_round_trips_every_code_and_pads_to_whole_tiles():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (5, 576), generator=g, dtype=torch.int32)
    q[0, :16] = torch.arange(-8, 8)  # every code, the sign bit of the top nibble too
    p = L.pack_int4_planar(q)
    assert p.dtype == torch.int32 and p.shape == (5, 768 // 8)  # 576 -> 3 tiles of 256
    assert torch.equal(L.unpack_int4_planar(p, 576), q)
    assert not L.unpack_int4_planar(p, 768)[:, 576:].any()  # padding codes are 0
    # nibble i of word j in tile t is k = 256 t + 32 i + j
    assert (int(p[1, 32 + 3]) >> 8) & 0xF == int(q[1, 256 + 64 + 3]) & 0xF


def test_int4_triton_shapes():
    assert L.int4_triton_supported(4096, 128) and L.int4_triton_supported(576, 64)
    assert L.int4_triton_supported(4096, 256) and L.int4_triton_supported(2048, 512)
    assert not L.int4_triton_supported(4096, 4096 + 256)  # K not a whole number of groups
    assert not L.int4_triton_supported(512, 16)  # a group smaller than a 32-wide slice
    assert not L.int4_triton_supported(100, 20)


INTERPRET_CHECK = textwrap.dedent(
    """
    import torch
    from llmopt.engines.native import linear as L
    from llmopt.engines.native import attention as A
    g = torch.Generator().manual_seed(1)
    worst, bad = 0.0, []
    cases = ((40, 576, 64, 1, False), (24, 512, 128, 3, True), (72, 256, 32, 20, True),
             (64, 384, 128, 17, False), (16, 512, 256, 2, True))
    # each config of the dot kernels (1, 2, 4 tiles; prompt tiles); of the GEMV: 128, 64 and
    # 32 rows, K split 1, 2, 4 and 8 ways (a split past the last tile reads nothing), 2 tiles
    # a step; the GEMV plain and with the norm and the residual fused
    for cfg in (0, 1, 2, 5, 7, 11):
        A.INTERPRET_CONFIG = cfg
        for n, k, group, m, asym in cases:
            w = torch.randn(n, k, generator=g)
            q, s = L.quantize_int4(w, group)
            zp = torch.randint(-2, 3, s.shape, generator=g) if asym else None
            qg = q.float().reshape(n, -1, group) - (zp.float()[..., None] if asym else 0.0)
            deq = (qg * s[..., None]).reshape(n, k)
            zero = None if zp is None else -zp.float() * s
            x = torch.randn(m, k, generator=g)
            ref = x @ deq.t()
            # the GEMV also normalizing x (an RMSNorm's weight gw) and adding a residual r
            gw, r = torch.rand(k, generator=g) + 0.5, torch.randn(m, n, generator=g)
            xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * gw
            fused = {"norm": (gw, 1e-5), "residual": r}
            for kern, extra, want in (
                ("dot", {}, ref),
                ("gemv", {}, ref),  # the GEMV at any row count too (one program row each)
                ("gemv", fused, xn @ deq.t() + r),
            ):
                packed = L.pack_int4_planar(q)
                y = L.int4_mm(x, packed, s, zero, group, kern, **extra)
                assert y.shape == (m, n), (y.shape, m, n)
                err = float((y - want).norm() / want.norm())
                if not err < 1e-5:  # (NaN too) every case that fails is named, not only the first
                    what = kern + "".join(f"+{e}" for e in extra)
                    bad.append((cfg, what, n, k, group, m, asym, int(y.isnan().sum()), err))
                worst = max(worst, err)
    print("worst", worst)
    assert not bad, "config, kernel, N, K, group, M, asym, NaNs, error: " + repr(bad)
    """
)


def test_int4_kernels_in_triton_interpreter():
    pytest.importorskip("triton")  # not a dependency on CPU hosts; CUDA hosts have it
    # The interpreter runs `tl.dot` as numpy's matmul: one BLAS thread, so that a failure here
    # is the kernel's and not how a threaded sgemm splits the product on the host's CPU.
    env = {**os.environ, "TRITON_INTERPRET": "1", "OPENBLAS_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, "-c", INTERPRET_CHECK],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0 and "worst" in r.stdout, r.stdout[-1000:] + r.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 4, 5, 64, 300])
@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("k", [576, 4096])  # SmolLM2's width pads to 3 tiles of 256
def test_int4_linear_on_gpu_uses_triton_and_matches_its_weights(m, asym, k, monkeypatch):
    monkeypatch.setattr(L, "INT4_TRITON", True)  # (the CUDA default)
    n, group = 1024, 64 if k == 576 else 128
    g = torch.Generator().manual_seed(m)
    w = torch.randn(n, k, generator=g) * 0.02
    q, s = L.quantize_int4(w, group)
    zp = torch.randint(-2, 3, s.shape, generator=g) if asym else None
    zpc = None if zp is None else zp.cuda()
    lin = L.Int4Linear(q.cuda(), s.cuda(), group, None, torch.bfloat16, zero_point=zpc)
    assert lin.triton_kernel, "the Triton int4 kernels failed their check on this GPU"
    qg = q.float().reshape(n, -1, group) - (zp.float()[..., None] if asym else 0.0)
    deq = qg * s[..., None]
    x = torch.randn(m, k, generator=g)
    ref = x @ deq.reshape(n, k).t()
    y = lin(x.to("cuda", torch.bfloat16)).float().cpu()
    assert float((y - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize(  # (each shape autotunes the kernel's configs once)
    "n,k,group,half",
    [
        (4096, 4096, 128, True),
        (1000, 4096, 128, True),
        (6144, 14336, 128, True),
        (512, 1536, 256, True),
        (1000, 4096, 128, False),
        (576, 576, 64, False),  # (groups of 64 take the fp32 products either way)
    ],
)
@pytest.mark.parametrize("fused", [False, True])
def test_int4_gemv_on_gpu_matches_its_weights(n, k, group, half, asym, fused, monkeypatch):
    """The one-row GEMV against the dequantized weights: products in half precision (PTX,
    groups of 128 or more) and in fp32, with and without zero points, rows that are not whole
    blocks, SmolLM2's padded width, and K splits (the autotuner tries each); `fused`: x is an
    RMSNorm's input that the GEMV normalizes, and a residual is added in its epilogue (launched
    as a programmatic dependent where the GPU has it)."""
    monkeypatch.setattr(L, "INT4_GEMV_HALF", half)
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) * 0.02
    q, s = L.quantize_int4(w, group)
    sc = s.to(torch.bfloat16).cuda()  # the kernel's scales and zeros, bf16 as the layer's
    zero = None
    w_of_group = q.float().reshape(n, -1, group) * sc.float().cpu()[..., None]
    if asym:
        zp = torch.randint(-2, 3, s.shape, generator=g)
        zero = (-zp.float() * s).to(torch.bfloat16).cuda()
        w_of_group += zero.float().cpu()[..., None]
    x = (torch.randn(1, k, generator=g) * 3).to(torch.bfloat16)  # a few units, as after a norm
    x[0, :8] *= 300  # and outliers, as a down projection sees (half precision: < 16,384)
    extra = {}
    if fused:  # the residual stream before a norm: larger than its normalized rows
        gw = (torch.rand(k, generator=g) + 0.5).to(torch.bfloat16)
        r = torch.randn(1, n, generator=g).to(torch.bfloat16)
        x = x * 7
        extra = {"norm": (gw.cuda(), 1e-5), "residual": r.cuda()}
        xf = x.float()
        xn = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * gw.float()
        ref = xn @ w_of_group.reshape(n, k).t() + r.float()
    else:
        ref = x.float() @ w_of_group.reshape(n, k).t()
    y = L.int4_mm(x.cuda(), L.pack_int4_planar(q.cuda()), sc, zero, group, "gemv", **extra)
    assert y.shape == (1, n) and not y.isnan().any()
    err = float((y.float().cpu() - ref).norm() / ref.norm())
    assert err < 5e-3, err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("k", [576, 1536, 4096])  # SmolLM2's hidden and MLP widths, Llama's
def test_int4_linear_tinygemm_takes_widths_not_divisible_by_128(k, monkeypatch):
    monkeypatch.setattr(L, "INT4_TRITON", False)  # tinygemm, where the Triton layout is off
    n, group = 64, 64
    g = torch.Generator().manual_seed(k)
    w = torch.randn(n, k, generator=g) * 0.02
    q, s = L.quantize_int4(w, group)
    lin = L.Int4Linear(q.cuda(), s.cuda(), group, None, torch.bfloat16)
    assert not lin.triton_kernel
    deq = (q.float().reshape(n, -1, group) * s[..., None]).reshape(n, k)
    x = torch.randn(3, k, generator=g)
    ref = x @ deq.t()
    y = lin(x.to("cuda", torch.bfloat16)).float().cpu()
    assert float((y - ref).norm() / ref.norm()) < 1e-2


def test_tinygemm_k_tiles_refuses_widths_it_cannot_tile():
    assert L.tinygemm_k_tiles(576) == 4
    with pytest.raises(ValueError, match="divisible by 32"):
        L.tinygemm_k_tiles(80)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_int4_gemv_pdl_matches_the_plain_launch_on_gpu(monkeypatch):
    """The int4 GEMV launched as a programmatic dependent (`GEMV_PDL`: the first weights loaded
    before it waits for its input), plain and with the norm and residual fused, gives the plain
    launch's output eagerly and inside a compiled step's CUDA graph, where its input is written
    by the kernel just before it (an Inductor kernel, then the other GEMV)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90+")
    g = torch.Generator().manual_seed(3)

    def layer(n, k):
        q, s = L.quantize_int4(torch.randn(n, k, generator=g) * 0.02, 128)
        return L.pack_int4_planar(q.cuda()), s.to(torch.bfloat16).cuda()

    def row(k):
        return torch.randn(1, k, generator=g).to("cuda", torch.bfloat16)

    def both(fn, *args, **kw):
        monkeypatch.setattr(L, "GEMV_PDL", False)
        want = fn(*args, **kw)
        monkeypatch.setattr(L, "GEMV_PDL", True)
        got = fn(*args, **kw)
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
        return want

    (p1, s1), (p2, s2) = layer(1024, 2048), layer(2048, 1024)
    gw = (torch.rand(2048, generator=g) + 0.5).to("cuda", torch.bfloat16)
    x = row(2048)
    both(L.int4_mm, x, p1, s1, None, 128, "gemv")
    both(L.int4_mm, x, p1, s1, None, 128, "gemv", norm=(gw, 1e-5), residual=row(1024))

    def step(x):
        h = L.int4_mm(x * 2, p1, s1, None, 128, "gemv", norm=(gw, 1e-5))
        return L.int4_mm(h, p2, s2, None, 128, "gemv", residual=x)

    want = both(step, x)
    torch._dynamo.reset()
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up, CUDA-graph capture, replay
        got = both(lambda: compiled(x).clone())
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    torch._dynamo.reset()
