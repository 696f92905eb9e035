"""Decode attention that reads the paged KV cache in place: a flash-decoding Triton kernel.

One decode step has one query per sequence. The torch path (`model.Attention._paged`) gathers
every block of each sequence's table into a contiguous copy (table width, not context length),
then runs two batched matmuls and a softmax: four passes over the keys/values and several
launches per layer. This kernel reads each key/value row once, straight from the block pool:

- split-K over the context: program (b, kv_head, split) walks `SPLIT` token positions of
  sequence b, up to its own length (position + 1), not the table's width, with an online
  softmax, and writes a partial output and its log-sum-exp; a second kernel combines the splits.
  The number of splits is chosen from the shapes alone (batch x KV heads against the number of
  multiprocessors), so a CUDA graph replays the same grid whatever the lengths.
- grouped-query attention: the `G` query heads of one KV head are the rows of one `tl.dot`
  (padded to 16), so each key/value row is read once for all of them.

`paged_decode` is called inside the compiled decode step (Dynamo traces user-defined Triton
kernels), on CUDA only; the CPU keeps the torch path. `decode_attention_available()` says
whether it runs here (Triton importable, a CUDA GPU, and one check against the torch reference
passed), and `ENABLED` turns it off (benchmarks compare the two paths in one process).
"""

from __future__ import annotations

import functools
import logging
import math
import os

import torch

__all__ = [
    "ENABLED",
    "decode_attention_available",
    "num_splits",
    "paged_decode",
    "paged_decode_rope",
    "prepare_rope",
    "FUSE_ROPE",
    "FUSE_ROPE_MAX_ROWS",
    "reference",
    "launch",
    "sm_count",
]

log = logging.getLogger(__name__)

ENABLED = True  # set False to run the torch gather path on CUDA too (benchmarks, A/B checks)
# RoPE and the KV-cache write inside the decode kernel (`paged_decode_rope`) instead of the
# compiled step's own kernels, for steps of up to FUSE_ROPE_MAX_ROWS rows: on the H200 at batch
# 1, bf16 +2-2.5% tokens/s in two side-by-side pairs (docs/benchmarks.md); larger batches keep
# the separate kernels until timed (`benchmarks/decode.py --attention triton triton-rope`,
# which fuses at every batch size).
FUSE_ROPE = True
FUSE_ROPE_MAX_ROWS = 1
_KERNELS: dict = {}
_SM_COUNT: dict = {}
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
INTERPRET_CONFIG = 0  # which autotune config the interpreter runs (tests walk them)


def num_splits(batch: int, n_kv: int, max_tokens: int, sms: int, min_tokens: int = 64) -> int:
    """Splits of the context per (sequence, KV head): enough programs to give every
    multiprocessor about two, but no split shorter than `min_tokens` positions of the table.

    >>> num_splits(1, 8, 4096, 132)   # batch 1: 8 programs alone would leave 124 SMs idle
    33
    >>> num_splits(64, 8, 4096, 132)  # 512 programs already fill the chip
    1
    >>> num_splits(1, 8, 128, 132)    # a short table: at most 2 splits of 64
    2
    """
    want = math.ceil(2 * sms / max(1, batch * n_kv))
    return max(1, min(want, math.ceil(max_tokens / min_tokens)))


def reference(
    q, k_cache, v_cache, block_tables, ctx_lens, block_size: int, scale: float | None = None
) -> torch.Tensor:
    """The same attention in plain torch, in fp32: q (B, H, D), caches (rows, n_kv, D),
    block_tables (B, nb), ctx_lens (B,) keys visible per sequence; `scale` as in
    `paged_decode`. Returns (B, H, D) fp32."""
    b, h, d = q.shape
    n_kv = k_cache.shape[1]
    g = h // n_kv
    out = torch.empty(b, h, d, dtype=torch.float32, device=q.device)
    for i in range(b):
        n = int(ctx_lens[i])
        t = torch.arange(n, device=q.device)
        rows = block_tables[i, t // block_size] * block_size + t % block_size
        k = k_cache[rows].float().repeat_interleave(g, dim=1)  # (n, H, D)
        v = v_cache[rows].float().repeat_interleave(g, dim=1)
        s = torch.einsum("hd,nhd->hn", q[i].float(), k) * (scale or 1.0 / math.sqrt(d))
        out[i] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), v)
    return out


def launch(kernel, grid, *args, **kwargs) -> None:
    """Launch an autotuned Triton kernel; under Triton's interpreter (TRITON_INTERPRET=1, the CPU
    tests), whose autotuner needs a GPU driver, launch the jitted function with the config
    `INTERPRET_CONFIG` picks instead."""
    if not _INTERPRET:
        kernel[grid](*args, **kwargs)
        return
    cfg = kernel.configs[INTERPRET_CONFIG % len(kernel.configs)]
    g = grid(cfg.kwargs) if callable(grid) else grid
    kernel.fn[g](*args, **kwargs, **cfg.kwargs)


@functools.cache
def _kernels():
    from llmopt.engines.native import triton_kernels as T  # heavy: triton, a GPU-host package

    return T.decode_split, T.decode_combine


@functools.cache
def _rope_kernel():
    from llmopt.engines.native import triton_kernels as T  # heavy: triton, as in `_kernels`

    return T.decode_split_rope


def prepare_rope() -> None:
    """Look the fused kernel up eagerly (`Transformer.setup_cache` does, when a layer takes it):
    inside the compiled step `paged_decode_rope` must find it already, as Dynamo cannot trace
    the import."""
    _KERNELS.setdefault("decode", _kernels())
    _KERNELS.setdefault("decode_rope", _rope_kernel())


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def sm_count(device: torch.device) -> int:
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SM_COUNT:
        _SM_COUNT[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SM_COUNT[i]


def _splits(bsz: int, n_kv: int, max_tokens: int, sms: int | None, device) -> tuple[int, int]:
    """(number of splits, positions per split) for a launch of the split kernel."""
    sms = sms if sms is not None else (sm_count(device) if device.type == "cuda" else 132)
    splits = num_splits(bsz, n_kv, max_tokens, sms)
    split = math.ceil(max_tokens / splits)
    return math.ceil(max_tokens / split), split


def _partials(bsz: int, h: int, d: int, splits: int, device):
    """The split kernel's partial outputs and log-sum-exps (unread stand-ins for one split:
    the kernel then writes the output directly; distinct, as no argument may alias)."""
    n = bsz * h * splits if splits > 1 else 1
    po = torch.empty(n, d if splits > 1 else 1, device=device, dtype=torch.float32)
    pl = torch.empty(n, device=device, dtype=torch.float32)
    return po, pl


def _combine(po, pl, out, splits: int) -> torch.Tensor:
    if splits > 1:
        bsz, h, d = out.shape
        _KERNELS["decode"][1][(bsz, h)](
            po, pl, out, H=h, D=d, BLOCK_D=_pow2(d), NUM_SPLITS=splits, BLOCK_S=_pow2(splits)
        )
    return out


def _split_launch(
    kernel, inputs, strides, h, k_cache, block_tables, block_size, sms, scale, dtype, **extra
) -> torch.Tensor:
    """Launch a split kernel (`decode_split` or `decode_split_rope`: their arguments are the
    inputs, the partials and output, the scale, the strides, the batch, then the shapes) and
    combine its splits; returns (B, h, D) in `dtype`."""
    bsz, (n_kv, d) = block_tables.shape[0], k_cache.shape[1:]
    dev = k_cache.device
    splits, split = _splits(bsz, n_kv, block_tables.shape[1] * block_size, sms, dev)
    out = torch.empty(bsz, h, d, device=dev, dtype=dtype)
    po, pl = _partials(bsz, h, d, splits, dev)
    launch(
        kernel,
        (bsz, n_kv, splits),
        *inputs,
        *(po, pl, out),
        1.0 / math.sqrt(d) if scale is None else scale,
        *strides,
        bsz,
        H=h,
        G=h // n_kv,
        BLOCK_H=max(16, _pow2(h // n_kv)),
        D=d,
        BLOCK_D=_pow2(d),
        PAGE=block_size,
        SPLIT=split,
        NUM_SPLITS=splits,
        DYNAMIC=not _INTERPRET,
        **extra,
    )
    return _combine(po, pl, out, splits)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    pos: torch.Tensor,
    block_size: int,
    sms: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of one query per sequence over its paged keys/values, read in place.

    q (B, H, D) (any strides with a unit last one); k_cache/v_cache (rows, n_kv, D) contiguous,
    bf16/fp16/fp32 or float8 (upcast to q's dtype as read); block_tables (B, nb) int64;
    pos (B,) the query's position (keys 0..pos are visible); `scale` multiplies the scores
    (None: 1/sqrt(D)). Returns (B, H, D) in q's dtype.
    """
    if "decode" not in _KERNELS:  # created eagerly (`decode_attention_available`) before compiling
        _KERNELS["decode"] = _kernels()
    bsz, h, d = q.shape
    return _split_launch(
        _KERNELS["decode"][0],
        (q, k_cache, v_cache, block_tables, pos),
        (q.stride(0), q.stride(1), k_cache.stride(0), block_tables.stride(0), pos.stride(0)),
        h,
        k_cache,
        block_tables,
        block_size,
        sms,
        scale,
        q.dtype,
    )


def paged_decode_rope(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    pos: torch.Tensor,
    block_size: int,
    n_heads: int,
    sms: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """`paged_decode` with the step's RoPE and KV-cache write folded into the kernel.

    qkv (B, (n_heads + 2 n_kv) D): the fused q/k/v projection of each sequence's new token,
    before RoPE (rotate-half convention); cos/sin (B, D / 2) fp32 at each token's position.
    The new key (rotated) and value are written into the cache row of position `pos`, as
    `model.write_rows` would, and attended to with the cached positions 0..pos-1. Returns
    (B, n_heads, D) in qkv's dtype.
    """
    if "decode" not in _KERNELS:
        _KERNELS["decode"] = _kernels()
    if "decode_rope" not in _KERNELS:
        _KERNELS["decode_rope"] = _rope_kernel()
    return _split_launch(
        _KERNELS["decode_rope"],
        (qkv, cos, sin, k_cache, v_cache, block_tables, pos),
        (qkv.stride(0), cos.stride(0), k_cache.stride(0), block_tables.stride(0), pos.stride(0)),
        n_heads,
        k_cache,
        block_tables,
        block_size,
        sms,
        scale,
        qkv.dtype,
        N_KV=k_cache.shape[1],
    )


@functools.cache
def decode_attention_available() -> bool:
    """Triton importable, a CUDA GPU present, and the kernel matches `reference` on it."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    try:  # one eager check on this GPU; on failure decode keeps the torch gather path
        _KERNELS["decode"] = _kernels()
        g = torch.Generator(device="cuda").manual_seed(0)
        kc = torch.randn(8 * 16, 2, 64, device="cuda", generator=g, dtype=torch.bfloat16)
        vc = torch.randn(8 * 16, 2, 64, device="cuda", generator=g, dtype=torch.bfloat16)
        q = torch.randn(2, 8, 64, device="cuda", generator=g, dtype=torch.bfloat16)
        tables = torch.tensor([[3, 5, 1], [7, 2, 0]], device="cuda")
        pos = torch.tensor([40, 17], device="cuda")
        ref = reference(q, kc, vc, tables, pos + 1, 16)
        err = float((paged_decode(q, kc, vc, tables, pos, 16).float() - ref).norm() / ref.norm())
        if err > 2e-2:
            raise RuntimeError(f"relative error {err:.2e}")
        return True
    except Exception as e:  # a Triton/driver mismatch must not take the engine down
        log.warning("Triton decode attention disabled on this GPU (%s): gather path", e)
        return False
