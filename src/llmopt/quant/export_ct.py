"""Write a quantized model as a Hugging Face folder in the compressed-tensors format.

The layouts are the library's own: we build its `QuantizationScheme`/`QuantizationConfig` objects
and let its compressors turn (dequantized weight, scale) into the stored tensors, so the folder
is what vLLM, transformers (with compressed-tensors installed) and our `torch` engine read:

| recipe | format | tensors per Linear |
| --- | --- | --- |
| w4a16*, w8a16 | pack-quantized | weight_packed (out, in*bits/32) int32, weight_scale, weight_shape |
| w4a16*-asym | pack-quantized | as w4a16 plus weight_zero_point (ceil(out*bits/32), in/g) int32 |
| w8a8-int8, w8a8-dynamic | int-quantized | weight int8 (out, in), weight_scale (out, 1) |
| fp8-dynamic | float-quantized | weight float8_e4m3fn, weight_scale (out, 1) |
| fp8-static | float-quantized | as fp8-dynamic plus input_scale (1,) |
| kv-fp8 (any recipe) | kv_cache_scheme | self_attn.k_scale, self_attn.v_scale (1,) |

Asymmetric specs (`symmetric: false` in the config) carry a zero point per group/channel:
compressed-tensors computes it as int8 in the signed code range ([-8, 7] at 4 bits) and its
pack-quantized compressor stores it + 2^(bits-1) (unsigned, 0..15), packed 8 to an int32 along the
output dimension (`packed_dim=0`), the codes themselves + 2^(bits-1) along the input dimension;
decompressed weight = (code - zero point) * scale.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from llmopt.quant.primitives import WeightSpec, dequantize_weight

if TYPE_CHECKING:
    from llmopt.core.recipes import Recipe
    from llmopt.quant.sequential import QuantizedLinear

__all__ = ["scheme_for", "format_for", "quantization_config", "compressed_state"]


def _weight_args(spec: WeightSpec):
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(
        num_bits=spec.bits,
        type=spec.type,
        symmetric=spec.symmetric,
        strategy=spec.granularity,
        group_size=spec.group_size,
        dynamic=False,
        # Informational (the scales are stored): how they were chosen, when not plain absmax.
        **({"observer": "mse"} if spec.observer == "mse" else {}),
    )


def _input_args(activations: str):
    from compressed_tensors.quantization import QuantizationArgs

    if activations == "none":
        return None
    if activations == "static-fp8":
        return QuantizationArgs(
            num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False
        )
    kind = "int" if activations == "dynamic-int8" else "float"
    return QuantizationArgs(num_bits=8, type=kind, symmetric=True, strategy="token", dynamic=True)


def format_for(spec: WeightSpec, activations: str) -> str:
    """compressed-tensors format name: weight-only int packs into int32 (what vLLM's WNA16
    kernels read); W8A8 int stores int8; FP8 stores float8_e4m3fn."""
    if spec.type == "float":
        return "float-quantized"
    return "pack-quantized" if activations == "none" else "int-quantized"


def scheme_for(spec: WeightSpec, activations: str, targets: list[str]):
    from compressed_tensors.quantization import QuantizationScheme

    return QuantizationScheme(
        targets=targets,
        weights=_weight_args(spec),
        input_activations=_input_args(activations),
        format=format_for(spec, activations),
    )


def _groups(linears: dict[str, QuantizedLinear]) -> list[tuple[tuple, list[str]]]:
    by_key: dict[tuple, list[str]] = {}
    for name, ql in linears.items():
        by_key.setdefault((ql.spec, ql.activations), []).append(name)
    # Largest group first: it targets "Linear", the others name their modules explicitly.
    return sorted(by_key.items(), key=lambda kv: -len(kv[1]))


def quantization_config(
    recipe: Recipe,
    linears: dict[str, QuantizedLinear],
    ignore: list[str],
    kv: bool,
) -> dict[str, Any]:
    """The `quantization_config` of config.json (a compressed-tensors QuantizationConfig).

    One group when every quantized Linear shares a scheme (targets ["Linear"], everything else
    in `ignore`); with per-layer overrides every group lists its modules by name.
    """
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig

    groups = _groups(linears)
    config_groups, formats = {}, set()
    for i, ((spec, act), names) in enumerate(groups):
        targets = ["Linear"] if len(groups) == 1 else sorted(names)
        config_groups[f"group_{i}"] = scheme_for(spec, act, targets)
        formats.add(format_for(spec, act))
    kv_args = (
        QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False)
        if kv
        else None
    )
    fmt = formats.pop() if len(formats) == 1 else ("mixed-precision" if formats else "dense")
    qc = QuantizationConfig(
        config_groups=config_groups,
        kv_cache_scheme=kv_args,
        format=fmt,
        quantization_status="compressed",
        ignore=ignore,
    )
    d = qc.model_dump(mode="json")
    d["quant_method"] = "compressed-tensors"
    return d


def compressed_state(ql: QuantizedLinear, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The stored tensors of one Linear (local names: weight_packed, weight_scale, ...), made by
    the compressed-tensors compressor of its format from (dequantized weight, scale, zero point)."""
    from compressed_tensors.compressors import BaseCompressor

    fmt = format_for(ql.spec, ql.activations)
    scheme = scheme_for(ql.spec, ql.activations, ["Linear"])
    compressor = BaseCompressor.get_value_from_registry(fmt)
    scale = ql.scale.to(dtype)
    weight = dequantize_weight(ql.codes, ql.scale, ql.spec, ql.zero_point).to(torch.float32)
    state = {"weight": weight, "weight_scale": scale}
    if ql.zero_point is not None:
        state["weight_zero_point"] = ql.zero_point.to(torch.int8)
    out = compressor.compress(state, scheme)
    if ql.input_scale is not None:
        out["input_scale"] = ql.input_scale.to(dtype)
    return {k: v.contiguous() for k, v in out.items()}


def write_folder(
    model,
    recipe: Recipe,
    linears: dict[str, QuantizedLinear],
    ignore: list[str],
    kv_scales: dict[int, tuple[float, float]],
    layers_prefix: str,
    out: Path,
) -> None:
    """Write config.json (with quantization_config), model.safetensors, generation config."""
    from safetensors.torch import save_file

    dtype = next(model.parameters()).dtype
    state = {k: v for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    for name, ql in linears.items():
        state.pop(f"{name}.weight")
        for k, v in compressed_state(ql, dtype).items():
            state[f"{name}.{k}"] = v
    for i, (k_scale, v_scale) in kv_scales.items():
        state[f"{layers_prefix}.{i}.self_attn.k_scale"] = torch.tensor([k_scale], dtype=dtype)
        state[f"{layers_prefix}.{i}.self_attn.v_scale"] = torch.tensor([v_scale], dtype=dtype)
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in state.items()},
        out / "model.safetensors",
        {"format": "pt"},
    )
    config = model.config.to_dict()
    config["quantization_config"] = quantization_config(recipe, linears, ignore, bool(kv_scales))
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
