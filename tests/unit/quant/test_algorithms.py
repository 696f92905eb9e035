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
    weight_qparams,
)
from llmopt.quant.sequential import QuantizedLinear

ASYM_G32 = WeightSpec(4, "int", "group", 32, symmetric=False)
SPECS = {
    "int4-g32": (WeightSpec(4, "int", "group", 32), "none"),
    "int4-g32-asym": (ASYM_G32, "none"),
    "int4-channel-asym": (WeightSpec(4, "int", "channel", symmetric=False), "none"),
    "int8-channel": (WeightSpec(8, "int", "channel"), "none"),
    "int8-w8a8": (WeightSpec(8, "int", "channel"), "dynamic-int8"),
    "fp8-channel": (WeightSpec(8, "float", "channel"), "dynamic-fp8"),
    "fp8-static": (WeightSpec(8, "float", "channel"), "static-fp8"),
}


@pytest.mark.parametrize("key", sorted(SPECS))
def test_codes_match_compressed_tensors_and_decompress_back(key):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    spec, act = SPECS[key]
    torch.manual_seed(0)
    w = torch.randn(48, 96) + 0.5  # off-center rows: asymmetric zero points are not all alike
    q, s, z = algorithms.rtn(w, spec)
    assert (z is None) == spec.symmetric
    ql = QuantizedLinear("x", spec, q, s, act, torch.tensor([0.1]) if act == "static-fp8" else None)
    ql.zero_point = z
    stored = compressed_state(ql, torch.float32)
    fmt = format_for(spec, act)
    if fmt == "pack-quantized":
        assert stored["weight_packed"].dtype == torch.int32
        assert stored["weight_packed"].shape == (48, 96 * spec.bits // 32)
        assert stored["weight_shape"].tolist() == [48, 96]
        # The packed words hold our codes exactly (compressed-tensors re-quantizes on compress).
        assert torch.equal(unpack_from_int32(stored["weight_packed"], spec.bits, (48, 96)), q)
        if spec.symmetric:
            assert "weight_zero_point" not in stored
        else:
            # Zero points: int32 words packed along the output dim, 8 per word at 4 bits,
            # stored unsigned (z + 8); they unpack to ours, in the signed code range.
            zp = stored["weight_zero_point"]
            assert zp.dtype == torch.int32 and zp.shape == (48 * 4 // 32, s.shape[1])
            assert torch.equal(unpack_from_int32(zp, 4, z.shape, packed_dim=0), z)
            assert z.min() >= -8 and z.max() <= 7 and len(z.unique()) > 1
            assert q.min() == -8 and q.max() == 7  # the whole range of codes is used
    else:
        want = torch.float8_e4m3fn if spec.type == "float" else torch.int8
        assert stored["weight"].dtype == want
        assert torch.equal(stored["weight"].float(), q.float())  # exactly our codes
    if act == "static-fp8":
        assert stored["input_scale"].shape == (1,)
    scheme = scheme_for(spec, act, ["Linear"])
    back = BaseCompressor.get_value_from_registry(fmt).decompress(dict(stored), scheme)
    torch.testing.assert_close(back["weight"].float(), dequantize_weight(q, s, spec, z))


def test_asymmetric_qparams_are_compressed_tensors_own():
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    torch.manual_seed(3)
    w = torch.randn(16, 64) * torch.rand(16, 1) + torch.randn(16, 1)
    w[0, :32] = w[0, :32].abs() + 0.1  # a group of positive weights only: the range still has 0
    args = QuantizationArgs(
        num_bits=4, type="int", symmetric=False, strategy="group", group_size=32
    )
    g = w.reshape(16, 2, 32)
    ct_s, ct_z = calculate_qparams(g.amin(-1), g.amax(-1), args)
    s, z = weight_qparams(w, ASYM_G32)
    assert torch.equal(s, ct_s) and torch.equal(z, ct_z) and z.dtype == ct_z.dtype == torch.int8
    assert z[0, 0] == -8  # min clamped to 0 -> zero point at the lowest code
    torch.testing.assert_close(fake_quant_weight(w, ASYM_G32), fake_quantize(w, s, z, args))
    # 0 is exactly representable, and the error is at most half a step inside the range.
    assert fake_quant_weight(torch.zeros(2, 32), ASYM_G32).abs().max() == 0
    step = s.repeat_interleave(32, 1)
    assert ((fake_quant_weight(w, ASYM_G32) - w).abs() <= step / 2 + 1e-6).all()


def test_asymmetric_beats_symmetric_on_off_center_groups():
    torch.manual_seed(4)
    w = torch.randn(64, 256) * 0.5 + torch.randn(64, 1)  # rows not centered on 0
    sym, mse = WeightSpec(4, "int", "group", 32), WeightSpec(4, "int", "group", 32, observer="mse")
    asym_mse = WeightSpec(4, "int", "group", 32, observer="mse", symmetric=False)
    e_sym, e_asym = (
        sqnr_db(w, fake_quant_weight(w, sym)),
        sqnr_db(w, fake_quant_weight(w, ASYM_G32)),
    )
    assert e_asym > e_sym + 2  # one more bit of range used: ~6 dB at best
    assert sqnr_db(w, fake_quant_weight(w, asym_mse)) >= e_asym
    assert sqnr_db(w, fake_quant_weight(w, mse)) >= e_sym


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
    q_rtn, s_rtn, _ = algorithms.rtn(w, spec)
    q_g, s_g, z_g = algorithms.gptq(w, x.T @ x, spec)
    assert z_g is None
    err_rtn = (x @ dequantize_weight(q_rtn, s_rtn, spec).T - ref).pow(2).mean()
    err_gptq = (x @ dequantize_weight(q_g, s_g, spec).T - ref).pow(2).mean()
    assert err_gptq < 0.7 * err_rtn
    assert q_g.min() >= -8 and q_g.max() <= 7


def test_asymmetric_gptq_rounds_each_column_with_its_groups_scale_and_zero_point():
    torch.manual_seed(1)
    w = torch.randn(64, 128) + 0.3
    # Uncorrelated inputs (H = I): no error to spread, so GPTQ must equal RTN bit for bit, which
    # holds only if every column is rounded with its own group's scale and zero point.
    q_r, s_r, z_r = algorithms.rtn(w, ASYM_G32)
    q_i, s_i, z_i = algorithms.gptq(w, torch.eye(128), ASYM_G32)
    assert torch.equal(q_i, q_r) and torch.equal(s_i, s_r) and torch.equal(z_i, z_r)
    x = _correlated_inputs()
    ref = x @ w.T
    q_g, s_g, z_g = algorithms.gptq(w, x.T @ x, ASYM_G32)
    assert z_g.dtype == torch.int8 and z_g.shape == s_g.shape == (64, 4)
    assert q_g.min() >= -8 and q_g.max() <= 7 and z_g.min() >= -8 and z_g.max() <= 7
    err_rtn = (x @ dequantize_weight(q_r, s_r, ASYM_G32, z_r).T - ref).pow(2).mean()
    err_gptq = (x @ dequantize_weight(q_g, s_g, ASYM_G32, z_g).T - ref).pow(2).mean()
    assert err_gptq < 0.7 * err_rtn
    sym = WeightSpec(4, "int", "group", 32)
    q_s, s_s, _ = algorithms.gptq(w, x.T @ x, sym)
    assert err_gptq < (x @ dequantize_weight(q_s, s_s, sym).T - ref).pow(2).mean()


def test_gptq_activation_order_puts_the_loud_inputs_first_and_keeps_the_layout():
    torch.manual_seed(3)
    x = _correlated_inputs(seed=3).flip(
        1
    )  # the outlier channels last: left to right sees them last
    w = torch.randn(64, 128)
    spec = WeightSpec(4, "int", "group", 32)
    ref = x @ w.T

    def err(q, s):
        return (x @ dequantize_weight(q, s, spec).T - ref).pow(2).mean()

    q_a, s_a, _ = algorithms.gptq(w, x.T @ x, spec)  # actorder is the default
    q_l, s_l, _ = algorithms.gptq(w, x.T @ x, spec, actorder=False)
    # Static groups: the scales are RTN's, whatever the order, so the export needs no g_idx.
    assert torch.equal(s_a, algorithms.rtn(w, spec)[1]) and torch.equal(s_a, s_l)
    assert err(q_a, s_a) < 0.8 * err(q_l, s_l)


@pytest.mark.parametrize("spec", [WeightSpec(4, "int", "group", 32), ASYM_G32])
def test_awq_clip_shrinks_ranges_where_the_inputs_say_it_pays(spec):
    torch.manual_seed(4)
    x = _correlated_inputs(seed=4)
    w = torch.randn(64, 128)
    w[torch.rand(64, 128) < 0.02] *= 6  # a few large weights stretch their groups' ranges
    ref = x @ w.T

    def err(weight):
        q, s, z = algorithms.rtn(weight, spec)
        return (x @ dequantize_weight(q, s, spec, z).T - ref).pow(2).mean()

    clipped = algorithms.awq_clip(w, x, spec, tokens=x.shape[0])
    assert clipped.shape == w.shape and clipped.dtype == w.dtype
    assert (clipped.abs() <= w.abs() + 1e-6).all()  # only ever clipped toward zero
    assert not torch.equal(clipped, w)
    assert err(clipped) < 0.9 * err(w)


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


def test_awq_duo_scaling_weight_term_is_autoawqs():
    # Two linears, group 2: |W| over each group's absmax, averaged over all 3 output rows.
    w1 = torch.tensor([[1.0, -2.0, 4.0, 1.0], [0.5, 0.5, -1.0, 3.0]])
    w2 = torch.tensor([[2.0, 1.0, 0.0, -2.0]])
    mean = algorithms._awq_weight_mean([w1, w2], WeightSpec(4, "int", "group", 2))
    want = torch.tensor(
        [(0.5 + 1 + 1) / 3, (1 + 1 + 0.5) / 3, (1 + 1 / 3 + 0) / 3, (0.25 + 1 + 1) / 3]
    )
    assert torch.allclose(mean, want, atol=1e-5)
    # Duo scaling (the default) searches other candidates than mean|x|^ratio alone; both are
    # no worse than no scaling on inputs with outlier channels.
    x = _correlated_inputs(seed=2)
    ws = [torch.randn(32, 128), torch.randn(48, 128)]
    spec = WeightSpec(4, "int", "group", 32)
    duo = algorithms.awq_search(x, ws, [spec, spec])
    plain = algorithms.awq_search(x, ws, [spec, spec], duo=False)
    assert not torch.equal(duo, plain)


def test_awq_search_scores_candidates_with_the_asymmetric_quantizer():
    torch.manual_seed(2)
    x = _correlated_inputs(seed=2)
    ws = [torch.randn(32, 128) + 0.5, torch.randn(48, 128)]
    sym = WeightSpec(4, "int", "group", 32)
    s_sym = algorithms.awq_search(x, ws, [sym, sym])
    s_asym = algorithms.awq_search(x, ws, [ASYM_G32, ASYM_G32])

    def err(scale):  # output error under the asymmetric quantizer the linears will get
        return sum(
            (x @ (fake_quant_weight(w * scale, ASYM_G32) / scale).T - x @ w.T).pow(2).mean()
            for w in ws
        )

    # Searching with the symmetric quantizer picks another ratio, worse for asymmetric weights.
    assert not torch.equal(s_asym, s_sym)
    assert err(s_asym) < err(s_sym) < err(torch.ones(128))


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
