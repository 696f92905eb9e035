"""FP8 E4M3 arithmetic (weights and dynamic per-token activations) and the mse scale observer."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llmopt.core.recipes import Recipe, get_recipe
from llmopt.quant import algorithms
from llmopt.quant.export_ct import compressed_state, format_for, quantization_config, scheme_for
from llmopt.quant.primitives import (
    FP8_MAX,
    WeightSpec,
    dequantize_weight,
    fake_quant_activation,
    fake_quant_weight,
    mse_weight_scale,
    weight_scale,
)
from llmopt.quant.sequential import QuantizedLinear

FP8 = WeightSpec(8, "float", "channel")


def _heavy_tailed(out=32, inp=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g)
    w[:, :3] *= 8  # a few large columns, as real weights have
    return w * torch.distributions.Exponential(1.0).sample((out, 1))  # rows of different sizes


def test_fp8_max_is_e4m3fn_largest_finite():
    assert FP8_MAX == torch.finfo(torch.float8_e4m3fn).max == 448.0


def test_e4m3_round_trip_exact_on_grid_and_within_half_ulp_elsewhere():
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)]
    assert torch.equal(grid.to(torch.float8_e4m3fn).float(), grid)  # representable: exact
    x = torch.linspace(2.0**-6, 448.0, 10001)  # normal range: 3 mantissa bits
    rel = ((x.to(torch.float8_e4m3fn).float() - x) / x).abs()
    assert rel.max() <= 2.0**-4 + 1e-7  # round to nearest: at most half a step (1/16 relative)


def test_fp8_weight_codes_keep_row_absmax_and_rows_independent():
    w = _heavy_tailed()
    q, s, _ = algorithms.rtn(w, FP8)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (32, 1)
    assert torch.equal(q.float().abs().amax(1), torch.full((32,), 448.0))  # absmax -> 448
    w2 = w.clone()
    w2[0] *= 100
    q2, s2, _ = algorithms.rtn(w2, FP8)
    assert torch.equal(q2[1:].float(), q[1:].float()) and torch.equal(s2[1:], s[1:])


def test_dynamic_fp8_activation_scale_is_per_token_absmax_over_448():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 64, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 1e3, 7.0]).view(1, 5, 1)
    y = fake_quant_activation(x, "dynamic-fp8")
    amax = x.abs().amax(-1, keepdim=True)
    s = amax / FP8_MAX  # fp32, per token (vLLM's dynamic per-token FP8)
    want = (x / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s
    assert torch.equal(y, want)
    torch.testing.assert_close(y.abs().amax(-1, keepdim=True), amax)  # max element is exact
    rel = ((y - x).abs() / x.abs()).flatten()
    assert rel[x.abs().flatten() > (amax * 2.0**-6 / 448).expand_as(x).flatten()].max() <= 2.0**-4
    x2 = x.clone()
    x2[0, 0] *= 1e4  # another token's range does not change this one's codes
    y2 = fake_quant_activation(x2, "dynamic-fp8")
    assert torch.equal(y2[0, 1:], y[0, 1:]) and torch.equal(y2[1], y[1])


@pytest.mark.parametrize(
    "spec",
    [
        FP8,
        WeightSpec(8, "float", "tensor"),
        WeightSpec(8, "int", "channel"),
        WeightSpec(4, "int", "group", 32),
        WeightSpec(8, "float", "channel", torch.bfloat16),
    ],
    ids=["fp8-channel", "fp8-tensor", "int8-channel", "int4-g32", "fp8-bf16-scales"],
)
def test_mse_scale_never_worse_than_absmax(spec):
    mse_spec = dataclasses.replace(spec, observer="mse")
    total_abs, total_mse = 0.0, 0.0
    for seed in range(4):
        w = _heavy_tailed(seed=seed)
        e_abs = (fake_quant_weight(w, spec) - w).pow(2)
        e_mse = (fake_quant_weight(w, mse_spec) - w).pow(2)
        if spec.granularity == "channel":  # per channel, not only in total
            assert (e_mse.sum(1) <= e_abs.sum(1) * (1 + 1e-6)).all()
        total_abs, total_mse = total_abs + e_abs.sum().item(), total_mse + e_mse.sum().item()
        s_abs, s_mse = weight_scale(w, spec), mse_weight_scale(w, spec)
        assert s_mse.shape == s_abs.shape and s_mse.dtype == spec.scale_dtype
        ratio = s_mse.float() / s_abs.float()
        assert (ratio <= 1 + 1e-2).all() and (ratio >= 0.8 - 1e-2).all()  # absmax x [0.8, 1]
    assert total_mse < total_abs  # and it does find something better on these weights


def test_mse_scale_codes_match_compressed_tensors_and_config_says_mse():
    from compressed_tensors.compressors import BaseCompressor

    spec = dataclasses.replace(FP8, observer="mse")
    w = _heavy_tailed()
    q, s, _ = algorithms.rtn(w, spec)
    assert not torch.equal(s, weight_scale(w, FP8))  # the mse scales are the stored ones
    ql = QuantizedLinear("x", spec, q, s, "dynamic-fp8")
    stored = compressed_state(ql, torch.float32)
    assert torch.equal(stored["weight"].float(), q.float())  # the compressor writes our codes
    assert torch.equal(stored["weight_scale"], s)
    fmt = format_for(spec, "dynamic-fp8")
    back = BaseCompressor.get_value_from_registry(fmt).decompress(
        dict(stored), scheme_for(spec, "dynamic-fp8", ["Linear"])
    )
    assert torch.equal(back["weight"].float(), dequantize_weight(q, s, spec))
    cfg = quantization_config(get_recipe("fp8-dynamic"), {"x": ql}, ["lm_head"], False)
    assert cfg["config_groups"]["group_0"]["weights"]["observer"] == "mse"


def test_fp8_presets_use_the_mse_observer_and_recipes_validate_it():
    assert get_recipe("fp8-dynamic").weight_observer == "mse"
    assert get_recipe("fp8-static").weight_observer == "mse"
    assert get_recipe("w8a16").weight_observer == "absmax"
    r = get_recipe("fp8-dynamic")
    assert Recipe.from_dict(r.to_dict()) == r
    with pytest.raises(ValueError, match="weight_observer"):
        r.with_changes(weight_observer="minmax")
