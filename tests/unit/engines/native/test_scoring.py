"""`scoring.window_logits`: a window scored in three pieces (prefill, paged chunk, one-token
steps) gives the logits of one prefill over the whole window; with it, the norms folded into the
projections (`weights.fold_norms_`) keep the model's logits on every path."""

from __future__ import annotations

import pytest
import torch

from llmopt.engines.native.config import NativeConfig
from llmopt.engines.native.scoring import window_logits
from llmopt.engines.native.weights import random_model


@pytest.mark.parametrize("prefill,decode", [(8, 5), (40, 0), (1, 39)])
def test_pieces_match_one_prefill(prefill, decode, tiny_native):
    model = tiny_native()
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(0))
    got = window_logits(model, ids, prefill, decode, torch.float32, "cpu")
    whole = window_logits(model, ids, 40, 0, torch.float32, "cpu")
    assert got.shape == whole.shape == (40, 128)
    assert torch.allclose(got, whole, atol=1e-4, rtol=1e-4), float((got - whole).abs().max())


def test_window_too_short_is_refused(tiny_native):
    with pytest.raises(ValueError, match="cannot hold prefill=30, decode=20"):
        window_logits(
            tiny_native(), torch.zeros(40, dtype=torch.long), 30, 20, torch.float32, "cpu"
        )


@pytest.mark.parametrize("fuse", [False, True])
def test_folding_the_norms_keeps_the_model(monkeypatch, fuse, tiny_native):
    """`weights.fold_norms_`: the norms' weights moved into the projections, the blocks pass the
    norm along; prefill, paged chunk and one-token steps give the same logits (on the CPU the
    GEMV path declines, so FUSE_NORM on exercises the fallbacks)."""
    from llmopt.engines.native import linear as L
    from llmopt.engines.native.weights import fold_norms_

    monkeypatch.setattr(L, "FUSE_NORM", fuse)
    model = tiny_native()
    gen = torch.Generator().manual_seed(1)
    for b in model.model.layers:  # norms that are not all ones, or the fold proves nothing
        for norm in (b.input_layernorm, b.post_attention_layernorm):
            norm.weight.data = torch.rand(norm.weight.shape, generator=gen) + 0.5
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(0))
    ref = window_logits(model, ids, 8, 5, torch.float32, "cpu")
    assert fold_norms_(model) == len(model.model.layers)
    assert fold_norms_(model) == 0  # once
    assert all(b.norms_folded for b in model.model.layers)
    got = window_logits(model, ids, 8, 5, torch.float32, "cpu")
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), float((got - ref).abs().max())


def test_quantizing_folds_the_norms_where_the_gemv_takes_them(monkeypatch, tiny_native):
    from llmopt.engines.native import linear as L
    from llmopt.engines.native.weights import quantize_model_

    monkeypatch.setattr(L, "FUSE_NORM", True)
    model = tiny_native()
    quantize_model_(model, "int8")  # on the CPU no GEMV takes the norm: the model as it was
    assert not any(b.norms_folded for b in model.model.layers)
    model = tiny_native()
    quantize_model_(model, "int8", fold=True)  # (the default on CUDA)
    assert all(b.norms_folded for b in model.model.layers)
    model = tiny_native()
    quantize_model_(model, "int4", group=32, fold=True)  # no GEMV for int4: nothing to fold for
    assert not any(b.norms_folded for b in model.model.layers)


def _with_norms(model):
    """`model` with norm weights far from one (0.1-4.1, seeded): a fold that moves them shows."""
    gen = torch.Generator().manual_seed(3)
    for b in model.model.layers:
        for norm in (b.input_layernorm, b.post_attention_layernorm):
            norm.weight.data = torch.rand(norm.weight.shape, generator=gen) * 4 + 0.1
    return model


def test_int4_unfolds_the_norms_a_16_bit_load_folded(monkeypatch, tiny_native):
    """A 16-bit model loaded on CUDA has its norms folded (`dense_gemv_`); int4, whose kernels
    take no norm, must not quantize the folded columns (a scale group would span norm weights
    of different sizes: SmolLM2 +89% perplexity instead of +29%). `quantize_model_` unfolds
    them: the same int4 model as from the unfolded weights; `fold=True` keeps the fold."""
    from llmopt.engines.native import linear as L
    from llmopt.engines.native.weights import dense_gemv_, quantize_model_

    monkeypatch.setattr(L, "FUSE_NORM", True)

    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(0))
    plain = _with_norms(tiny_native())
    quantize_model_(plain, "int4", group=32)
    want = window_logits(plain, ids, 8, 5, torch.float32, "cpu")
    folded = _with_norms(tiny_native())
    dense_gemv_(folded)
    assert all(b.norms_folded for b in folded.model.layers)
    quantize_model_(folded, "int4", group=32)
    assert not any(b.norms_folded for b in folded.model.layers)
    norm = folded.model.layers[0].input_layernorm.weight
    assert torch.equal(norm, plain.model.layers[0].input_layernorm.weight)
    got = window_logits(folded, ids, 8, 5, torch.float32, "cpu")
    kept = _with_norms(tiny_native())
    dense_gemv_(kept)
    quantize_model_(kept, "int4", group=32, fold=True)  # (what `real_weights.py --fold-norms`
    assert all(b.norms_folded for b in kept.model.layers)  # measures)
    other = window_logits(kept, ids, 8, 5, torch.float32, "cpu")

    def rel(a):
        return float((a - want).norm() / want.norm())

    # unfolded: a rare code flips where w * g / g rounds across a rounding boundary
    assert rel(got) < 0.03 and rel(other) > 10 * rel(got), (rel(got), rel(other))


@pytest.mark.parametrize(
    "group, ignore, unfolded",
    [
        (128, ("lm_head",), (False, False)),  # K = 64: every normed projection stays 16-bit
        (32, ("lm_head", "gate_up_proj"), (True, False)),  # only q/k/v become int4
        (32, ("lm_head",), (True, True)),
    ],
    ids=["group-too-wide", "mlp-ignored", "all"],
)
def test_int4_unfolds_only_the_norms_before_int4_projections(
    monkeypatch, tiny_native, group, ignore, unfolded
):
    """Where a norm's projections stay 16-bit (a group that does not divide their width, or
    ignored), the norm stays folded, so that the dense GEMV keeps taking it; the rest is
    unfolded before quantizing. The logits are those of the int4 model quantized from the
    unfolded weights either way."""
    from llmopt.engines.native import linear as L
    from llmopt.engines.native.weights import dense_gemv_, quantize_model_

    monkeypatch.setattr(L, "FUSE_NORM", True)

    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(0))
    folded = _with_norms(tiny_native())
    dense_gemv_(folded)
    names = quantize_model_(folded, "int4", ignore=ignore, group=group)
    assert all(n.endswith("down_proj") for n in names) == (group == 128), names
    for b in folded.model.layers:
        norms = (b.input_layernorm, b.post_attention_layernorm)
        assert tuple(not n.folded for n in norms) == unfolded
        assert b.norms_folded == (not all(unfolded))
    want_model = _with_norms(tiny_native())  # (never folded)
    assert quantize_model_(want_model, "int4", ignore=ignore, group=group) == names
    want = window_logits(want_model, ids, 8, 5, torch.float32, "cpu")
    got = window_logits(folded, ids, 8, 5, torch.float32, "cpu")
    # (a rare code flips where w * g / g rounds across a rounding boundary)
    assert float((got - want).norm() / want.norm()) < 0.03


@pytest.mark.parametrize("group", [128, 32], ids=["group-too-wide", "all-int4"])
def test_int4_leaves_its_16_bit_projections_on_the_dense_gemv(monkeypatch, tiny_native, group):
    """Where the one-row GEMV takes the norms (on CUDA), the projections an int4 model leaves
    16-bit (a group wider than their inputs: SmolLM2's 576 at g128) become `DenseLinear` with
    their norm folded, as in a 16-bit model, instead of cuBLAS after a norm kernel; the norms
    before int4 layers stay unfolded, and the logits are those of the plain int4 model."""
    from llmopt.engines.native import linear as L
    from llmopt.engines.native import weights as W

    monkeypatch.setattr(L, "FUSE_NORM", True)
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(0))
    plain = _with_norms(tiny_native())
    names = W.quantize_model_(plain, "int4", group=group)  # (CPU: no GEMV, nothing folded)
    want = window_logits(plain, ids, 8, 5, torch.float32, "cpu")
    monkeypatch.setattr(W, "_gemv_takes_norms", lambda model: True)  # as on CUDA
    model = _with_norms(tiny_native())
    assert W.quantize_model_(model, "int4", group=group) == names
    for b in model.model.layers:
        ins, outs = W._block_projections(b)
        for lins, norm in ((ins, b.input_layernorm), (outs, b.post_attention_layernorm)):
            int4 = [isinstance(m, L.Int4Linear) for m in lins]
            assert norm.folded == (not any(int4)), (group, int4)
            assert all(i or isinstance(m, L.DenseLinear) for i, m in zip(int4, lins, strict=True))
        assert isinstance(b.mlp.down_proj, L.Int4Linear)  # (takes only the residual add)
        assert isinstance(b.self_attn.o_proj, L.Int4Linear if group == 32 else L.DenseLinear)
    got = window_logits(model, ids, 8, 5, torch.float32, "cpu")
    # (the fold's rounding, then the int4 kernel's 16-bit activations)
    assert float((got - want).norm() / want.norm()) < 2e-3, float((got - want).abs().max())


def test_dense_gemv_folds_and_keeps_the_model(monkeypatch, tiny_native):
    """`weights.dense_gemv_` (16-bit models under FUSE_NORM): the norms folded, every block's
    projections made `DenseLinear` (lm_head left alone), the logits unchanged; on the CPU the
    layers decline the GEMV and run the dense matmul."""
    from llmopt.engines.native import linear as L
    from llmopt.engines.native.weights import dense_gemv_

    monkeypatch.setattr(L, "FUSE_NORM", True)
    model = tiny_native()
    for b in model.model.layers:
        for norm in (b.input_layernorm, b.post_attention_layernorm):
            norm.weight.data = torch.rand(norm.weight.shape, generator=torch.Generator()) + 0.5
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(0))
    ref = window_logits(model, ids, 8, 5, torch.float32, "cpu")
    names = dense_gemv_(model)
    assert len(names) == 4 * len(model.model.layers), names  # qkv, o, gate_up, down
    assert all(isinstance(model.get_submodule(n), L.DenseLinear) for n in names)
    assert type(model.lm_head) is torch.nn.Linear
    assert dense_gemv_(model) == []  # once
    row = torch.ones(1, 1, model.cfg.dim)
    norm = model.model.layers[0].input_layernorm
    assert norm.folded  # (its weight is in the projections now)
    assert L.norm_linear(model.get_submodule(names[0]), row, norm) is None  # no GPU here
    got = window_logits(model, ids, 8, 5, torch.float32, "cpu")
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), float((got - ref).abs().max())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["int8", "fp8", "bf16", "int4"])
def test_norm_in_the_gemv_matches_the_norm_kernel_on_gpu(mode, monkeypatch):
    """RMSNorm inside the one-row GEMV and the residual add in its epilogue (`FUSE_NORM`): a
    folded, quantized model's one-token steps give the logits of the same model with the norms
    run as their own kernels (bf16: one rounding fewer per fusion); the chunks are unchanged.
    int4 unfolds the norms (`quantize_model_`): its GEMV multiplies x by the norm's weight."""
    from llmopt.engines.native import linear as L
    from llmopt.engines.native.weights import dense_gemv_, fold_norms_, quantize_model_

    if mode == "fp8" and not L.fp8_supported():
        pytest.skip("FP8 needs compute capability 8.9+")
    cfg = NativeConfig.from_hf(
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 1024,
            "intermediate_size": 2048,
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "vocab_size": 512,
            "max_position_embeddings": 1024,
        }
    )
    model = random_model(cfg, "cuda", torch.bfloat16, seed=2)
    for b in model.model.layers:
        for norm in (b.input_layernorm, b.post_attention_layernorm):
            norm.weight.data.uniform_(0.5, 1.5)
    fold_norms_(model)
    if mode == "bf16":  # dense bf16 weights through the GEMV (`DenseLinear`)
        dense_gemv_(model)
    else:
        quantize_model_(model, mode)
    ids = torch.randint(0, 512, (48,), generator=torch.Generator().manual_seed(0))
    row = torch.ones(1, 1, 1024, device="cuda", dtype=torch.bfloat16)
    qkv = model.model.layers[0].self_attn.qkv_proj
    norm = model.model.layers[0].input_layernorm
    assert norm.folded == (mode != "int4")
    monkeypatch.setattr(L, "FUSE_NORM", False)
    want = window_logits(model, ids, 16, 16, torch.bfloat16, "cuda")
    assert L.norm_linear(qkv, row, norm) is None  # switched off: the norm kernel runs
    monkeypatch.setattr(L, "FUSE_NORM", True)
    assert L.norm_linear(qkv, row, norm) is not None
    assert L.norm_linear(qkv, row.expand(1, 2, 1024), norm) is None  # two rows: declined
    got = window_logits(model, ids, 16, 16, torch.bfloat16, "cuda")
    d = want[-16:] - got[-16:]
    assert d.abs().max() > 0  # the fused kernels ran
    sqnr = 10 * torch.log10(want[-16:].pow(2).sum() / d.pow(2).sum())
    assert sqnr > 30, float(sqnr)
    torch.testing.assert_close(got[:-16], want[:-16])
