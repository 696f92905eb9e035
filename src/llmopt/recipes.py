"""Recipes: what is done to a model's numbers (precision, quantization), independent of the engine.

A recipe is a frozen config object; presets are registered by name in `RECIPES`. Engines say which
recipes they can run (`Engine.incompatible`). Accept a preset name or a `Recipe` everywhere:

>>> get_recipe("w8a16").weight_bits
8
>>> get_recipe(Recipe(name="custom", dtype="bfloat16")).dtype
'bfloat16'
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

__all__ = ["Recipe", "RECIPES", "register_recipe", "get_recipe"]

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Recipe:
    """One way to change a model's numbers.

    Args:
        name: preset name, used in candidate ids and reports.
        dtype: the compute/storage dtype of everything that is not quantized.
        weight_bits: None (no weight quantization) or 8 (int8, symmetric).
        weight_granularity: "channel" (one scale per output row) or "tensor".
        activations: "none" (weight-only: activations stay in `dtype`) or "dynamic-int8"
            (activations quantized to int8 at run time; per-token or per-tensor, as the engine does).
        ignore: module name suffixes left unquantized (the output head by default: it is the most
            sensitive layer and, tied to the embeddings, often shared).
    """

    name: str
    dtype: str = "float32"
    weight_bits: int | None = None
    weight_granularity: Literal["channel", "tensor"] = "channel"
    activations: Literal["none", "dynamic-int8"] = "none"
    ignore: tuple[str, ...] = ("lm_head",)
    description: str = ""
    extra: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"recipe {self.name!r}: dtype {self.dtype!r} is not one of {DTYPES}")
        if self.weight_bits not in (None, 8):
            raise ValueError(
                f"recipe {self.name!r}: weight_bits={self.weight_bits} is not supported yet; "
                "use 8 (int8) or None (no weight quantization)"
            )
        if self.activations == "dynamic-int8" and self.weight_bits != 8:
            raise ValueError(f"recipe {self.name!r}: dynamic int8 activations need weight_bits=8")

    @property
    def quantized(self) -> bool:
        return self.weight_bits is not None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ignore"] = list(self.ignore)
        return d


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
