"""Checks that run before any quantization work, so a mismatch costs seconds, not an hour.

- FP8 recipes on a CUDA GPU below compute capability 8.9 (no FP8 tensor cores to deploy on).
- A group size that does not divide a layer's input width.
- Layers with weights that the recipe cannot quantize (not nn.Linear): listed as skipped.
- Not enough host memory for the model (plus float copies for auto-exclude), or device memory
  for one layer plus its calibration activations and statistics.
- Asymmetric weights (`-asym` recipes): recipes that cannot have them are refused when the
  Recipe is built (8-bit, FP8, quantized activations, per-tensor scales); here, the loaders that
  will not read the folder are named in `Preflight.notes` (and the facts) before any work.

The model is built on the meta device from its config here: shapes only, no weights read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from llmopt.core.errors import LlmoptError
from llmopt.core.units import dtype_bytes
from llmopt.quant.primitives import WeightSpec
from llmopt.quant.sequential import decoder_layers

if TYPE_CHECKING:
    from llmopt.core.recipes import Recipe

__all__ = ["QuantConfigError", "QuantMemoryError", "Preflight", "preflight", "plan_specs"]


class QuantConfigError(LlmoptError):
    """The recipe cannot be applied to this model or device as asked."""


class QuantMemoryError(LlmoptError):
    """Not enough host or device memory for the chosen quantization mode."""


@dataclass
class Preflight:
    specs: dict[str, WeightSpec] = field(default_factory=dict)  # Linear name -> spec
    ignored: list[str] = field(default_factory=list)  # Linear names left by the ignore list
    skipped: dict[str, str] = field(default_factory=dict)  # module name -> reason
    host_bytes_needed: int = 0
    device_bytes_needed: int = 0
    notes: list[str] = field(default_factory=list)  # what the folder will not load in, and why


def _ignored(name: str, ignore: tuple[str, ...]) -> bool:
    return any(name == s or name.endswith("." + s) for s in ignore)


def plan_specs(model: nn.Module, recipe: Recipe) -> Preflight:
    """WeightSpec of every Linear the recipe quantizes; ignored and skipped modules with reasons."""
    scale_dtype = getattr(torch, recipe.dtype)
    pf = Preflight()
    for name, mod in model.named_modules():
        has_weight = isinstance(getattr(mod, "weight", None), torch.Tensor)
        if not isinstance(mod, nn.Linear):
            if has_weight and mod.weight.dim() == 2 and not isinstance(mod, nn.Embedding):
                pf.skipped[name] = f"{type(mod).__name__} is not nn.Linear (not quantized)"
            continue
        if _ignored(name, recipe.ignore):
            pf.ignored.append(name)
            continue
        if recipe.weight_bits is None:
            continue
        bits, group = recipe.weight_bits, recipe.group_size
        for o in recipe.overrides:
            if o.matches(name):
                bits = o.weight_bits or bits
                group = o.group_size or group
                break
        gran = "group" if group is not None else recipe.weight_granularity
        # Asymmetric recipes are 4-bit; a layer an override puts at 8 bits stays symmetric.
        symmetric = recipe.weight_symmetric or bits != 4
        pf.specs[name] = WeightSpec(
            bits, recipe.weight_type, gran, group, scale_dtype, recipe.weight_observer, symmetric
        )
    return pf


def refuse_engine_recipes(recipe: Recipe) -> None:
    """Recipes an engine quantizes itself, not this pipeline: GGUF types (llama.cpp's quantizer,
    the llamacpp engine) and static int8 activations (NNCF, the openvino engine)."""
    if recipe.activations == "static-int8":
        raise QuantConfigError(
            f"recipe {recipe.name!r} (static int8 activations) is NNCF's post-training "
            "quantization: the openvino engine builds it",
            hint=f"`llmopt optimize MODEL --candidates openvino-{recipe.name}` builds and measures it",
        )
    if recipe.gguf_type:
        raise QuantConfigError(
            f"recipe {recipe.name!r} is llama.cpp's own {recipe.gguf_type}: llama.cpp quantizes it",
            hint=f"`llmopt optimize --candidates llamacpp-{recipe.name}` builds and measures it; "
            "`llmopt quantize --export gguf-q8_0` writes a GGUF from here",
        )


def preflight(
    model_meta: nn.Module,
    recipe: Recipe,
    *,
    device: str,
    num_samples: int,
    seq_len: int,
    keep_originals: bool,
) -> Preflight:
    """Raise a typed error with the fix for every mismatch; return the plan otherwise."""
    refuse_engine_recipes(recipe)
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise QuantConfigError(
                f"--device {device} but torch sees no CUDA GPU",
                hint="use --device cpu, or install a CUDA build of torch",
            )
        if recipe.weight_type == "float" or recipe.kv_cache_dtype == "fp8":
            cc = torch.cuda.get_device_capability(torch.device(device))
            if cc < (8, 9):
                raise QuantConfigError(
                    f"recipe {recipe.name!r} makes an FP8 model, but this GPU has compute "
                    f"capability {cc[0]}.{cc[1]}; FP8 kernels need 8.9+ (Ada, Hopper, Blackwell)",
                    hint="use w8a16, w8a8-int8 or w4a16 on this GPU",
                )
    pf = plan_specs(model_meta, recipe)
    bad = []
    for name, spec in pf.specs.items():
        in_f = model_meta.get_submodule(name).in_features
        if spec.granularity == "group" and in_f % spec.group_size:
            bad.append(f"{name} (in_features {in_f})")
    if bad:
        raise QuantConfigError(
            f"group size {recipe.group_size} does not divide the input width of {len(bad)} "
            f"layer(s): {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}",
            hint="pick a group size that divides every width (32 divides most), or add those "
            "layers to the ignore list",
        )
    _memory(model_meta, recipe, pf, device, num_samples, seq_len, keep_originals)
    pf.notes += _asymmetric_notes(pf)
    return pf


def _asymmetric_notes(pf: Preflight) -> list[str]:
    """Where an asymmetric folder does not load (transformers 5.24, compressed-tensors 0.20.1)."""
    if all(s.symmetric for s in pf.specs.values()):
        return []
    why = (
        "transformers (with compressed-tensors 0.20.1) loads asymmetric pack-quantized folders "
        "only with quantization_config=CompressedTensorsConfig(dequantize=True): its default "
        "route lays out unpacked zero points and stops on the size mismatch"
    )
    if len({s for s in pf.specs.values()}) > 1:
        why += (
            "; with per-layer overrides (two or more config groups) that route fails too (it "
            "decompresses every layer with one scheme), so transformers cannot load this folder; "
            "the torch engine (and vLLM, whose kernels read zero points) can"
        )
    return [why]


def _memory(model_meta, recipe, pf, device, num_samples, seq_len, keep_originals) -> None:
    import psutil

    nbytes = dtype_bytes(recipe.dtype)
    n_params = sum(p.numel() for p in model_meta.parameters())
    # The model in host memory, plus float copies of the quantized weights for auto-exclude.
    quantized = sum(model_meta.get_submodule(n).weight.numel() for n in pf.specs)
    pf.host_bytes_needed = n_params * nbytes + (quantized * nbytes if keep_originals else 0)
    avail = psutil.virtual_memory().available
    if pf.host_bytes_needed > avail:
        raise QuantMemoryError(
            f"the model needs {pf.host_bytes_needed / 2**30:.1f} GiB of host memory, "
            f"{avail / 2**30:.1f} GiB is available",
            hint="free memory, drop --auto-exclude (it keeps float copies), or use a bigger host",
        )
    layers = decoder_layers(model_meta)
    layer_bytes = max(sum(p.numel() for p in layer.parameters()) for layer in layers) * nbytes
    hidden = model_meta.config.hidden_size
    inter = getattr(model_meta.config, "intermediate_size", 4 * hidden)
    acts = num_samples * seq_len * hidden * nbytes * 3  # inputs, float and quantized outputs
    stats = 0
    if recipe.algorithm == "gptq":
        # The layer's float32 Hessians (q/k/v, o, gate/up, down inputs), plus GPTQ's working set
        # for the widest one: the damped copy, its Cholesky factor and the inverse's factor
        # (docs/benchmarks.md compares measured peaks with this estimate).
        widest = max(inter, hidden)
        stats = 4 * (3 * hidden * hidden + inter * inter) + 3 * 4 * widest * widest
    work = seq_len * max(inter, hidden) * 4 * 8  # one sample's transient activations
    pf.device_bytes_needed = layer_bytes + acts + stats + work
    if device.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        if pf.device_bytes_needed > free:
            raise QuantMemoryError(
                f"sequential calibration needs about {pf.device_bytes_needed / 2**30:.1f} GiB "
                f"on {device} (one layer, {num_samples} x {seq_len} activations, statistics); "
                f"{free / 2**30:.1f} GiB is free",
                hint="use fewer --samples or a shorter --seq-len",
            )
