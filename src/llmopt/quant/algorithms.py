"""Weight rounding algorithms on one Linear at a time: RTN, GPTQ, and the AWQ / SmoothQuant scale
searches (per-channel scales folded into the op before the linears, so the float model computes
exactly the same function and only the rounding changes).

Written here rather than taken from llm-compressor: llm-compressor 0.14 pins transformers<=5.17
(we run 5.24) and compressed-tensors==0.19, and pulls in `datasets` and `auto-round`; each
algorithm below is a page of torch.
"""

from __future__ import annotations

import math

import torch

from llmopt.quant.primitives import (
    WeightSpec,
    choose_weight_qparams,
    dequantize_weight,
    expand_to_weight,
    fake_quant_weight,
    grouped,
    quantize_weight,
)

__all__ = ["rtn", "gptq", "awq_search", "awq_clip", "smoothquant_scales"]


QParams = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # codes, scale, zero point


def rtn(w: torch.Tensor, spec: WeightSpec) -> QParams:
    """Round to nearest with the scale (and, asymmetric, zero point) of `spec.observer` (absmax /
    min-max, or mse). Returns (codes, scale, zero point or None when symmetric)."""
    s, z = choose_weight_qparams(w, spec)
    return quantize_weight(w, s, spec, z), s, z


def gptq(
    w: torch.Tensor,
    hessian: torch.Tensor,
    spec: WeightSpec,
    *,
    damp: float = 0.01,
    block: int = 128,
    actorder: bool = True,
) -> QParams:
    """GPTQ (Frantar et al. 2022): quantize columns one at a time, spreading each column's rounding
    error over the not-yet-quantized columns through the inverse Hessian of the layer's inputs.

    Args:
        w: (out, in) float weight.
        hessian: (in, in) sum of x^T x over calibration tokens (any positive scale).
        spec: int weights. Scales (and zero points, asymmetric) are chosen up front from the
            original weights by `spec.observer`, group by group ("static" groups), so the
            layout is the one RTN stores: no g_idx, the same kernels. Each column is rounded
            with its group's scale and zero point: q = clamp(round(w / s + z)), error
            w - (q - z) * s.
        damp: fraction of the mean diagonal added for numerical stability.
        block: columns updated together (a speed setting; the result is the same).
        actorder: visit the columns in decreasing Hessian diagonal (the inputs with the most
            energy first, while most columns are still free to absorb their error), as
            llm-compressor's `actorder: "weight"` / "static" does. On SmolLM2-135M (g64,
            docs/benchmarks.md) it turned GPTQ from barely better than RTN into clearly better;
            False keeps the left-to-right order of the paper.

    Returns:
        (codes (out, in) int8, scale, zero point or None) in the layout `spec` asks for.
    """
    assert spec.type == "int", "GPTQ is for int weights"
    W = w.detach().float().clone()  # (out, in)
    in_f = W.shape[1]
    H = hessian.float().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H += torch.eye(in_f, device=H.device) * damp * torch.mean(torch.diag(H))

    scale, zero = choose_weight_qparams(W, spec)
    # Every column's scale and zero point, (out, in), so the loop below is layout-free.
    S = expand_to_weight(scale, W, spec).expand_as(W)
    Z = torch.zeros_like(S) if zero is None else expand_to_weight(zero, W, spec).expand_as(W)
    perm = torch.argsort(torch.diag(H), descending=True) if actorder else None
    if perm is not None:
        W, S, Z, H = W[:, perm], S[:, perm], Z[:, perm], H[perm][:, perm]

    # Upper Cholesky factor of H^-1: row i holds how column i's error moves the later columns.
    L = torch.linalg.cholesky(H)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)  # (in, in)
    Q = torch.zeros_like(W, dtype=torch.int8)
    for i1 in range(0, in_f, block):
        i2 = min(i1 + block, in_f)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            s, z = S[:, i1 + i : i1 + i + 1], Z[:, i1 + i : i1 + i + 1]
            wcol = W1[:, i : i + 1]
            q = torch.round(wcol / s + z).clamp(spec.qmin, spec.qmax)
            Q[:, i1 + i] = q.flatten().to(torch.int8)
            err = (wcol - (q - z) * s) / Hinv1[i, i]
            W1[:, i:] -= err @ Hinv1[i : i + 1, i:]
            Err1[:, i : i + 1] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    if perm is not None:
        Q = Q[:, torch.argsort(perm)]
    return Q, scale, zero


def awq_search(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    specs: list[WeightSpec],
    *,
    grid: int = 20,
    duo: bool = True,
) -> torch.Tensor:
    """AWQ (Lin et al. 2023) scale search for linears that share one input.

    Salient input channels (large mean |x|) are scaled up before rounding, and the inverse
    scale is folded into the previous op. Picks s = mean|x|^ratio / mean|W|^(1 - ratio)
    (normalized; `duo`, AutoAWQ's and llm-compressor's default, with |W| over each group's
    absmax; `duo=False`: mean|x|^ratio alone) for the ratio in [0, 1) that minimizes the MSE of
    the linears' outputs against the float outputs, each candidate rounded by the quantizer the
    linears will get (`fake_quant_weight` with their spec: symmetric or asymmetric, absmax or
    mse). On SmolLM2 (g64 asymmetric, with clipping) duo scaling took perplexity from +12.5% to
    +11.1% over fp32.

    Args:
        x: (tokens, in) calibration inputs of the linears.
        weights: their (out_k, in) float weights.
        specs: their quantization specs.

    Returns:
        (in,) scales s: use W * s in the linears and x / s as their input.
    """
    x = x.float()
    x_mean = x.abs().mean(0)  # (in,)
    ref = [x @ w.float().T for w in weights]
    w_mean = _awq_weight_mean(weights, specs[0]) if duo else None
    best, best_s = math.inf, torch.ones_like(x_mean)
    for k in range(grid):
        ratio = k / grid
        if w_mean is None:
            s = x_mean.pow(ratio).clamp(min=1e-4)
        else:
            s = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        err = 0.0
        for w, spec, y in zip(weights, specs, ref, strict=True):
            wq = fake_quant_weight(w.float() * s, spec) / s
            err += (x @ wq.T - y).pow(2).mean().item()
        if err < best:
            best, best_s = err, s
    return best_s


def _awq_weight_mean(weights: list[torch.Tensor], spec: WeightSpec) -> torch.Tensor:
    # AutoAWQ's and llm-compressor's "duo scaling" weight term: |W| normalized by each
    # group's absmax (each row's, per channel), averaged over every output row of the linears.
    w = torch.cat([w.detach().float() for w in weights]).abs()  # (sum out, in)
    wg = grouped(w, spec)
    return (wg / (wg.amax(-1, keepdim=True) + 1e-6)).view_as(w).mean(0)


def awq_clip(
    w: torch.Tensor,
    x: torch.Tensor,
    spec: WeightSpec,
    *,
    grid: int = 20,
    max_shrink: float = 0.5,
    tokens: int = 512,
    rows: int = 256,
) -> torch.Tensor:
    """AWQ's weight clipping (AutoAWQ's `auto_clip`): shrink each row-group's range where
    that lowers its rounding error as the inputs see it.

    For every (row, group), tries the range [min, max] x r for r = 1, 1 - 1/grid, ... down to
    1 - max_shrink (symmetric: +-max|w| x r), rounds the clipped group with `spec`, and keeps
    the r with the smallest mean squared error of the group's partial output x_g . w_g over a
    sample of `tokens` input rows. Scales are not stored here: quantize the returned weight with
    RTN and the chosen range becomes its scale (and zero point). AutoAWQ skips the query and key
    projections (their error passes through a softmax, where the partial-output error is a poor
    guide); so does the caller.

    Args:
        w: (out, in) weight, after AWQ's scaling.
        x: (tokens, in) calibration inputs of this linear (after AWQ's scaling).
        spec: an int group or channel spec.
        rows: output rows searched at a time (bounds memory: rows x tokens x groups floats).

    Returns:
        The clipped weight, same shape and dtype as w.
    """
    assert spec.type == "int" and spec.granularity in ("group", "channel"), spec
    out_f, in_f = w.shape
    g = spec.group_size if spec.granularity == "group" else in_f
    x = x.float()[:: max(1, x.shape[0] // tokens)][:tokens].view(-1, in_f // g, g)  # (t, ng, g)
    clipped = w.detach().float().clone().view(out_f, in_f // g, g)
    for r0 in range(0, out_f, rows):
        wg = clipped[r0 : r0 + rows]  # (r, ng, g): a view, updated in place at the end
        ref = torch.einsum("tng,rng->rtn", x, wg)
        hi, lo = wg.amax(-1, keepdim=True), wg.amin(-1, keepdim=True)
        if spec.symmetric:
            hi = torch.maximum(hi, -lo)
            lo = -hi
        best_err = torch.full(wg.shape[:2], math.inf, device=w.device)
        best = wg.clone()
        for i in range(int(max_shrink * grid)):
            r = 1 - i / grid
            cw = torch.minimum(torch.maximum(wg, lo * r), hi * r)
            deq = fake_quant_weight(cw.reshape(-1, in_f), spec).view_as(wg)
            err = (torch.einsum("tng,rng->rtn", x, deq) - ref).pow(2).mean(1)  # (r, ng)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = torch.where(better.unsqueeze(-1), cw, best)
        wg.copy_(best)
    return clipped.view(out_f, in_f).to(w.dtype)


def smoothquant_scales(
    act_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float
) -> torch.Tensor:
    """SmoothQuant (Xiao et al. 2022): s_j = max|x_j|^alpha / max_k|W_kj|^(1-alpha).

    Use x / s and W * s; activation outliers move into the weights, which int8 per-channel
    weights absorb far better than per-token int8 activations absorb outliers.
    """
    w_absmax = torch.stack([w.float().abs().amax(0) for w in weights]).amax(0)  # (in,)
    s = act_absmax.float().clamp(min=1e-5).pow(alpha) / w_absmax.clamp(min=1e-5).pow(1 - alpha)
    return s.clamp(min=1e-5)


def dequantized(
    q: torch.Tensor, scale: torch.Tensor, spec: WeightSpec, zero_point: torch.Tensor | None = None
) -> torch.Tensor:
    return dequantize_weight(q, scale, spec, zero_point)
