"""Recipes: what is done to a model's numbers (precision, quantization), independent of the engine.

A recipe is a frozen config object; presets are registered by name in `RECIPES`. Engines say which
recipes they can run (`Engine.incompatible`); `llmopt.quant.quantize` runs every quantized one.
Accept a preset name or a `Recipe` everywhere:

>>> get_recipe("w8a16").weight_bits
8
>>> get_recipe(Recipe(name="custom", dtype="bfloat16")).dtype
'bfloat16'
>>> get_recipe("w4a16-gptq-g64").group_size
64
>>> get_recipe("w4a16-awq-g64-asym").weight_symmetric
False
>>> Recipe.from_dict(get_recipe("fp8-static").to_dict()) == get_recipe("fp8-static")
True
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Literal

__all__ = ["Recipe", "LayerOverride", "RECIPES", "register_recipe", "get_recipe"]

DTYPES = ("float32", "bfloat16", "float16")
ALGORITHMS = ("rtn", "awq", "gptq", "smoothquant")
ACTIVATIONS = ("none", "dynamic-int8", "dynamic-fp8", "static-fp8", "static-int8")
GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class LayerOverride:
    """Change the recipe for the linear layers whose name matches `pattern` (a suffix, e.g.
    "mlp.down_proj", or a full name, "model.layers.3.self_attn.q_proj").

    Args:
        pattern: module name suffix.
        weight_bits: 4 or 8 for these layers; None keeps the recipe's.
        group_size: group size for these layers (4-bit only); None keeps the recipe's.
    """

    pattern: str
    weight_bits: int | None = None
    group_size: int | None = None

    def __post_init__(self) -> None:
        if self.weight_bits not in (None, 4, 8):
            raise ValueError(f"override {self.pattern!r}: weight_bits must be 4 or 8")
        if self.group_size not in (None, *GROUP_SIZES):
            raise ValueError(f"override {self.pattern!r}: group_size must be one of {GROUP_SIZES}")

    def matches(self, name: str) -> bool:
        return name == self.pattern or name.endswith("." + self.pattern)


@dataclass(frozen=True)
class Recipe:
    """One way to change a model's numbers.

    Args:
        name: preset name, used in candidate ids and reports.
        dtype: the compute/storage dtype of everything that is not quantized.
        weight_bits: None (no weight quantization), 8 or 4.
        weight_granularity: "channel" (one scale per output row), "tensor", or "group"
            (one scale per `group_size` input columns of a row; needs `group_size`).
        activations: "none" (weight-only: activations stay in `dtype`), "dynamic-int8"
            (int8 per token at run time), "dynamic-fp8" (FP8 E4M3 per token at run time) or
            "static-fp8" (FP8 E4M3, one scale per layer input from calibration) or "static-int8"
            (int8, scales per activation tensor from calibration: OpenVINO/NNCF's static PTQ).
        ignore: module name suffixes left unquantized (the output head by default: it is the most
            sensitive layer and, tied to the embeddings, often shared).
        weight_type: "int" or "float" (FP8 E4M3, needs weight_bits=8).
        group_size: 32, 64 or 128 with weight_granularity="group".
        algorithm: how weights are rounded. "rtn" (round to nearest), "awq" (activation-aware
            per-channel scaling folded into the previous op, then RTN), "gptq" (second-order error
            compensation, column by column), "smoothquant" (moves activation outliers into the
            weights before int8 activation quantization).
        smoothing_alpha: SmoothQuant migration strength (0..1).
        kv_cache_dtype: None (KV cache in `dtype`) or "fp8" (E4M3 with calibrated per-layer
            k/v scales).
        overrides: per-layer changes (`LayerOverride`), first match wins.
        weight_observer: how weight scales are chosen: "absmax" (int: max|w| / 7.5 at 4 bits,
            / 127.5 at 8; FP8: / 448) or "mse" (per channel/group, that scale times the factor
            in [0.80, 1.00] with the smallest squared rounding error, as llm-compressor's `mse`
            observer). The scale is stored, so kernels compute the same numbers either way.
        weight_symmetric: True (zero point 0: codes -8..7 x scale at 4 bits) or False (a zero
            point per group/channel: the group's [min, max] spread over all 16 codes,
            compressed-tensors' `symmetric: false`, what AutoAWQ and GPTQ default to). False is
            for 4-bit weight-only int recipes (`-asym` presets); layers that an override puts at
            8 bits stay symmetric.
        gguf_type: one of llama.cpp's own block types ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M",
            "Q4_0"), written by llama.cpp's quantizer; only engines that run GGUF take it.
    """

    name: str
    dtype: str = "float32"
    weight_bits: int | None = None
    weight_granularity: Literal["channel", "tensor", "group"] = "channel"
    activations: Literal["none", "dynamic-int8", "dynamic-fp8", "static-fp8", "static-int8"] = (
        "none"
    )
    ignore: tuple[str, ...] = ("lm_head",)
    description: str = ""
    extra: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    weight_type: Literal["int", "float"] = "int"
    group_size: int | None = None
    algorithm: Literal["rtn", "awq", "gptq", "smoothquant"] = "rtn"
    smoothing_alpha: float = 0.5
    kv_cache_dtype: Literal["fp8"] | None = None
    overrides: tuple[LayerOverride, ...] = ()
    weight_observer: Literal["absmax", "mse"] = "absmax"
    weight_symmetric: bool = True
    gguf_type: str | None = None

    def __post_init__(self) -> None:
        n = self.name
        if self.gguf_type is not None and (
            self.weight_bits or self.activations != "none" or self.kv_cache_dtype
        ):
            raise ValueError(f"recipe {n!r}: a GGUF type is the whole quantization; drop the rest")
        if self.dtype not in DTYPES:
            raise ValueError(f"recipe {n!r}: dtype {self.dtype!r} is not one of {DTYPES}")
        if self.weight_bits not in (None, 4, 8):
            raise ValueError(
                f"recipe {n!r}: weight_bits={self.weight_bits} is not supported; "
                "use 8, 4 or None (no weight quantization)"
            )
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"recipe {n!r}: activations must be one of {ACTIVATIONS}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"recipe {n!r}: algorithm must be one of {ALGORITHMS}")
        if self.weight_type not in ("int", "float"):
            raise ValueError(f"recipe {n!r}: weight_type must be 'int' or 'float'")
        if self.activations != "none" and self.weight_bits != 8:
            raise ValueError(f"recipe {n!r}: quantized activations need weight_bits=8")
        if self.activations in ("dynamic-int8", "static-int8") and self.weight_type != "int":
            raise ValueError(f"recipe {n!r}: int8 activations need int8 weights")
        if self.activations in ("dynamic-fp8", "static-fp8") and self.weight_type != "float":
            raise ValueError(f"recipe {n!r}: FP8 activations need weight_type='float' (FP8)")
        if self.weight_type == "float" and self.weight_bits != 8:
            raise ValueError(f"recipe {n!r}: float weights are FP8 E4M3: set weight_bits=8")
        if self.weight_type == "float" and self.algorithm != "rtn":
            raise ValueError(f"recipe {n!r}: FP8 weights are rounded to nearest (algorithm='rtn')")
        if self.weight_granularity == "group":
            if self.group_size not in GROUP_SIZES:
                raise ValueError(
                    f"recipe {n!r}: group quantization needs group_size in {GROUP_SIZES}"
                )
            if self.weight_type != "int":
                raise ValueError(f"recipe {n!r}: group scales are for int weights only")
        elif self.group_size is not None:
            raise ValueError(
                f"recipe {n!r}: group_size={self.group_size} needs weight_granularity='group'"
            )
        if self.algorithm == "smoothquant" and self.activations != "dynamic-int8":
            raise ValueError(f"recipe {n!r}: smoothquant is for int8 activations (w8a8-int8)")
        if self.algorithm in ("awq", "gptq") and self.weight_bits is None:
            raise ValueError(f"recipe {n!r}: {self.algorithm} needs quantized weights")
        if not 0.0 <= self.smoothing_alpha <= 1.0:
            raise ValueError(f"recipe {n!r}: smoothing_alpha must be in [0, 1]")
        if self.weight_observer not in ("absmax", "mse"):
            raise ValueError(f"recipe {n!r}: weight_observer must be 'absmax' or 'mse'")
        if not isinstance(self.weight_symmetric, bool):
            raise ValueError(f"recipe {n!r}: weight_symmetric must be True or False")
        if not self.weight_symmetric and (
            self.weight_bits != 4 or self.weight_type != "int" or self.activations != "none"
        ):
            raise ValueError(
                f"recipe {n!r}: asymmetric weights (weight_symmetric=False) are for 4-bit "
                "weight-only int recipes (w4a16); 8-bit and FP8 weights are symmetric"
            )
        if not self.weight_symmetric and self.weight_granularity == "tensor":
            raise ValueError(
                f"recipe {n!r}: asymmetric weights need weight_granularity 'group' or 'channel' "
                "(compressed-tensors stores zero points per group or channel only)"
            )
        if self.kv_cache_dtype not in (None, "fp8"):
            raise ValueError(f"recipe {n!r}: kv_cache_dtype must be None or 'fp8'")
        if not isinstance(self.ignore, tuple):
            object.__setattr__(self, "ignore", tuple(self.ignore))
        ov = tuple(
            o if isinstance(o, LayerOverride) else LayerOverride(**o) for o in self.overrides
        )
        object.__setattr__(self, "overrides", ov)

    @property
    def quantized(self) -> bool:
        return self.weight_bits is not None or self.kv_cache_dtype is not None

    @property
    def calibrated(self) -> bool:
        """Whether the checkpoint comes from the quantization pipeline (`llmopt.quant`: minutes
        per build, not seconds) rather than an engine's own writer: 4-bit weights, AWQ, GPTQ,
        SmoothQuant, FP8, a calibrated KV cache. The build stage runs it before the engine.

        >>> get_recipe("w4a16").calibrated, get_recipe("w8a16").calibrated
        (True, False)
        """
        return (
            self.weight_bits == 4
            or self.algorithm != "rtn"
            or self.weight_type == "float"
            or self.kv_cache_dtype is not None
        )

    def with_changes(self, **changes: Any) -> Recipe:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ignore"] = list(self.ignore)
        d["overrides"] = [asdict(o) for o in self.overrides]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Recipe:
        """Inverse of `to_dict` (unknown keys are an error, so typos do not pass silently)."""
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown recipe fields {sorted(unknown)}; known: {sorted(known)}")
        d = dict(d)
        d["ignore"] = tuple(d.get("ignore", ("lm_head",)))
        d["overrides"] = tuple(LayerOverride(**o) for o in d.get("overrides", ()))
        return cls(**d)


RECIPES: dict[str, Recipe] = {}


def register_recipe(recipe: Recipe) -> Recipe:
    assert recipe.name not in RECIPES, f"recipe {recipe.name!r} registered twice"
    RECIPES[recipe.name] = recipe
    return recipe


def get_recipe(recipe: str | Recipe) -> Recipe:
    """Return the preset named `recipe`, or `recipe` itself if it is already a Recipe."""
    if isinstance(recipe, Recipe):
        return recipe
    try:
        return RECIPES[recipe]
    except KeyError:
        raise ValueError(
            f"unknown recipe {recipe!r}; choose one of: {', '.join(sorted(RECIPES))}"
        ) from None


register_recipe(Recipe("fp32", "float32", description="full precision, the reference"))
register_recipe(Recipe("bf16", "bfloat16", description="bfloat16 weights and compute"))
register_recipe(Recipe("fp16", "float16", description="float16 weights and compute"))
register_recipe(
    Recipe(
        "w8a16",
        "float32",
        weight_bits=8,
        description="int8 weights (per output channel, symmetric), activations unquantized",
    )
)
register_recipe(
    Recipe(
        "w8a8-dynamic",
        "float32",
        weight_bits=8,
        activations="dynamic-int8",
        description="int8 weights per channel, activations quantized to int8 at run time",
    )
)

# 4-bit weight-only. GPTQ is the default: on smollm2-135m it gave the lowest perplexity of the
# three at g128 (docs/quantization.md has the table), and it needs no architecture mapping.
# Every preset has an asymmetric twin named with "-asym" at the end (compressed-tensors' W4A16 vs
# W4A16_ASYM): a zero point per group, as AutoAWQ and GPTQ default to. The unsuffixed names stay
# symmetric, so earlier results and artifacts keep their meaning.
_W4_DEFAULT = "gptq"
for _sym, _suffix in ((True, ""), (False, "-asym")):
    _kind = "" if _sym else " asymmetric (zero point per group)"
    for _alg in ("rtn", "awq", "gptq"):
        for _g in GROUP_SIZES:
            register_recipe(
                Recipe(
                    f"w4a16-{_alg}-g{_g}{_suffix}",
                    "float32",
                    weight_bits=4,
                    weight_granularity="group",
                    group_size=_g,
                    algorithm=_alg,
                    weight_symmetric=_sym,
                    # GPTQ chooses its static group scales up front, so the mse search costs
                    # one pass per weight; on SmolLM2 g64 it took GPTQ from +25.8% to +21.7%.
                    weight_observer="mse" if _alg == "gptq" else "absmax",
                    description=f"int4{_kind} weights, groups of {_g}, {_alg.upper()}; "
                    "activations unquantized",
                )
            )
        register_recipe(  # g128 by default
            replace(RECIPES[f"w4a16-{_alg}-g128{_suffix}"], name=f"w4a16-{_alg}{_suffix}")
        )
    register_recipe(replace(RECIPES[f"w4a16-{_W4_DEFAULT}-g128{_suffix}"], name=f"w4a16{_suffix}"))
register_recipe(
    Recipe(
        "w8a8-int8",
        "float32",
        weight_bits=8,
        activations="dynamic-int8",
        algorithm="smoothquant",
        description="SmoothQuant, int8 weights per channel, int8 activations per token (dynamic)",
    )
)
register_recipe(
    Recipe(
        "w8a8-static",
        "float32",
        weight_bits=8,
        activations="static-int8",
        description="int8 weights per channel, int8 activations with calibrated static scales "
        "(post-training quantization as NNCF does it)",
    )
)
register_recipe(
    Recipe(
        "fp8-dynamic",
        "float32",
        weight_bits=8,
        weight_type="float",
        activations="dynamic-fp8",
        weight_observer="mse",
        description="FP8 E4M3 weights per channel (mse scales), FP8 activations per token (dynamic)",
    )
)
register_recipe(
    Recipe(
        "fp8-static",
        "float32",
        weight_bits=8,
        weight_type="float",
        activations="static-fp8",
        weight_observer="mse",
        description="FP8 E4M3 weights per channel (mse scales), FP8 activations with calibrated "
        "per-layer scales",
    )
)
register_recipe(
    Recipe(
        "kv-fp8",
        "float32",
        kv_cache_dtype="fp8",
        description="FP8 E4M3 KV cache with calibrated per-layer k/v scales; weights unchanged",
    )
)

# llama.cpp's own quantization types, the ones users pick by hand (K-quants mix block sizes and
# keep the most sensitive tensors in more bits). Run by the `llamacpp` engine only.
GGUF_TYPES = {
    "Q8_0": "8-bit blocks of 32 (llama.cpp Q8_0)",
    "Q6_K": "6-bit k-quant super-blocks (llama.cpp Q6_K)",
    "Q5_K_M": "5-bit k-quants, sensitive tensors in 6 bits (llama.cpp Q5_K_M)",
    "Q4_K_M": "4-bit k-quants, sensitive tensors in 6 bits (llama.cpp Q4_K_M)",
    "Q4_0": "4-bit blocks of 32 (llama.cpp Q4_0)",
}
for _type, _desc in GGUF_TYPES.items():
    register_recipe(Recipe(f"gguf-{_type.lower()}", "float32", gguf_type=_type, description=_desc))
