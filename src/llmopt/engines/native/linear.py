"""Quantized linear layers for the native engine: int8 and int4 weight-only, FP8 W8A8.

Each layer holds the weight in the layout its kernel wants and computes y = x W^T (+ b) in the
activation dtype. The kernels are PyTorch's and, on CUDA at decode rows, our own Triton kernels
(`triton_kernels.py`; no torchao on our hosts):

| layer       | CPU                                   | CUDA                                         |
|-------------|---------------------------------------|----------------------------------------------|
| Int8Linear  | `_weight_int8pack_mm` (rows <= 8)     | Triton: `wo8_gemv` at 1 row, `wo8_dot` at    |
|             |                                       | 2-16; dequant + cuBLAS above                 |
| Int4Linear  | `_weight_int4pack_mm_for_cpu`         | Triton (`INT4_TRITON`): `int4_gemv` at 1     |
|             |                                       | row, `int4_dot` above; else tinygemm         |
| Fp8Linear   | refused (no fast FP8 matmul on CPU)   | weight-only Triton: the GEMV at 1 row,       |
|             |                                       | `wo8_dot` at 2-16; `_scaled_mm` above        |
|             |                                       | (row-wise scales, cc >= 8.9)                 |

`DenseLinear` keeps 16-bit weights and cuBLAS, and lends them to the one-row GEMV where it
takes the RMSNorm before the layer or the residual add after it (`FUSE_NORM`).

Above `TRITON_M` rows (prompts), int8 layers dequantize and use the dense matmul: the weight-only
kernels are built for memory-bound decode rows and lose to cuBLAS/oneDNN on a whole prompt.

Quantization here is plain symmetric round-to-nearest (what a checkpoint without calibration gets);
calibrated weights (AWQ, GPTQ) arrive already quantized from `llmopt.quant` in compressed-tensors
folders and are only re-laid-out here (`weights.py`). Asymmetric int4 (a zero point per group)
costs nothing extra: tinygemm dequantizes `(u - 8) * scale + zero` with a float `zero` per group,
so `Int4Linear` stores `zero = -z * scale` for the signed zero point `z` (bf16, as the scales).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from llmopt.engines.native import cuda_gemv
from llmopt.engines.native.attention import _INTERPRET, launch

__all__ = [
    "Int8Linear",
    "Int4Linear",
    "Fp8Linear",
    "DenseLinear",
    "quantize_int8",
    "quantize_int4",
    "quantize_fp8",
    "fp8_supported",
    "SMALL_M",
    "int4_mm",
    "wo_mm",
    "tile_counters",
    "INT4_TRITON",
    "INT4_ONE_ROW",
    "INT4_GEMV_HALF",
    "WO8_KERNEL",
    "FUSE_SILU",
    "FUSE_NORM",
    "norm_linear",
    "linear_add",
    "GEMV_EVEN",
    "GEMV_PDL",
    "GEMV_INT8_F16",
    "GEMV_PREFETCH",
    "GEMV_CUDA",
    "INT4_GEMV_CUDA",
    "INT4_GEMV_TEAMS",
    "INT4_GEMV_EARLY",
    "INT4_GEMV_VARIANTS",
    "INT4_GEMV_FIT",
    "prepare_cuda_gemv",
    "pdl_supported",
    "silu_down",
    "pack_int4_planar",
    "unpack_int4_planar",
]

log = logging.getLogger(__name__)

SMALL_M = 8
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (q int8 (N, K), scale fp32 (N,)), w ~= q * scale."""
    w = w.float()
    s = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    return torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8), s


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric groupwise int4: (q int8 in [-8, 7] (N, K), scale fp32 (N, K // group))."""
    n, k = w.shape
    assert k % group == 0, f"group size {group} does not divide in_features {k}"
    wg = w.float().reshape(n, k // group, group)
    s = wg.abs().amax(dim=2).clamp(min=1e-8) / 7.5
    q = torch.round(wg / s[..., None]).clamp(-8, 7).to(torch.int8)
    return q.reshape(n, k), s


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel FP8 E4M3: (q float8_e4m3fn (N, K), scale fp32 (N,))."""
    w = w.float()
    s = w.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
    return (w / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s


def fp8_supported(device: torch.device | str | None = None) -> bool:
    """FP8 tensor-core matmuls need an NVIDIA GPU of compute capability 8.9 or newer."""
    if not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


_PDL: dict[int, bool] = {}  # CUDA device index -> has programmatic dependent launch


def pdl_supported(index: int) -> bool:
    """Programmatic dependent launch (griddepcontrol) needs compute capability 9.0 or newer.
    Answered once per device, eagerly by the layers' kernel checks: inside a compiled step
    this is a dict lookup (Dynamo does not trace the driver query)."""
    if index not in _PDL:
        _PDL[index] = torch.cuda.get_device_capability(index) >= (9, 0)
    return _PDL[index]


class _QuantLinear(nn.Module):
    def __init__(self, n: int, k: int, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features, self.dtype = k, n, dtype
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)

    def _counters(self) -> None:
        # the Triton kernel's K-split counters (`tile_counters`), a buffer: fixed address
        n, dev = self.out_features, self.weight.device
        c = tile_counters(n, TRITON_M, dev) if self.triton_kernel else None
        self.register_buffer("counters", c, persistent=False)

    def _finish(self, y: torch.Tensor, shape) -> torch.Tensor:
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Int8Linear(_QuantLinear):
    """int8 weights, one scale per output channel; activations stay in `dtype`."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias, dtype: torch.dtype):
        super().__init__(q.shape[0], q.shape[1], bias, dtype)
        # clone(): tensors read from safetensors may sit at unaligned offsets of the mapped file,
        # and the CPU int8pack kernel (AVX-512/AMX) segfaults on those (seen with 64-wide rows).
        self.register_buffer("weight", q.to(torch.int8).contiguous().clone())
        # The int8pack kernel takes the scale in the activation dtype (bf16 on CPU: see forward).
        kdt = torch.bfloat16 if q.device.type == "cpu" else dtype
        self.register_buffer("scale", scale.flatten().to(kdt).contiguous())
        self.register_buffer("scale_f", scale.flatten().to(dtype).contiguous())
        # PyTorch's CUDA `_weight_int8pack_mm` exists but reads weights slower than a bf16 matmul
        # (benchmarks/linear_kernels.py): CUDA uses the Triton kernel (`wo_mm`).
        self.packed_kernel = q.device.type == "cpu"
        self.triton_kernel = q.device.type == "cuda" and _triton_available()
        if self.triton_kernel and GEMV_CUDA:  # built, checked and timed now, not inside a step
            cuda_gemv.available(q.device.index or 0, _wo8_cuda_cases)
            _pick_wo8(self.weight, self.scale_f, dtype)
        self._counters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] <= SMALL_M and self.packed_kernel:
            # On CPU the kernel is fastest with bf16 activations (AVX512-BF16/AMX); fp32 models
            # lose a little precision in the activations here, as w8a16 means.
            xin = x2.to(self.scale.dtype).contiguous()
            y = torch.ops.aten._weight_int8pack_mm(xin, self.weight, self.scale).to(x.dtype)
        elif x2.shape[0] <= TRITON_M and self.triton_kernel:
            y = wo_mm(x2, self.weight, self.scale_f, counters=self.counters)
        else:
            y = F.linear(x2, self.weight.to(x.dtype)) * self.scale_f.to(x.dtype)
        return self._finish(y, shape)


class Int4Linear(_QuantLinear):
    """int4 weights in groups along the input dimension (tinygemm layout).

    `q` (N, K) holds signed codes in [-8, 7], `scale` (N, K / group); with `zero_point` (same
    layout, signed int in [-8, 7], compressed-tensors' asymmetric convention) the weight is
    (q - zero_point) * scale, else q * scale. tinygemm computes (u - 8) * scale + zero with
    u = q + 8, so the zero point becomes the float offset zero = -zero_point * scale: the same
    kernel, no extra cost.
    """

    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        group: int,
        bias,
        dtype,
        zero_point: torch.Tensor | None = None,
    ):
        n, k = q.shape
        super().__init__(n, k, bias, dtype)
        self.group = group
        u = (q.to(torch.int32) + 8).contiguous()  # tinygemm dequant: (u - 8) * scale + zero
        scale = scale.float()
        zero = torch.zeros_like(scale) if zero_point is None else -zero_point.float() * scale
        # On CUDA the Triton kernels (`int4_mm`: fused dequant, weights read at 4 bits) when they
        # pass their check on this GPU, in their own layout; tinygemm's layout otherwise.
        self.triton_kernel = (
            INT4_TRITON
            and q.device.type == "cuda"
            and int4_triton_supported(k, group)
            and _triton_int4_available()
        )
        if self.triton_kernel:
            self.register_buffer("weight", pack_int4_planar(q))
            self.register_buffer("scale", scale.to(dtype).contiguous())
            zp = None if zero_point is None else zero.to(dtype).contiguous()
            self.register_buffer("zero", zp)
            # the one-row GEMV's K-split counters: a buffer, so a CUDA graph sees one address
            self.register_buffer("counters", gemv_counters(n, 1, q.device), persistent=False)
            if INT4_GEMV_CUDA:  # built, checked and timed now, not inside a compiled step
                cuda_gemv.int4_available(q.device.index or 0, _int4_cuda_cases)
                _pick_int4(self.weight, self.scale, self.zero, group, dtype)
            return
        sz = torch.stack([scale.t(), zero.t()], dim=-1)  # (K/g, N, 2)
        self.register_buffer("scales_zeros", sz.to(torch.bfloat16).contiguous())
        if q.device.type == "cpu":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 2)
        else:
            u8 = (u[:, ::2] << 4 | u[:, 1::2]).to(torch.uint8)
            packed = torch.ops.aten._convert_weight_to_int4pack(u8, tinygemm_k_tiles(k))
        self.register_buffer("weight", packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if self.triton_kernel:
            x2 = x.reshape(-1, self.in_features)
            y = int4_mm(x2, self.weight, self.scale, self.zero, self.group, counters=self.counters)
            return self._finish(y, shape)
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        if x2.device.type == "cpu":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2, self.weight, self.group, self.scales_zeros
            )
        else:
            y = torch.ops.aten._weight_int4pack_mm(x2, self.weight, self.group, self.scales_zeros)
        return self._finish(y.to(x.dtype), shape)


def tinygemm_k_tiles(k: int) -> int:
    """tinygemm's inner K tiles for `in_features` k: the most (8, 4 or 2) whose 16-wide tiles
    divide k (8 needs k % 128 == 0: SmolLM2's 576 takes 4).

    >>> tinygemm_k_tiles(4096), tinygemm_k_tiles(576), tinygemm_k_tiles(96)
    (8, 4, 2)
    """
    for tiles in (8, 4, 2):
        if k % (16 * tiles) == 0:
            return tiles
    raise ValueError(
        f"int4 weights on CUDA need in_features divisible by 32 (tinygemm's K tile); this "
        f"layer has {k}: use int8 or FP8 for this model"
    )


class Fp8Linear(_QuantLinear):
    """FP8 E4M3 weights (per-channel scales) x FP8 activations (dynamic per-token scales)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias, dtype):
        super().__init__(q.shape[0], q.shape[1], bias, dtype)
        self.register_buffer(
            "weight", q.contiguous()
        )  # (N, K) row-major; passed as K x N col-major
        self.register_buffer("scale", scale.float().reshape(1, -1).contiguous())  # (1, N)
        # At decode sizes the FP8 weights go through the weight-only kernel (activations stay
        # 16-bit): `_scaled_mm` at one row reads FP8 weights at well under half of bandwidth
        # (benchmarks/linear_kernels.py) and needs three extra kernels to quantize activations.
        self.triton_kernel = q.device.type == "cuda" and _triton_available()
        if self.triton_kernel and GEMV_CUDA:  # built, checked and timed now, not inside a step
            cuda_gemv.available(q.device.index or 0, _wo8_cuda_cases)
            _pick_wo8(self.weight, self.scale, dtype)
        self._counters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] <= TRITON_M and self.triton_kernel:
            y = wo_mm(x2, self.weight, self.scale, counters=self.counters)
            return self._finish(y, shape)
        xs = x2.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX  # (M, 1)
        xq = (x2 / xs).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        y = torch._scaled_mm(
            xq, self.weight.t(), scale_a=xs, scale_b=self.scale, out_dtype=self.dtype
        )
        return self._finish(y, shape)


class DenseLinear(_QuantLinear):
    """16-bit weights as they are, made to take the one-row GEMV's fusions (`FUSE_NORM`): at one
    activation row on CUDA, `norm_linear` / `linear_add` run the RMSNorm before the layer and
    the residual add after it inside the Triton GEMV (unit scales), as for int8 and FP8; its own
    forward, for every other call, is the dense matmul (cuBLAS) as before. Whether the GEMV
    reads bf16 weights as fast as cuBLAS is `benchmarks/linear_kernels.py`'s `bf16-gemv`
    column. Made by `weights.dense_gemv_`."""

    def __init__(self, w: torch.Tensor, bias, dtype: torch.dtype):
        super().__init__(w.shape[0], w.shape[1], bias, dtype)
        self.register_buffer("weight", w.to(dtype).contiguous())
        self.register_buffer("scale", torch.ones(w.shape[0], device=w.device))  # fp32
        self.triton_kernel = w.device.type == "cuda" and _triton_available()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._finish(F.linear(x.reshape(-1, self.in_features), self.weight), x.shape)


# Rows up to which int8/FP8 layers take the Triton kernel (`wo_mm`): decode batches. Above it
# (prompts) the dense matmul on dequantized weights is compute-bound and cuBLAS wins.
TRITON_M = 16
# Kernel of the int8/FP8 layers at decode rows: "dot" (tensor cores, one weight read for all
# rows), "dot1" (the same without its K split), "gemv" (CUDA cores, one program row per
# activation row) or "auto", from the H200's measurements (docs/benchmarks.md, issue 24): the
# GEMV at one row (faster for FP8; for int8, reading words, equal to the dot overall and faster
# on the narrow projections), the dot kernel at 2-16 rows (there it reads the weights 2-4x
# faster than the GEMV, which re-reads them per row). Benchmarks force one.
WO8_KERNEL = "auto"
# The Triton int4 kernels (`int4_mm`: the layout chosen at load, `int4_gemv` at one row,
# `int4_dot` at more rows and for prompts) instead of tinygemm on CUDA, where they take the
# shape (`int4_triton_supported`) and pass their check on the GPU. On: against tinygemm on the 8B
# shape they decode faster at batch 1 (H200 1.12x interleaved, H100 1.03x) and at batch 64 (H100
# 2.67x), and prefill a 128-token prompt 2.6x (one) and 4.0x (64) faster (docs/benchmarks.md).
# Off: tinygemm at every row count.
INT4_TRITON = True
# The Triton int4 path's kernel at one row: "gemv" (`int4_gemv`: on the H200 faster than
# tinygemm on three of the 8B shapes and level on the fourth, 1.12x tinygemm end to end at batch
# 1, where `int4_dot` reads ~1.75x slower than tinygemm; docs/benchmarks.md) or "dot"
# (`int4_dot`, the tensor-core kernel the Triton path uses at 2-16 rows).
INT4_ONE_ROW = "gemv"
# `int4_gemv`'s products in half precision (four f16 products summed per scale group, then
# fp32), as Marlin dequantizes: about half the instructions per weight of the fp32 products
# (`benchmarks/gemv_ptx.py --formats int4 int4-f32`). Groups of 128 or more; GPU only (PTX).
INT4_GEMV_HALF = True
# SiLU x up computed inside the FP8 down projection's one-row GEMV (`silu_down`): off, as timed
# alone it costs about what it saves (the compiled step's own SiLU x up is one small Inductor
# kernel; docs/benchmarks.md); `benchmarks/decode.py --fuse-silu off on` measures it end to end.
FUSE_SILU = False
# RMSNorm inside the one-row GEMV that reads its output (qkv, gate/up; `norm_linear`) and the
# residual add in the epilogue of the one that ends each half-layer (o, down; `linear_add`), for
# int8/FP8, dense bf16 (`DenseLinear`) and int4 on the Triton layout at batch 1: the norm
# kernels between the linears and their launches are gone. int8/FP8/bf16 need the norms'
# weights folded into the linears first (`weights.fold_norms_`, done on CUDA by
# `quantize_model_` for int8/FP8 and by `weights.dense_gemv_` for 16-bit models while this is
# on); the int4 GEMV multiplies its input by the norm's weight instead (+5% tokens/s on an
# H100 at batch 1, docs/benchmarks.md). On: on the H200, side by side at
# batch 1, bf16 +11% and FP8 +8% tokens/s, quality unchanged (docs/benchmarks.md;
# `benchmarks/decode.py --linear FUSE_NORM=off default`).
FUSE_NORM = True
# The one-row GEMV launched as a programmatic dependent (CUDA sm_90+, `_wo8_gemv_pdl`,
# `_int4_gemv_pdl`): it may start while the kernel before it drains, loads its first weight
# tile, and only then waits for its input; each linear's fixed ramp-up overlaps the kernel
# before. On where the GPU has it (`pdl_supported`): FP8 +6% tokens/s at batch 1 on the H200,
# int4 +3% on an H100 (docs/benchmarks.md;
# `benchmarks/decode.py --linear GEMV_PDL=off default`).
GEMV_PDL = True
# The int8 GEMV's bytes made floats through half precision (`triton_kernels.
# _words_as_floats_f16`: a byte permute and an f16x2 subtraction per pair, as FP8's pairs are
# converted) instead of a shift and mask per byte: ~13% fewer instructions per weight in the
# main loop for sm_90 (`benchmarks/gemv_ptx.py`). Off until timed on a GPU (`benchmarks/decode.py
# --modes int8 --linear default GEMV_INT8_F16=on`).
GEMV_INT8_F16 = False
# The int8 GEMV's autotuner also times configs that load each weight tile one loop step ahead
# of its products (`triton_kernels.wo8_gemv_ahead`), so that a warp's loads overlap its own
# arithmetic: Nsight Compute showed the GEMVs stalled mostly on their loads (`long_scoreboard`).
# On the H200, side by side at batch 1: int8 +1.3% tokens/s; timed alone FP8 was slower with
# it on every 8B shape, so FP8 and bf16 never take it, and the int4 GEMV, 2% slower with it end
# to end, does not have it (`benchmarks/decode.py --linear default GEMV_PREFETCH=off`;
# docs/benchmarks.md).
GEMV_PREFETCH = True
# The one-row int8/FP8 GEMV in CUDA C++ (`cuda_gemv`: more loads in flight per thread, fewer
# instructions per weight byte) instead of Triton's, on GPUs where it builds (nvcc and ninja
# present) and passes its check; otherwise, and for the SiLU x up input, Triton's. On: on the
# H200, side by side at batch 1 on the 8B shape, int8 1.19x and FP8 1.04x tokens/s
# (docs/benchmarks.md; `benchmarks/decode.py --linear default GEMV_CUDA=on`). Layers built
# while this is on build the kernel eagerly (`cuda_gemv.available`); code that switches it
# on later calls `prepare_cuda_gemv` first.
GEMV_CUDA = True
# The int4 one-row GEMV in CUDA C++ (`cuda_gemv.int4_gemv`, csrc/int4_gemv.cu: Marlin's
# dequantization of the Triton layout, two codes per f16x2 instruction) instead of the Triton
# int4 GEMV, for layers on the Triton int4 layout (`INT4_TRITON`) with symmetric codes, K a
# multiple of 256 and a power-of-two group, with the RMSNorm and residual add fused as the
# Triton GEMV fuses them. On since its blocks own several groups of rows (the activations
# staged once per 16-32 rows): 5.8% faster end to end than the Triton GEMV on an H100, every
# 8B shape picked for it by the per-shape timing (docs/benchmarks.md; `benchmarks/decode.py
# --linear default INT4_GEMV_CUDA=off`). Where its build or check fails, Triton's GEMV runs.
INT4_GEMV_CUDA = True
# Which of the CUDA int4 GEMV's configurations its per-shape timing may choose: those whose
# blocks deal their groups of rows to several teams of warps (`INT4_GEMV_TEAMS`), and those
# that request a second loop step's weights before the programmatic-dependency wait
# (`INT4_GEMV_EARLY`). Both on; off takes them out of the timing, so that an end-to-end A/B
# (`benchmarks/decode.py --linear default INT4_GEMV_EARLY=off`) shows what each design adds:
# read when a step is traced, each compiled step times and keeps its own set.
INT4_GEMV_TEAMS = True
INT4_GEMV_EARLY = True
# And those with variant bit 1 or 2 (csrc/int4_gemv.cu: the activations staged with 16-byte
# loads in one pass where the row fits; one block barrier per group of rows): on; off keeps the
# timing to the configurations without them (`--linear default INT4_GEMV_VARIANTS=off`).
INT4_GEMV_VARIANTS = True
# And those whose groups of rows per block are fitted, at launch, to the blocks the GPU holds at
# once (csrc/int4_gemv.cu's fit_chunks: one wave, where a fixed count of groups can leave a last
# partial one): on; off for the A/B (`--linear default INT4_GEMV_FIT=off`).
INT4_GEMV_FIT = True
# Per weight shape, the one-row GEMV is the CUDA C++ kernel or Triton's, whichever ran faster on
# this GPU when the first layer of that shape was built (`_pick_one_row`: both timed eagerly,
# interleaved, the L2 flushed; the CUDA kernel keeps the shape unless Triton's is faster by
# more than `GEMV_PICK_MARGIN`). Neither kernel wins every shape (timed alone on the H200: the CUDA
# FP8 GEMV is faster on the 8B model's gate/up and down, slower on qkv; docs/benchmarks.md).
# Off: every shape takes the CUDA kernel where `GEMV_CUDA` / `INT4_GEMV_CUDA` route to it (read
# per call, so a model built with it on can run either way: `benchmarks/decode.py --linear`).
GEMV_PICK = True
GEMV_PICK_MARGIN = 0.02
# The pick's timing: off, each kernel is one launch after an L2 flush (Triton's `do_bench`); on,
# launches back to back in a CUDA graph over weight copies larger than the L2, each launched as
# the compiled step launches it (a programmatic dependent where `GEMV_PDL` is on): closer to
# what the step sees (timed alone by `do_bench`, the CUDA FP8 GEMV won the 8B model's qkv
# projection, which it loses in CUDA-graph replays: docs/benchmarks.md). Off: on an H100 it
# picked what `do_bench` picks for every 8B shape (FP8 end to end x1.001); not yet run on an
# H200, where the misranking was seen (`benchmarks/decode.py --linear GEMV_PICK_REPLAY=on`).
GEMV_PICK_REPLAY = False
# ("wo8" or "int4", N, K, weight dtype or group, activation dtype, device index) -> whether the
# CUDA kernel keeps that shape; a shape not timed (no layer built it) takes the CUDA kernel
_CUDA_PICKED: dict[tuple, bool] = {}
_PICK_TIMES: dict[tuple, tuple[float, float]] = {}  # the same keys -> (CUDA ms, Triton ms)
_KERNELS: dict = {}  # Triton kernels, created eagerly (outside torch.compile, which sees launches)


def _kernel(name: str):
    """The Triton kernel `name` of `triton_kernels`, looked up once. The availability checks
    look each up eagerly, so that inside the compiled step this is a dict lookup: Dynamo cannot
    trace the import."""
    if name not in _KERNELS:
        _KERNELS[name] = getattr(_triton_kernels(), name)
    return _KERNELS[name]


def _check(name: str, fn) -> bool:
    """Run one eager correctness check of a Triton kernel on this GPU; False (and a warning)
    when Triton is missing, there is no GPU, or the kernel fails or is wrong here."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    if not torch.cuda.is_available():
        return False
    try:
        fn()
        return True
    except Exception as e:  # a Triton/driver mismatch must not take the engine down
        log.warning("Triton %s kernel disabled on this GPU (%s); using the fallback", name, e)
        return False


def _assert_close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    err = float((got.float() - ref).norm() / ref.norm())
    if err > 1e-2:
        raise RuntimeError(f"relative error {err:.2e} ({what})")


@functools.cache
def _triton_available() -> bool:
    """The int8/FP8 decode kernels compile and are right on this GPU."""

    def check():
        for name in ("wo8_gemv", "wo8_gemv_ahead", "wo8_dot", "wo8_dot_nosplit"):
            _kernel(name)
        for i in range(torch.cuda.device_count()):
            pdl_supported(i)
        g = torch.Generator(device="cuda").manual_seed(0)
        w = torch.randn(96, 512, device="cuda", generator=g)
        q, s = quantize_int8(w)
        for m in (1, 5):
            x = torch.randn(m, 512, device="cuda", generator=g, dtype=torch.bfloat16)
            ref = x.float() @ (q.float() * s[:, None]).t()
            for kern in ("gemv", "dot"):
                _assert_close(wo_mm(x, q, s, kern), ref, f"{kern} at {m} rows")

    return _check("int8/FP8", check)


@functools.cache
def _triton_kernels():
    from llmopt.engines.native import triton_kernels as T  # heavy: triton, a GPU-host package

    return T


def _m_bucket(m: int) -> int:
    """Autotune once per power-of-two row count (16 at least, 4096 at most)."""
    return min(1 << max(4, (m - 1).bit_length()), 4096)


SPLIT_K_MAX = 8  # the largest K split among `triton_kernels.wo8_dot`'s configs
# The largest tiles among `triton_kernels.wo8_gemv`'s configs: shapes they divide (every 8B
# projection) run it without masks (EVEN), unless GEMV_EVEN is off (side-by-side runs:
# `benchmarks/linear_kernels.py`'s `-masked` columns).
GEMV_TILE_N, GEMV_TILE_K = 64, 1024
GEMV_EVEN = True
INT4_GEMV_TILE_N = 128  # the largest BLOCK_N of `triton_kernels.int4_gemv`'s configs


def tile_counters(n: int, m: int, device) -> torch.Tensor:
    """Zeroed per-tile counters for `wo_mm`'s K-split reduction at up to `m` rows and `n`
    outputs. Every launch leaves them zero again; a layer keeps its own as a buffer, so that the
    compiled step's CUDA graph sees a fixed address (a tensor made per call would not be). Two
    launches sharing counters must not overlap: the engine runs one CUDA stream."""
    return torch.zeros(-(-n // 16) * -(-m // 16), dtype=torch.int32, device=device)


def gemv_counters(n: int, m: int, device) -> torch.Tensor:
    """Zeroed per-row-block counters for `int4_mm`'s GEMV K split (`triton_kernels.int4_gemv`):
    one per 8 outputs per row, as `tile_counters` for the dot kernels."""
    return torch.zeros(m * -(-n // 8), dtype=torch.int32, device=device)


def wo_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    kernel: str | None = None,
    counters: torch.Tensor | None = None,
    gated: bool = False,
    norm_eps: float | None = None,
    residual: torch.Tensor | None = None,
    cuda: bool = True,
) -> torch.Tensor:
    """y (M, N) = x (M, K) @ (w (N, K) * scale (N,))^T for decode rows, on CUDA via Triton.

    `w` is int8 or float8_e4m3fn (1 byte per weight); `scale` one float per output channel.
    `kernel`: "dot" (`triton_kernels.wo8_dot`), "dot1" (the same without a K split), "gemv"
    (`triton_kernels.wo8_gemv`) or "auto" (see `WO8_KERNEL`, the default). `counters`: the
    dot kernel's per-tile counters (`tile_counters`); made here when not given. `gated`: x is a
    gate/up projection's output (M, 2K) and the product's input is silu(gate) * up, computed by
    the GEMV as it reads x (`silu_down`; GEMV only). `norm_eps`: x is an RMSNorm's input whose
    weight is folded into `w` (`weights.fold_norms_`), normalized by the GEMV (`norm_linear`);
    `residual` (M, N): added to the output in the GEMV's epilogue (`linear_add`). GEMV only.
    `cuda`: the one-row GEMV may be the CUDA C++ one (`GEMV_CUDA`); False keeps Triton's.
    """
    import triton

    m, k = x.shape
    if gated:
        k //= 2
    n = w.shape[0]
    x = x.contiguous()
    kernel = kernel or WO8_KERNEL
    if kernel == "auto":
        kernel = "gemv" if m == 1 else "dot"
    if (gated or norm_eps is not None or residual is not None) and kernel != "gemv":
        raise ValueError(f"gated, normalized or residual input needs the GEMV, not {kernel!r}")
    if kernel == "gemv" and not gated and cuda and _cuda_gemv_here(x, w):
        eps = 0.0 if norm_eps is None else float(norm_eps)
        r = x if residual is None else residual.reshape(m, n)
        pdl = GEMV_PDL and pdl_supported(x.device.index or 0)
        return cuda_gemv.wo8_gemv(
            x, w, scale, r, eps, norm_eps is not None, residual is not None, pdl
        )
    if kernel == "gemv":
        # int8 is read as int32 words of four bytes (`triton_kernels._bytes_as_float`)
        words = w.dtype == torch.int8 and k % 4 == 0
        wv = w.view(torch.int32) if words else w
        even = GEMV_EVEN and n % GEMV_TILE_N == 0 and k % GEMV_TILE_K == 0
        if w.dtype == torch.float8_e4m3fn and not even:  # masked loads need a 0: read bytes
            wv = w.view(torch.uint8)
        flags = {"WORDS": words, "GATED": gated, "EVEN": even}
        flags |= {"NORM": norm_eps is not None, "RESID": residual is not None}
        flags["F16"] = words and GEMV_INT8_F16 and not _INTERPRET  # (inline PTX: GPU only)
        ahead = words and GEMV_PREFETCH
        eps = 0.0 if norm_eps is None else float(norm_eps)
        r = None if residual is None else residual.reshape(m, n).contiguous()
        if GEMV_PDL and not _INTERPRET and pdl_supported(x.device.index or 0):
            lower = {name.lower(): value for name, value in flags.items()}
            return torch.ops.llmopt.wo8_gemv_pdl(
                x, wv, scale, x if r is None else r, eps, n, k, **lower, ahead=ahead
            )
        return _gemv(x, wv, scale, r, eps, n, k, flags, pdl=False, ahead=ahead)

    y = torch.empty(m, n, device=x.device, dtype=x.dtype)

    def grid2(meta):
        return (
            triton.cdiv(n, meta["BLOCK_N"]),
            triton.cdiv(m, meta["BLOCK_M"]),
            meta["SPLIT_K"],
        )

    if counters is None:
        counters = tile_counters(n, m, x.device)
    # the K-split partials (fp32), sized for the largest split: the autotuner picks the config
    ws = torch.empty(SPLIT_K_MAX, m, n, device=x.device, dtype=torch.float32)
    name = "wo8_dot_nosplit" if kernel == "dot1" else "wo8_dot"
    launch(_kernel(name), grid2, x, w, scale, y, ws, counters, m, n, _m_bucket(m), K=k)
    return y


def prepare_cuda_gemv(device: torch.device | str | None = None, int4: bool = False) -> str:
    """Build and check the CUDA GEMV (with `int4`: the int4 one) for `device` now (eagerly,
    outside any compiled step) so that `GEMV_CUDA` (`INT4_GEMV_CUDA`) can route to it; '' when
    it runs there, else why not."""
    dev = torch.device(device or "cuda")
    if dev.type != "cuda":
        return "not a GPU"
    if int4:
        return cuda_gemv.int4_unavailable_reason(dev.index or 0, _int4_cuda_cases)
    return cuda_gemv.unavailable_reason(dev.index or 0, _wo8_cuda_cases)


def _cuda_check_data(dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn(37, 512, device=dev, generator=g)  # (37 rows: no block's multiple)
    return w, torch.randn(2, 512, device=dev, generator=g, dtype=torch.bfloat16)


def _wo8_cuda_cases(dev: torch.device):
    """The 1-byte CUDA GEMV's check (`cuda_gemv.Cases`): int8 and, where the GPU converts it,
    FP8 weights, against fp32 references."""
    w, x = _cuda_check_data(dev)
    for quant in (quantize_int8, quantize_fp8)[: 1 + fp8_supported(dev)]:
        q, s = quant(w)
        ref = x.float() @ (q.float() * s[:, None]).t()
        yield (x, q, s, x, 0.0, False, False), ref, str(q.dtype)


def _int4_cuda_cases(dev: torch.device):
    """The int4 CUDA GEMV's check: every group size it takes, against fp32 references, and
    the RMSNorm and residual it fuses (group 256)."""
    w, x = _cuda_check_data(dev)
    for group in (32, 64, 128, 256):
        q, s = quantize_int4(w, group)
        deq = (q.float().reshape(37, -1, group) * s[..., None]).reshape(37, 512)
        args = (x, pack_int4_planar(q), s.to(x.dtype).contiguous(), x, x, group, 0.0)
        yield (*args, False, False), x.float() @ deq.t(), f"group {group}"
    gw = torch.linspace(0.5, 1.5, x.shape[1], device=dev).to(x.dtype)
    r = torch.linspace(-1, 1, x.shape[0] * 37, device=dev).reshape(-1, 37).to(x.dtype)
    xf = x.float() * 40  # (a residual stream far from unit scale: the norm brings it back)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * gw.float()
    args = (xf.to(x.dtype), pack_int4_planar(q), s.to(x.dtype).contiguous(), gw, r, 256, 1e-5)
    yield (*args, True, True), normed @ deq.t() + r.float(), "norm and residual"
    # massive activations (a down projection's input can carry a few in the thousands): beyond
    # what the f16 sums of raw products hold, so the block stages the row scaled down
    xm = x.clone()
    xm[:, 5], xm[0, 300] = 30000.0, -60000.0
    args = (xm, pack_int4_planar(q), s.to(x.dtype).contiguous(), gw, r, 256, 0.0)
    yield (*args, False, True), xm.float() @ deq.t() + r.float(), "massive activations"


def _cuda_gemv_here(x: torch.Tensor, w: torch.Tensor) -> bool:
    # a dict lookup inside a compiled step: whether it was built here is decided eagerly
    return (
        GEMV_CUDA
        and x.device.type == "cuda"
        and not _INTERPRET
        and cuda_gemv.supports(x, w)  # (first: a bf16 layer's step never reads the build state)
        and cuda_gemv.ready(x.device.index or 0)
        and (not GEMV_PICK or _CUDA_PICKED.get(_pick_key("wo8", w, w.dtype, x), True))
    )


def _pick_key(kind: str, w: torch.Tensor, what, x: torch.Tensor) -> tuple:
    # (int4's K is its packed width: one key per layout, which is what the kernels read)
    return (kind, w.shape[0], w.shape[1], what, x.dtype, x.device.index or 0)


def _pick_one_row(
    kind: str, weights: tuple[torch.Tensor, ...], what, dtype: torch.dtype, cuda, triton
) -> None:
    """Decide, once per shape and eagerly (layer construction, outside any compiled step),
    whether the CUDA kernel `cuda(x, *weights)` or the Triton one `triton(x, *weights)` runs
    this shape's one-row GEMV (`GEMV_PICK`), on a random activation row of `dtype`: five
    rounds interleaved, medians, each a single launch after an L2 flush (Triton's `do_bench`)
    or, with `GEMV_PICK_REPLAY`, launches back to back in a CUDA graph (`_replayed_ms`)."""
    w = weights[0]
    k = w.shape[1] * (8 if kind == "int4" else 1)
    g = torch.Generator(device=w.device).manual_seed(0)  # (the global generator is the user's)
    x = torch.randn(1, k, device=w.device, dtype=dtype, generator=g)
    key = _pick_key(kind, w, what, x)
    if not GEMV_PICK or key in _CUDA_PICKED:
        return
    fns = {"cuda": cuda, "triton": triton}
    if GEMV_PICK_REPLAY:
        copies = _weight_copies(weights)
        graphs = {name: _replay_graph(fn, x, copies) for name, fn in fns.items()}
        timers = {name: functools.partial(_replayed_ms, *graphs[name]) for name in fns}
    else:
        timers = {name: functools.partial(_launched_ms, fn, x, weights) for name, fn in fns.items()}
    times: dict[str, list[float]] = {"cuda": [], "triton": []}
    for _ in range(5):
        for name, timer in timers.items():
            times[name].append(timer())
    t_cuda, t_triton = (sorted(t)[2] for t in times.values())
    _CUDA_PICKED[key] = t_cuda <= t_triton * (1 + GEMV_PICK_MARGIN)
    _PICK_TIMES[key] = (t_cuda, t_triton)
    log.info(
        "one-row GEMV %s: CUDA %.1f us, Triton %.1f us: %s",
        key[:5],
        1e3 * t_cuda,
        1e3 * t_triton,
        "CUDA" if _CUDA_PICKED[key] else "Triton",
    )


def _weight_copies(weights: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, ...]]:
    """`weights` and enough copies of them that cycling through all of them reads twice the
    GPU's L2 cache: each launch then reads its weights from DRAM, as a decode step does (one
    layer's weights are long evicted by the time the next token reaches them)."""
    size = sum(t.numel() * t.element_size() for t in weights)
    l2 = torch.cuda.get_device_properties(weights[0].device).L2_cache_size
    n = min(16, max(2, -(-2 * l2 // size)))
    return [weights] + [tuple(t.clone() for t in weights) for _ in range(n - 1)]


def _replay_graph(fn, x: torch.Tensor, copies: list) -> tuple[torch.cuda.CUDAGraph, int]:
    """A CUDA graph of `fn(x, *ws)` launched back to back over the weight copies (at least 24
    launches), and its launch count. Each copy runs once eagerly first: the kernels' tuning
    and compiles happen outside the capture, as they do before a compiled step's capture."""
    for ws in copies:
        fn(x, *ws)
    torch.cuda.synchronize(x.device)
    calls = len(copies) * -(-24 // len(copies))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream(x.device)
    with torch.cuda.graph(graph, stream=stream):
        for i in range(calls):
            fn(x, *copies[i % len(copies)])
    graph.replay()  # (the first replay uploads the graph)
    torch.cuda.synchronize(x.device)
    return graph, calls


def _replayed_ms(graph: torch.cuda.CUDAGraph, calls: int) -> float:
    """Milliseconds per launch over three replays of `graph` (`_replay_graph`): the kernel as
    a CUDA-graph replay sees it, each launch right after the last and reading its weights
    from DRAM, which is how the compiled step runs it. (A single launch timed after an L2
    flush, as Triton's `do_bench` times, ranked the kernels otherwise on some shapes:
    docs/benchmarks.md.)"""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (3 * calls)


def gemv_picks() -> list[dict]:
    """Every per-shape pick made in this process (`GEMV_PICK`), for benchmark records: the
    kernel family, weight shape (int4: packed width), the CUDA and Triton times (us) and which
    kernel the shape keeps."""
    return [
        {
            "kind": key[0],
            "shape": [key[1], key[2]],
            "what": str(key[3]),
            "cuda_us": 1e3 * _PICK_TIMES[key][0],
            "triton_us": 1e3 * _PICK_TIMES[key][1],
            "picked": "cuda" if picked else "triton",
        }
        for key, picked in _CUDA_PICKED.items()
        if key in _PICK_TIMES
    ]


def _launched_ms(fn, x: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> float:
    """`fn(x, *weights)`'s median time in ms, single launches after an L2 flush (Triton's
    `do_bench`): the pick's default timing."""
    from triton.testing import do_bench

    return do_bench(lambda: fn(x, *weights), warmup=5, rep=20, return_mode="median")


def _pick_wo8(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
    """`_pick_one_row` for a 1-byte layer's weights, where the CUDA GEMV runs."""
    x0 = torch.empty(1, w.shape[1], device=w.device, dtype=dtype)
    if not (GEMV_CUDA and GEMV_PICK and _cuda_gemv_here(x0, w)):
        return
    s = scale.reshape(-1)

    # (each as the step launches it: a programmatic dependent where `GEMV_PDL` is on; the
    # shape is not in the table yet, so `cuda=True` routes to the CUDA kernel)
    def cuda(x, w, s):
        return wo_mm(x, w, s, "gemv", cuda=True)

    def triton(x, w, s):
        return wo_mm(x, w, s, "gemv", cuda=False)

    _pick_one_row("wo8", (w, s), w.dtype, dtype, cuda, triton)


def _pick_int4(packed, scale, zero, group: int, dtype: torch.dtype) -> None:
    """`_pick_one_row` for an int4 layer in the Triton layout, where the CUDA int4 GEMV runs."""
    x0 = torch.empty(1, packed.shape[1] * 8, device=packed.device, dtype=dtype)
    if not (INT4_GEMV_CUDA and GEMV_PICK and _int4_cuda_here(x0, packed, group, zero)):
        return

    def cuda(x, packed, scale):  # (as `_pick_wo8`'s)
        return int4_mm(x, packed, scale, zero, group, "gemv", cuda=True)

    counters = gemv_counters(packed.shape[0], 1, packed.device)  # (as a layer keeps its own)

    def triton(x, packed, scale):
        return int4_mm(x, packed, scale, zero, group, "gemv", counters, cuda=False)

    _pick_one_row("int4", (packed, scale), group, dtype, cuda, triton)


def _gemv(
    x, w, scale, r, eps: float, n: int, k: int, flags: dict, pdl: bool, ahead: bool
) -> torch.Tensor:
    """Launch `triton_kernels.wo8_gemv` (`wo_mm`'s arguments; `r` the residual or None), as a
    programmatic dependent with `pdl`, through `wo8_gemv_ahead` with `ahead`."""
    import triton

    m = x.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)

    def grid(meta):
        return (triton.cdiv(n, meta["BLOCK_N"]), m)

    # (PDL always given: Inductor, which traces the plain launch, passes no constexpr defaults)
    opts = {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}
    r = y if r is None else r  # (unread without RESID)
    kernel = _kernel("wo8_gemv_ahead" if ahead else "wo8_gemv")
    launch(kernel, grid, x, w, scale, y, r, eps, n, k, **flags, **opts)
    return y


# An opaque operator, not a Triton kernel that the compiled step traces: Inductor recompiles a
# traced user kernel from its own metadata, which has no launch attribute, so only a launch
# it cannot see keeps `launch_pdl` (CUDA graphs capture it as a programmatic edge).
@torch.library.custom_op("llmopt::wo8_gemv_pdl", mutates_args=())
def _wo8_gemv_pdl(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    r: torch.Tensor,
    eps: float,
    n: int,
    k: int,
    words: bool,
    gated: bool,
    even: bool,
    norm: bool,
    resid: bool,
    f16: bool,
    ahead: bool,
) -> torch.Tensor:
    """`wo_mm`'s GEMV with `GEMV_PDL`; `r`: the residual under `resid`, else any tensor."""
    flags = {"WORDS": words, "GATED": gated, "EVEN": even, "NORM": norm, "RESID": resid}
    flags["F16"] = f16
    return _gemv(x, w, scale, r if resid else None, eps, n, k, flags, pdl=True, ahead=ahead)


@_wo8_gemv_pdl.register_fake
def _(x, w, scale, r, eps, n, k, words, gated, even, norm, resid, f16, ahead):
    return x.new_empty(x.shape[0], n)


def silu_down(down: nn.Module, gu: torch.Tensor) -> torch.Tensor | None:
    """`down(silu(gate) * up)` for a gate/up projection's output `gu` (..., 2I) in one kernel:
    the FP8 GEMV computes each activation as it reads it, so the SiLU x up kernel and its round
    trip through memory are gone (one kernel per layer per decode step). Applies where
    `FUSE_SILU` is on, `down` is an FP8 layer on the Triton kernels, and there is one
    activation row with the GEMV chosen for it; otherwise None (the caller runs both ops).

    FP8 only: on the H200 the GEMV with the SiLU inside took 2.2 us more than without for FP8
    weights and 4.6 us more for int8, whose GEMV spends its integer units turning bytes into
    floats (`benchmarks/linear_kernels.py --gated`, docs/benchmarks.md): each program recomputes
    the SiLU of the whole activation row. `wo_mm(gated=True)` takes either format."""
    if not (FUSE_SILU and isinstance(down, Fp8Linear) and down.triton_kernel):
        return None
    if gu.numel() != gu.shape[-1] or WO8_KERNEL not in ("auto", "gemv"):
        return None
    y = wo_mm(gu.reshape(1, -1), down.weight, down.scale, kernel="gemv", gated=True)
    return down._finish(y, gu.shape)


def _gemv_row(lin: nn.Module, x: torch.Tensor) -> bool:
    # one activation row, an int8/FP8/dense-GEMV layer on the Triton kernels, the GEMV chosen
    return (
        FUSE_NORM
        and isinstance(lin, (Int8Linear, Fp8Linear, DenseLinear))
        and lin.triton_kernel
        and lin.bias is None
        and x.numel() == x.shape[-1]
        and WO8_KERNEL in ("auto", "gemv")
    )


def _int4_row(lin: nn.Module, x: torch.Tensor) -> bool:
    # one activation row, an int4 layer on the Triton layout, its one-row GEMV chosen
    return (
        FUSE_NORM
        and isinstance(lin, Int4Linear)
        and lin.triton_kernel
        and lin.bias is None
        and x.numel() == x.shape[-1]
        and INT4_ONE_ROW == "gemv"
    )


def norm_linear(lin: nn.Module, x: torch.Tensor, norm: nn.Module) -> torch.Tensor | None:
    """`lin(norm(x))` in one kernel, `norm` an RMSNorm (`weight`, `eps`, `gemma`, `folded`):
    the GEMV normalizes the row it reads. Applies where `FUSE_NORM` is on and x is one row, for
    an int8/FP8 layer or a `DenseLinear` on the Triton kernels whose columns hold the norm's
    weight (`norm.folded`, `weights.fold_norms_`), and for an int4 layer on the Triton layout
    with the norm unfolded (the GEMV multiplies x by the weight; not Gemma's 1 + w);
    otherwise None (the caller runs the norm and the layer)."""
    if norm.folded and _gemv_row(lin, x):
        y = wo_mm(x.reshape(1, -1), lin.weight, _gemv_scale(lin), kernel="gemv", norm_eps=norm.eps)
    elif not norm.folded and not norm.gemma and _int4_row(lin, x):
        y = _int4_layer_gemv(lin, x, norm=(norm.weight, norm.eps))
    else:
        return None
    return y.reshape(*x.shape[:-1], lin.out_features)


def linear_add(lin: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor | None:
    """`residual + lin(x)` in one kernel (the add in the GEMV's epilogue), for one row of x and
    the layers `norm_linear` takes (folded or not); otherwise None."""
    if _gemv_row(lin, x):
        y = wo_mm(x.reshape(1, -1), lin.weight, _gemv_scale(lin), kernel="gemv", residual=residual)
    elif _int4_row(lin, x):
        y = _int4_layer_gemv(lin, x, residual=residual)
    else:
        return None
    return y.reshape(*x.shape[:-1], lin.out_features)


def _int4_layer_gemv(lin: nn.Module, x: torch.Tensor, **fused) -> torch.Tensor:
    x2 = x.reshape(1, -1)
    return int4_mm(x2, lin.weight, lin.scale, lin.zero, lin.group, "gemv", lin.counters, **fused)


def _gemv_scale(lin: nn.Module) -> torch.Tensor:
    return lin.scale_f if isinstance(lin, Int8Linear) else lin.scale


def pack_int4_planar(q: torch.Tensor) -> torch.Tensor:
    """(N, K) signed int4 codes (-8..7) -> (N, KP / 8) int32, KP = K rounded up to 256: in each
    tile of 256 codes, nibble i of word j holds the code of k = 32 i + j (two's complement), so
    one nibble of 32 consecutive words is a contiguous 32-wide slice of K (the layout
    `triton_kernels.int4_dot` reads). Padding codes are 0.

    >>> q = torch.arange(256).reshape(1, 256) % 16 - 8
    >>> p = pack_int4_planar(q)
    >>> p.shape, hex(p[0, 0].item() & 0xFFFFFFFF)   # codes of k = 0, 32, ..., 224: all -8
    (torch.Size([1, 32]), '0x88888888')
    >>> torch.equal(unpack_int4_planar(p, 256), q)
    True
    """
    n, k = q.shape
    kp = -(-k // 256) * 256
    u = torch.zeros(n, kp, dtype=torch.int64, device=q.device)
    u[:, :k] = q.to(torch.int64) & 0xF
    # (n, tiles, 8 nibbles, 32 words) -> words (n, tiles, 32), nibble i shifted by 4 i
    u = u.reshape(n, kp // 256, 8, 32) << (4 * torch.arange(8, device=q.device))[:, None]
    v = u.sum(2).reshape(n, kp // 8)
    return torch.where(v >= 1 << 31, v - (1 << 32), v).to(torch.int32).contiguous()


def unpack_int4_planar(p: torch.Tensor, k: int) -> torch.Tensor:
    """The inverse of `pack_int4_planar`: (N, KP / 8) int32 -> (N, k) signed codes (int32)."""
    n = p.shape[0]
    shifts = 4 * torch.arange(8, device=p.device, dtype=torch.int32)
    u = (p.reshape(n, -1, 1, 32) >> shifts[:, None]) & 0xF  # (n, tiles, 8, 32)
    u = torch.where(u >= 8, u - 16, u).reshape(n, -1)
    return u[:, :k]


def int4_mm(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    group: int,
    kernel: str | None = None,
    counters: torch.Tensor | None = None,
    half: bool | None = None,
    cuda: bool = True,
    norm: tuple[torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """y (M, N) = x (M, K) @ W^T, W[n, k] = q[n, k] * scale[n, k // group] (+ zero[n, ...]),
    q the codes `pack_int4_planar` packed into `packed` (N, KP / 8); any row count. `kernel`:
    "dot" (`triton_kernels.int4_dot`), "gemv" (`int4_gemv`, one program row per activation
    row) or None for `INT4_ONE_ROW` at one row and the dot kernel otherwise. `counters`: the
    GEMV's K-split counters (`gemv_counters`, at least M x cdiv(N, 8)); made here when not
    given or too few. `half`: the GEMV's products in half precision (None: `INT4_GEMV_HALF`).
    `cuda`: the GEMV may be the CUDA C++ one (`INT4_GEMV_CUDA`); False keeps Triton's.
    `norm` (weight (K,), eps): x is an RMSNorm's input, normalized by the GEMV as it reads it
    (`norm_linear`); `residual` (M, N): added to the output in the GEMV's epilogue
    (`linear_add`). Both GEMV only (Triton's or the CUDA one)."""
    import triton

    m, k = x.shape
    n = packed.shape[0]
    x = x.contiguous()
    z = scale if zero is None else zero  # an unread stand-in when there is no zero
    kernel = kernel or (INT4_ONE_ROW if m == 1 else "dot")
    fused = norm is not None or residual is not None
    if fused and kernel != "gemv":
        raise ValueError(f"a normalized or residual input needs the GEMV, not {kernel!r}")
    shape = {"K": k, "KP": packed.shape[1] * 8, "G": group, "HAS_ZERO": zero is not None}
    if kernel == "gemv":
        g, eps = (scale, 0.0) if norm is None else (norm[0], float(norm[1]))  # (unread if no norm)
        r = x if residual is None else residual.reshape(m, n).contiguous()
        if cuda and _int4_cuda_here(x, packed, group, zero):
            pdl = GEMV_PDL and pdl_supported(x.device.index or 0)
            if norm is not None:
                g = g.to(x.dtype)
            fused_args = (norm is not None, residual is not None, pdl)
            configs = (INT4_GEMV_TEAMS, INT4_GEMV_EARLY, INT4_GEMV_VARIANTS, INT4_GEMV_FIT)
            return cuda_gemv.int4_gemv(x, packed, scale, g, r, group, eps, *fused_args, *configs)
        if counters is None or counters.numel() < m * -(-n // 8):
            counters = gemv_counters(n, m, x.device)
        flags = {"even_n": n % INT4_GEMV_TILE_N == 0, "asm": not _INTERPRET}
        flags["half"] = INT4_GEMV_HALF if half is None else half
        flags |= {"norm": norm is not None, "resid": residual is not None}
        args = (
            x,
            packed,
            scale,
            z,
            counters,
            g,
            r,
            eps,
            n,
            k,
            shape["KP"],
            group,
            zero is not None,
        )
        if GEMV_PDL and not _INTERPRET and pdl_supported(x.device.index or 0):
            return torch.ops.llmopt.int4_gemv_pdl(*args, **flags)
        return _int4_gemv(*args, **flags, pdl=False)

    y = torch.empty(m, n, device=x.device, dtype=x.dtype)

    def grid(meta):
        return (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, meta["BLOCK_M"]))

    name = "int4_dot" if m <= TRITON_M else "int4_dot_prompt"
    launch(_kernel(name), grid, x, packed, scale, z, y, m, n, _m_bucket(m), **shape)
    return y


def _int4_gemv(
    x,
    packed,
    scale,
    z,
    counters,
    g,
    r,
    eps: float,
    n: int,
    k: int,
    kp: int,
    group: int,
    has_zero: bool,
    even_n: bool,
    asm: bool,
    half: bool,
    norm: bool,
    resid: bool,
    pdl: bool,
) -> torch.Tensor:
    """Launch `triton_kernels.int4_gemv` (`int4_mm`'s arguments; `z`, `g`, `r` stand-ins where
    there is no zero, norm or residual), as a programmatic dependent with `pdl`."""
    import triton

    m = x.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)

    def grid(meta):
        return (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"], m)

    ws = torch.empty(SPLIT_K_MAX, m, n, device=x.device, dtype=torch.float32)
    # NORM: each split's sum of x^2 per program along N (BLOCK_N >= 8)
    sq = (
        torch.empty(SPLIT_K_MAX, m, -(-n // 8), device=x.device, dtype=torch.float32)
        if norm
        else ws
    )
    flags = {"EVEN_N": even_n, "ASM": asm, "HALF": half, "NORM": norm, "RESID": resid}
    shape = {"K": k, "KP": kp, "G": group, "HAS_ZERO": has_zero}
    # (PDL always given: Inductor, which traces the plain launch, passes no constexpr defaults)
    opts = {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}
    args = (x, packed, scale, z, y, ws, counters, g, r, sq, eps, n)
    launch(_kernel("int4_gemv"), grid, *args, **shape, **flags, **opts)
    return y


# Opaque to Inductor, as `_wo8_gemv_pdl` (which says why). The K-split counters the kernel
# takes and gives back are left as they were (each count returns to 0): no mutated arguments.
@torch.library.custom_op("llmopt::int4_gemv_pdl", mutates_args=())
def _int4_gemv_pdl(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    z: torch.Tensor,
    counters: torch.Tensor,
    g: torch.Tensor,
    r: torch.Tensor,
    eps: float,
    n: int,
    k: int,
    kp: int,
    group: int,
    has_zero: bool,
    even_n: bool,
    asm: bool,
    half: bool,
    norm: bool,
    resid: bool,
) -> torch.Tensor:
    """`int4_mm`'s GEMV with `GEMV_PDL`."""
    args = (x, packed, scale, z, counters, g, r, eps, n, k, kp, group, has_zero)
    return _int4_gemv(*args, even_n, asm, half, norm, resid, pdl=True)


@_int4_gemv_pdl.register_fake
def _(
    x,
    packed,
    scale,
    z,
    counters,
    g,
    r,
    eps,
    n,
    k,
    kp,
    group,
    has_zero,
    even_n,
    asm,
    half,
    norm,
    resid,
):
    return x.new_empty(x.shape[0], n)


def _int4_cuda_here(x: torch.Tensor, packed: torch.Tensor, group: int, zero) -> bool:
    # as `_cuda_gemv_here`: a dict lookup inside a compiled step
    return (
        INT4_GEMV_CUDA
        and x.device.type == "cuda"
        and not _INTERPRET
        and cuda_gemv.int4_supports(x, packed, group, zero)
        and cuda_gemv.int4_ready(x.device.index or 0)
        and (not GEMV_PICK or _CUDA_PICKED.get(_pick_key("int4", packed, group, x), True))
    )


def int4_triton_supported(k: int, group: int) -> bool:
    """Shapes the Triton int4 kernel takes: a scale group that holds whole 32-wide slices of a
    256-code tile (32, 64, 128) or whole tiles (multiples of 256), and divides K."""
    return (group in (32, 64, 128) or group % 256 == 0) and k % group == 0


@functools.cache
def _triton_int4_available() -> bool:
    """The int4 kernels compile and are right on this GPU (decode rows and a prompt)."""

    def check():
        _kernel("int4_dot"), _kernel("int4_dot_prompt"), _kernel("int4_gemv")
        g = torch.Generator(device="cuda").manual_seed(0)
        w = torch.randn(96, 512, device="cuda", generator=g)
        q, s = quantize_int4(w, 128)
        packed = pack_int4_planar(q)
        deq = (q.float().reshape(96, -1, 128) * s[..., None]).reshape(96, 512)
        for m, kern in ((1, "gemv"), (2, "dot"), (24, "dot")):
            x = torch.randn(m, 512, device="cuda", generator=g, dtype=torch.bfloat16)
            got = int4_mm(x, packed, s.to(torch.bfloat16).contiguous(), None, 128, kern)
            _assert_close(got, x.float() @ deq.t(), f"int4 {kern} at {m} rows")

    return _check("int4", check)
