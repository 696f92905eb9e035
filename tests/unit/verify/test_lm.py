"""Causal-LM verification on the tiny Llama: gates, bootstrap intervals, planted faults, attribution."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llmopt.core.recipes import get_recipe
from llmopt.core.settings import EngineSettings
from llmopt.engines import get_engine
from llmopt.model.info import inspect_model
from llmopt.verify.attribution import layer_sqnr
from llmopt.verify.gates import Gates, failures, gate_rows
from llmopt.verify.lm import verify_causal_lm

TEXT = (
    "The river rises in the northern hills and flows south through farmland and two market "
    "towns before it reaches the sea. In the nineteenth century a canal joined it to the "
    "capital, and mills were built along its banks. "
) * 12


def _runner(folder: Path, recipe: str = "fp32"):
    info = inspect_model(str(folder))
    return get_engine("hf").load(folder, info, get_recipe(recipe), EngineSettings(threads=1))


def _windows(runner, n: int = 8, t: int = 64) -> torch.Tensor:
    ids = runner.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    return torch.tensor(ids[: n * t]).view(n, t)


def _scale_layer(folder: Path, layer: int, factor: float) -> None:
    # The planted fault: every weight of one decoder block multiplied by `factor`.
    from safetensors.torch import load_file, save_file

    f = folder / "model.safetensors"
    state = load_file(f)
    prefix = f"model.layers.{layer}."
    for k in state:
        if k.startswith(prefix) and k.endswith("proj.weight"):
            state[k] = state[k] * factor
    save_file(state, f, {"format": "pt"})


def test_unmodified_model_passes_with_noise_labels(tiny_llama_dir):
    ref = _runner(tiny_llama_dir)
    cand = _runner(tiny_llama_dir)
    r = verify_causal_lm("same", cand, _windows(ref), ref, 0.01, gates=Gates())
    assert r.passed, gate_rows(r)
    ppl = r.metric("perplexity")
    assert ppl.delta == pytest.approx(0.0, abs=1e-6) and ppl.n == 8 * 63
    assert ppl.noise is True and ppl.ci_low <= 0.0 <= ppl.ci_high
    assert r.metric("top1_agreement").candidate == 1.0
    assert r.metric("greedy_match_length").candidate == 32.0


def test_bootstrap_is_seeded(tiny_llama_dir):
    ref = _runner(tiny_llama_dir)
    cand = _runner(tiny_llama_dir, "bf16")
    w = _windows(ref)
    a = verify_causal_lm("bf16", cand, w, ref, generation_prompts=0)
    b = verify_causal_lm("bf16", cand, w, ref, generation_prompts=0)
    assert (a.metric("perplexity").ci_low, a.metric("perplexity").ci_high) == (
        b.metric("perplexity").ci_low,
        b.metric("perplexity").ci_high,
    )
    assert a.metric("perplexity").ci_low < a.metric("perplexity").ci_high


def test_layer_scaled_by_1_5_fails_and_is_attributed(tiny_llama_dir, tmp_path):
    import shutil

    bad = Path(shutil.copytree(tiny_llama_dir, tmp_path / "scaled"))
    _scale_layer(bad, 1, 1.5)
    ref, cand = _runner(tiny_llama_dir), _runner(bad)
    # Perplexity alone misses it on a random model (it even drops); the default gates do not.
    assert verify_causal_lm("scaled", cand, _windows(ref), ref, 0.01).passed
    r = verify_causal_lm("scaled", cand, _windows(ref), ref, 0.01, gates=Gates())
    assert not r.passed
    assert {m.name for m in failures(r)} & {"perplexity", "top1_agreement", "kl_divergence_mean"}
    a = layer_sqnr(ref.model, cand.model, {"input_ids": _windows(ref)[:1]})
    assert a.first_jump == 1 and a.first_jump_name == "model.layers.1"
    assert a.layers[0].sqnr_db == 200.0  # block 0 is untouched: identical output


def test_nan_logits_fail(tiny_llama_dir):
    ref = _runner(tiny_llama_dir)
    cand = _runner(tiny_llama_dir)
    with torch.no_grad():
        cand.model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    r = verify_causal_lm("nan", cand, _windows(ref, 2), ref, generation_prompts=0)
    assert not r.passed and any("non-finite" in n for n in r.notes)


def test_gate_presets_and_validation():
    assert Gates.preset("loose").max_quality_drop == 0.05
    assert Gates.preset("default", max_quality_drop=0.02).max_quality_drop == 0.02
    with pytest.raises(ValueError, match="unknown gate preset"):
        Gates.preset("nope")
    with pytest.raises(ValueError, match="fraction"):
        Gates(max_quality_drop=5)
    assert json.dumps(Gates().to_dict())


def test_saved_reference_outputs_give_the_same_verdict(tiny_llama_dir, tmp_path):
    from llmopt.verify.lm import ReferenceOutputs

    ref = _runner(tiny_llama_dir)
    cand = _runner(tiny_llama_dir, "bf16")
    w = _windows(ref, n=4)
    live = verify_causal_lm("bf16", cand, w, ref, 0.01, gates=Gates(), generation_prompts=2)
    path = tmp_path / "ref.npz"
    # The reference verified as itself saves what the comparison needs...
    verify_causal_lm(
        "ref", ref, w, None, 0.01, gates=Gates(), generation_prompts=2, keep_reference=path
    )
    saved = ReferenceOutputs.load(path, w, 2, 32)
    assert saved is not None
    cached = verify_causal_lm("bf16", cand, w, saved, 0.01, gates=Gates(), generation_prompts=2)
    for a, b in zip(live.metrics, cached.metrics, strict=True):
        assert (a.name, a.reference, a.candidate, a.passed) == (
            b.name,
            b.reference,
            b.candidate,
            b.passed,
        )
    # ...and only for the windows and settings it was made for.
    assert ReferenceOutputs.load(path, w[:3], 2, 32) is None
    assert ReferenceOutputs.load(path, w, 1, 32) is None
    assert ReferenceOutputs.load(tmp_path / "absent.npz", w, 2, 32) is None


def test_top_k_kl_is_exact_for_small_vocabularies_and_a_lower_bound_otherwise():
    import numpy as np

    from llmopt.verify import lm

    g = torch.Generator().manual_seed(0)
    V, T = 2000, 7
    lr = torch.log_softmax(torch.randn(T, V, generator=g) * 3, -1)
    lc = torch.log_softmax(lr + 0.3 * torch.randn(T, V, generator=g), -1)
    full = float((lr.exp() * (lr - lc)).sum(-1).mean())
    for k, exact in ((V, True), (64, False)):
        vals, idx = torch.topk(lr, k, -1)
        ref = lm.ReferenceOutputs(
            np.zeros(1), lr.argmax(-1).numpy()[None], idx.numpy()[None], vals.numpy()[None], [], "x"
        )
        got = lm._kl_top(ref, 0, lc)
        if exact:
            assert got == pytest.approx(full, rel=1e-4)  # float32 sum vs float64
        else:
            assert 0 < got <= full + 1e-9
