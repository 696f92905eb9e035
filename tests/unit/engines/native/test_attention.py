"""The flash-decoding kernel (`engines/native/attention.py`) against the torch paths.

On a CUDA GPU: the kernel against the fp32 reference over random paged caches (permuted blocks,
ragged lengths, GQA and MHA, bf16 and float8 caches), and a whole decode step through the kernel
against the same step through the torch gather path. On the CPU: the kernel's logic under
Triton's interpreter (a subprocess with TRITON_INTERPRET=1, fp32), and the decode path stays the
torch one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from llmopt.engines.native import attention


def cuda(f):
    return pytest.mark.gpu(
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(f)
    )


def _case(seed, batch, n_kv, g, d, block_size, width, dtype, device):
    """Random q, caches and tables: each sequence a random set of blocks (never block 0), a
    random length up to its table's capacity."""
    gen = torch.Generator().manual_seed(seed)
    n_blocks = batch * width + 1
    rows = n_blocks * block_size
    kc = torch.randn(rows, n_kv, d, generator=gen).to(device=device, dtype=dtype)
    vc = torch.randn(rows, n_kv, d, generator=gen).to(device=device, dtype=dtype)
    q_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
    q = torch.randn(batch, n_kv * g, d, generator=gen).to(device=device, dtype=q_dtype)
    tables = (torch.randperm(n_blocks - 1, generator=gen)[: batch * width] + 1).view(batch, width)
    pos = torch.randint(0, width * block_size, (batch,), generator=gen)
    pos[0] = width * block_size - 1  # one full table
    return q, kc, vc, tables.to(device), pos.to(device)


def _small_llama():
    """A two-layer Llama config (8 heads, 2 KV heads) for whole decode steps on the GPU."""
    from llmopt.engines.native.config import NativeConfig

    return NativeConfig.from_hf(
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "vocab_size": 512,
            "max_position_embeddings": 1024,
        }
    )


def _rel(x, ref):
    return float((x.float() - ref).norm() / ref.norm())


def test_num_splits_fills_the_chip_and_keeps_splits_long():
    assert attention.num_splits(1, 8, 4096, 132) * 8 >= 2 * 132
    assert attention.num_splits(64, 8, 4096, 132) == 1
    for b in (1, 2, 4, 16):
        s = attention.num_splits(b, 8, 256, 132)
        assert 1 <= s <= 4  # 256 positions: no split under 64


def test_reference_matches_dense_softmax_attention():
    q, kc, vc, tables, pos = _case(0, 3, 2, 4, 16, 4, 5, torch.float32, "cpu")
    out = attention.reference(q, kc, vc, tables, pos + 1, 4)
    for i in range(3):  # the contiguous form of sequence i, by hand
        n = int(pos[i]) + 1
        t = torch.arange(n)
        rows = tables[i, t // 4] * 4 + t % 4
        k, v = kc[rows], vc[rows]  # (n, n_kv, d)
        for h in range(8):
            s = (q[i, h] @ k[:, h // 4].T) / 4.0
            torch.testing.assert_close(out[i, h], torch.softmax(s, 0) @ v[:, h // 4])


def test_kernel_logic_under_triton_interpreter():
    """The kernel itself (split and combine) on the CPU through Triton's interpreter."""
    pytest.importorskip("triton")  # not a dependency on CPU hosts; CUDA hosts have it
    code = textwrap.dedent(
        """
        import torch
        from llmopt.engines.native import attention
        from test_attention import _case as case
        worst = 0.0
        for seed, batch, n_kv, g, d, bs, width, sms, scale in (
            (1, 2, 2, 4, 32, 16, 4, 4, None),    # 2 splits per sequence and KV head
            (2, 3, 1, 1, 16, 8, 5, 100, None),   # MHA-like (g 1), many splits, some past the end
            (3, 1, 2, 2, 64, 16, 3, 1, None),    # one split: the direct write
            (4, 2, 2, 2, 32, 16, 3, 4, 0.37),    # a model's own score scale (Granite, Gemma)
        ):
            q, kc, vc, tables, pos = case(seed, batch, n_kv, g, d, bs, width, torch.float32, "cpu")
            ref = attention.reference(q, kc, vc, tables, pos + 1, bs, scale)
            out = attention.paged_decode(q, kc, vc, tables, pos, bs, sms=sms, scale=scale)
            assert not out.isnan().any()
            worst = max(worst, float((out - ref).norm() / ref.norm()))
        print("worst", worst)
        assert worst < 1e-4, worst
        """
    )
    here = os.path.dirname(__file__)
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([here, *sys.path]),
    }
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "worst" in r.stdout


ROPE_CHECK = """
import torch
from llmopt.engines.native import attention
from llmopt.engines.native.model import apply_rope, write_rows
from test_attention import _case as case
worst = 0.0
for seed, batch, n_kv, g, d, bs, width, sms in (
    (1, 2, 2, 4, 32, 16, 4, 4),    # splits: the new key in one of them
    (2, 3, 1, 2, 16, 8, 5, 100),   # many splits, some past the end
    (3, 2, 2, 2, 32, 16, 3, 1),    # one split: the direct write
):  # (no float8 cache here: the interpreter's fp32 -> float8 rounding misses at binade edges;
    # `test_rope_fused_kernel_on_gpu` covers it)
    _, kc, vc, tables, pos = case(seed, batch, n_kv, g, d, bs, width, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(seed)
    h = n_kv * g
    qkv = torch.randn(batch, (h + 2 * n_kv) * d, generator=gen)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = pos.float()[:, None] * inv
    cos, sin = ang.cos(), ang.sin()  # (B, D/2)
    # the unfused path: RoPE in torch, the cache rows written, then the kernel over 0..pos
    q, k, v = qkv.split([h * d, n_kv * d, n_kv * d], dim=-1)
    c4, s4 = cos[:, None, None], sin[:, None, None]
    q = apply_rope(q.view(batch, 1, h, d), c4, s4)[:, 0]
    k = apply_rope(k.view(batch, 1, n_kv, d), c4, s4)[:, 0]
    rows = tables.gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs
    kr, vr = kc.clone(), vc.clone()
    write_rows(kr, rows, k)
    write_rows(vr, rows, v.reshape(batch, n_kv, d))
    kf, vf = kc.clone(), vc.clone()
    out = attention.paged_decode_rope(qkv, cos, sin, kf, vf, tables, pos, bs, h, sms=sms)
    assert not out.isnan().any()
    # the new rows as torch writes them, every other row untouched
    other = torch.ones(kc.shape[0], dtype=torch.bool)
    other[rows] = False
    for got, want, old in ((kf, kr, kc), (vf, vr, vc)):
        assert torch.equal(got[other], old[other])
        assert float((got[rows] - want[rows]).abs().max()) < 1e-5
    # and attention over what the kernel wrote
    ref = attention.reference(q, kf, vf, tables, pos + 1, bs)
    worst = max(worst, float((out - ref).norm() / ref.norm()))
print("worst", worst)
assert worst < 1e-4, worst
"""


def test_rope_fused_kernel_under_triton_interpreter():
    """`paged_decode_rope` (RoPE and the KV write in the kernel) against RoPE in torch, the rows
    written by `write_rows`, then the reference over the same cache: output and cache rows."""
    pytest.importorskip("triton")
    here = os.path.dirname(__file__)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([here, *sys.path])}
    r = subprocess.run(
        [sys.executable, "-c", ROPE_CHECK], env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "worst" in r.stdout


def test_cpu_decode_keeps_the_torch_path(monkeypatch, tiny_native):
    model = tiny_native(seed=0)
    monkeypatch.setattr(attention, "FUSE_ROPE", True)  # no kernel here, so no fused RoPE either
    model.setup_cache(4, 16, torch.float32, "cpu")
    assert not any(layer.self_attn.decode_kernel for layer in model.model.layers)
    assert not any(layer.self_attn.fuse_rope for layer in model.model.layers)


@cuda
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize(
    "batch,n_kv,g,d,width", [(1, 8, 4, 128, 40), (64, 8, 4, 128, 9), (5, 4, 1, 64, 17)]
)
def test_kernel_matches_reference_on_gpu(kv_dtype, batch, n_kv, g, d, width):
    if not attention.decode_attention_available():
        pytest.fail("the decode kernel failed its check on this GPU")
    for seed in range(3):  # fresh inputs each time
        q, kc, vc, tables, pos = _case(seed, batch, n_kv, g, d, 16, width, torch.float32, "cuda")
        kc, vc = kc.to(kv_dtype), vc.to(kv_dtype)
        ref = attention.reference(q, kc, vc, tables, pos + 1, 16)
        out = attention.paged_decode(q, kc, vc, tables, pos, 16)
        assert out.dtype == q.dtype and not out.isnan().any()
        assert _rel(out, ref) < 2e-2


@cuda
@pytest.mark.parametrize("batch", [1, 3, 64])
def test_decode_step_kernel_matches_gather_path(batch):
    """A whole decode step of a small random model: kernel vs torch gather, same cache."""
    from llmopt.engines.native.weights import random_model

    cfg = _small_llama()
    model = random_model(cfg, "cuda", torch.bfloat16, seed=1)
    width, bs = 8, 16
    model.setup_cache(batch * width + 1, bs, torch.bfloat16, "cuda")
    assert all(layer.self_attn.decode_kernel for layer in model.model.layers)
    gen = torch.Generator().manual_seed(batch)
    for layer in model.model.layers:  # a filled cache, as after prefills
        layer.self_attn.k_cache.normal_(generator=None)
        layer.self_attn.v_cache.normal_()
    tables = (torch.randperm(batch * width, generator=gen) + 1).view(batch, width).cuda()
    pos = torch.randint(0, width * bs, (batch, 1), generator=gen).cuda()
    tokens = torch.randint(0, 512, (batch, 1), generator=gen).cuda()
    with torch.inference_mode():
        fast = model(tokens, pos, tables)
        for layer in model.model.layers:
            layer.self_attn.decode_kernel = False
        slow = model(tokens, pos, tables)
    assert _rel(fast, slow) < 2e-2
    assert (fast.argmax(-1) == slow.argmax(-1)).float().mean() >= 0.9


@cuda
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_rope_fused_kernel_on_gpu(kv_dtype, monkeypatch):
    """A decode step with RoPE and the KV write in the kernel against the same step with them
    in the compiled graph's own kernels: same logits, same cache rows written."""
    from llmopt.engines.native.weights import random_model  # q/k/v fused, as loaded

    cfg = _small_llama()
    model = random_model(cfg, "cuda", torch.bfloat16, seed=2)
    batch, width, bs = 3, 8, 16
    results = {}
    for fused in (False, True):
        monkeypatch.setattr(attention, "FUSE_ROPE", fused)
        model.setup_cache(batch * width + 1, bs, kv_dtype, "cuda")
        assert all(layer.self_attn.fuse_rope == fused for layer in model.model.layers)
        torch.manual_seed(0)
        for layer in model.model.layers:  # the same filled cache both times
            layer.self_attn.k_cache.copy_(
                torch.randn_like(layer.self_attn.k_cache, dtype=torch.float32)
            )
            layer.self_attn.v_cache.copy_(
                torch.randn_like(layer.self_attn.v_cache, dtype=torch.float32)
            )
        gen = torch.Generator().manual_seed(5)
        tables = (torch.randperm(batch * width, generator=gen) + 1).view(batch, width).cuda()
        pos = torch.randint(1, width * bs, (batch, 1), generator=gen).cuda()
        tokens = torch.randint(0, 512, (batch, 1), generator=gen).cuda()
        with torch.inference_mode():
            logits = model(tokens, pos, tables)
        caches = [layer.self_attn.k_cache.float().clone() for layer in model.model.layers]
        results[fused] = logits, caches
    (plain, kc0), (fast, kc1) = results[False], results[True]
    assert _rel(fast, plain) < 2e-2
    for a, b in zip(kc0, kc1, strict=True):  # RoPE in fp32 vs bf16: rows agree to rounding
        assert float((a - b).abs().max()) <= 0.07 * float(a.abs().max())


@cuda
def test_compiled_generator_uses_the_kernel_and_agrees_with_gather(tiny_llama_dir, monkeypatch):
    """The kernel inside the compiled (CUDA-graph) decode step: same greedy tokens as the
    compiled gather path on the same weights."""
    from llmopt.engines.native import SamplingParams, load_generator

    prompt, params = [5, 6, 7, 8, 9], SamplingParams(max_tokens=12, ignore_eos=True)
    fast = load_generator(tiny_llama_dir, "bf16", device="cuda", compile=True)
    assert fast.model.model.layers[0].self_attn.decode_kernel
    got, _ = fast.generate(prompt, params)
    monkeypatch.setattr(attention, "ENABLED", False)
    slow = load_generator(tiny_llama_dir, "bf16", device="cuda", compile=True)
    assert not slow.model.model.layers[0].self_attn.decode_kernel
    want, _ = slow.generate(prompt, params)
    assert len(got) == 12 and got[:4] == want[:4]
