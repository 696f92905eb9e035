"""What the search predicts before it spends: the screening order and the calibrated builds an
RTN sibling's screen rules out."""

from __future__ import annotations

from llmopt.optimize.predict import (
    CALIBRATION_KEEPS,
    SCREEN_TOLERANCE,
    predicted_miss,
    screen_order,
)


def test_cheap_builds_then_rtn_then_calibrated():
    recipes = ["w4a16-gptq-g128", "fp32", "w4a16-awq-g128", "w4a16-rtn-g128", "w8a16", "gguf-q8_0"]
    order = [recipes[i] for i in screen_order(recipes)]
    assert order[:3] == ["fp32", "w8a16", "gguf-q8_0"]
    assert order[3] == "w4a16-rtn-g128"
    assert set(order[4:]) == {"w4a16-gptq-g128", "w4a16-awq-g128"}


def test_a_far_miss_of_rtn_rules_out_calibration_at_the_same_bits():
    budget = 0.01
    # Just beyond what calibration has been seen to recover: predicted to miss, with the numbers.
    drop = 1.01 * SCREEN_TOLERANCE * budget / CALIBRATION_KEEPS
    screened = {"hf-w4a16-rtn-g128": ("w4a16-rtn-g128", drop)}
    why = predicted_miss("w4a16-awq-g128", screened, budget)
    assert why is not None and "hf-w4a16-rtn-g128" in why and "docs/quantization.md" in why
    assert predicted_miss("w4a16-gptq-g128", screened, budget) is not None
    # Just inside it: calibration might still pass, so it is built.
    near = {"hf-w4a16-rtn-g128": ("w4a16-rtn-g128", 0.99 * drop)}
    assert predicted_miss("w4a16-awq-g128", near, budget) is None


def test_the_rule_needs_a_true_sibling():
    far = {"x": ("w4a16-rtn-g128", 0.5)}
    assert predicted_miss("w8a16", far, 0.01) is None  # not calibrated: nothing to predict
    assert predicted_miss("w8a8-int8", far, 0.01) is None  # other bits, activations quantized
    # A coarser RTN sibling (g128) says nothing about a finer-grouped recipe (g64).
    assert predicted_miss("w4a16-awq-g64", far, 0.01) is None
    assert predicted_miss("w4a16-awq-g128", {}, 0.01) is None
