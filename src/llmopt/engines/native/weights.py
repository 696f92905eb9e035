"""Build a native `Transformer` from an HF folder (dense or compressed-tensors) or from a config.

The model is created on the `meta` device (no memory), then each parameter is materialized from
its safetensors tensor straight onto the target device, so peak host memory stays near one tensor
rather than a whole fp32 copy of the model.

Weights that arrive quantized (a compressed-tensors `quantization_config`, as `llmopt.quant` and
llm-compressor write) are re-laid-out for this engine's kernels without re-quantizing, so AWQ/GPTQ
choices survive. Asymmetric int4 (`weight_zero_point`, `symmetric: false`, the `-asym` recipes)
runs on the same int4 kernel, the zero points folded into its per-group float offsets
(`Int4Linear`). 8-bit codes with group scales or zero points (an 8-bit override inside a w4a16
recipe; llm-compressor's asymmetric W8A16) have no kernel here: they are dequantized exactly
into a `DequantizedLinear` (dense compute, correct numbers) rather than refused. The bits of a
pack-quantized layer come from its packed width, not the config, since overrides mix them.
Dense weights can be
quantized on load (`quant="int8" | "int4" | "fp8"`, round-to-nearest), which is what the
benchmark and the on-the-fly recipes use.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmopt.core.errors import LlmoptError
from llmopt.engines.native import linear as L
from llmopt.engines.native.config import HF_HINT, NativeConfig, UnsupportedModel
from llmopt.engines.native.model import Transformer, rope_inv_freq

__all__ = [
    "load_model",
    "random_model",
    "quantize_model_",
    "fuse_projections_",
    "fold_norms_",
    "dense_gemv_",
    "QUANT_MODES",
    "HEAD_MODES",
    "quantize_head_",
]

QUANT_MODES = ("int8", "int4", "fp8")


def _linear_names(model: Transformer) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


class DequantizedLinear(nn.Linear):
    """A stored quantized linear that no kernel here runs (8-bit codes with group scales or zero
    points, e.g. an 8-bit override inside a 4-bit recipe), held as its exact dequantized weight
    (q - zero point) * scale in the model dtype. Dense from then on, but never quantized again
    on load, nor fused."""


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _set_param(model: nn.Module, name: str, t: torch.Tensor) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, nn.Parameter(t, requires_grad=False))


def _fuse(parent: nn.Module, parts: tuple[str, ...], fused: str) -> bool:
    mods = [getattr(parent, p) for p in parts]
    if not all(type(m) is nn.Linear for m in mods):
        return False  # already quantized (a compressed-tensors checkpoint): keep them apart
    w = torch.cat([m.weight.data for m in mods])
    bias = [m.bias for m in mods]
    lin = nn.Linear(w.shape[1], w.shape[0], bias=bias[0] is not None, device="meta")
    lin.weight = nn.Parameter(w, requires_grad=False)
    if bias[0] is not None:
        lin.bias = nn.Parameter(torch.cat([b.data for b in bias]), requires_grad=False)
    setattr(parent, fused, lin)
    for p in parts:
        setattr(parent, p, None)
    return True


def fuse_projections_(model: Transformer) -> None:
    """Concatenate q/k/v and gate/up weights into single linears (before any quantization)."""
    for layer in model.model.layers:
        _fuse(layer.self_attn, ("q_proj", "k_proj", "v_proj"), "qkv_proj")
        _fuse(layer.mlp, ("gate_proj", "up_proj"), "gate_up_proj")


def fold_multipliers_(model: Transformer) -> None:
    """Fold Granite's residual multiplier into each block's output projections (o_proj,
    down_proj) and 1 / logits_scaling into the final norm's weight, in place (dense weights only:
    a quantized checkpoint's codes are not rescaled here)."""
    cfg = model.cfg
    r, s = cfg.residual_multiplier, cfg.logits_scaling
    outs = [m for b in model.model.layers for m in (b.self_attn.o_proj, b.mlp.down_proj)]
    if (r != 1.0 or s != 1.0) and not all(type(m) is nn.Linear for m in outs):
        raise UnsupportedModel(
            "a quantized checkpoint with residual/logits multipliers (Granite) is not "
            "implemented natively",
            hint=HF_HINT,
        )
    with torch.no_grad():
        if r != 1.0:
            for m in outs:
                m.weight.mul_(r)
        if s != 1.0:
            model.model.norm.weight.div_(s)


def fold_norms_(model: Transformer, per_norm: bool = False) -> int:
    """Fold each block's two RMSNorm weights into the columns of the dense projections that read
    their outputs (q/k/v, gate/up), in place, and set the norms' weights to ones: the block then
    passes the norm along with the raw residual stream (`Block.norms_folded`), so that at batch 1
    the int8/FP8 GEMV normalizes what it reads (`linear.FUSE_NORM`). Same function: norm(x) W^T
    = (x r) (W diag(g))^T. Before quantizing (the fold changes what each row's scale covers).
    Blocks of other shapes (sandwich or post norms, Gemma's 1 + w, already-quantized
    projections) are left as they are. `per_norm`: fold each norm on its own, where its
    projections are all dense (int4 models, whose int4 layers take their norm unfolded); by
    default both norms of a block or neither. Returns the number of blocks folded."""
    done = 0
    with torch.no_grad():
        for b in model.model.layers:
            if b.norms_folded or b.sandwich or b.post_norms or b.mlp.gemma:
                continue
            ins, outs = _block_projections(b)
            pairs = ((ins, b.input_layernorm), (outs, b.post_attention_layernorm))
            dense = [all(type(m) is nn.Linear for m in lins) for lins, _ in pairs]
            take = dense if per_norm else [all(dense)] * 2
            if not any(take):
                continue
            gains = []
            for (lins, norm), t in zip(pairs, take, strict=True):
                if not t:
                    gains.append(None)
                    continue
                g = norm.weight.detach().float().clone()  # (fp32 weights: not a view)
                for m in lins:  # (in fp32: one rounding to the weights' dtype)
                    m.weight.copy_(m.weight.float() * g[None, :])
                norm.weight.fill_(1.0)
                norm.folded = True
                gains.append(g)
            b.norms_folded = True
            b.folded_gains = tuple(gains)  # for `unfold_norms_`
            done += 1
    return done


def _block_projections(b) -> tuple[list, list]:
    att, mlp = b.self_attn, b.mlp
    ins = [att.qkv_proj] if att.qkv_proj is not None else [att.q_proj, att.k_proj, att.v_proj]
    outs = [mlp.gate_up_proj] if mlp.gate_up_proj is not None else [mlp.gate_proj, mlp.up_proj]
    return ins, outs


def unfold_norms_(model: Transformer, which: Callable[[list], bool] | None = None) -> int:
    """Undo `fold_norms_` where its projections are still 16-bit: divide each column by the norm
    weight it was multiplied by (one more rounding, far below any quantization error) and give
    the norms their weights back. For formats whose kernels do not take the norm (int4): a scale
    group spans columns of different norm weights once folded, which costs SmolLM2 int4 g64 +89%
    perplexity against +29% unfolded (docs/benchmarks.md). `which(projections)`: unfold only the
    norms whose projections it accepts (default: all); a norm whose projections stay 16-bit is
    better left folded, as the GEMV then takes it. Returns the number of norms unfolded."""
    done = 0
    with torch.no_grad():
        for b in model.model.layers:
            gains = getattr(b, "folded_gains", None)
            if not b.norms_folded or gains is None:
                continue
            left = list(gains)
            norms = (b.input_layernorm, b.post_attention_layernorm)
            pairs = zip(_block_projections(b), norms, gains, strict=True)
            for i, (lins, norm, g) in enumerate(pairs):
                if g is None or (which is not None and not which(lins)):
                    continue
                if not all(type(m) in (nn.Linear, L.DenseLinear) for m in lins):
                    continue  # already quantized: the fold is part of their weights now
                inv = torch.where(g != 0, 1.0 / g, torch.zeros_like(g))  # (a zero gain: 0 out)
                for m in lins:
                    m.weight.copy_(m.weight.float() * inv[None, :])
                norm.weight.copy_(g)
                norm.folded = False
                left[i] = None
                done += 1
            b.norms_folded = any(g is not None for g in left)
            b.folded_gains = tuple(left) if b.norms_folded else None
    return done


def _finish(model: Transformer, device) -> Transformer:
    cfg = model.cfg
    if cfg.tie_embeddings or model.lm_head.weight.is_meta:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(cfg).to(device)
    if cfg.local_layers and cfg.local_rope_theta is not None:
        model.inv_freq_local = rope_inv_freq(cfg, cfg.local_rope_theta).to(device)
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise RuntimeError(f"weights missing from the checkpoint: {left[:5]}")
    return model.eval()


def quantize_linear(lin: nn.Linear, mode: str, group: int = 128) -> nn.Module:
    """A `mode` (int8, int4, fp8) round-to-nearest copy of one dense linear, in its dtype."""
    assert mode in QUANT_MODES, mode
    w, bias, dtype = lin.weight.data, lin.bias, lin.weight.dtype
    if mode == "int8":
        q, s = L.quantize_int8(w)
        return L.Int8Linear(q, s, bias, dtype)
    if mode == "int4":
        q, s = L.quantize_int4(w, group)
        return L.Int4Linear(q, s, group, bias, dtype)
    q, s = L.quantize_fp8(w)
    return L.Fp8Linear(q, s, bias, dtype)


def _gemv_takes_norms(model: Transformer) -> bool:
    # the one-row GEMV takes the norms (`linear.FUSE_NORM`) on CUDA only: elsewhere the model
    # is kept as it was, norms unfolded
    return L.FUSE_NORM and model.lm_head.weight.device.type == "cuda"


def quantize_model_(
    model: Transformer,
    mode: str,
    ignore: tuple[str, ...] = ("lm_head",),
    group: int = 128,
    fold: bool | None = None,
) -> list[str]:
    """Replace the dense linears by `mode` layers (round-to-nearest), in place; returns names.
    `fold`: for int8/FP8, fold the norms into the projections first (`fold_norms_`); by default
    where their one-row GEMV takes the norm (`linear.FUSE_NORM`, on CUDA). int4 keeps the norms
    unfolded (its GEMV multiplies its input by the norm's weight instead): norms folded before
    (`dense_gemv_`, by a 16-bit load on CUDA) are unfolded first (`unfold_norms_`), unless
    `fold` is True (studies of the folded weights)."""
    assert mode in QUANT_MODES, mode
    takes_norm = mode in ("int8", "fp8")
    if fold is None:
        fold = takes_norm and _gemv_takes_norms(model)

    def quantized(name: str, lin: nn.Module) -> bool:
        if any(name == s or name.endswith("." + s) for s in ignore):
            return False
        if isinstance(lin, DequantizedLinear):
            return False  # already quantized by the checkpoint (exact values kept)
        return not (mode == "int4" and lin.in_features % group)  # (else left dense; listed)

    # (a 16-bit model loaded on CUDA holds `DenseLinear` projections: `dense_gemv_`)
    names = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, L.DenseLinear))]
    names = [n for n in names if quantized(n, model.get_submodule(n))]
    if fold and takes_norm:
        fold_norms_(model)
    elif not fold and not takes_norm:
        # only the norms whose projections become int4: where they stay 16-bit (a group that
        # does not divide their width), the dense GEMV keeps taking the norm
        targets = {id(model.get_submodule(n)) for n in names}
        unfold_norms_(model, which=lambda lins: any(id(m) in targets for m in lins))
    for name in names:
        _set_module(model, name, quantize_linear(model.get_submodule(name), mode, group))
    if _gemv_takes_norms(model):
        # the projections left 16-bit (ignored, or a group that does not divide their width:
        # SmolLM2's 576-wide inputs at int4 g128) take the dense GEMV with their norm and
        # residual add, as a 16-bit model's do, rather than cuBLAS after a norm kernel
        dense_gemv_(model, per_norm=True)
    return names


def dense_gemv_(model: Transformer, per_norm: bool = False) -> list[str]:
    """For a 16-bit model under `linear.FUSE_NORM`: fold the norms (`fold_norms_`) and make each
    folded block's dense projections `linear.DenseLinear`, so that at batch 1 the one-row GEMV
    runs the RMSNorm before them and the residual add after them, as for int8/FP8 (the same
    weights: cuBLAS still serves every other row count). `per_norm`: as `fold_norms_`'s (for the
    projections a quantized model leaves dense). Returns the names swapped."""
    fold_norms_(model, per_norm)
    done = []
    for i, b in enumerate(model.model.layers):
        if not b.norms_folded:
            continue
        for name in _linear_names(b):
            lin = b.get_submodule(name)
            if type(lin) is nn.Linear:
                _set_module(b, name, L.DenseLinear(lin.weight.data, lin.bias, lin.weight.dtype))
                done.append(f"model.layers.{i}.{name}")
    return done


def random_model(cfg: NativeConfig, device, dtype: torch.dtype, seed: int = 0) -> Transformer:
    """Seeded random weights (std 0.02; norms 1), never all-zero: for benchmarks of big shapes."""
    with torch.device("meta"):
        model = Transformer(cfg)
    g = torch.Generator(device=device).manual_seed(seed)
    for name, p in list(model.named_parameters()):
        if name == "lm_head.weight" and cfg.tie_embeddings:
            continue
        if name.endswith("norm.weight"):
            t = torch.ones(p.shape, device=device, dtype=dtype)
        else:
            t = torch.randn(p.shape, device=device, dtype=dtype, generator=g) * 0.02
        _set_param(model, name, t)
    model = _finish(model, device)
    fuse_projections_(model)
    return model


def load_model(
    folder: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    quant: str | None = None,
    ignore: tuple[str, ...] = ("lm_head",),
    group: int = 128,
    head: str | None = None,
) -> Transformer:
    """Load an HF folder's safetensors into a native Transformer on `device`. `quant` the body's
    linears (round-to-nearest, but those in `ignore`), `head` the output projection's format
    where it is still dense (`quantize_head_`; None keeps it dense)."""
    from safetensors import safe_open

    folder = Path(folder)
    raw = json.loads((folder / "config.json").read_text())
    cfg = NativeConfig.from_hf(raw)
    qcfg = raw.get("quantization_config")
    with torch.device("meta"):
        model = Transformer(cfg)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no .safetensors files")
    tensors: dict[str, Any] = {}
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    for h in handles:
        for k in h.keys():  # noqa: SIM118 (safe_open handles are not mappings)
            tensors[k] = h
    _split_fused(tensors, cfg)
    linears = set(_linear_names(model))
    for name in linears:
        if f"{name}.weight" not in tensors and not _is_quantized(name, tensors):
            continue  # tied lm_head: filled in _finish
        bias = (
            tensors[f"{name}.bias"].get_tensor(f"{name}.bias")
            if f"{name}.bias" in tensors
            else None
        )
        if _is_quantized(name, tensors):
            _set_module(model, name, _from_compressed(name, tensors, qcfg, device, dtype, bias))
            continue
        w = tensors[f"{name}.weight"].get_tensor(f"{name}.weight").to(device=device, dtype=dtype)
        _set_param(model, f"{name}.weight", w)
        if bias is not None:
            _set_param(model, f"{name}.bias", bias.to(device=device, dtype=dtype))
    for name, p in list(model.named_parameters()):
        if p.is_meta and name in tensors:
            _set_param(model, name, tensors[name].get_tensor(name).to(device=device, dtype=dtype))
    model = _finish(model, device)
    fold_multipliers_(model)
    fuse_projections_(model)
    if quant:
        quantize_model_(model, quant, ignore, group)
    elif _gemv_takes_norms(model) and dtype != torch.float32:
        dense_gemv_(model)  # the norms and residual adds inside the one-row GEMV
    if head:
        quantize_head_(model, head)
    return model


HEAD_MODES = ("int8",)


def quantize_head_(model: Transformer, mode: str) -> bool:
    """Make the output projection a `mode` (int8: per-channel weight-only) layer, in place,
    where it is dense; False where it is not (a checkpoint's quantized head stays as stored).

    Why int8 only: the head is the layer most sensitive to rounding (on SmolLM2-135M an int8 head
    adds 0.08 points to the int8 model's perplexity change, an int4 head takes the int4 model's
    from +29% to +72%; docs/benchmarks.md), and at batch 1 it is a large share of a quantized
    model's reads (the 8B shape's bf16 head is 1.05 GB of an int4 step's 4.65). A tied head gets
    its own int8 copy; the embedding table, read one row per token, stays as it is."""
    if mode not in HEAD_MODES:
        raise LlmoptError(
            f"lm_head={mode!r} is not an output-projection format the torch engine runs",
            hint=f"use one of {', '.join(('dense', *HEAD_MODES))}",
        )
    if type(model.lm_head) is not nn.Linear:
        return False
    model.lm_head = quantize_linear(model.lm_head, mode)
    return True


class _Rows:
    """Rows `start:end` of a stored tensor, read like a safetensors handle (`get_tensor`)."""

    def __init__(self, handle: Any, key: str, start: int, end: int):
        self.handle, self.key, self.start, self.end = handle, key, start, end

    def get_tensor(self, _name: str) -> torch.Tensor:
        return self.handle.get_tensor(self.key)[self.start : self.end]


def _split_fused(tensors: dict[str, Any], cfg: NativeConfig) -> None:
    """Checkpoints that store q/k/v and gate/up fused (Phi-3: `qkv_proj`, `gate_up_proj`) as the
    separate tensors the model is built from (`fuse_projections_` joins them again after)."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    parts = {
        "self_attn.qkv_proj": (("q_proj", q), ("k_proj", kv), ("v_proj", kv)),
        "mlp.gate_up_proj": (("gate_proj", cfg.intermediate), ("up_proj", cfg.intermediate)),
    }
    for key in [k for k in tensors if k.endswith((".qkv_proj.weight", ".gate_up_proj.weight"))]:
        base, fused = key.removesuffix(".weight").rsplit(".", 2)[0], key.split(".")[-3:-1]
        start = 0
        for name, rows in parts[".".join(fused)]:
            tensors[f"{base}.{fused[0]}.{name}.weight"] = _Rows(
                tensors[key], key, start, start + rows
            )
            start += rows
        del tensors[key]


def _is_quantized(name: str, tensors) -> bool:
    return f"{name}.weight_scale" in tensors


def _from_compressed(name: str, tensors, qcfg: dict | None, device, dtype, bias) -> nn.Module:
    """One compressed-tensors linear -> this engine's layer, keeping the stored integer values."""

    def get(key):
        return tensors[key].get_tensor(key).to(device)

    scale = get(f"{name}.weight_scale").float()
    b = None if bias is None else bias.to(device)
    bits = _num_bits(qcfg)
    if f"{name}.weight_packed" in tensors:  # pack-quantized int4 (or int8) in int32 words
        shape = torch.Size(get(f"{name}.weight_shape").tolist())
        packed = get(f"{name}.weight_packed")
        bits = _packed_bits(packed.shape[-1], shape[-1]) or bits  # per layer: overrides mix them
        q = _unpack_int32()(packed, bits, shape).to(torch.int8)
    else:
        q = get(f"{name}.weight")
    n, k = q.shape
    is_int4 = bits == 4 and int(q.min()) >= -8 and int(q.max()) <= 7
    zp = None
    if f"{name}.weight_zero_point" in tensors:
        zp = get(f"{name}.weight_zero_point")
        if zp.dtype == torch.int32:  # pack-quantized: unsigned, packed along the output dim
            zp = _unpack_int32()(zp, bits, torch.Size((n, scale.numel() // n)), packed_dim=0)
        # signed, as compressed-tensors computes it; all zero: symmetric (older writers stored it)
        zp = zp.reshape(n, -1).to(torch.int8) if bool(zp.any()) else None
    if q.dtype == torch.float8_e4m3fn:
        return L.Fp8Linear(q, scale.flatten(), b, dtype)
    grouped = scale.numel() > n
    if not is_int4 and (grouped or zp is not None):  # no int8 kernel with groups or zeros
        return _dequantized(q, scale.reshape(n, -1), zp, b, dtype)
    if not grouped:  # per channel
        if is_int4:
            return L.Int4Linear(q, scale.reshape(n, 1), k, b, dtype, zero_point=zp)
        return L.Int8Linear(q, scale.flatten(), b, dtype)
    group = k // scale.shape[1]
    return L.Int4Linear(q, scale.reshape(n, -1), group, b, dtype, zero_point=zp)


def _dequantized(q, scale, zp, bias, dtype) -> DequantizedLinear:
    n, k = q.shape
    w = q.float()
    if zp is not None:
        w = w - zp.float().repeat_interleave(k // zp.shape[1], 1)
    w = w * scale.float().repeat_interleave(k // scale.shape[1], 1)
    lin = DequantizedLinear(k, n, bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(w.to(dtype), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
    return lin


def _unpack_int32():
    """compressed-tensors' own unpacker (its module moved between releases)."""
    try:  # compressed-tensors >= 0.20
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    except ImportError:  # 0.9 - 0.19
        from compressed_tensors.compressors.quantized_compressors.pack_quantized import (
            unpack_from_int32,
        )
    return unpack_from_int32


def _packed_bits(words: int, in_features: int) -> int | None:
    """Bits per weight of a pack-quantized row: `in_features` values in `words` int32 words
    (ceil(in * bits / 32), which differs for every bits once in >= 32). A folder with per-layer
    overrides mixes 4- and 8-bit layers, so the config's first group cannot say it."""
    found = [b for b in range(1, 9) if -(-in_features * b // 32) == words]
    return found[0] if len(found) == 1 else None


def _num_bits(qcfg: dict | None) -> int:
    for g in ((qcfg or {}).get("config_groups") or {}).values():
        w = g.get("weights") or {}
        if w.get("num_bits"):
            return int(w["num_bits"])
    return 8
