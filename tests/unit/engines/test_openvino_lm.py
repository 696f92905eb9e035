"""The openvino engine on the tiny random Llama: the float32 stateful IR computes what
transformers computes (full sequence, and prefill + decode steps against the full sequence), NNCF
int8 and llmopt's int4 codes really quantize and stay close, a damaged IR or a state from an
earlier prefill is refused, and the search space lists openvino candidates."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from llmopt.core.errors import LlmoptError
from llmopt.core.recipes import get_recipe
from llmopt.engines import get_engine, load_runner, openvino_lm
from llmopt.model.info import inspect_model

pytest.importorskip("openvino")
pytest.importorskip("nncf")

INT4 = ("w4a16-rtn-g32", "w4a16-rtn-g32-asym")


@pytest.fixture(scope="module")
def built(tmp_path_factory, _tiny_llama_master):
    from llmopt.quant import build_checkpoint

    src = _tiny_llama_master
    root = tmp_path_factory.mktemp("openvino-lm")
    info = inspect_model(src)
    out = {}
    for recipe in ("fp32", "w8a16", *INT4):
        rec = get_recipe(recipe)
        source = src
        if rec.calibrated:  # what the build stage does before the engine
            source = root / f"{recipe}-checkpoint"
            build_checkpoint(src, recipe, source)
        (root / recipe).mkdir()
        facts = get_engine("openvino").build(source, info, rec, root / recipe)
        out[recipe] = (root / recipe, facts)
    return src, info, out


@pytest.fixture(scope="module")
def windows():
    torch.manual_seed(3)
    return torch.randint(0, 250, (2, 24))


def _ref(built):
    src, info, _ = built
    return load_runner("hf", src, info, "fp32", {"threads": 1})


def test_float32_ir_computes_what_transformers_computes(built, windows):
    _, info, art = built
    ref = _ref(built).logits(windows)
    runner = load_runner("openvino", art["fp32"][0], info, "fp32", {"threads": 1})
    assert runner.linear_kernels() == {"f32": 15}
    got = runner.logits(windows)
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()


def test_prefill_and_decode_steps_match_the_full_sequence(built, windows):
    _, info, art = built
    runner = load_runner("openvino", art["fp32"][0], info, "fp32", {"threads": 1})
    full = runner.logits(windows)
    logits, state = runner.prefill(windows[:, :10])  # batch 2
    steps = [logits]
    for p in range(10, windows.shape[1]):
        logits, state = runner.decode(windows[:, p : p + 1], state)
        steps.append(logits)
    got = torch.stack(steps, 1)
    # The KV cache stays in f32 (OpenVINO's CPU default would be u8): fp32-tight agreement.
    assert torch.allclose(got, full[:, 9:], atol=1e-4), (got - full[:, 9:]).abs().max()


def test_greedy_tokens_are_those_of_transformers(built):
    from llmopt.verify.lm import greedy_tokens

    _, info, art = built
    prompt = torch.tensor([5, 80, 120, 33, 7, 200, 18])
    runner = load_runner("openvino", art["fp32"][0], info, "fp32", {"threads": 1})
    assert greedy_tokens(runner, prompt, 16) == greedy_tokens(_ref(built), prompt, 16)


def test_a_state_from_an_earlier_prefill_is_refused(built, windows):
    _, info, art = built
    runner = load_runner("openvino", art["fp32"][0], info, "fp32", {"threads": 1})
    _, old = runner.prefill(windows[:1, :5])
    runner.prefill(windows[:1, :6])
    with pytest.raises(ValueError, match="latest prefill"):
        runner.decode(windows[:1, 6:7], old)


@pytest.mark.parametrize("recipe", ["w8a16", *INT4])
def test_int_weights_are_in_the_ir_and_stay_close(built, windows, recipe):
    _, info, art = built
    folder, facts = art[recipe]
    xml = (folder / openvino_lm.IR_FILE).read_text()
    kind = "i8" if recipe == "w8a16" else ("u4" if recipe.endswith("asym") else "i4")
    # 2 layers x 7 linears, the embedding and the tied head left in float (the recipe's ignore).
    assert facts["int_linears"] == 14
    assert xml.count(f'element_type="{kind}"') >= 14
    ref = _ref(built).logits(windows)
    runner = load_runner("openvino", folder, info, recipe, {"threads": 1})
    assert runner.linear_kernels() == {kind: 14, "f32": 1}  # the plugin's int kernels run them
    got = runner.logits(windows)
    assert torch.isfinite(got).all()
    drift = (got - ref).abs().max().item()
    assert 0 < drift < (0.05 if recipe == "w8a16" else 0.5) * ref.abs().max().item()
    logits, state = runner.prefill(windows[:, :12])
    logits, _ = runner.decode(windows[:, 12:13], state)
    assert torch.allclose(logits, got[:, 12], atol=1e-4)


def test_int4_codes_are_the_checkpoints_own(built, windows):
    """The IR computes the checkpoint's dequantized weights: what transformers computes on the
    same numbers (the float model filled with (q - zero) * scale), not a re-rounding."""
    _, info, art = built
    for recipe in INT4:
        model, codes = openvino_lm._load_dense(art[recipe][0].parent / f"{recipe}-checkpoint")
        assert len(codes) == 14
        with torch.no_grad():
            ref = model(windows).logits
        got = load_runner("openvino", art[recipe][0], info, recipe, {"threads": 1}).logits(windows)
        assert torch.allclose(got, ref, atol=1e-3), (recipe, (got - ref).abs().max())


def test_a_damaged_ir_is_refused_with_its_fix(built, tmp_path):
    _, info, art = built
    broken = shutil.copytree(art["fp32"][0], tmp_path / "broken")
    xml = broken / openvino_lm.IR_FILE
    xml.write_text(xml.read_text()[:2000])
    with pytest.raises(LlmoptError, match="rebuild the openvino candidate"):
        load_runner("openvino", broken, info, "fp32", {"threads": 1})


def test_corrupted_weights_fail_verification(built, tmp_path):
    from llmopt.assets.text import token_windows
    from llmopt.verify.lm import verify_causal_lm

    src, info, art = built
    broken = shutil.copytree(art["fp32"][0], tmp_path / "broken")
    data = np.fromfile(broken / "model.bin", dtype=np.uint8)
    rng = np.random.default_rng(0)
    mid = len(data) // 2  # inside the float weights: a run of them becomes noise
    data[mid : mid + 8192] = rng.integers(0, 256, 8192, dtype=np.uint8)
    data.tofile(broken / "model.bin")
    ref = _ref(built)
    win = token_windows(ref.tokenizer, "The quick brown fox. " * 200, 32, 4)
    good = load_runner("openvino", art["fp32"][0], info, "fp32", {"threads": 1})
    bad = load_runner("openvino", broken, info, "fp32", {"threads": 1})
    ok = verify_causal_lm("openvino-fp32", good, win, ref, 0.01, generation_prompts=0)
    res = verify_causal_lm("broken", bad, win, ref, 0.01, generation_prompts=0)
    assert ok.passed and not res.passed


def test_recipes_and_devices_it_refuses(tiny_llama_dir, monkeypatch):
    from llmopt.engines import openvino as ov_engine

    info = inspect_model(tiny_llama_dir)
    eng = get_engine("openvino")
    for ok in ("fp32", "w8a16", "w4a16-gptq-g32", "w4a16-awq-g64-asym"):
        assert eng.incompatible(info, get_recipe(ok), "cpu") is None, ok
    assert "weight-only" in eng.incompatible(info, get_recipe("w8a8-dynamic"), "cpu")
    assert "weight-only" in eng.incompatible(info, get_recipe("kv-fp8"), "cpu")
    assert "emulated" in eng.incompatible(info, get_recipe("fp16"), "cpu")
    assert "CPU" in eng.incompatible(info, get_recipe("fp32"), "cuda")
    monkeypatch.setattr(ov_engine, "isa_features", lambda: ["avx2"])
    assert "no native bf16" in eng.incompatible(info, get_recipe("bf16"), "cpu")


def test_the_search_space_lists_openvino_causal_lm_candidates(tiny_llama_dir):
    from llmopt.hardware.target import Target
    from llmopt.optimize.space import candidate_space

    info = inspect_model(tiny_llama_dir)
    target = Target(device="cpu", threads=1, cpu="test", memory_bytes=8 * 2**30)
    cands, skipped = candidate_space(info, target)
    ids = {c.id for c in cands}
    assert {"openvino-fp32", "openvino-w8a16", "openvino-w4a16-rtn-g64"} <= ids
    why = {s["id"]: s["reason"] for s in skipped}
    assert "name it in --candidates" in why["openvino-w8a16-kv_cacheu8"]
    named, _ = candidate_space(info, target, only=["openvino-w8a16-kv_cacheu8"])
    assert [c.settings.options["kv_cache"] for c in named if not c.reference] == ["u8"]
