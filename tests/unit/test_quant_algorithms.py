"""Quantization arithmetic against compressed-tensors' own compressors, and the algorithms
against round-to-nearest on the same data."""

from __future__ import annotations

import pytest
import torch

from llmopt.quant import algorithms
from llmopt.quant.export_ct import compressed_state, format_for, scheme_for
from llmopt.quant.primitives import (
    WeightSpec,
    dequantize_weight,
    fake_quant_activation,
    fake_quant_weight,
    sqnr_db,
)
from llmopt.quant.sequential import QuantizedLinear

SPECS = {
    "int4-g32": (WeightSpec(4, "int", "group", 32), "none"),
    "int8-channel": (WeightSpec(8, "int", "channel"), "none"),
    "int8-w8a8": (WeightSpec(8, "int", "channel"), "dynamic-int8"),
    "fp8-channel": (WeightSpec(8, "float", "channel"), "dynamic-fp8"),
    "fp8-static": (WeightSpec(8, "float", "channel"), "static-fp8"),
}


@pytest.mark.parametrize("key", sorted(SPECS))
def test_codes_match_compressed_tensors_and_decompress_back(key):
    from compressed_tensors.compressors import BaseCompressor

    spec, act = SPECS[key]
    torch.manual_seed(0)
    w = torch.randn(48, 96)
    q, s = algorithms.rtn(w, spec)
    ql = QuantizedLinear("x", spec, q, s, act, torch.tensor([0.1]) if act == "static-fp8" else None)
    stored = compressed_state(ql, torch.float32)
    fmt = format_for(spec, act)
    if fmt == "pack-quantized":
        assert stored["weight_packed"].dtype == torch.int32
        assert stored["weight_packed"].shape == (48, 96 * spec.bits // 32)
        assert stored["weight_shape"].tolist() == [48, 96]
    else:
        want = torch.float8_e4m3fn if spec.type == "float" else torch.int8
        assert stored["weight"].dtype == want
        assert torch.equal(stored["weight"].float(), q.float())  # exactly our codes
    if act == "static-fp8":
        assert stored["input_scale"].shape == (1,)
    scheme = scheme_for(spec, act, ["Linear"])
    back = BaseCompressor.get_value_from_registry(fmt).decompress(dict(stored), scheme)
    torch.testing.assert_close(back["weight"].float(), dequantize_weight(q, s, spec))


def test_fake_quant_error_shrinks_with_bits_and_groups():
    torch.manual_seed(0)
    w = torch.randn(64, 256)
    e4c = sqnr_db(w, fake_quant_weight(w, WeightSpec(4, "int", "channel")))
    e4g = sqnr_db(w, fake_quant_weight(w, WeightSpec(4, "int", "group", 32)))
    e8 = sqnr_db(w, fake_quant_weight(w, WeightSpec(8, "int", "channel")))
    efp8 = sqnr_db(w, fake_quant_weight(w, WeightSpec(8, "float", "channel")))
    assert e4c < e4g < efp8 < e8
    assert e8 > 35  # int8 per channel on Gaussian weights: ~40 dB


def _correlated_inputs(n=2048, d=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, 8, generator=g) @ torch.randn(8, d, generator=g)
    x = base + 0.1 * torch.randn(n, d, generator=g)
    x[:, :4] *= 20  # a few outlier channels, as in real LLM activations
    return x


def test_gptq_beats_rtn_on_output_error():
    torch.manual_seed(1)
    x = _correlated_inputs()
    w = torch.randn(64, 128)
    spec = WeightSpec(4, "int", "group", 32)
    ref = x @ w.T
    q_rtn, s_rtn = algorithms.rtn(w, spec)
    q_g, s_g = algorithms.gptq(w, x.T @ x, spec)
    err_rtn = (x @ dequantize_weight(q_rtn, s_rtn, spec).T - ref).pow(2).mean()
    err_gptq = (x @ dequantize_weight(q_g, s_g, spec).T - ref).pow(2).mean()
    assert err_gptq < 0.7 * err_rtn
    assert q_g.min() >= -8 and q_g.max() <= 7


def test_awq_scales_are_no_worse_than_rtn():
    torch.manual_seed(2)
    x = _correlated_inputs(seed=2)
    ws = [torch.randn(32, 128), torch.randn(48, 128)]
    spec = WeightSpec(4, "int", "group", 32)
    s = algorithms.awq_search(x, ws, [spec, spec])

    def err(scale):
        return sum(
            (x @ (fake_quant_weight(w * scale, spec) / scale).T - x @ w.T).pow(2).mean() for w in ws
        )

    assert err(s) <= err(torch.ones(128))
    assert not torch.equal(s, torch.ones(128))  # outlier channels get scaled


def test_smoothquant_moves_outliers_out_of_activations():
    x = _correlated_inputs(seed=3)
    w = torch.randn(64, 128)
    s = algorithms.smoothquant_scales(x.abs().amax(0), [w], 0.5)
    ref = x @ w.T

    def w8a8_err(xs, ws):
        xq = fake_quant_activation(xs, "dynamic-int8")
        wq = fake_quant_weight(ws, WeightSpec(8, "int", "channel"))
        return (xq @ wq.T - ref).pow(2).mean()

    assert w8a8_err(x / s, w * s) < w8a8_err(x, w)


def test_static_fp8_activation_uses_the_given_scale():
    x = torch.tensor([[1.0, -2.0, 500.0]])
    y = fake_quant_activation(x, "static-fp8", torch.tensor([1.0]))
    assert y[0, 2] == 448.0  # clipped at the FP8 range of that scale
    assert sqnr_db(x[:, :2], y[:, :2]) > 30
