"""Quantization primitives: weight scales, quantize/dequantize, fake-quantized activations.

The arithmetic matches compressed-tensors' own (`x / scale (+ zero point)`, clamp, round to
nearest even for int, cast for FP8), so the integers we compute are exactly the ones its
compressors write and vLLM / transformers read back.

Symmetric (`WeightSpec.symmetric`, the default; zero point 0, as the W4A16 / W8A8 / FP8 presets of
compressed-tensors): scale = max|w| / ((qmax - qmin) / 2), i.e. max|w| / 7.5 at 4 bits and
/ 127.5 at 8 (compressed-tensors' convention: every code used), codes in [-2^(b-1), 2^(b-1)-1],
w ~= q * scale.
Asymmetric (int only; compressed-tensors' `symmetric=False`, its `W4A16_ASYM` preset, what AutoAWQ
and GPTQ default to): the range [min(w, 0), max(w, 0)] of each channel/group is mapped onto all
2^b codes: scale = (max - min) / (2^b - 1), zero point z = round(qmin - min / scale) clamped to the
code range, codes q = clamp(round(w / scale + z)), w ~= (q - z) * scale. Codes and zero points are
signed int8 here ([-8, 7] at 4 bits), as compressed-tensors computes them; its pack-quantized
format stores both + 2^(b-1), i.e. the unsigned 0..15 codes and zero points of AutoAWQ/GPTQ.

Shapes: a Linear weight is (out, in). Scales and zero points: "channel" (out, 1); "group"
(out, in // g); "tensor" (1,).

Scale observers (`WeightSpec.observer`): "absmax" (the scale above) or "mse" (the scale,
among absmax x {1.00, 0.99, ..., 0.80}, that gives each channel/group the smallest squared
rounding error; the grid of llm-compressor's `mse` observer; asymmetric: min and max both
shrunk by the same factor). Either way the chosen scale (and zero point) is the stored one and the
codes are `x / scale (+ z)` rounded, so the deployed kernels compute the same thing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "WeightSpec",
    "grouped",
    "FP8_MAX",
    "weight_scale",
    "mse_weight_scale",
    "choose_weight_scale",
    "weight_qparams",
    "choose_weight_qparams",
    "quantize_weight",
    "dequantize_weight",
    "expand_to_weight",
    "fake_quant_weight",
    "fake_quant_activation",
    "sqnr_db",
    "sqnr_db_over",
]

FP8_MAX = 448.0  # largest finite float8_e4m3fn
_EPS = 1e-12


@dataclass(frozen=True)
class WeightSpec:
    """How one Linear's weight is quantized (resolved from a Recipe plus overrides)."""

    bits: int = 8
    type: str = "int"  # "int" | "float" (FP8 E4M3)
    granularity: str = "channel"  # "channel" | "group" | "tensor"
    group_size: int | None = None
    scale_dtype: torch.dtype = torch.float32
    observer: str = "absmax"  # "absmax" | "mse" (see the module docstring)
    symmetric: bool = True  # False: int codes with a zero point per channel/group

    def __post_init__(self) -> None:
        assert self.symmetric or self.type == "int", "asymmetric weights are int only"

    @property
    def qmax(self) -> float:
        return FP8_MAX if self.type == "float" else float(2 ** (self.bits - 1) - 1)

    @property
    def qmin(self) -> float:
        # Symmetric int: the code range is [-2^(b-1), 2^(b-1)-1], all of it used (see _sym_scale).
        return -FP8_MAX if self.type == "float" else float(-(2 ** (self.bits - 1)))


def grouped(w: torch.Tensor, spec: WeightSpec) -> torch.Tensor:
    """`w` (out, in) viewed as the groups one scale covers: (out, G, g) per group, (out, 1, in)
    per channel, (1, 1, n) per tensor. Scales, zero points and the algorithms' weight terms are
    all computed over this view, so they agree on what a group is."""
    out, inp = w.shape
    if spec.granularity == "group":
        assert inp % spec.group_size == 0, f"group {spec.group_size} does not divide {inp}"
        return w.reshape(out, inp // spec.group_size, spec.group_size)  # (out, G, g)
    if spec.granularity == "channel":
        return w.reshape(out, 1, inp)
    return w.reshape(1, 1, -1)


def _sym_scale(amax: torch.Tensor, spec: WeightSpec, factor: float = 1.0) -> torch.Tensor:
    # compressed-tensors' (and llm-compressor's) symmetric convention: absmax / ((qmax - qmin) / 2),
    # so int4 uses all 16 codes (absmax / 7.5; +absmax rounds to 7, a half-step clip). Against
    # absmax / qmax (15 codes): +0.4-0.5 dB weight SQNR at 4 bits on Gaussian/Laplace groups,
    # and SmolLM2's RTN g64 +45.2% -> +28.1% perplexity; at 8 bits the two are within 0.03 dB.
    return (amax * factor / ((spec.qmax - spec.qmin) / 2)).clamp(min=_EPS).to(spec.scale_dtype)


def _asym_qparams(
    mn: torch.Tensor, mx: torch.Tensor, spec: WeightSpec, factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    # compressed-tensors' calculate_qparams for symmetric=False: the range always holds 0, the
    # zero point is rounded into the code range (int8). Computed from the stored (rounded) scale.
    mn = (mn * factor).clamp(max=0.0)
    mx = (mx * factor).clamp(min=0.0)
    scale = ((mx - mn) / (spec.qmax - spec.qmin)).clamp(min=_EPS).to(spec.scale_dtype)
    zp = torch.round(spec.qmin - mn / scale.float()).clamp(spec.qmin, spec.qmax)
    return scale, zp.to(torch.int8)


def _layout(t: torch.Tensor, spec: WeightSpec) -> torch.Tensor:
    return t.reshape(1) if spec.granularity == "tensor" else t  # channel (out, 1); group (out, G)


def weight_qparams(w: torch.Tensor, spec: WeightSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scale, zero point) of `w` (out, in) from its range: absmax / ((qmax - qmin) / 2) for
    symmetric specs (zero point None), min/max for asymmetric ones (int8 zero points in the code
    range). The scale is rounded to `spec.scale_dtype` (what is stored).

    >>> s, z = weight_qparams(torch.tensor([[-1.0, 2.0, 0.5]]), WeightSpec(4, symmetric=False))
    >>> s.tolist(), z.tolist()  # 3 / 15 per code; -1 -> code -8, so 0 -> -8 + 5 = -3
    ([[0.20000000298023224]], [[-3]])
    """
    g = grouped(w.detach().float(), spec)  # (out, G, g) or (1, 1, n)
    if spec.symmetric:
        return _layout(_sym_scale(g.abs().amax(dim=-1), spec), spec), None
    s, z = _asym_qparams(g.amin(dim=-1), g.amax(dim=-1), spec)
    return _layout(s, spec), _layout(z, spec)


def weight_scale(w: torch.Tensor, spec: WeightSpec) -> torch.Tensor:
    """Absmax scale of `w` (out, in) for a symmetric `spec`, rounded to `spec.scale_dtype`.

    >>> weight_scale(torch.tensor([[1.0, -2.0], [0.5, 0.25]]), WeightSpec()).flatten().tolist()
    [0.01568627543747425, 0.003921568859368563]
    """
    assert spec.symmetric, "asymmetric specs have a zero point too: use weight_qparams"
    return weight_qparams(w, spec)[0]


MSE_SHRINK = 0.20  # largest fraction of absmax the mse observer clips (llm-compressor: maxshrink)
MSE_GRID = 100  # candidates are absmax * (1 - i / MSE_GRID), i = 0 .. MSE_SHRINK * MSE_GRID


def mse_weight_qparams(
    w: torch.Tensor, spec: WeightSpec, *, shrink: float = MSE_SHRINK, grid: int = MSE_GRID
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per channel/group (scale, zero point) minimizing the squared rounding error of `w`.

    Candidates are the range (absmax, or min and max for asymmetric specs) times 1, 1 - 1/grid,
    ..., 1 - shrink (the full range first, kept on ties), each scale rounded to
    `spec.scale_dtype` before its error is measured, so the result never has a larger error
    than `weight_qparams` and is exactly what is stored. Same layout as `weight_qparams`.
    """
    g = grouped(w.detach().float(), spec)  # (O, G, g)
    amax = g.abs().amax(dim=-1)  # (O, G)
    mn, mx = g.amin(dim=-1), g.amax(dim=-1)
    best_err, best, best_z = None, None, None
    for i in range(int(round(shrink * grid)) + 1):
        f = 1.0 - i / grid
        if spec.symmetric:
            s, z = _sym_scale(amax, spec, f), None
        else:
            s, z = _asym_qparams(mn, mx, spec, f)
        sf = s.float().unsqueeze(-1)  # (O, G, 1)
        zf = 0.0 if z is None else z.float().unsqueeze(-1)
        x = (g / sf + zf).clamp(spec.qmin, spec.qmax)
        q = x.to(torch.float8_e4m3fn).float() if spec.type == "float" else torch.round(x)
        err = ((q - zf) * sf - g).pow(2).sum(dim=-1)  # (O, G)
        if best is None:
            best_err, best, best_z = err, s, z
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = torch.where(better, s, best)
            if z is not None:
                best_z = torch.where(better, z, best_z)
    return _layout(best, spec), None if best_z is None else _layout(best_z, spec)


def mse_weight_scale(
    w: torch.Tensor, spec: WeightSpec, *, shrink: float = MSE_SHRINK, grid: int = MSE_GRID
) -> torch.Tensor:
    """The scale of `mse_weight_qparams` for a symmetric `spec`."""
    assert spec.symmetric, "asymmetric specs have a zero point too: use mse_weight_qparams"
    return mse_weight_qparams(w, spec, shrink=shrink, grid=grid)[0]


def choose_weight_qparams(
    w: torch.Tensor, spec: WeightSpec
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The (scale, zero point or None) that `spec.observer` picks for `w` (what RTN stores)."""
    if spec.observer == "mse":
        return mse_weight_qparams(w, spec)
    return weight_qparams(w, spec)


def choose_weight_scale(w: torch.Tensor, spec: WeightSpec) -> torch.Tensor:
    """The scale `spec.observer` picks for `w` under a symmetric `spec`."""
    assert spec.symmetric, "asymmetric specs have a zero point too: use choose_weight_qparams"
    return choose_weight_qparams(w, spec)[0]


def expand_to_weight(scale: torch.Tensor, w: torch.Tensor, spec: WeightSpec) -> torch.Tensor:
    """A scale (or zero point) as float, in a shape that broadcasts against w's (out, in)."""
    if spec.granularity == "group":
        return scale.float().repeat_interleave(spec.group_size, dim=1)
    return scale.float().reshape(-1, 1) if spec.granularity == "channel" else scale.float()


def _check_zero_point(zero_point: torch.Tensor | None, spec: WeightSpec) -> None:
    assert (zero_point is None) == spec.symmetric, (
        "a zero point goes with an asymmetric spec, and only with one"
    )


def quantize_weight(
    w: torch.Tensor, scale: torch.Tensor, spec: WeightSpec, zero_point: torch.Tensor | None = None
) -> torch.Tensor:
    """Codes of `w`: int8 tensor holding the b-bit integers, or float8_e4m3fn."""
    _check_zero_point(zero_point, spec)
    x = w.detach().float() / expand_to_weight(scale, w, spec)
    if zero_point is not None:
        x = x + expand_to_weight(zero_point, w, spec)
    x = x.clamp(spec.qmin, spec.qmax)
    if spec.type == "float":
        return x.to(torch.float8_e4m3fn)
    return torch.round(x).to(torch.int8)


def dequantize_weight(
    q: torch.Tensor, scale: torch.Tensor, spec: WeightSpec, zero_point: torch.Tensor | None = None
) -> torch.Tensor:
    """(q - zero point) * scale in float32 (compressed-tensors' dequantize)."""
    _check_zero_point(zero_point, spec)
    x = q.float()
    if zero_point is not None:
        x = x - expand_to_weight(zero_point, q, spec)
    return x * expand_to_weight(scale, q, spec)


def fake_quant_weight(w: torch.Tensor, spec: WeightSpec) -> torch.Tensor:
    """Quantize then dequantize `w` with RTN and `spec.observer`'s scale (and zero point, for
    asymmetric specs); same dtype as `w`."""
    s, z = choose_weight_qparams(w, spec)
    return dequantize_weight(quantize_weight(w, s, spec, z), s, spec, z).to(w.dtype)


def fake_quant_activation(
    x: torch.Tensor, mode: str, static_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Fake-quantize activations x (..., in) the way the deployed kernel will.

    mode: "dynamic-int8" (symmetric per token), "dynamic-fp8" (per token), "static-fp8" (one
    calibrated scale for the tensor, `static_scale`).
    """
    xf = x.float()
    if mode == "static-fp8":
        assert static_scale is not None, "static-fp8 needs a calibrated scale"
        # The scale is kept on the host with the layer's other facts; the hook runs wherever the
        # layer is (the GPU during calibration).
        s = static_scale.to(device=xf.device, dtype=torch.float32)
        return ((xf / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s).to(x.dtype)
    # int8: absmax / 127.5 with codes clamped to [-128, 127], compressed-tensors' symmetric
    # convention (what transformers computes when it loads the folder; vLLM's kernel uses 127).
    qmax = 127.5 if mode == "dynamic-int8" else FP8_MAX
    s = (xf.abs().amax(dim=-1, keepdim=True) / qmax).clamp(min=_EPS)  # (..., 1) per token
    if mode == "dynamic-int8":
        q = torch.round(xf / s).clamp(-128, 127)
    else:
        q = (xf / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return (q * s).to(x.dtype)


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (higher is better; inf when identical).

    >>> round(sqnr_db(torch.ones(4), torch.ones(4) * 1.1), 1)
    20.0
    """
    return sqnr_db_over([reference], [approx])


def sqnr_db_over(references: list[torch.Tensor], approxes: list[torch.Tensor]) -> float:
    """`sqnr_db` of the concatenation of the pairs, computed a pair at a time: an 8B layer's
    outputs over 128 x 2,048 calibration tokens are 2 GiB each in bf16, and concatenating them
    in fp32 held several such copies at once (about 20 GiB of a GPU).

    >>> round(sqnr_db_over([torch.ones(2), torch.ones(2)], [torch.ones(2), torch.ones(2) * 1.1]), 1)
    23.0
    """
    signal, noise = 0.0, 0.0
    for r, a in zip(references, approxes, strict=True):
        ref = r.float()
        signal += float(ref.pow(2).sum())
        noise += float((ref - a.float()).pow(2).sum())
    if noise == 0:
        return float("inf")
    return 10 * math.log10(max(signal, _EPS) / noise)
