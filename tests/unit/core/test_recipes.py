"""Recipes: presets, validation with the fix in the message, to_dict/from_dict round trip."""

from __future__ import annotations

import pytest

from llmopt.core.recipes import RECIPES, LayerOverride, Recipe, get_recipe


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_preset_round_trips(name):
    r = get_recipe(name)
    assert Recipe.from_dict(r.to_dict()) == r


def test_existing_presets_keep_their_fields():
    w8 = get_recipe("w8a16")
    assert (w8.weight_bits, w8.weight_granularity, w8.activations, w8.ignore) == (
        8,
        "channel",
        "none",
        ("lm_head",),
    )
    assert get_recipe("w8a8-dynamic").activations == "dynamic-int8"
    assert not get_recipe("fp32").quantized and get_recipe("w8a16").quantized


def test_new_presets():
    w4 = get_recipe("w4a16")
    assert (w4.weight_bits, w4.group_size, w4.weight_granularity) == (4, 128, "group")
    assert get_recipe("w4a16-awq-g64").algorithm == "awq"
    assert get_recipe("w4a16-rtn").group_size == 128
    sq = get_recipe("w8a8-int8")
    assert (sq.algorithm, sq.activations) == ("smoothquant", "dynamic-int8")
    fp8 = get_recipe("fp8-static")
    assert (fp8.weight_type, fp8.activations) == ("float", "static-fp8")
    kv = get_recipe("kv-fp8")
    assert kv.kv_cache_dtype == "fp8" and kv.quantized and kv.weight_bits is None


def test_asymmetric_presets_are_twins_of_the_symmetric_ones():
    from dataclasses import replace

    w4 = [n for n in RECIPES if n.startswith("w4a16")]
    sym = [n for n in w4 if not n.endswith("-asym")]
    assert len(sym) == 13 and sorted(w4) == sorted(sym + [n + "-asym" for n in sym])
    for name in sym:  # the existing names stay symmetric; the twin differs only there
        r, a = get_recipe(name), get_recipe(name + "-asym")
        assert r.weight_symmetric and not a.weight_symmetric
        assert replace(a, name=r.name, description=r.description, weight_symmetric=True) == r
    a = get_recipe("w4a16-asym")
    assert (a.algorithm, a.group_size, a.weight_symmetric) == ("gptq", 128, False)
    assert all(get_recipe(n).weight_symmetric for n in RECIPES if not n.endswith("-asym"))
    # Dicts written before the field existed still load (symmetric).
    old = get_recipe("w4a16-rtn-g64").to_dict()
    del old["weight_symmetric"]
    assert Recipe.from_dict(old) == get_recipe("w4a16-rtn-g64")


def test_asymmetric_overrides_to_8_bits_stay_symmetric():
    from torch import nn

    from llmopt.quant.checks import plan_specs

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.up_proj, self.down_proj = nn.Linear(64, 64), nn.Linear(64, 64)

    r = get_recipe("w4a16-rtn-g32-asym").with_changes(
        overrides=(LayerOverride("down_proj", weight_bits=8),)
    )
    specs = plan_specs(Tiny(), r).specs
    assert (specs["up_proj"].bits, specs["up_proj"].symmetric) == (4, False)
    assert (specs["down_proj"].bits, specs["down_proj"].symmetric) == (8, True)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"weight_bits": 3}, "weight_bits=3"),
        ({"weight_bits": 4, "weight_granularity": "group"}, "group_size"),
        ({"weight_bits": 4, "group_size": 64}, "weight_granularity='group'"),
        ({"weight_bits": 4, "weight_type": "float"}, "FP8"),
        ({"weight_bits": 8, "activations": "dynamic-fp8"}, "weight_type='float'"),
        ({"weight_bits": 8, "algorithm": "smoothquant"}, "int8 activations"),
        ({"algorithm": "gptq"}, "quantized weights"),
        ({"kv_cache_dtype": "int4"}, "kv_cache_dtype"),
        ({"weight_bits": 8, "weight_symmetric": False}, "4-bit weight-only"),
        ({"weight_bits": None, "weight_symmetric": False}, "4-bit weight-only"),
        (
            {
                "weight_bits": 8,
                "weight_type": "float",
                "activations": "dynamic-fp8",
                "weight_symmetric": False,
            },
            "4-bit weight-only",
        ),
        ({"weight_bits": 4, "weight_granularity": "tensor", "weight_symmetric": False}, "group"),
        ({"weight_bits": 4, "weight_symmetric": "no"}, "True or False"),
    ],
)
def test_invalid_recipes_say_why(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Recipe("bad", **kwargs)


def test_overrides_and_unknown_fields():
    r = Recipe(
        "mixed",
        weight_bits=4,
        weight_granularity="group",
        group_size=64,
        overrides=({"pattern": "mlp.down_proj", "weight_bits": 8},),
    )
    assert r.overrides == (LayerOverride("mlp.down_proj", weight_bits=8),)
    assert r.overrides[0].matches("model.layers.3.mlp.down_proj")
    assert not r.overrides[0].matches("model.layers.3.mlp.up_proj")
    assert Recipe.from_dict(r.to_dict()) == r
    with pytest.raises(ValueError, match="unknown recipe fields"):
        Recipe.from_dict(r.to_dict() | {"bits": 4})
    with pytest.raises(ValueError, match="unknown recipe"):
        get_recipe("w3a16")
