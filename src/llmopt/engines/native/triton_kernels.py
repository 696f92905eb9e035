"""The Triton kernels of the native engine's CUDA decode path (imported only where Triton is).

- `decode_split` / `decode_combine`: flash-decoding attention over the paged KV cache
  (`attention.paged_decode` launches them and documents the algorithm); `decode_split_rope`
  the same with RoPE and the KV-cache write folded in (`attention.paged_decode_rope`).
- `wo8_dot`: int8 / FP8 weight-only matmul for decode rows, split along K where that fills the
  GPU (`linear.wo_mm` launches it); `wo8_dot_nosplit` the same without the split; `wo8_gemv`
  the CUDA-core GEMV for one row.
- `int4_dot`: weight-only int4 matmul, any row count (`linear.int4_mm` launches it;
  `linear.pack_int4_planar` gives the weight layout); `int4_gemv` the same layout at one row on
  the CUDA cores.

Module-level functions, as Triton resolves the helpers a kernel calls through the module's
globals (a kernel defined inside a function cannot call another). Without Triton (CPU hosts)
the module imports and defines nothing; its callers check for Triton first.
"""

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU hosts without Triton
    triton = None

if triton is not None:
    _DECODE_CONFIGS = [
        triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s)
        for bn, w, s in ((32, 4, 2), (64, 4, 2), (64, 4, 3), (128, 8, 2), (64, 2, 3))
    ]

    @triton.jit
    def _tile(
        q,
        k_ptr,
        v_ptr,
        tab_ptr,
        b,
        kvh,
        n0,
        end,
        m,
        lsum,
        acc,
        qk_scale,
        stride_kr,
        stride_tb,
        D: tl.constexpr,
        PAGE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        d,
        dmask,
    ):
        # One tile of BLOCK_N positions: scores for all G heads at once, online softmax update.
        t = n0 + tl.arange(0, BLOCK_N)
        tmask = t < end
        blk = tl.load(tab_ptr + b * stride_tb + t // PAGE, mask=tmask, other=0)
        rows = (blk * PAGE + t % PAGE).to(tl.int64)
        kv_off = rows[:, None] * stride_kr + kvh * D + d[None, :]
        kvmask = tmask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + kv_off, mask=kvmask, other=0.0).to(q.dtype)
        # fp32 explicitly: Inductor passes the Python-float scale as fp64
        qk = (tl.dot(q, tl.trans(k)) * qk_scale).to(tl.float32)  # (BLOCK_H, BLOCK_N)
        qk = tl.where(tmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, axis=1))
        # a tile wholly past the end (interpreter path) leaves m at -inf: keep alpha finite
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        lsum = lsum * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_off, mask=kvmask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
        return m_new, lsum, acc

    @triton.jit
    def _walk(
        q,
        k_ptr,
        v_ptr,
        tab_ptr,
        b,
        kvh,
        start,
        end,
        qk_scale,
        stride_kr,
        stride_tb,
        D: tl.constexpr,
        PAGE: tl.constexpr,
        SPLIT: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
        DYNAMIC: tl.constexpr,
        d,
        dmask,
    ):
        # The cached positions start..end-1 of one split, tile by tile: (m, lsum, acc) of the
        # online softmax.
        m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        lsum = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        if DYNAMIC:  # the GPU: walk only this sequence's own positions
            for n0 in tl.range(start, end, BLOCK_N):
                m, lsum, acc = _tile(
                    q, k_ptr, v_ptr, tab_ptr, b, kvh, n0, end, m, lsum, acc, qk_scale,
                    stride_kr, stride_tb, D, PAGE, BLOCK_N, d, dmask,
                )  # fmt: skip
        else:  # Triton's interpreter takes only constant loop bounds: the whole split, masked
            for i in tl.range(0, SPLIT, BLOCK_N):
                m, lsum, acc = _tile(
                    q, k_ptr, v_ptr, tab_ptr, b, kvh, start + i, end, m, lsum, acc, qk_scale,
                    stride_kr, stride_tb, D, PAGE, BLOCK_N, d, dmask,
                )  # fmt: skip
        return m, lsum, acc

    @triton.jit
    def _finish(
        m,
        lsum,
        acc,
        out_ptr,
        po_ptr,
        pl_ptr,
        b,
        sp,
        heads,
        hmask,
        d,
        dmask,
        H: tl.constexpr,
        D: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
    ):
        # The split's output: written directly at one split, else its partial and log-sum-exp.
        # A split past the sequence's end ran no iteration: lsum 0, its log-sum-exp -inf, and
        # the combine gives it weight 0 (its output is written as 0, never left unset).
        safe = tl.where(lsum > 0, lsum, 1.0)
        o = acc / safe[:, None]
        omask = hmask[:, None] & dmask[None, :]
        if NUM_SPLITS == 1:
            tl.store(
                out_ptr + b * H * D + heads[:, None] * D + d[None, :],
                o.to(out_ptr.dtype.element_ty),
                mask=omask,
            )
        else:
            lse = tl.where(lsum > 0, m + tl.log2(safe), float("-inf"))  # log2 units
            row = (b * H + heads) * NUM_SPLITS + sp
            tl.store(po_ptr + row[:, None] * D + d[None, :], o, mask=omask)
            tl.store(pl_ptr + row, lse, mask=hmask)

    @triton.autotune(configs=_DECODE_CONFIGS, key=["G", "D", "SPLIT", "NUM_SPLITS", "batch"])
    @triton.jit
    def decode_split(
        q_ptr,
        k_ptr,
        v_ptr,
        tab_ptr,
        pos_ptr,
        po_ptr,
        pl_ptr,
        out_ptr,
        sm_scale,
        stride_qb,
        stride_qh,
        stride_kr,
        stride_tb,
        stride_pb,
        batch,
        H: tl.constexpr,
        G: tl.constexpr,
        BLOCK_H: tl.constexpr,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PAGE: tl.constexpr,
        SPLIT: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        DYNAMIC: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        ctx = tl.load(pos_ptr + b * stride_pb).to(tl.int32) + 1  # keys 0..pos are visible
        start = sp * SPLIT
        end = tl.minimum(start + SPLIT, ctx)
        j = tl.arange(0, BLOCK_H)
        hmask = j < G
        heads = kvh * G + j
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        q = tl.load(
            q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
            mask=hmask[:, None] & dmask[None, :],
            other=0.0,
        )
        # exp2 instead of exp: fold log2(e) into the scale once
        qk_scale = sm_scale * 1.4426950408889634
        m, lsum, acc = _walk(
            q, k_ptr, v_ptr, tab_ptr, b, kvh, start, end, qk_scale, stride_kr, stride_tb,
            D, PAGE, SPLIT, BLOCK_N, BLOCK_H, BLOCK_D, DYNAMIC, d, dmask,
        )  # fmt: skip
        _finish(
            m, lsum, acc, out_ptr, po_ptr, pl_ptr, b, sp, heads, hmask, d, dmask, H, D, NUM_SPLITS
        )

    @triton.jit
    def _rope(a, b, sign, c, sn):
        # rotate-half RoPE in fp32: x cos + sign x[partner] sin (partner d +- D/2, sign -1 / +1)
        return a.to(tl.float32) * c + sign * b.to(tl.float32) * sn

    @triton.autotune(configs=_DECODE_CONFIGS, key=["G", "D", "SPLIT", "NUM_SPLITS", "batch"])
    @triton.jit
    def decode_split_rope(
        qkv_ptr,
        cos_ptr,
        sin_ptr,
        k_ptr,
        v_ptr,
        tab_ptr,
        pos_ptr,
        po_ptr,
        pl_ptr,
        out_ptr,
        sm_scale,
        stride_qkv,
        stride_cs,
        stride_kr,
        stride_tb,
        stride_pb,
        batch,
        H: tl.constexpr,
        G: tl.constexpr,
        N_KV: tl.constexpr,
        BLOCK_H: tl.constexpr,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PAGE: tl.constexpr,
        SPLIT: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        DYNAMIC: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        # `decode_split` with the step's own work folded in: the rows of `qkv_ptr` are the fused
        # q/k/v projection before RoPE (H, then N_KV, then N_KV heads of D). Each program rotates
        # its G query heads; the one program per (sequence, KV head) whose split holds the new
        # position rotates that key, writes key and value into their cache row (rounded to the
        # cache's dtype, and used rounded, as the unfused path reads them back) and attends to
        # them from registers. The other positions come from the cache as in `decode_split`.
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        pos = tl.load(pos_ptr + b * stride_pb).to(tl.int32)
        start = sp * SPLIT
        end = tl.minimum(start + SPLIT, pos)  # cached keys: 0 .. pos - 1
        j = tl.arange(0, BLOCK_H)
        hmask = j < G
        heads = kvh * G + j
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        HALF: tl.constexpr = D // 2
        dp = tl.where(d < HALF, d + HALF, d - HALF)
        sign = tl.where(d < HALF, -1.0, 1.0)
        c = tl.load(cos_ptr + b * stride_cs + d % HALF, mask=dmask, other=0.0).to(tl.float32)
        sn = tl.load(sin_ptr + b * stride_cs + d % HALF, mask=dmask, other=0.0).to(tl.float32)
        row_ptr = qkv_ptr + b * stride_qkv
        qdt = qkv_ptr.dtype.element_ty
        qm = hmask[:, None] & dmask[None, :]
        qa = tl.load(row_ptr + heads[:, None] * D + d[None, :], mask=qm, other=0.0)
        qb = tl.load(row_ptr + heads[:, None] * D + dp[None, :], mask=qm, other=0.0)
        q = _rope(qa, qb, sign[None, :], c[None, :], sn[None, :]).to(qdt)
        qk_scale = sm_scale * 1.4426950408889634
        m, lsum, acc = _walk(
            q, k_ptr, v_ptr, tab_ptr, b, kvh, start, end, qk_scale, stride_kr, stride_tb,
            D, PAGE, SPLIT, BLOCK_N, BLOCK_H, BLOCK_D, DYNAMIC, d, dmask,
        )  # fmt: skip
        if (start <= pos) & (pos < start + SPLIT):  # the new position is in this split
            kp = row_ptr + H * D + kvh * D
            ka = tl.load(kp + d, mask=dmask, other=0.0)
            kt = _rope(ka, tl.load(kp + dp, mask=dmask, other=0.0), sign, c, sn)
            vt = tl.load(row_ptr + (H + N_KV) * D + kvh * D + d, mask=dmask, other=0.0)
            blk = tl.load(tab_ptr + b * stride_tb + pos // PAGE)
            crow = (blk * PAGE + pos % PAGE).to(tl.int64) * stride_kr + kvh * D + d
            kc = kt.to(k_ptr.dtype.element_ty)
            vc = vt.to(v_ptr.dtype.element_ty)
            tl.store(k_ptr + crow, kc, mask=dmask)
            tl.store(v_ptr + crow, vc, mask=dmask)
            kf = kc.to(qdt).to(tl.float32)
            qk = tl.sum(q.to(tl.float32) * kf[None, :], axis=1) * qk_scale
            qk = qk.to(tl.float32)  # as in _tile: an fp64 scale would make `m` fp64 here
            m_new = tl.maximum(m, qk)
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(qk - m_new)
            lsum = lsum * alpha + p
            acc = acc * alpha[:, None] + p[:, None] * vc.to(qdt).to(tl.float32)[None, :]
            m = m_new
        _finish(
            m, lsum, acc, out_ptr, po_ptr, pl_ptr, b, sp, heads, hmask, d, dmask, H, D, NUM_SPLITS
        )

    @triton.jit
    def decode_combine(
        po_ptr,
        pl_ptr,
        out_ptr,
        H: tl.constexpr,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.arange(0, BLOCK_S)
        smask = s < NUM_SPLITS
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        base = (b * H + h) * NUM_SPLITS
        lse = tl.load(pl_ptr + base + s, mask=smask, other=float("-inf"))
        w = tl.exp2(lse - tl.max(lse, axis=0))  # split 0 always holds key 0: the max is finite
        w = tl.where(smask, w, 0.0)
        o = tl.load(
            po_ptr + (base + s[:, None]) * D + d[None, :],
            mask=smask[:, None] & dmask[None, :],
            other=0.0,
        )
        res = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
        tl.store(out_ptr + (b * H + h) * D + d, res.to(out_ptr.dtype.element_ty), mask=dmask)

    @triton.jit
    def _bytes_as_float(wd, i: tl.constexpr):
        # Byte i of int32 words `wd` (signed int8 weights, four per word) as fp32, by bit
        # arithmetic instead of a conversion instruction: ((u & 0xFF) ^ 0x80) in the mantissa of
        # 2^23 is the float 2^23 + 128 + b exactly (b the signed byte), so one subtraction gives
        # b. Int-to-float conversions issue at a quarter of the integer rate, about the rate
        # int8 weights arrive at from memory. (The tensor-core kernel `wo8_dot` reads int8 as
        # bytes: there the words, four strided loads of x and four narrower dots measured
        # slower; docs/benchmarks.md.)
        f = (((wd >> (8 * i)) & 0xFF) ^ 0x4B000080).to(tl.float32, bitcast=True)
        return f - 8388736.0

    @triton.jit
    def _words_as_floats_f16(wd):
        # The four signed bytes of each int32 word as fp32 (byte i of word j: weight 4 j + i),
        # through half precision (`linear.GEMV_INT8_F16`): one byte permute lays two bytes, sign
        # bits flipped, under the f16 exponent of 1024 (0x64uu is 1024 + u exactly), one
        # f16x2 subtraction of 1152 makes the pair signed, and each half becomes fp32 in one
        # instruction, as FP8's pairs do: about 3.3 instructions per weight where
        # `_bytes_as_float` takes about 5 (`benchmarks/gemv_ptx.py`).
        return tl.inline_asm_elementwise(
            """
            {
            .reg .b32 t, lo, hi, k;
            .reg .b16 a, b, c, d;
            xor.b32 t, $4, 0x80808080;
            mov.b32 k, 0x64646464;
            prmt.b32 lo, t, k, 0x4140;
            prmt.b32 hi, t, k, 0x4342;
            mov.b32 k, 0x64806480;
            sub.f16x2 lo, lo, k;
            sub.f16x2 hi, hi, k;
            mov.b32 {a, b}, lo;
            mov.b32 {c, d}, hi;
            cvt.f32.f16 $0, a;
            cvt.f32.f16 $1, b;
            cvt.f32.f16 $2, c;
            cvt.f32.f16 $3, d;
            }
            """,
            "=f,=f,=f,=f,r",
            [wd],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True,
            pack=1,
        )

    @triton.jit
    def _gemv_x(x_ptr, m, k, mask, K: tl.constexpr, GATED: tl.constexpr, EVEN: tl.constexpr):
        # x[m, k] as fp32; GATED: silu(gate) * up of a gate/up row (2K wide), each rounded to the
        # activation dtype as the two separate ops round (F.silu, then the product): the down
        # projection reads its input without the SiLU x up kernel and its round trip. EVEN: no
        # mask (k is in range).
        if GATED:
            if EVEN:
                g = tl.load(x_ptr + m * 2 * K + k)
                u = tl.load(x_ptr + m * 2 * K + K + k)
            else:
                g = tl.load(x_ptr + m * 2 * K + k, mask=mask, other=0.0)
                u = tl.load(x_ptr + m * 2 * K + K + k, mask=mask, other=0.0)
            gf = g.to(tl.float32)
            act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
            return (act * u.to(tl.float32)).to(g.dtype).to(tl.float32)
        if EVEN:
            return tl.load(x_ptr + m * K + k).to(tl.float32)
        return tl.load(x_ptr + m * K + k, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _gemv_w(
        w_ptr,
        rn,
        c0,
        N,
        KW: tl.constexpr,
        BW: tl.constexpr,
        EVEN: tl.constexpr,
    ):
        # The GEMV's weight tile: rows rn, columns c0 .. c0 + BW of w (N, KW), 0 where masked.
        # FP8 weights come as their bytes (uint8) where masked: FP8 has no literal for
        # `other=`, and zeroing after the load would be a select per weight.
        c = c0 + tl.arange(0, BW)
        ptrs = w_ptr + rn[:, None] * KW + c[None, :]
        if EVEN:  # (one return: after a static `if` Triton still builds what follows it)
            w = tl.load(ptrs)
        else:
            w = tl.load(ptrs, mask=(rn[:, None] < N) & (c[None, :] < KW), other=0)
        return w

    @triton.jit
    def _gemv_acc(
        acc,
        xsq,
        wt,
        x_ptr,
        m,
        k0,
        rn,
        N,
        K: tl.constexpr,
        WORDS: tl.constexpr,
        GATED: tl.constexpr,
        EVEN: tl.constexpr,
        NORM: tl.constexpr,
        BLOCK_K: tl.constexpr,
        F16: tl.constexpr,
    ):
        # acc += the products of weight tile `wt` (`_gemv_w`) with activations k0 .. k0 +
        # BLOCK_K of row m; NORM: xsq += their squares; F16: int8 words made floats through
        # half precision (`_words_as_floats_f16`). Returns (acc, xsq).
        xk = k0 + tl.arange(0, BLOCK_K)
        xv = _gemv_x(x_ptr, m, xk, xk < K, K, GATED, EVEN)
        if NORM:
            xsq += xv * xv
        if WORDS:  # x[4 j + i] for i = 0..3, from one load: (BW, 2, 2) split twice
            BW: tl.constexpr = BLOCK_K // 4
            xa, xb = tl.split(tl.reshape(xv, (BW, 2, 2)))  # 4 j + 2 a, 4 j + 2 a + 1
            x0, x2 = tl.split(xa)
            x1, x3 = tl.split(xb)
            if F16:
                w0, w1, w2, w3 = _words_as_floats_f16(wt)
                acc += w0 * x0[None, :]
                acc += w1 * x1[None, :]
                acc += w2 * x2[None, :]
                acc += w3 * x3[None, :]
            else:
                acc += _bytes_as_float(wt, 0) * x0[None, :]
                acc += _bytes_as_float(wt, 1) * x1[None, :]
                acc += _bytes_as_float(wt, 2) * x2[None, :]
                acc += _bytes_as_float(wt, 3) * x3[None, :]
        else:
            if wt.dtype == tl.uint8:  # FP8 bytes (`_gemv_w`)
                wt = wt.to(tl.float8e4nv, bitcast=True)
            acc += wt.to(tl.float32) * xv[None, :]
        return acc, xsq

    # Weight-only GEMV on the CUDA cores (written by hand: neither cuBLAS nor PyTorch's CUDA
    # int8pack kernel reads 1-byte weights near bandwidth). One program computes BLOCK_N outputs
    # of one activation row; the partial products stay in a register tile, reduced at the end.
    # (AHEAD: see `wo8_gemv`; `wo8_gemv_ahead` times each config with it and without)
    _GEMV_CONFIGS = [
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "AHEAD": False}, num_warps=w, num_stages=st)
        for bn, bk, w, st in (
            (8, 512, 4, 3),
            (16, 256, 4, 3),
            (16, 512, 8, 3),
            (32, 256, 8, 3),
            (32, 128, 4, 3),
            (64, 128, 8, 3),
            (8, 1024, 4, 4),
            (16, 1024, 8, 4),
        )
    ]

    @triton.autotune(configs=_GEMV_CONFIGS, key=["N", "K", "WORDS"])
    @triton.jit
    def wo8_gemv(
        x_ptr,
        w_ptr,
        s_ptr,
        y_ptr,
        r_ptr,
        eps,
        N,
        K: tl.constexpr,
        WORDS: tl.constexpr,
        GATED: tl.constexpr,
        EVEN: tl.constexpr,
        NORM: tl.constexpr,
        RESID: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PDL: tl.constexpr = False,
        F16: tl.constexpr = False,
        AHEAD: tl.constexpr = False,
    ):
        # y[m] = (w @ x[m]) * scale; w (N, K) float8_e4m3fn, or with WORDS int8 read as an
        # (N, K / 4) int32 view (byte i of word j is k = 4 j + i, `_bytes_as_float`). GATED: the
        # rows of x are a gate/up projection's output (2K: gate, then up), and x[m] is
        # silu(gate) * up, made here as it is read (`_gated_x`). EVEN: every config's tiles
        # divide N and K, so no load or store is masked (a masked load costs a register move
        # per element, and FP8, which has no literal for `other=`, a select per weight). The int8
        # tile's activations are loaded as one contiguous vector and split into the four byte
        # positions in registers: four strided loads compile to a 2-byte load and a 64-bit
        # address add per element, and measured slower (docs/benchmarks.md).
        # NORM: x[m] is an RMSNorm's input, the norm's weight already folded into w's columns
        # (`weights.fold_norms_`): the output is rsqrt(mean(x^2) + eps) (w @ x), the sum of
        # squares gathered from the activations every program reads anyway, so the norm kernel
        # and its round trip are gone. RESID: the output is r[m] + (w @ x[m]) * scale, the
        # residual add of the layer done in the epilogue (one rounding instead of two).
        pid_n, m = tl.program_id(0), tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        xsq = tl.zeros((BLOCK_K,), dtype=tl.float32)  # NORM: sum of x^2, per position in a tile
        if WORDS:  # a tile is BW words of w's (N, K / 4) int32 view, BLOCK_K activations
            BW: tl.constexpr = BLOCK_K // 4
            KW: tl.constexpr = K // 4
        else:
            BW: tl.constexpr = BLOCK_K
            KW: tl.constexpr = K
        acc = tl.zeros((BLOCK_N, BW), dtype=tl.float32)
        STEP: tl.constexpr = BLOCK_K // BW  # activations per weight element
        if AHEAD:
            # Each tile's weights are loaded one step ahead, before the products of the tile
            # before (`wo8_gemv_ahead`'s configs, `linear.GEMV_PREFETCH`): a warp's loads can
            # then overlap its own arithmetic, where loading and using a tile in one step leaves
            # it waiting a full memory latency per step (Nsight Compute: the GEMVs stall mostly
            # on `long_scoreboard`). ptxas may still issue the loads late, and they hold
            # registers: timed alone it helps some shapes and formats and hurts others, so the
            # autotuner times both. (Triton's pipeliner stages some configs' loads through
            # shared memory on its own.)
            LAST: tl.constexpr = ((KW + BW - 1) // BW - 1) * BW  # the last tile's column
            wt = _gemv_w(w_ptr, rn, 0, N, KW, BW, EVEN)
            if PDL:  # (see below: the first tile is loaded before waiting)
                tl.extra.cuda.gdc_wait()
            for c0 in tl.range(0, LAST, BW):
                wn = _gemv_w(w_ptr, rn, c0 + BW, N, KW, BW, EVEN)
                k0 = c0 * STEP
                acc, xsq = _gemv_acc(
                    acc, xsq, wt, x_ptr, m, k0, rn, N, K, WORDS, GATED, EVEN, NORM, BLOCK_K, F16
                )
                wt = wn
            if PDL:  # every weight load issued: the next dependent kernel may start its own
                tl.extra.cuda.gdc_launch_dependents()
            k0 = LAST * STEP
            acc, xsq = _gemv_acc(
                acc, xsq, wt, x_ptr, m, k0, rn, N, K, WORDS, GATED, EVEN, NORM, BLOCK_K, F16
            )
        else:
            FIRST: tl.constexpr = BW if PDL else 0
            if PDL:
                # Launched as a programmatic dependent (`linear.GEMV_PDL`): this program may run
                # while the kernel before still drains. The weights do not depend on it, so the
                # first tile is loaded before waiting; the activations (and the residual) after.
                wt = _gemv_w(w_ptr, rn, 0, N, KW, BW, EVEN)
                tl.extra.cuda.gdc_wait()
                acc, xsq = _gemv_acc(
                    acc, xsq, wt, x_ptr, m, 0, rn, N, K, WORDS, GATED, EVEN, NORM, BLOCK_K, F16
                )
            for c0 in tl.range(FIRST, KW, BW):
                wt = _gemv_w(w_ptr, rn, c0, N, KW, BW, EVEN)
                k0 = c0 * STEP
                acc, xsq = _gemv_acc(
                    acc, xsq, wt, x_ptr, m, k0, rn, N, K, WORDS, GATED, EVEN, NORM, BLOCK_K, F16
                )
            if PDL:  # every weight load issued: the next dependent kernel may start its own
                tl.extra.cuda.gdc_launch_dependents()
        y = tl.sum(acc, axis=1)
        if NORM:  # (fp32: inside a compiled graph Inductor passes `eps` as fp64)
            y = y * tl.math.rsqrt((tl.sum(xsq, axis=0) / K + eps).to(tl.float32))
        if EVEN:
            y = y * tl.load(s_ptr + rn).to(tl.float32)
            if RESID:
                y += tl.load(r_ptr + m * N + rn).to(tl.float32)
            tl.store(y_ptr + m * N + rn, y.to(y_ptr.dtype.element_ty))
        else:
            y = y * tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
            if RESID:
                y += tl.load(r_ptr + m * N + rn, mask=rn < N, other=0.0).to(tl.float32)
            tl.store(y_ptr + m * N + rn, y.to(y_ptr.dtype.element_ty), mask=rn < N)

    # The same GEMV, its autotuner timing every config also with AHEAD (`linear.GEMV_PREFETCH`).
    wo8_gemv_ahead = triton.autotune(
        configs=_GEMV_CONFIGS
        + [
            triton.Config(
                c.kwargs | {"AHEAD": True}, num_warps=c.num_warps, num_stages=c.num_stages
            )
            for c in _GEMV_CONFIGS
        ],
        key=["N", "K", "WORDS"],
    )(wo8_gemv.fn)

    # Weight-only matmuls on the tensor cores, dequantization fused: decode rows are padded to a
    # 16-row `tl.dot` (the idle rows cost tensor-core time, which a memory-bound matmul has to
    # spare), so one program reads its BLOCK_N weight rows once for all M activation rows, where
    # a CUDA-core GEMV (`wo8_gemv`) re-reads them per row, and the multiply-adds leave
    # the ALUs to the dequantization.

    # The sweep's best per 8B linear shape at 1-16 rows (`benchmarks/linear_kernels.py
    # --sweep`, docs/benchmarks.md), each also split along K (SPLIT_K): the narrow projections
    # (4,096-6,144 outputs) give 64-192 programs of 32-64 outputs, about one per multiprocessor,
    # too few weight bytes in flight to reach the copy rate; split 2-8 ways along K they give
    # several per multiprocessor. The autotuner picks per shape.
    _DOT_CONFIGS = [
        triton.Config(
            {"BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk},
            num_warps=4,
            num_stages=st,
        )
        for bn, bk, st in (
            (64, 512, 3),
            (32, 512, 3),
            (32, 1024, 3),
            (64, 256, 3),
            (32, 256, 5),
            (64, 512, 5),
        )
        for sk in (1, 2, 4, 8)
    ]

    # (no `prune_configs_by`: Dynamo failed to trace a pruned autotuner called by more than one
    # layer of a compiled step; a split that is not whole tiles is correct, only slower)
    @triton.autotune(configs=_DOT_CONFIGS, key=["N", "K", "M_BUCKET"])
    @triton.jit
    def wo8_dot(
        x_ptr,
        w_ptr,
        s_ptr,
        y_ptr,
        ws_ptr,
        sem_ptr,
        M,
        N,
        M_BUCKET,
        K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,
    ):
        # y = (x @ w^T) * scale, w (N, K) int8 or float8_e4m3fn (or bf16, for comparisons), one
        # scale per output channel; the 1-byte formats convert exactly to the activation dtype
        # before the dot. With SPLIT_K > 1, program (n, m, s) sums K's s-th part into an fp32
        # partial in `ws_ptr` (SPLIT_K, M, N); the last of a tile's SPLIT_K programs to finish
        # (a counter per tile in `sem_ptr`, which it resets to 0) adds the partials in split
        # order, so the result does not depend on which program came last.
        pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mmask, nmask = rm < M, rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        KS: tl.constexpr = (K + SPLIT_K - 1) // SPLIT_K  # this split's part of K
        WHOLE: tl.constexpr = K % SPLIT_K == 0 and KS % BLOCK_K == 0
        kend = tl.minimum(pid_k * KS + KS, K)
        for k0 in tl.range(0, KS, BLOCK_K):
            rk = pid_k * KS + k0 + tl.arange(0, BLOCK_K)
            kmask = rk < kend
            x = tl.load(
                x_ptr + rm[:, None] * K + rk[None, :],
                mask=mmask[:, None] & kmask[None, :],
                other=0.0,
            )
            wmask = nmask[:, None] & kmask[None, :]
            w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=wmask)
            if WHOLE:  # noqa: SIM108 - whole tiles: no select (masked rows unstored)
                wx = w.to(x.dtype)
            else:  # no FP8 literal for `other=`: zero the tail here
                wx = tl.where(wmask, w.to(x.dtype), 0.0)
            acc += tl.dot(x, tl.trans(wx))
        omask = mmask[:, None] & nmask[None, :]
        if SPLIT_K > 1:
            part = rm[:, None] * N + rn[None, :]
            tl.store(ws_ptr + pid_k * M * N + part, acc, mask=omask)
            # every thread's partial stored before the counter's release (acq_rel, GPU scope)
            tl.debug_barrier()
            tile = sem_ptr + pid_m * tl.num_programs(0) + pid_n
            if tl.atomic_add(tile, 1, sem="acq_rel") == SPLIT_K - 1:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in tl.static_range(SPLIT_K):  # from L2: other programs wrote them
                    acc += tl.load(ws_ptr + s * M * N + part, mask=omask, cache_modifier=".cg")
                tl.atomic_xchg(tile, 0)  # ready for the next launch
                s = tl.load(s_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
                tl.store(
                    y_ptr + rm[:, None] * N + rn[None, :],
                    (acc * s[None, :]).to(y_ptr.dtype.element_ty),
                    mask=omask,
                )
        else:
            s = tl.load(s_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
            tl.store(
                y_ptr + rm[:, None] * N + rn[None, :],
                (acc * s[None, :]).to(y_ptr.dtype.element_ty),
                mask=omask,
            )

    # The same kernel without the K split: benchmarks and `linear.wo_mm(kernel="dot1")` compare
    # the two side by side.
    wo8_dot_nosplit = triton.autotune(
        configs=[c for c in _DOT_CONFIGS if c.kwargs["SPLIT_K"] == 1],
        key=["N", "K", "M_BUCKET"],
    )(wo8_dot.fn)

    # int4 in a layout chosen for the dot (`linear.pack_int4_planar`): per tile of 256 codes a
    # row holds 32 words, and nibble i of word j is the signed code of k = 256 t + 32 i + j. So
    # nibble i of a tile's 32 words is one contiguous 32-wide slice of K: two integer shifts
    # (sign-extending) give its codes as a (BLOCK_N, 32) operand with no reshape, and a slice
    # never straddles a scale group (groups of 32, 64, 128 or 256): the dot results of one group
    # are summed before its scale multiplies them once.

    # the sweep's best per 8B shape (decode rows: `int4_dot`), and prompts' tiles
    # (`int4_dot_prompt`): two autotuners over one kernel rather than one with pruning, which
    # Dynamo failed to trace when several layers of a compiled step called it
    _INT4_CONFIGS = [
        triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "TILES": t}, num_warps=4, num_stages=3)
        for t in (1, 2, 4)
    ]
    _INT4_PROMPT_CONFIGS = [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "TILES": 1}, num_warps=w, num_stages=3)
        for bm, bn, w in ((64, 64, 4), (64, 128, 8), (128, 128, 8))
    ]

    @triton.autotune(configs=_INT4_CONFIGS, key=["N", "K", "G", "M_BUCKET"])
    @triton.jit
    def int4_dot(
        x_ptr,
        w_ptr,
        s_ptr,
        z_ptr,
        y_ptr,
        M,
        N,
        M_BUCKET,
        K: tl.constexpr,
        KP: tl.constexpr,
        G: tl.constexpr,
        HAS_ZERO: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        TILES: tl.constexpr,
    ):
        # KP: K padded to whole tiles of 256 (the packed row is KP / 8 words; padded codes are 0
        # and their x is masked to 0). w[n, k] = q * scale[n, k // G] (+ zero[n, k // G]).
        pid_n, pid_m = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mmask, nmask = rm < M, rn < N
        j = tl.arange(0, 32)
        FLUSH: tl.constexpr = G // 32 if G < 256 else 8  # slices per scale multiply
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for t0 in tl.range(0, KP // 256, TILES):
            for tt in tl.static_range(TILES):
                t = t0 + tt
                p = tl.load(
                    w_ptr + rn[:, None] * (KP // 8) + t * 32 + j[None, :],
                    mask=nmask[:, None],
                    other=0,
                )
                part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                xs = tl.zeros((BLOCK_M,), dtype=tl.float32)
                for i in tl.static_range(8):
                    k = t * 256 + i * 32 + j
                    x = tl.load(
                        x_ptr + rm[:, None] * K + k[None, :],
                        mask=mmask[:, None] & (k < K)[None, :],
                        other=0.0,
                    )
                    q = (p << (28 - 4 * i)) >> 28  # arithmetic shift: the signed code
                    part += tl.dot(x, tl.trans(q.to(x.dtype)))
                    if HAS_ZERO:
                        xs += tl.sum(x.to(tl.float32), axis=1)
                    if (i + 1) % FLUSH == 0:
                        g = (t * 256 + i * 32) // G
                        gmask = nmask & (g < K // G)
                        s = tl.load(s_ptr + rn * (K // G) + g, mask=gmask, other=0.0)
                        acc += part * s.to(tl.float32)[None, :]
                        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                        if HAS_ZERO:
                            z = tl.load(z_ptr + rn * (K // G) + g, mask=gmask, other=0.0)
                            acc += xs[:, None] * z.to(tl.float32)[None, :]
                            xs = tl.zeros((BLOCK_M,), dtype=tl.float32)
        tl.store(
            y_ptr + rm[:, None] * N + rn[None, :],
            acc.to(y_ptr.dtype.element_ty),
            mask=mmask[:, None] & nmask[None, :],
        )

    int4_dot_prompt = triton.autotune(
        configs=_INT4_PROMPT_CONFIGS, key=["N", "K", "G", "M_BUCKET"]
    )(int4_dot.fn)

    # int4 at one decode row on the CUDA cores, from the same planar layout, with the bit
    # arithmetic of `_bytes_as_float` and no shift per nibble: nibble i (< 4) of a word, masked
    # in place and xor-ed with 8 << 4i (code c stored as c & 0xF, so u ^ 8 = c + 8) inside the
    # mantissa of 2^23, is the float 2^23 + (c + 8) 16^i exactly; one subtraction leaves c 16^i,
    # and the activation is pre-scaled by 16^-i (exact). Mask and xor are one 3-input logic
    # instruction (`lop3`, written as PTX: from `&` then `^` ptxas makes two), the upper four
    # nibbles take one shift per word, so a weight costs a logic instruction, a subtraction and
    # a multiply-add: no conversions, no tensor cores (`benchmarks/gemv_ptx.py --formats int4`
    # counts them).
    #
    # One program reads BLOCK_N rows, TILES tiles of 256 codes at a time (a row's TILES x 32
    # words are contiguous), over its SPLIT_K-th part of K: the narrow projections (4,096
    # outputs) have too few rows to keep enough weight bytes in flight otherwise. The K-split
    # partials are added as `wo8_dot` adds them (the last program of a row block, in split
    # order). The autotuner picks the tile and split per shape.
    _INT4_GEMV_CONFIGS = [
        triton.Config({"BLOCK_N": bn, "TILES": t, "SPLIT_K": sk}, num_warps=w, num_stages=st)
        for bn, t, sk, w, st in (
            (128, 1, 1, 4, 3),
            (128, 1, 2, 4, 3),
            (128, 1, 4, 4, 3),
            (128, 1, 8, 4, 3),
            (64, 1, 1, 2, 3),
            (64, 1, 2, 2, 3),
            (64, 1, 4, 2, 3),
            (64, 1, 8, 2, 4),
            (64, 1, 1, 4, 3),
            (64, 1, 4, 4, 3),
            (32, 1, 4, 2, 3),
            (32, 2, 8, 2, 3),
        )
    ]

    @triton.jit
    def _nibbles_as_floats(q, ASM: tl.constexpr):
        # nibbles 0-3 of int32 words q as the floats 2^23 + (c + 8) 16^i (c the signed code);
        # ASM: one `lop3` each (mask and xor), else `&` and `^` (the interpreter runs no PTX)
        if ASM:
            a, b, c, d = tl.inline_asm_elementwise(
                """
                lop3.b32 $0, $4, 0x0000000F, 0x4B000008, 0x6a;
                lop3.b32 $1, $4, 0x000000F0, 0x4B000080, 0x6a;
                lop3.b32 $2, $4, 0x00000F00, 0x4B000800, 0x6a;
                lop3.b32 $3, $4, 0x0000F000, 0x4B008000, 0x6a;
                """,
                "=r,=r,=r,=r,r",
                [q],
                dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                is_pure=True,
                pack=1,
            )
        else:
            a = (q & 0xF) ^ 0x4B000008
            b = (q & 0xF0) ^ 0x4B000080
            c = (q & 0xF00) ^ 0x4B000800
            d = (q & 0xF000) ^ 0x4B008000
        return (
            a.to(tl.float32, bitcast=True),
            b.to(tl.float32, bitcast=True),
            c.to(tl.float32, bitcast=True),
            d.to(tl.float32, bitcast=True),
        )

    @triton.jit
    def _int4_group(ptr, rn, g, nmask, t, tend, K: tl.constexpr, G: tl.constexpr, MASKED):
        # scale (or zero) of group g per tile (TILES,) for rows rn: (BLOCK_N, TILES) fp32
        gp = ptr + rn[:, None] * (K // G) + g[None, :]
        if MASKED:
            v = tl.load(gp, mask=nmask[:, None] & (t < tend)[None, :], other=0.0)
        else:
            v = tl.load(gp)
        return v.to(tl.float32)

    @triton.jit
    def _int4_x(
        x_ptr,
        g_ptr,
        m,
        t,
        tend,
        i: tl.constexpr,
        K: tl.constexpr,
        WHOLE: tl.constexpr,
        NORM: tl.constexpr,
    ):
        # the activations of nibble i per tile: x[t * 256 + 32 i + j] (TILES, 32), fp32, as the
        # products take them and as loaded: with NORM (x an RMSNorm's input) the first is
        # x * g, g the norm's weight (its 1 / rms is a scalar the GEMV applies at the end)
        j = tl.arange(0, 32)
        k = t[:, None] * 256 + i * 32 + j[None, :]
        if WHOLE:
            x = tl.load(x_ptr + m * K + k).to(tl.float32)
        else:
            mask = (k < K) & (t < tend)[:, None]
            x = tl.load(x_ptr + m * K + k, mask=mask, other=0.0).to(tl.float32)
        if NORM:
            if WHOLE:
                g = tl.load(g_ptr + k).to(tl.float32)
            else:
                g = tl.load(g_ptr + k, mask=mask, other=0.0).to(tl.float32)
            return x * g, x
        return x, x

    @triton.jit
    def _int4_step(
        acc,
        zacc,
        xsq,
        p,
        x_ptr,
        g_ptr,
        s_ptr,
        z_ptr,
        m,
        t,
        tend,
        rn,
        nmask,
        K: tl.constexpr,
        G: tl.constexpr,
        WHOLE: tl.constexpr,
        MASKED: tl.constexpr,
        HAS_ZERO: tl.constexpr,
        ASM: tl.constexpr,
        NORM: tl.constexpr,
    ):
        # acc += the products of words p (BLOCK_N, TILES, 32) with their activations, in fp32:
        # per nibble a logic instruction, a subtraction and a multiply-add; the partial sums of
        # a scale group multiplied by their scale once (any group size)
        FLUSH: tl.constexpr = G // 32 if G < 256 else 8  # slices per scale multiply
        part = tl.zeros(p.shape, dtype=tl.float32)
        xs = tl.zeros(t.shape, dtype=tl.float32)
        for h in tl.static_range(2):  # nibbles 0-3, then 4-7 shifted down
            f0, f1, f2, f3 = _nibbles_as_floats(p if h == 0 else p >> 16, ASM)
            for i4 in tl.static_range(4):  # nibble 4 h + i4 (spelled out: a constexpr bound
                # to a local name becomes a tensor)
                f = f0 if i4 == 0 else (f1 if i4 == 1 else (f2 if i4 == 2 else f3))
                x, xr = _int4_x(x_ptr, g_ptr, m, t, tend, 4 * h + i4, K, WHOLE, NORM)
                if NORM:
                    xsq += xr * xr
                c = 8388608.0 + 8.0 * (16**i4)
                part += (f - c) * (x * (1.0 / 16**i4))[None, :, :]
                if HAS_ZERO:
                    xs += tl.sum(x, axis=1)
                if (4 * h + i4 + 1) % FLUSH == 0:
                    g = (t * 256 + (4 * h + i4) * 32) // G  # the slice's group per tile
                    sc = _int4_group(s_ptr, rn, g, nmask, t, tend, K, G, MASKED)
                    acc += part * sc[:, :, None]
                    part = tl.zeros(p.shape, dtype=tl.float32)
                    if HAS_ZERO:
                        z = _int4_group(z_ptr, rn, g, nmask, t, tend, K, G, True)
                        zacc += xs[None, :] * z
                        xs = tl.zeros(t.shape, dtype=tl.float32)
        return acc, zacc, xsq

    @triton.jit
    def _pack_f16x2(lo, hi):
        # two fp32 tensors as one int32 of two halves (lo in the low 16 bits), rounded
        return tl.inline_asm_elementwise(
            "cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=tl.int32, is_pure=True, pack=1
        )

    @triton.jit
    def _word_dot_f16(q, xa, xb, xc, xd):
        # The eight codes of words q against their activations in half precision, as Marlin
        # dequantizes: one `lop3` lays two nibbles (0 and 4, or 1 and 5 of q; 2 and 6, or 3 and
        # 7 of q >> 8) under the f16 exponent of 1024, sign flipped (1024 + c + 8, or 1024 +
        # 16 (c + 8)), one f16x2 multiply-add makes both c / 16 exactly, one more multiplies
        # them by their activations (xa: those of nibbles 0 and 4, xb: 1 and 5, ...; f16x2) and
        # adds: two instructions per two weights and one per word for the shift. Returns the
        # sums of nibbles 0-3 and of 4-7 (each four products of at most |x| / 2: no overflow
        # below |x| = 16,384), as fp32, / 16.
        return tl.inline_asm_elementwise(
            """
            {
            .reg .b32 t, w, p, a, b, c, d;
            .reg .b16 l, h;
            shr.u32 t, $2, 8;
            mov.b32 a, 0x2C002C00;
            mov.b32 b, 0xD408D408;
            mov.b32 c, 0x1C001C00;
            mov.b32 d, 0xC480C480;
            lop3.b32 w, $2, 0x000F000F, 0x64086408, 0x6a;
            fma.rn.f16x2 w, w, a, b;
            mul.rn.f16x2 p, w, $3;
            lop3.b32 w, $2, 0x00F000F0, 0x64806480, 0x6a;
            fma.rn.f16x2 w, w, c, d;
            fma.rn.f16x2 p, w, $4, p;
            lop3.b32 w, t, 0x000F000F, 0x64086408, 0x6a;
            fma.rn.f16x2 w, w, a, b;
            fma.rn.f16x2 p, w, $5, p;
            lop3.b32 w, t, 0x00F000F0, 0x64806480, 0x6a;
            fma.rn.f16x2 w, w, c, d;
            fma.rn.f16x2 p, w, $6, p;
            mov.b32 {l, h}, p;
            cvt.f32.f16 $0, l;
            cvt.f32.f16 $1, h;
            }
            """,
            "=f,=f,r,r,r,r,r",
            [q, xa, xb, xc, xd],
            dtype=(tl.float32, tl.float32),
            is_pure=True,
            pack=1,
        )

    @triton.jit
    def _int4_step_half(
        acc,
        zacc,
        xsq,
        p,
        x_ptr,
        g_ptr,
        s_ptr,
        z_ptr,
        m,
        t,
        tend,
        rn,
        nmask,
        K: tl.constexpr,
        G: tl.constexpr,
        WHOLE: tl.constexpr,
        MASKED: tl.constexpr,
        HAS_ZERO: tl.constexpr,
        NORM: tl.constexpr,
    ):
        # `_int4_step` through half precision (`_word_dot_f16`), for groups of 128 codes or
        # more: nibbles 0-3 of a tile's words are its first 128 codes, 4-7 the other 128, so each
        # half-sum has one scale. acc holds sums / 16.
        x0, r0 = _int4_x(x_ptr, g_ptr, m, t, tend, 0, K, WHOLE, NORM)
        x1, r1 = _int4_x(x_ptr, g_ptr, m, t, tend, 1, K, WHOLE, NORM)
        x2, r2 = _int4_x(x_ptr, g_ptr, m, t, tend, 2, K, WHOLE, NORM)
        x3, r3 = _int4_x(x_ptr, g_ptr, m, t, tend, 3, K, WHOLE, NORM)
        x4, r4 = _int4_x(x_ptr, g_ptr, m, t, tend, 4, K, WHOLE, NORM)
        x5, r5 = _int4_x(x_ptr, g_ptr, m, t, tend, 5, K, WHOLE, NORM)
        x6, r6 = _int4_x(x_ptr, g_ptr, m, t, tend, 6, K, WHOLE, NORM)
        x7, r7 = _int4_x(x_ptr, g_ptr, m, t, tend, 7, K, WHOLE, NORM)
        if NORM:
            xsq += r0 * r0 + r1 * r1 + r2 * r2 + r3 * r3 + r4 * r4 + r5 * r5 + r6 * r6 + r7 * r7
        lo, hi = _word_dot_f16(
            p,
            _pack_f16x2(x0, x4)[None, :, :],
            _pack_f16x2(x1, x5)[None, :, :],
            _pack_f16x2(x2, x6)[None, :, :],
            _pack_f16x2(x3, x7)[None, :, :],
        )
        ga, gb = (t * 256) // G, (t * 256 + 128) // G
        sa = _int4_group(s_ptr, rn, ga, nmask, t, tend, K, G, MASKED)
        sb = _int4_group(s_ptr, rn, gb, nmask, t, tend, K, G, MASKED)
        acc += lo * sa[:, :, None]  # (two multiply-adds; `+` of both products is three)
        acc += hi * sb[:, :, None]
        if HAS_ZERO:  # (zacc holds sums / 16 too)
            za = _int4_group(z_ptr, rn, ga, nmask, t, tend, K, G, True)
            zb = _int4_group(z_ptr, rn, gb, nmask, t, tend, K, G, True)
            xsa = tl.sum(x0 + x1 + x2 + x3, axis=1) * (1.0 / 16)
            xsb = tl.sum(x4 + x5 + x6 + x7, axis=1) * (1.0 / 16)
            zacc += xsa[None, :] * za + xsb[None, :] * zb
        return acc, zacc, xsq

    @triton.jit
    def _int4_tiles(
        acc,
        zacc,
        xsq,
        wrow,
        t,
        x_ptr,
        g_ptr,
        s_ptr,
        z_ptr,
        m,
        tend,
        rn,
        nmask,
        K: tl.constexpr,
        G: tl.constexpr,
        WHOLE: tl.constexpr,
        MASKED: tl.constexpr,
        HAS_ZERO: tl.constexpr,
        ASM: tl.constexpr,
        NORM: tl.constexpr,
        F16: tl.constexpr,
        WAIT: tl.constexpr = False,
    ):
        # one step of `int4_gemv`: the words of tiles t for rows rn, and their products (WAIT:
        # the words requested first, then the wait for the kernel before, as a programmatic
        # dependent's first step does: the weights do not depend on it, x does)
        if MASKED:
            wmask = nmask[:, None, None] & (t < tend)[None, :, None]
            p = tl.load(wrow + t[None, :, None] * 32, mask=wmask, other=0)
        else:
            p = tl.load(wrow + t[None, :, None] * 32)
        if WAIT:
            tl.extra.cuda.gdc_wait()
        return _int4_products(
            acc,
            zacc,
            xsq,
            p,
            t,
            x_ptr,
            g_ptr,
            s_ptr,
            z_ptr,
            m,
            tend,
            rn,
            nmask,
            K,
            G,
            WHOLE,
            MASKED,
            HAS_ZERO,
            ASM,
            NORM,
            F16,
        )

    @triton.jit
    def _int4_products(
        acc,
        zacc,
        xsq,
        p,
        t,
        x_ptr,
        g_ptr,
        s_ptr,
        z_ptr,
        m,
        tend,
        rn,
        nmask,
        K: tl.constexpr,
        G: tl.constexpr,
        WHOLE: tl.constexpr,
        MASKED: tl.constexpr,
        HAS_ZERO: tl.constexpr,
        ASM: tl.constexpr,
        NORM: tl.constexpr,
        F16: tl.constexpr,
    ):
        if F16:
            return _int4_step_half(
                acc,
                zacc,
                xsq,
                p,
                x_ptr,
                g_ptr,
                s_ptr,
                z_ptr,
                m,
                t,
                tend,
                rn,
                nmask,
                K,
                G,
                WHOLE,
                MASKED,
                HAS_ZERO,
                NORM,
            )
        return _int4_step(
            acc,
            zacc,
            xsq,
            p,
            x_ptr,
            g_ptr,
            s_ptr,
            z_ptr,
            m,
            t,
            tend,
            rn,
            nmask,
            K,
            G,
            WHOLE,
            MASKED,
            HAS_ZERO,
            ASM,
            NORM,
        )

    @triton.autotune(configs=_INT4_GEMV_CONFIGS, key=["N", "K", "G", "HALF"])
    @triton.jit
    def int4_gemv(
        x_ptr,
        w_ptr,
        s_ptr,
        z_ptr,
        y_ptr,
        ws_ptr,
        sem_ptr,
        g_ptr,
        r_ptr,
        sq_ptr,
        eps,
        N,
        K: tl.constexpr,
        KP: tl.constexpr,
        G: tl.constexpr,
        HAS_ZERO: tl.constexpr,
        EVEN_N: tl.constexpr,
        ASM: tl.constexpr,
        HALF: tl.constexpr,
        NORM: tl.constexpr,
        RESID: tl.constexpr,
        BLOCK_N: tl.constexpr,
        TILES: tl.constexpr,
        SPLIT_K: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        # y[m] = W x[m], W[n, k] = c * scale[n, k // G] (+ zero[n, k // G]); program (n, s, m)
        # over tiles s * TS .. (s + 1) * TS of K's KP / 256. EVEN_N: BLOCK_N divides N (no row
        # masks); WHOLE: the splits and tiles divide K (no K masks). HALF (with ASM, groups of
        # 128 or more): the products in half precision (`_int4_step_half`), else in fp32. With
        # SPLIT_K > 1 the partials go to `ws_ptr` (SPLIT_K, M, N) and a counter per row block
        # in `sem_ptr` (M x cdiv(N, 8), left at 0) names the program that adds them.
        # NORM: x[m] is the input of an RMSNorm of weight g (`g_ptr`, K) and y[m] = W rmsnorm(
        # x[m]) = rsqrt(mean(x^2) + eps) W (g x): the products take g x, the squares of x are
        # summed as it is read, and the scalar is applied once at the end (with a K split, each
        # split's sum of squares goes to `sq_ptr` (SPLIT_K, M, programs along N) beside its
        # partial). Unlike the 1-byte formats, whose norms are folded into their weights, a
        # scale group of int4 codes cannot take the norm's weight without losing precision
        # (`weights.unfold_norms_`), so the weight comes in here. RESID: y[m] += r[m] (the
        # layer's residual add) before the one rounding to the output's dtype.
        # PDL: launched as a programmatic dependent (`linear.GEMV_PDL`): the first step's
        # weights are loaded before waiting for the kernel before, whose output x (and r) is.
        pid_n, pid_k, m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < N
        KT: tl.constexpr = KP // 256
        TS: tl.constexpr = (KT + SPLIT_K - 1) // SPLIT_K
        WHOLE: tl.constexpr = KT % SPLIT_K == 0 and TS % TILES == 0 and K == KP
        MASKED: tl.constexpr = not (WHOLE and EVEN_N)
        F16: tl.constexpr = HALF and ASM and G % 128 == 0
        tt = tl.arange(0, TILES)
        j = tl.arange(0, 32)
        tend = tl.minimum(pid_k * TS + TS, KT)
        wrow = w_ptr + rn[:, None, None] * (KP // 8) + j[None, None, :]
        acc = tl.zeros((BLOCK_N, TILES, 32), dtype=tl.float32)
        zacc = tl.zeros((BLOCK_N, TILES), dtype=tl.float32)
        xsq = tl.zeros((TILES, 32), dtype=tl.float32)  # NORM: squares of x, per position
        FIRST: tl.constexpr = TILES if PDL else 0
        if PDL:  # the first step's weights requested before the wait (`_int4_tiles`' WAIT)
            t = pid_k * TS + tt
            acc, zacc, xsq = _int4_tiles(
                acc,
                zacc,
                xsq,
                wrow,
                t,
                x_ptr,
                g_ptr,
                s_ptr,
                z_ptr,
                m,
                tend,
                rn,
                nmask,
                K,
                G,
                WHOLE,
                MASKED,
                HAS_ZERO,
                ASM,
                NORM,
                F16,
                True,
            )
        for t0 in tl.range(FIRST, TS, TILES):
            t = pid_k * TS + t0 + tt  # this step's tiles
            acc, zacc, xsq = _int4_tiles(
                acc,
                zacc,
                xsq,
                wrow,
                t,
                x_ptr,
                g_ptr,
                s_ptr,
                z_ptr,
                m,
                tend,
                rn,
                nmask,
                K,
                G,
                WHOLE,
                MASKED,
                HAS_ZERO,
                ASM,
                NORM,
                F16,
            )
        if PDL:  # every weight load issued: the next dependent kernel may start its own
            tl.extra.cuda.gdc_launch_dependents()
        y = tl.sum(tl.sum(acc, axis=2), axis=1) + tl.sum(zacc, axis=1)
        if F16:
            y = y * 16.0
        sq = tl.sum(tl.sum(xsq, axis=1), axis=0)  # (NORM: this split's sum of x^2)
        if SPLIT_K > 1:
            part_y = ws_ptr + (pid_k * tl.num_programs(2) + m) * N + rn
            tl.store(part_y, y, mask=nmask)
            part_sq = sq_ptr + (pid_k * tl.num_programs(2) + m) * tl.num_programs(0) + pid_n
            if NORM:
                tl.store(part_sq, sq)
            # every thread's partial stored before the counter's release (acq_rel, GPU scope)
            tl.debug_barrier()
            row_block = sem_ptr + m * tl.cdiv(N, 8) + pid_n
            if tl.atomic_add(row_block, 1, sem="acq_rel") == SPLIT_K - 1:
                y = tl.zeros((BLOCK_N,), dtype=tl.float32)
                sq = 0.0
                for s in tl.static_range(SPLIT_K):  # from L2: other programs wrote them
                    y += tl.load(
                        ws_ptr + (s * tl.num_programs(2) + m) * N + rn,
                        mask=nmask,
                        cache_modifier=".cg",
                    )
                    if NORM:
                        sq += tl.load(
                            sq_ptr + (s * tl.num_programs(2) + m) * tl.num_programs(0) + pid_n,
                            cache_modifier=".cg",
                        )
                tl.atomic_xchg(row_block, 0)  # ready for the next launch
                _int4_store(y, sq, y_ptr, r_ptr, eps, m, rn, nmask, N, K, NORM, RESID)
        else:
            _int4_store(y, sq, y_ptr, r_ptr, eps, m, rn, nmask, N, K, NORM, RESID)

    @triton.jit
    def _int4_store(
        y,
        sq,
        y_ptr,
        r_ptr,
        eps,
        m,
        rn,
        nmask,
        N,
        K: tl.constexpr,
        NORM: tl.constexpr,
        RESID: tl.constexpr,
    ):
        # `int4_gemv`'s epilogue: the norm's scalar (sq: the row's sum of x^2), the residual,
        # one rounding to y's dtype (fp32 math: inside a compiled graph Inductor passes `eps`
        # as fp64)
        if NORM:
            y = y * tl.math.rsqrt((sq / K + eps).to(tl.float32))
        if RESID:
            y += tl.load(r_ptr + m * N + rn, mask=nmask, other=0.0).to(tl.float32)
        tl.store(y_ptr + m * N + rn, y.to(y_ptr.dtype.element_ty), mask=nmask)
