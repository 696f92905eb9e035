"""Layer-by-layer (sequential) calibration of a decoder LM.

The model stays in host memory; one decoder layer at a time moves to the device, sees the
calibration activations that the already-quantized layers before it produce, is quantized, and
moves back. So peak accelerator memory is about one layer plus its activations and statistics
(GPTQ Hessians, AWQ input samples), whatever the model's size:

    embed(windows) -> h_0
    for layer i: stats = hooks(layer_i(h_i)); quantize layer_i; h_{i+1} = layer_i(h_i)

The result is the model itself with fake-quantized weights (dequantized codes, so torch
evaluates exactly what the deployed kernels compute) and activation/KV fake-quant hooks, plus
the codes and scales of every quantized Linear for export.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from llmopt.core.errors import UnsupportedModelError
from llmopt.quant import algorithms
from llmopt.quant.primitives import (
    FP8_MAX,
    WeightSpec,
    dequantize_weight,
    fake_quant_activation,
    sqnr_db,
    sqnr_db_over,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from llmopt.core.recipes import Recipe

__all__ = [
    "QuantizedLinear",
    "SequentialResult",
    "decoder_layers",
    "layers_prefix",
    "run_sequential",
    "quantize_rtn",
    "kv_fp8",
]

log = logging.getLogger(__name__)

AWQ_TOKENS = 2048  # input rows kept per linear for the AWQ search (a sample is enough)


@dataclass
class QuantizedLinear:
    """Codes, scales and (asymmetric specs) zero points of one quantized Linear (what the exporter
    writes)."""

    name: str
    spec: WeightSpec
    codes: torch.Tensor  # (out, in) int8 codes or float8_e4m3fn, on CPU
    scale: torch.Tensor
    activations: str  # recipe.activations
    input_scale: torch.Tensor | None = None  # static FP8 (1,)
    sqnr_db: float = float("nan")  # output SQNR of this linear on calibration inputs
    original: torch.Tensor | None = None  # float weight before rounding (kept for auto-exclude)
    zero_point: torch.Tensor | None = None  # int8, layout of `scale`; asymmetric specs only


@dataclass
class SequentialResult:
    linears: dict[str, QuantizedLinear] = field(default_factory=dict)
    layer_sqnr_db: list[float] = field(default_factory=list)  # decoder layer outputs
    kv_scales: dict[int, tuple[float, float]] = field(default_factory=dict)  # layer -> (k, v)
    smoothed: list[str] = field(default_factory=list)  # "prev -> linears" mappings folded
    fallbacks: list[str] = field(default_factory=list)  # layers the algorithm could not handle
    seconds: float = 0.0


class _Stop(Exception):
    pass


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer list of a transformers causal LM (Llama, Mistral, Qwen2/3, Gemma...)."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise UnsupportedModelError(
            f"{type(model).__name__} has no model.layers list; sequential quantization supports "
            "decoder LMs laid out like Llama (model.embed_tokens, model.layers, model.norm)",
            hint="use a Llama/Mistral/Qwen-family model",
        )
    return layers


# --- KV cache FP8: one wrapper around the sdpa attention function --------------------------------
# Keys reach the attention function after RoPE, exactly as the cache stores them, so calibrating and
# fake-quantizing there matches an FP8 KV cache. Attention modules without `_llmopt_kv` pass through.


@contextmanager
def kv_fp8():
    """While active, attention modules with `_llmopt_kv` set record K/V absmax ("observe") or
    fake-quantize K/V with their scales ("quantize")."""
    from transformers.modeling_utils import AttentionInterface

    mapping = AttentionInterface._global_mapping
    inner = mapping["sdpa"]

    def wrapper(module, query, key, value, *args, **kwargs):
        kv = getattr(module, "_llmopt_kv", None)
        if kv is not None:
            if kv["mode"] == "observe":
                kv["k"] = max(kv["k"], float(key.detach().abs().amax()))
                kv["v"] = max(kv["v"], float(value.detach().abs().amax()))
            else:
                key = fake_quant_activation(key, "static-fp8", torch.tensor(kv["k_scale"]))
                value = fake_quant_activation(value, "static-fp8", torch.tensor(kv["v_scale"]))
        return inner(module, query, key, value, *args, **kwargs)

    mapping["sdpa"] = wrapper
    try:
        yield
    finally:
        mapping["sdpa"] = inner


# --- capture --------------------------------------------------------------------------------------


def _capture_layer0(model, layers, windows: torch.Tensor, device: str):
    # Run the model up to layer 0 for each window; keep (hidden, kwargs) on the device.
    base = model.model
    keep = [m for n, m in base.named_children() if n != "layers" and n != "norm"]
    for m in keep:
        m.to(device)
    captured: list[tuple[torch.Tensor, dict[str, Any]]] = []

    def pre_hook(_mod, args, kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        kwargs = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        captured.append((hidden.detach(), kwargs))
        raise _Stop

    h = layers[0].register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        for w in windows:
            with suppress(_Stop):
                base(input_ids=w.view(1, -1).to(device), use_cache=False)
    finally:
        h.remove()
        for m in keep:
            m.to("cpu")
    return captured


def _layer_out(out):
    return out[0] if isinstance(out, tuple) else out


def _run_layer(layer, captured) -> list[torch.Tensor]:
    return [_layer_out(layer(h, **kw)) for h, kw in captured]


@dataclass
class _Stats:
    hessian: torch.Tensor | None = None
    tokens: int = 0
    absmax: torch.Tensor | None = None  # per input channel
    sample: list[torch.Tensor] = field(default_factory=list)
    sampled: int = 0


def _collect(layer, captured, names: dict[str, nn.Linear], need: set[str]) -> dict[str, _Stats]:
    stats = {n: _Stats() for n in names}
    hooks = []

    def make(name):
        def hook(_m, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()  # (tokens, in)
            st = stats[name]
            if "hessian" in need:
                h = x.T @ x
                st.hessian = h if st.hessian is None else st.hessian + h
            am = x.abs().amax(0)
            st.absmax = am if st.absmax is None else torch.maximum(st.absmax, am)
            if "sample" in need and st.sampled < AWQ_TOKENS:
                take = x[: AWQ_TOKENS - st.sampled]
                st.sample.append(take)
                st.sampled += take.shape[0]
            st.tokens += x.shape[0]

        return hook

    for n, m in names.items():
        hooks.append(m.register_forward_pre_hook(make(n)))
    try:
        with torch.no_grad():
            outs = _run_layer(layer, captured)
    finally:
        for h in hooks:
            h.remove()
    return stats, outs


# --- smoothing maps (Llama family) ----------------------------------------------------------------


def _mappings(layer) -> list[tuple[nn.Module, list[str]]]:
    """(previous op, [linear names inside the layer]) pairs whose input channels can be rescaled
    exactly: RMSNorm weight before q/k/v and gate/up; up_proj rows before down_proj; v_proj rows
    before o_proj when there is one KV head per query head."""
    out = []
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None:
        return out
    if hasattr(layer, "input_layernorm") and all(hasattr(attn, p) for p in ("q_proj", "k_proj")):
        out.append(
            (layer.input_layernorm, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"])
        )
    if hasattr(attn, "o_proj") and attn.v_proj.weight.shape[0] == attn.o_proj.weight.shape[1]:
        out.append((attn.v_proj, ["self_attn.o_proj"]))
    if hasattr(layer, "post_attention_layernorm") and hasattr(mlp, "gate_proj"):
        out.append((layer.post_attention_layernorm, ["mlp.gate_proj", "mlp.up_proj"]))
    if hasattr(mlp, "up_proj") and hasattr(mlp, "down_proj"):
        out.append((mlp.up_proj, ["mlp.down_proj"]))
    return out


def _fold(prev: nn.Module, linears: list[nn.Linear], s: torch.Tensor) -> None:
    # y = lin(prev(x)): scale prev's output channels by 1/s and the linears' input columns by s.
    with torch.no_grad():
        s = s.to(prev.weight.device)
        if isinstance(prev, nn.Linear):
            prev.weight.div_(s.view(-1, 1).to(prev.weight.dtype))
            if prev.bias is not None:
                prev.bias.div_(s.to(prev.bias.dtype))
        else:  # RMSNorm-style elementwise weight
            prev.weight.div_(s.to(prev.weight.dtype))
        for lin in linears:
            lin.weight.mul_(s.view(1, -1).to(lin.weight.dtype))


def _norm_is_foldable(prev: nn.Module) -> bool:
    # Gemma-style norms compute x * (1 + w): dividing w is not dividing the output.
    return isinstance(prev, nn.Linear) or "gemma" not in type(prev).__name__.lower()


# --- the driver -----------------------------------------------------------------------------------


def run_sequential(
    model: nn.Module,
    windows: torch.Tensor,
    recipe: Recipe,
    specs: dict[str, WeightSpec],
    *,
    device: str = "cpu",
    keep_originals: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> SequentialResult:
    """Quantize `model` in place, one decoder layer at a time.

    Args:
        model: a transformers causal LM on the CPU, in the recipe's dtype.
        windows: (N, T) calibration token ids.
        recipe: what to do (algorithm, activations, KV cache).
        specs: full Linear name -> WeightSpec for every Linear to quantize (others untouched).
        device: where each layer runs ("cpu" or "cuda[:i]").
        keep_originals: keep each linear's float weight on the CPU (auto-exclude restores them).
        progress: callable(done_layers, total_layers).

    Returns:
        SequentialResult; `model` now holds fake-quantized weights and activation hooks.
    """
    t0 = time.perf_counter()
    layers = decoder_layers(model)
    res = SequentialResult()
    prefix = layers_prefix(model, layers)
    with torch.no_grad(), kv_fp8():
        captured = _capture_layer0(model, layers, windows, device)
        for i, layer in enumerate(layers):
            layer.to(device)
            float_outs = _quantize_layer(
                i, layer, f"{prefix}.{i}.", captured, recipe, specs, res, keep_originals
            )
            outs = _run_layer(layer, captured)
            # Layer output SQNR: same inputs, float vs quantized layer (where the error enters).
            res.layer_sqnr_db.append(sqnr_db_over(float_outs, outs))
            del float_outs
            captured = [(o.detach(), kw) for o, (_, kw) in zip(outs, captured, strict=True)]
            layer.to("cpu")
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
            if progress:
                progress(i + 1, len(layers))
    res.seconds = time.perf_counter() - t0
    return res


def quantize_rtn(
    model: nn.Module,
    recipe: Recipe,
    specs: dict[str, WeightSpec],
    *,
    progress: Callable[[int, int], None] | None = None,
) -> SequentialResult:
    """Round every Linear in `specs` to nearest, in place, with no forward pass.

    Weight-only round-to-nearest reads nothing but the weights, so it needs no calibration
    text: the same codes and scales `run_sequential` computes for such a recipe, without the
    layer forwards it spends on sensitivity (per-linear SQNR, left NaN here).
    """
    assert recipe.algorithm == "rtn" and recipe.activations == "none", recipe.name
    assert recipe.kv_cache_dtype is None, recipe.name
    t0 = time.perf_counter()
    res = SequentialResult()
    names = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n in specs]
    with torch.no_grad():
        for i, (name, lin) in enumerate(names):
            w = lin.weight.detach()
            q, sc, z = algorithms.rtn(w, specs[name])
            lin.weight.data.copy_(dequantize_weight(q, sc, specs[name], z).to(w.dtype))
            res.linears[name] = QuantizedLinear(
                name,
                specs[name],
                q.cpu(),
                sc.cpu(),
                recipe.activations,
                zero_point=None if z is None else z.cpu(),
            )
            if progress:
                progress(i + 1, len(names))
    res.seconds = time.perf_counter() - t0
    return res


def layers_prefix(model, layers) -> str:
    """The module path of the decoder layer list (`model.layers`, ...): the exporter names every
    quantized linear from it."""
    for name, mod in model.named_modules():
        if mod is layers:
            return name
    raise AssertionError("layers not found in model")


def _quantize_layer(i, layer, prefix, captured, recipe, specs, res, keep_originals):
    local = {
        n: m for n, m in layer.named_modules() if isinstance(m, nn.Linear) and prefix + n in specs
    }
    # A sample of each linear's inputs always (per-linear SQNR); Hessians for GPTQ only.
    need = {"sample", "hessian"} if recipe.algorithm == "gptq" else {"sample"}
    attn = getattr(layer, "self_attn", None)
    if recipe.kv_cache_dtype == "fp8" and attn is not None:
        attn._llmopt_kv = {"mode": "observe", "k": 0.0, "v": 0.0}
    stats, float_outs = _collect(layer, captured, local, need)
    if recipe.kv_cache_dtype == "fp8" and attn is not None:
        kv = attn._llmopt_kv
        k_scale, v_scale = max(kv["k"], 1e-6) / FP8_MAX, max(kv["v"], 1e-6) / FP8_MAX
        attn._llmopt_kv = {"mode": "quantize", "k_scale": k_scale, "v_scale": v_scale}
        res.kv_scales[i] = (k_scale, v_scale)

    if recipe.algorithm in ("awq", "smoothquant"):
        _smooth(layer, prefix, local, stats, recipe, res, specs)

    for n, lin in local.items():
        spec, full = specs[prefix + n], prefix + n
        w = lin.weight.detach()
        if recipe.algorithm == "gptq" and spec.type == "int":
            q, s, z = algorithms.gptq(w, stats[n].hessian, spec)
        elif recipe.algorithm == "awq" and spec.type == "int" and not _query_or_key(n):
            clipped = algorithms.awq_clip(w, torch.cat(stats[n].sample), spec)
            q, s, z = algorithms.rtn(clipped, spec)
        else:
            q, s, z = algorithms.rtn(w, spec)
        deq = dequantize_weight(q, s, spec, z).to(w.dtype)
        x = torch.cat(stats[n].sample)  # (tokens, in)
        qs = sqnr_db(x @ w.float().T, x @ deq.float().T)
        input_scale = None
        if recipe.activations == "static-fp8":
            input_scale = (stats[n].absmax.amax() / FP8_MAX).clamp(min=1e-8).reshape(1).cpu()
        res.linears[full] = QuantizedLinear(
            full,
            spec,
            q.cpu(),
            s.cpu(),
            recipe.activations,
            input_scale,
            qs,
            w.detach().cpu().clone() if keep_originals else None,
            None if z is None else z.cpu(),
        )
        lin.weight.data.copy_(deq)
        if recipe.activations != "none":
            install_activation_hook(lin, recipe.activations, input_scale)
    return float_outs


def _query_or_key(name: str) -> bool:
    # AutoAWQ's list of what auto_clip leaves alone (Llama's q_proj/k_proj, BERT-style names,
    # fused qkv projections).
    leaf = name.rsplit(".", 1)[-1].lower()
    return leaf.startswith(("q_", "k_", "query", "key")) or "qkv" in leaf


def install_activation_hook(lin: nn.Linear, mode: str, input_scale: torch.Tensor | None) -> None:
    """Fake-quantize this Linear's input the way the deployed kernel does (idempotent)."""
    old = getattr(lin, "_llmopt_act_hook", None)
    if old is not None:
        old.remove()
    scale = None if input_scale is None else input_scale.clone()

    def hook(_m, args):
        return (fake_quant_activation(args[0], mode, scale), *args[1:])

    lin._llmopt_act_hook = lin.register_forward_pre_hook(hook)


def remove_activation_hook(lin: nn.Linear) -> None:
    old = getattr(lin, "_llmopt_act_hook", None)
    if old is not None:
        old.remove()
        del lin._llmopt_act_hook


def _smooth(layer, prefix, local, stats, recipe, res, specs) -> None:
    for prev, names in _mappings(layer):
        names = [n for n in names if n in local]
        if not names or not _norm_is_foldable(prev):
            if names:
                res.fallbacks.append(f"{prefix}{names[0]}: {type(prev).__name__} not foldable")
            continue
        lins = [local[n] for n in names]
        ws = [lin.weight.detach() for lin in lins]
        if recipe.algorithm == "smoothquant":
            s = algorithms.smoothquant_scales(stats[names[0]].absmax, ws, recipe.smoothing_alpha)
        else:
            x = torch.cat(stats[names[0]].sample)
            s = algorithms.awq_search(x, ws, [specs[prefix + n] for n in names])
        _fold(prev, lins, s)
        # The linears' inputs are now x / s: keep the statistics consistent.
        for n in names:
            st = stats[n]
            st.absmax = st.absmax / s
            st.sample = [x / s for x in st.sample]
            if st.hessian is not None:
                st.hessian = st.hessian / s.view(-1, 1) / s.view(1, -1)
        res.smoothed.append(f"{prefix}{'/'.join(names)}")
