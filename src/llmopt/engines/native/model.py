"""A compact Llama-family decoder over a paged KV cache, in the spirit of gpt-fast.

Why hand-written instead of transformers: decode at batch 1 is bound by per-op overhead in HF's
eager model (masks, cache objects, hooks), and HF's static cache cannot hold sequences of different
lengths that come and go. This module is ~200 lines of plain tensor code that `torch.compile`
turns into a few fused kernels (and one CUDA graph per batch/length bucket).

The KV cache is a pool of fixed-size blocks shared by all sequences, as in vLLM: each layer holds
`k_cache`/`v_cache` of shape (num_blocks * block_size, n_kv_heads, head_dim); a sequence owns a
list of blocks (its *block table*), and token position p of sequence b lives at row
`block_tables[b, p // block_size] * block_size + p % block_size`. Block 0 is scratch: padding rows
of a batch point there, so real sequences never get it.

Two attention paths:
- `prefill` (every sequence starts at position 0): SDPA with `is_causal` on the fresh keys/values
  (flash attention on GPU); the keys/values are also written to the cache.
- `paged` (decode, or a chunk after earlier tokens): gather each sequence's blocks, mask key
  positions past the query's, grouped-query attention without repeating K/V. On CUDA a decode
  step (one query per sequence) instead runs the flash-decoding Triton kernel of `attention.py`,
  which reads the blocks in place (`Attention.decode_kernel`, set by `setup_cache`). A chunk of T > 1
  queries may start at any position (right-padded rows too); a long one runs its queries in
  slices so the fp32 scores stay under `Attention.max_score_elems`.

Local (sliding-window) layers can hold only their window (`setup_cache(local_blocks=...)` and
`forward(local_tables=...)`): each sequence then owns a *ring* of `ring_blocks(block_size)` blocks
in the local layers' own, smaller pool, and position p lives in ring block `(p // block_size) %
R` (R the ring's length), so a block whose positions left the window is overwritten by the next
ones instead of growing the table. A local layer then attends over the ring as it was before this
call (each slot's position recomputed from the ring arithmetic, positions older than the window
masked) together with this call's fresh keys, and writes the fresh keys' last R blocks' worth
into the ring afterwards; so a prefill or a chunk longer than the window reads nothing its own
writes overwrote. Without `local_tables` every layer indexes the one shared pool by the full
block tables, as before.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from llmopt.engines.native import attention
from llmopt.engines.native.config import NativeConfig
from llmopt.engines.native.linear import linear_add, norm_linear, silu_down

__all__ = ["Transformer", "rope_inv_freq"]


def rope_inv_freq(cfg: NativeConfig, theta: float | None = None) -> torch.Tensor:
    """Inverse RoPE frequencies (head_dim / 2,) in fp32, with linear or Llama-3 scaling; with
    `theta`, plain frequencies of that base (Gemma 3's local layers)."""
    d = cfg.head_dim
    base = cfg.rope_theta if theta is None else theta
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if theta is not None:
        return inv
    sc = cfg.rope_scaling
    if sc.get("rope_type") == "linear":
        return inv / float(sc["factor"])
    if sc.get("rope_type") == "llama3":  # as transformers' _compute_llama3_parameters
        factor, lo, hi = (
            float(sc["factor"]),
            float(sc["low_freq_factor"]),
            float(sc["high_freq_factor"]),
        )
        old = float(sc["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        return torch.where(medium, smoothed, scaled)
    return inv


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, gemma: bool = False):
        super().__init__()
        self.eps, self.gemma = eps, gemma
        self.weight = nn.Parameter(torch.ones(dim))
        # The weight lives in the columns of the projections that read this norm's output
        # (`weights.fold_norms_`; its own weight is then ones): their GEMV may normalize.
        self.folded = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, H, D); cos/sin (B, T, 1, D/2). The rotate-half convention of HF Llama."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def write_rows(cache: torch.Tensor, idx: torch.Tensor, x: torch.Tensor) -> None:
    """cache[idx] = x, cast to the cache's dtype. A float8 cache is written through a uint8
    view: the CPU has no float8 `index_copy_`, and the bytes are the same on every device."""
    if cache.dtype.is_floating_point and cache.element_size() == 1:
        cache.view(torch.uint8).index_copy_(0, idx, x.to(cache.dtype).view(torch.uint8))
    else:
        cache.index_copy_(0, idx, x.to(cache.dtype))


class Attention(nn.Module):
    def __init__(self, cfg: NativeConfig, window: int | None = None):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.scale = cfg.attention_scale  # None: 1/sqrt(head_dim)
        self.window = window  # a local layer sees the last `window` positions only
        self.softcap = cfg.attn_softcap
        b = cfg.qkv_bias
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=b)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=b)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=b)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        # q/k/v fused into one matmul after loading (`weights.fuse_projections_`): one large GEMV
        # reads weights at a higher share of bandwidth than three small ones.
        self.qkv_proj: nn.Module | None = None
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, cfg.gemma) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, cfg.gemma) if cfg.qk_norm else None
        self.full_qk_norm = cfg.qk_norm_full  # OLMo 2: one norm over all heads of q (of k)
        if cfg.qk_norm_full:
            self.q_norm = RMSNorm(cfg.n_heads * cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.n_kv_heads * cfg.head_dim, cfg.norm_eps)
        # (rows, n_kv, hd) each, set by Transformer.setup_cache. Buffers, so torch.compile and
        # CUDA graphs see fixed addresses that are updated in place.
        self.register_buffer("k_cache", None, persistent=False)
        self.register_buffer("v_cache", None, persistent=False)
        # Decode (T == 1) through attention.paged_decode: a plain attribute, decided eagerly in
        # Transformer.setup_cache (CUDA, the kernel checked on this GPU, attention.ENABLED), so
        # the compiled step sees a constant. `decode_sms`: the GPU's multiprocessor count.
        self.decode_kernel = False
        self.decode_sms = 0
        # RoPE and the KV write inside that kernel (`attention.paged_decode_rope`), where this
        # layer's decode has nothing between the projection and RoPE (no q/k norm) and the
        # projection is fused: set with `decode_kernel`, from attention.FUSE_ROPE.
        self.fuse_rope = False

    # The paged path's fp32 scores (B, heads, T, S) at most this many elements at once (512 MiB):
    # a prefill chunk of T > 1 tokens over a long context runs its queries in slices.
    max_score_elems = 1 << 27

    def forward(
        self,
        x,
        cos,
        sin,
        rows,
        pos,
        block_tables,
        block_size: int,
        prefill: bool,
        ring=None,
        norm: RMSNorm | None = None,
        residual: torch.Tensor | None = None,
    ):
        # `norm`: x is the norm's input (the projection normalizes it where its GEMV can,
        # `_normed`); `residual`: returned plus the output projection's result
        B, T, _ = x.shape
        fuse = self.fuse_rope and self.decode_kernel and B <= attention.FUSE_ROPE_MAX_ROWS
        if fuse and not prefill and T == 1 and ring is None:
            out = attention.paged_decode_rope(
                _normed(self.qkv_proj, x, norm)[:, 0],
                cos.reshape(B, -1),
                sin.reshape(B, -1),
                self.k_cache,
                self.v_cache,
                block_tables,
                pos[:, 0],
                block_size,
                self.n_heads,
                sms=self.decode_sms,
                scale=self.scale,
            )
            return _added(self.o_proj, out.reshape(B, T, self.n_heads * self.hd), residual)
        if self.qkv_proj is not None:
            nq, nkv = self.n_heads * self.hd, self.n_kv * self.hd
            q, k, v = _normed(self.qkv_proj, x, norm).split([nq, nkv, nkv], dim=-1)
        else:
            x = x if norm is None else norm(x)
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.full_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(B, T, self.n_heads, self.hd)
        k = k.reshape(B, T, self.n_kv, self.hd)
        v = v.reshape(B, T, self.n_kv, self.hd)
        if self.q_norm is not None and not self.full_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if ring is not None:  # a local layer over its window-sized ring (see the module doc)
            out = self._ring(q, k, v, pos, ring, block_size)
            return _added(self.o_proj, out.reshape(B, T, self.n_heads * self.hd), residual)
        # Write this step's keys/values into their cache rows (a float8 cache stores them
        # rounded to e4m3, no scale: vLLM's `kv_cache_dtype=fp8` with its default scale 1).
        write_rows(self.k_cache, rows.reshape(-1), k.reshape(-1, self.n_kv, self.hd))
        write_rows(self.v_cache, rows.reshape(-1), v.reshape(-1, self.n_kv, self.hd))
        if (
            not prefill
            and T == 1
            and self.decode_kernel
            and self.window is None
            and not self.softcap
        ):
            # (the Triton kernel has neither a sliding window nor soft-capping)
            out = attention.paged_decode(
                q[:, 0],
                self.k_cache,
                self.v_cache,
                block_tables,
                pos[:, 0],
                block_size,
                sms=self.decode_sms,
                scale=self.scale,
            )
        elif prefill and (self.window is not None or self.softcap):
            # SDPA has neither a window nor soft-capping: the keys were just written to the
            # cache, so the paged path computes the same causal attention with both.
            out = self._paged(q, pos, block_tables, block_size)
        elif prefill:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                is_causal=True,
                enable_gqa=self.n_heads != self.n_kv,
                scale=self.scale,
            ).transpose(1, 2)
        else:
            out = self._paged(q, pos, block_tables, block_size)
        return _added(self.o_proj, out.reshape(B, T, self.n_heads * self.hd), residual)

    def _paged(self, q, pos, block_tables, block_size):
        B, T, _, hd = q.shape
        S = block_tables.shape[1] * block_size
        # Gather the sequences' blocks: (B, S, n_kv, hd) -> (B, n_kv, S, hd).
        kc = self.k_cache.view(-1, block_size, self.n_kv, hd)[block_tables]
        vc = self.v_cache.view(-1, block_size, self.n_kv, hd)[block_tables]
        # (a float8 cache is upcast as read: no matmul takes float8 operands with bf16 ones)
        kc = kc.reshape(B, S, self.n_kv, hd).transpose(1, 2).to(q.dtype)
        vc = vc.reshape(B, S, self.n_kv, hd).transpose(1, 2).to(q.dtype)
        if T > 1 and B * self.n_heads * T * S > self.max_score_elems:
            # A long prefill chunk: queries a slice at a time, so the fp32 scores stay bounded
            # (each query row's attention is independent of the others').
            rows = max(1, self.max_score_elems // (B * self.n_heads * S))
            return torch.cat(
                [
                    self._attend(q[:, a : a + rows], pos[:, a : a + rows], kc, vc)
                    for a in range(0, T, rows)
                ],
                dim=1,
            )
        return self._attend(q, pos, kc, vc)

    def _ring(self, q, k, v, pos, ring, block_size):
        """Windowed attention over the ring (what earlier calls wrote) and this call's keys,
        then the fresh keys written into the ring. `ring` is (tables (B, R), rows (B, T), keep
        (B, T) bool): the ring block ids, each fresh position's ring row, and which fresh
        positions to write (a row's last R blocks' worth of real tokens)."""
        tables, rows, keep = ring
        B, T, _, hd = q.shape
        R = tables.shape[1]
        kc = self.k_cache.view(-1, block_size, self.n_kv, hd)[tables].reshape(
            B, R * block_size, self.n_kv, hd
        )
        vc = self.v_cache.view(-1, block_size, self.n_kv, hd)[tables].reshape(
            B, R * block_size, self.n_kv, hd
        )
        # The position each ring slot holds: the latest block index <= the last one written
        # (the chunk's start - 1) that maps to this slot; negative (never written) is masked.
        last = pos[:, :1] - 1  # (B, 1)
        cur = torch.div(last, block_size, rounding_mode="floor")
        slot = torch.arange(R, device=q.device).view(1, R)
        blk = cur - torch.remainder(cur - slot, R)  # (B, R)
        offs = torch.arange(block_size, device=q.device).view(1, 1, block_size)
        old = (blk.unsqueeze(-1) * block_size + offs).reshape(B, R * block_size)
        old = torch.where((old >= 0) & (old <= last), old, torch.full_like(old, -(1 << 40)))
        keypos = torch.cat([old, pos], dim=1)  # (B, S); never-written slots far in the past
        kall = torch.cat([kc.to(k.dtype), k], dim=1).transpose(1, 2)  # (B, n_kv, S, hd)
        vall = torch.cat([vc.to(v.dtype), v], dim=1).transpose(1, 2)
        S = kall.shape[2]
        if T > 1 and B * self.n_heads * T * S > self.max_score_elems:
            step = max(1, self.max_score_elems // (B * self.n_heads * S))
            out = torch.cat(
                [
                    self._attend(q[:, a : a + step], pos[:, a : a + step], kall, vall, keypos)
                    for a in range(0, T, step)
                ],
                dim=1,
            )
        else:  # no loop over T: a compiled prefill (dynamic shapes) keeps T symbolic
            out = self._attend(q, pos, kall, vall, keypos)
        # Only after attending: a chunk longer than the ring would overwrite keys it reads.
        # Positions not kept go to scratch row 0 (whichever lands there, nothing real reads
        # it): a fixed-shape write, where selecting the kept ones (`nonzero`) would make the
        # shape depend on the data, a host sync and no CUDA graph for a compiled decode.
        idx = torch.where(keep, rows, torch.zeros_like(rows)).reshape(-1)
        write_rows(self.k_cache, idx, k.reshape(-1, self.n_kv, hd))
        write_rows(self.v_cache, idx, v.reshape(-1, self.n_kv, hd))
        return out

    def _attend(self, q, pos, kc, vc, keypos=None):
        B, T, _, hd = q.shape
        g = self.n_heads // self.n_kv
        S = kc.shape[2]
        # Grouped-query attention as plain batched matmuls over (B, n_kv): the g query heads of a
        # KV head become g * T rows, so K/V are neither repeated nor broadcast-expanded.
        qg = q.view(B, T, self.n_kv, g, hd).permute(0, 2, 3, 1, 4).reshape(B, self.n_kv, g * T, hd)
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(hd)
        scores = (qg @ kc.transpose(-1, -2)).float() * scale  # (B, n_kv, g*T, S)
        if self.softcap:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        # Key positions: the gathered blocks' own (0..S-1), or as given (B, S) by the ring.
        keys = torch.arange(S, device=q.device) if keypos is None else keypos
        keys = keys.view(-1, 1, 1, 1, S)
        visible = keys <= pos.view(B, 1, 1, T, 1)  # (B, 1, 1, T, S)
        if self.window is not None:
            visible &= keys > pos.view(B, 1, 1, T, 1) - self.window
        scores = scores.view(B, self.n_kv, g, T, S).masked_fill(~visible, float("-inf"))
        p = torch.softmax(scores, dim=-1).to(q.dtype).view(B, self.n_kv, g * T, S)
        out = (p @ vc).view(B, self.n_kv, g, T, hd)
        return out.permute(0, 3, 1, 2, 4)  # (B, T, n_kv, g, hd)


class MLP(nn.Module):
    def __init__(self, cfg: NativeConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.intermediate, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.intermediate, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate, cfg.dim, bias=False)
        self.gate_up_proj: nn.Module | None = None  # fused after loading, like qkv_proj
        self.gemma = cfg.gemma

    def forward(self, x, norm: RMSNorm | None = None, residual: torch.Tensor | None = None):
        # `norm` and `residual` as in `Attention.forward`
        if self.gate_up_proj is not None:
            gu = _normed(self.gate_up_proj, x, norm)
            y = None if self.gemma else silu_down(self.down_proj, gu)
            if y is not None:
                return y if residual is None else residual + y
            g, u = gu.chunk(2, dim=-1)
        else:
            x = x if norm is None else norm(x)
            g, u = self.gate_proj(x), self.up_proj(x)
        g = F.gelu(g, approximate="tanh") if self.gemma else F.silu(g)
        return _added(self.down_proj, g * u, residual)


def _normed(lin: nn.Module, x, norm: RMSNorm | None):
    # lin(norm(x)), the norm inside the GEMV where it can be (`linear.norm_linear`)
    if norm is None:
        return lin(x)
    y = norm_linear(lin, x, norm)
    return lin(norm(x)) if y is None else y


def _added(lin: nn.Module, x, residual):
    # residual + lin(x), the add in the GEMV's epilogue where it can be (`linear.linear_add`)
    if residual is None:
        return lin(x)
    y = linear_add(lin, x, residual)
    return residual + lin(x) if y is None else y


class Block(nn.Module):
    def __init__(self, cfg: NativeConfig, local: bool = False):
        super().__init__()
        self.local = local
        self.self_attn = Attention(cfg, cfg.local_window if local else None)
        self.mlp = MLP(cfg)
        self.post_norms = cfg.post_norms
        self.sandwich = cfg.sandwich_norms
        if cfg.sandwich_norms:  # Gemma 2/3: before and after both attention and MLP
            self.pre_feedforward_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.gemma)
            self.post_feedforward_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.gemma)
        if cfg.post_norms:  # OLMo 2: the outputs of attention and MLP are normalized
            self.post_feedforward_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        else:
            self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.gemma)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.gemma)
        # The two norms' weights live in the projections that read their outputs (set by
        # `weights.fold_norms_`, with each norm's `folded`; the norms' own weights are then
        # ones): the projections normalize their input, in the GEMV at batch 1
        # (`linear.FUSE_NORM`).
        self.norms_folded = False
        self.folded_gains = None  # the norm weights `weights.fold_norms_` folded, to undo it

    def forward(
        self, x, cos, sin, rows, pos, block_tables, block_size: int, prefill: bool, ring=None
    ):
        args = (rows, pos, block_tables, block_size, prefill, ring if self.local else None)
        if self.sandwich:
            h = self.input_layernorm(x)
            x = x + self.post_attention_layernorm(self.self_attn(h, cos, sin, *args))
            m = self.mlp(self.pre_feedforward_layernorm(x))
            return x + self.post_feedforward_layernorm(m)
        if self.post_norms:
            x = x + self.post_attention_layernorm(self.self_attn(x, cos, sin, *args))
            return x + self.post_feedforward_layernorm(self.mlp(x))
        # each projection takes the norm before it and the residual after it into its GEMV
        # where it can (`_normed`, `_added`); otherwise the same ops one by one
        x = self.self_attn(x, cos, sin, *args, norm=self.input_layernorm, residual=x)
        return self.mlp(x, norm=self.post_attention_layernorm, residual=x)


class Transformer(nn.Module):
    """Parameter names follow HF (`model.layers.0.self_attn.q_proj.weight`, ...) so HF
    safetensors load by name."""

    def __init__(self, cfg: NativeConfig):
        super().__init__()
        self.cfg = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        local = set(cfg.local_layers)
        self.model.layers = nn.ModuleList(Block(cfg, i in local) for i in range(cfg.n_layers))
        self.model.norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.gemma)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.block_size = 0
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        # Gemma 3's local layers rotate with their own base (None: the same as the others).
        local_theta = cfg.local_rope_theta if cfg.local_layers else None
        inv_local = None if local_theta is None else rope_inv_freq(cfg, local_theta)
        self.register_buffer("inv_freq_local", inv_local, persistent=False)

    def ring_blocks(self, block_size: int) -> int:
        """Blocks a sequence's ring holds in the local layers: enough for the window ending at
        any position (a window of W tokens spans at most ceil(W / block_size) + 1 blocks); 0
        for a model without local layers."""
        if not self.cfg.local_layers or not self.cfg.local_window:
            return 0
        return math.ceil(self.cfg.local_window / block_size) + 1

    def setup_cache(
        self,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device,
        local_blocks: int | None = None,
    ) -> None:
        """Allocate the KV block pool: num_blocks * block_size token rows per layer; with
        `local_blocks`, the local layers get a pool of their own of that many blocks (rings of
        `ring_blocks(block_size)` per sequence, block 0 scratch), used through `local_tables`."""
        self.block_size = block_size
        shape = (num_blocks * block_size, self.cfg.n_kv_heads, self.cfg.head_dim)
        local_shape = shape if local_blocks is None else (local_blocks * block_size, *shape[1:])
        kernel = (
            torch.device(device).type == "cuda"
            and self.cfg.head_dim >= 16  # tl.dot's smallest K
            and attention.ENABLED
            and attention.decode_attention_available()
        )
        sms = attention.sm_count(torch.device(device)) if kernel else 0
        for layer in self.model.layers:
            sh = local_shape if layer.local else shape
            layer.self_attn.k_cache = torch.zeros(sh, dtype=dtype, device=device)
            layer.self_attn.v_cache = torch.zeros(sh, dtype=dtype, device=device)
            att = layer.self_attn
            att.decode_kernel, att.decode_sms = kernel, sms
            att.fuse_rope = (
                kernel
                and attention.FUSE_ROPE
                and att.qkv_proj is not None
                and att.q_norm is None
                and att.window is None
                and not att.softcap
                and not layer.local
            )
            if att.fuse_rope:
                attention.prepare_rope()

    def forward(
        self,
        tokens: torch.Tensor,
        pos: torch.Tensor,
        block_tables: torch.Tensor,
        prefill: bool = False,
        last_only: bool = True,
        last_index: torch.Tensor | None = None,
        local_tables: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens, pos: (B, T) int64; block_tables: (B, nb) int64 block ids; local_tables:
        (B, ring_blocks) the sequences' rings in the local layers' pool (None: the local layers
        index the shared pool by `block_tables` like every other layer).

        `prefill=True` requires every sequence to start at position 0 in this call (right
        padding is fine: causal attention keeps real tokens from seeing it, and padding rows'
        block-table entries point at scratch block 0). Returns fp32 logits (B, V) at the last
        position, or at `last_index` (B,) per row, or (B, T, V) if not `last_only`.
        """
        bs = self.block_size
        rows = block_tables.gather(1, pos // bs) * bs + pos % bs  # (B, T) cache rows
        freqs = pos.unsqueeze(-1).float() * self.inv_freq  # (B, T, hd/2)
        cos, sin = freqs.cos().unsqueeze(2), freqs.sin().unsqueeze(2)
        cos_l, sin_l = cos, sin
        if self.inv_freq_local is not None:
            fl = pos.unsqueeze(-1).float() * self.inv_freq_local
            cos_l, sin_l = fl.cos().unsqueeze(2), fl.sin().unsqueeze(2)
        x = self.model.embed_tokens(tokens)
        if self.cfg.gemma:
            x = x * torch.tensor(math.sqrt(self.cfg.dim), dtype=x.dtype)
        if self.cfg.embedding_multiplier != 1.0:
            x = x * self.cfg.embedding_multiplier
        ring = None
        if local_tables is not None:
            R = local_tables.shape[1]
            lrows = local_tables.gather(1, torch.remainder(pos // bs, R)) * bs + pos % bs
            # The fresh positions a ring keeps: a row's last R blocks' worth of real tokens
            # (its padding, past `last_index`, is not written: it would wrap onto real ones).
            end = pos[:, -1:] if last_index is None else pos.gather(1, last_index.view(-1, 1))
            keep = (pos <= end) & (pos > end - R * bs)
            ring = (local_tables, lrows, keep)
        for layer in self.model.layers:
            c, s = (cos_l, sin_l) if layer.local else (cos, sin)
            x = layer(x, c, s, rows, pos, block_tables, bs, prefill, ring)
        x = self.model.norm(x)
        if last_index is not None:
            x = x[torch.arange(x.shape[0], device=x.device), last_index]
        elif last_only:
            x = x[:, -1]
        logits = self.lm_head(x).float()
        if self.cfg.final_softcap:
            logits = torch.tanh(logits / self.cfg.final_softcap) * self.cfg.final_softcap
        return logits
