"""Quantization primitives: weight scales, quantize/dequantize, fake-quantized activations.

The arithmetic matches compressed-tensors' own (`x / scale`, clamp, round to nearest even for int,
cast for FP8), so the integers we compute are exactly the ones its compressors write and vLLM /
transformers read back. Symmetric only (zero point 0), as the W4A16 / W8A8 / FP8 presets of
compressed-tensors are.

Shapes: a Linear weight is (out, in). Scales: "channel" (out, 1); "group" (out, in // g);
"tensor" (1,).

Scale observers (`WeightSpec.observer`): "absmax" (scale = max|w| / qmax) or "mse" (the scale,
among absmax x {1.00, 0.99, ..., 0.80}, that gives each channel/group the smallest squared
rounding error; the grid of llm-compressor's `mse` observer). Either way the chosen scale is the
stored one and the codes are `x / scale` rounded, so the deployed kernels compute the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "WeightSpec",
    "FP8_MAX",
    "weight_scale",
    "mse_weight_scale",
    "choose_weight_scale",
    "quantize_weight",
    "dequantize_weight",
    "fake_quant_weight",
    "fake_quant_activation",
    "sqnr_db",
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

    @property
    def qmax(self) -> float:
        return FP8_MAX if self.type == "float" else float(2 ** (self.bits - 1) - 1)

    @property
    def qmin(self) -> float:
        # Symmetric int: the code range is [-2^(b-1), 2^(b-1)-1]; scales use qmax so -2^(b-1)
        # is never produced by RTN, but GPTQ's rounding can land on it.
        return -FP8_MAX if self.type == "float" else float(-(2 ** (self.bits - 1)))


def _grouped(w: torch.Tensor, spec: WeightSpec) -> torch.Tensor:
    out, inp = w.shape
    if spec.granularity == "group":
        assert inp % spec.group_size == 0, f"group {spec.group_size} does not divide {inp}"
        return w.reshape(out, inp // spec.group_size, spec.group_size)  # (out, G, g)
    if spec.granularity == "channel":
        return w.reshape(out, 1, inp)
    return w.reshape(1, 1, -1)


def weight_scale(w: torch.Tensor, spec: WeightSpec) -> torch.Tensor:
    """Absmax scale of `w` (out, in) for `spec`, rounded to `spec.scale_dtype` (what is stored).

    >>> weight_scale(torch.tensor([[1.0, -2.0], [0.5, 0.25]]), WeightSpec()).flatten().tolist()
    [0.015748031437397003, 0.003937007859349251]
    """
    amax = _grouped(w.detach().float(), spec).abs().amax(dim=-1)  # (out, G) or (1, 1)
    scale = (amax / spec.qmax).clamp(min=_EPS).to(spec.scale_dtype)
    if spec.granularity == "tensor":
        return scale.reshape(1)
    return scale  # channel: (out, 1); group: (out, G)


MSE_SHRINK = 0.20  # largest fraction of absmax the mse observer clips (llm-compressor: maxshrink)
MSE_GRID = 100  # candidates are absmax * (1 - i / MSE_GRID), i = 0 .. MSE_SHRINK * MSE_GRID


def mse_weight_scale(
    w: torch.Tensor, spec: WeightSpec, *, shrink: float = MSE_SHRINK, grid: int = MSE_GRID
) -> torch.Tensor:
    """Per channel/group scale minimizing the squared rounding error of `w` (out, in).

    Candidates are absmax/qmax times 1, 1 - 1/grid, ..., 1 - shrink (absmax itself first, kept on
    ties), each rounded to `spec.scale_dtype` before its error is measured, so the result never
    has a larger error than `weight_scale` and is exactly what is stored. Same layout as
    `weight_scale`.
    """
    wf = w.detach().float()
    g = _grouped(wf, spec)  # (O, G, g)
    amax = g.abs().amax(dim=-1)  # (O, G)
    best_err, best = None, None
    for i in range(int(round(shrink * grid)) + 1):
        s = (amax * (1.0 - i / grid) / spec.qmax).clamp(min=_EPS).to(spec.scale_dtype)
        sf = s.float().unsqueeze(-1)  # (O, G, 1)
        x = (g / sf).clamp(spec.qmin, spec.qmax)
        q = x.to(torch.float8_e4m3fn).float() if spec.type == "float" else torch.round(x)
        err = (q * sf - g).pow(2).sum(dim=-1)  # (O, G)
        if best is None:
            best_err, best = err, s
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = torch.where(better, s, best)
    if spec.granularity == "tensor":
        return best.reshape(1)
    return best  # channel: (out, 1); group: (out, G)


def choose_weight_scale(w: torch.Tensor, spec: WeightSpec) -> torch.Tensor:
    """The scale `spec.observer` picks for `w` (what RTN stores)."""
    if spec.observer == "mse":
        return mse_weight_scale(w, spec)
    return weight_scale(w, spec)


def _expand(scale: torch.Tensor, w: torch.Tensor, spec: WeightSpec) -> torch.Tensor:
    # scale broadcast to w's (out, in) layout
    if spec.granularity == "group":
        return scale.float().repeat_interleave(spec.group_size, dim=1)
    return scale.float().reshape(-1, 1) if spec.granularity == "channel" else scale.float()


def quantize_weight(w: torch.Tensor, scale: torch.Tensor, spec: WeightSpec) -> torch.Tensor:
    """Codes of `w`: int8 tensor holding the b-bit integers, or float8_e4m3fn."""
    x = (w.detach().float() / _expand(scale, w, spec)).clamp(spec.qmin, spec.qmax)
    if spec.type == "float":
        return x.to(torch.float8_e4m3fn)
    return torch.round(x).to(torch.int8)


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, spec: WeightSpec) -> torch.Tensor:
    return q.float() * _expand(scale, q, spec)


def fake_quant_weight(w: torch.Tensor, spec: WeightSpec) -> torch.Tensor:
    """Quantize then dequantize `w` with RTN and `spec.observer`'s scale (same dtype as `w`)."""
    s = choose_weight_scale(w, spec)
    return dequantize_weight(quantize_weight(w, s, spec), s, spec).to(w.dtype)


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
        s = static_scale.float()
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
    ref = reference.float()
    noise = (ref - approx.float()).pow(2).sum()
    if noise == 0:
        return float("inf")
    return float(10 * torch.log10(ref.pow(2).sum().clamp(min=_EPS) / noise))
