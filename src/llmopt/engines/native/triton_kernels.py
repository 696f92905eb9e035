"""The Triton kernels of the native engine's CUDA decode path (imported only where Triton is).

- `decode_split` / `decode_combine`: flash-decoding attention over the paged KV cache
  (`attention.paged_decode` launches them and documents the algorithm).
- `int4_gemv` / `int4_gemm`: weight-only int4 matmuls with the dequantization fused
  (`linear.int4_mm` launches them; `linear.pack_int4` gives the weight layout).

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
        m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        lsum = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        if DYNAMIC:  # the GPU: walk only this sequence's own positions
            for n0 in tl.range(start, end, BLOCK_N):
                m, lsum, acc = _tile(
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
                    D,
                    PAGE,
                    BLOCK_N,
                    d,
                    dmask,
                )
        else:  # Triton's interpreter takes only constant loop bounds: the whole split, masked
            for i in tl.range(0, SPLIT, BLOCK_N):
                m, lsum, acc = _tile(
                    q,
                    k_ptr,
                    v_ptr,
                    tab_ptr,
                    b,
                    kvh,
                    start + i,
                    end,
                    m,
                    lsum,
                    acc,
                    qk_scale,
                    stride_kr,
                    stride_tb,
                    D,
                    PAGE,
                    BLOCK_N,
                    d,
                    dmask,
                )
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

    # Weight-only int4 with the dequantization fused into the matmul: weights stay 4 bits in
    # device memory and are expanded in registers, w = (u - 8) * scale (+ zero) per group of
    # G along K. GEMV for decode rows (one program: BLOCK_N outputs of one row, a 2-D register
    # tile reduced once at the end, as the int8 GEMV); a tl.dot GEMM for more rows.

    _GEMV_CONFIGS = [
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
        for bn, bk, w, st in (
            (16, 512, 4, 3),
            (32, 512, 8, 3),
            (8, 1024, 4, 3),
            (16, 1024, 8, 3),
            (32, 256, 4, 4),
            (64, 256, 8, 3),
            (8, 512, 4, 4),
        )
    ]

    @triton.jit
    def _int4_dequant(
        w_ptr,
        s_ptr,
        z_ptr,
        rn,
        k0,
        N,
        K: tl.constexpr,
        G: tl.constexpr,
        HAS_ZERO: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        shifts = tl.arange(0, 8) * 4
        rk8 = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        nmask = rn < N
        p = tl.load(
            w_ptr + rn[:, None] * (K // 8) + rk8[None, :],
            mask=nmask[:, None] & (rk8[None, :] < K // 8),
            other=0,
        )
        u = (p[:, :, None] >> shifts[None, None, :]) & 0xF  # (BLOCK_N, BLOCK_K // 8, 8)
        rg = k0 // G + tl.arange(0, BLOCK_K // G)
        gmask = nmask[:, None] & (rg[None, :] < K // G)
        s = tl.load(s_ptr + rn[:, None] * (K // G) + rg[None, :], mask=gmask, other=0.0)
        w = (tl.reshape(u, (BLOCK_N, BLOCK_K // G, G)).to(tl.float32) - 8.0) * s.to(tl.float32)[
            :, :, None
        ]
        if HAS_ZERO:
            z = tl.load(z_ptr + rn[:, None] * (K // G) + rg[None, :], mask=gmask, other=0.0)
            w += z.to(tl.float32)[:, :, None]
        return tl.reshape(w, (BLOCK_N, BLOCK_K))

    @triton.autotune(configs=_GEMV_CONFIGS, key=["N", "K", "G"])
    @triton.jit
    def int4_gemv(
        x_ptr,
        w_ptr,
        s_ptr,
        z_ptr,
        y_ptr,
        N,
        K: tl.constexpr,
        G: tl.constexpr,
        HAS_ZERO: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # Each packed word is loaded once (coalesced rows of BLOCK_K / 8 words) and never reshaped:
        # nibble i of every word meets x[8j + i] in turn. The 8 weights of a word share one group,
        # so the scale multiplies their summed products once.
        pid_n, m = tl.program_id(0), tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < N
        acc = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K):
            rk8 = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            kmask = rk8 < K // 8
            wmask = nmask[:, None] & kmask[None, :]
            p = tl.load(w_ptr + rn[:, None] * (K // 8) + rk8[None, :], mask=wmask, other=0)
            goff = rn[:, None] * (K // G) + (rk8 // (G // 8))[None, :]
            s = tl.load(s_ptr + goff, mask=wmask, other=0.0).to(tl.float32)
            inner = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
            xs = tl.zeros((BLOCK_K // 8,), dtype=tl.float32)
            for i in tl.static_range(8):
                x = tl.load(x_ptr + m * K + rk8 * 8 + i, mask=kmask, other=0.0).to(tl.float32)
                u = ((p >> (4 * i)) & 0xF).to(tl.float32) - 8.0
                inner += u * x[None, :]
                if HAS_ZERO:
                    xs += x
            acc += inner * s
            if HAS_ZERO:
                z = tl.load(z_ptr + goff, mask=wmask, other=0.0).to(tl.float32)
                acc += z * xs[None, :]
        y = tl.sum(acc, axis=1)
        tl.store(y_ptr + m * N + rn, y.to(y_ptr.dtype.element_ty), mask=nmask)

    _GEMM_CONFIGS = [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 128}, num_warps=w, num_stages=s)
        for bm, bn, w, s in ((16, 64, 4, 3), (32, 64, 4, 3), (64, 64, 4, 3), (64, 128, 8, 3))
    ]

    @triton.autotune(configs=_GEMM_CONFIGS, key=["N", "K", "G", "M_BUCKET"])
    @triton.jit
    def int4_gemm(
        x_ptr,
        w_ptr,
        s_ptr,
        z_ptr,
        y_ptr,
        M,
        N,
        M_BUCKET,
        K: tl.constexpr,
        G: tl.constexpr,
        HAS_ZERO: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(
                x_ptr + rm[:, None] * K + rk[None, :],
                mask=(rm[:, None] < M) & (rk[None, :] < K),
                other=0.0,
            )
            w = _int4_dequant(w_ptr, s_ptr, z_ptr, rn, k0, N, K, G, HAS_ZERO, BLOCK_N, BLOCK_K)
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        tl.store(
            y_ptr + rm[:, None] * N + rn[None, :],
            acc.to(y_ptr.dtype.element_ty),
            mask=(rm[:, None] < M) & (rn[None, :] < N),
        )
