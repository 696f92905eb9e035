"""What the search can predict before it spends: which candidates to screen first, and which
calibrated builds cannot pass the quality budget given what their cheaper siblings measured.

A calibrated 4-bit build (AWQ, GPTQ) costs minutes on a CPU where a round-to-nearest (RTN) build
of the same bits costs seconds, and calibration recovers only part of RTN's quality loss. Measured
on SmolLM2 at 4 bits, group 64 (docs/quantization.md): the best calibrated result kept 40% of the
RTN perplexity increase (RTN +28.1% -> AWQ asymmetric +11.1%; RTN asymmetric +20.9% -> +11.1%,
53%; earlier scales +45.3% -> +18.4%, 41%). So a calibrated sibling is predicted to end at no less
than `CALIBRATION_KEEPS` x the RTN loss, and it is skipped, with that reason, when even that
exceeds what the screen lets through (`SCREEN_TOLERANCE` x the budget: the screen sees fewer
tokens, so a borderline candidate is decided at full fidelity).
"""

from __future__ import annotations

from llmopt.core.recipes import Recipe, get_recipe

__all__ = ["CALIBRATION_KEEPS", "SCREEN_TOLERANCE", "screen_order", "predicted_miss"]

CALIBRATION_KEEPS = 0.4  # the smallest share of RTN's loss a calibrated build has kept
SCREEN_TOLERANCE = 1.5  # the screen cuts above 1.5x the budget (llmopt.optimize.halving)


def _cost_class(recipe: Recipe) -> int:
    """0: an engine's own writer (seconds); 1: RTN through the quantization pipeline (4-bit
    weights: no calibration data, still seconds); 2: calibrated (AWQ, GPTQ, SmoothQuant, FP8,
    KV: minutes on a CPU)."""
    if not recipe.calibrated:
        return 0
    return 1 if _is_rtn_weights(recipe) else 2


def _is_rtn_weights(recipe: Recipe) -> bool:
    return (
        recipe.algorithm == "rtn"
        and recipe.weight_type == "int"
        and recipe.activations == "none"
        and recipe.kv_cache_dtype is None
        and recipe.weight_bits is not None
    )


def screen_order(recipes: list[str]) -> list[int]:
    """Indices of `recipes` in the order to screen them: cheap builds first, then RTN at the
    bits the calibrated ones use (their screens decide whether the calibrations can pass), then
    the calibrated ones; the plan's order within each class.

    >>> screen_order(["w4a16-awq-g128", "w8a16", "w4a16-rtn-g128", "bf16"])
    [1, 3, 2, 0]
    """
    classes = [_cost_class(get_recipe(r)) for r in recipes]
    return sorted(range(len(recipes)), key=lambda i: classes[i])


def predicted_miss(
    recipe_name: str, screened: dict[str, tuple[str, float]], max_quality_drop: float
) -> str | None:
    """Why a calibrated `recipe_name` cannot pass, from RTN siblings already screened, or None.

    Args:
        recipe_name: the candidate's recipe.
        screened: candidate id -> (recipe name, screen quality drop) of finished screens.
        max_quality_drop: the quality budget.

    >>> predicted_miss("w4a16-awq-g128", {"hf-w4a16-rtn-g128": ("w4a16-rtn-g128", 0.25)}, 0.01)[:40]
    'predicted to miss the quality budget: hf'
    >>> predicted_miss("w4a16-awq-g128", {"hf-w4a16-rtn-g128": ("w4a16-rtn-g128", 0.02)}, 0.01)
    """
    r = get_recipe(recipe_name)
    if _cost_class(r) != 2 or r.weight_bits is None or r.activations != "none":
        return None
    limit = SCREEN_TOLERANCE * max_quality_drop
    for cid, (sib_name, drop) in screened.items():
        s = get_recipe(sib_name)
        if not (_is_rtn_weights(s) and s.weight_bits == r.weight_bits):
            continue
        if s.weight_type != r.weight_type or (s.group_size or 0) > (r.group_size or 0) > 0:
            continue  # a coarser RTN sibling says less about a finer-grouped recipe
        best = CALIBRATION_KEEPS * drop
        if best > limit:
            return (
                f"predicted to miss the quality budget: {cid} (the same {s.weight_bits}-bit "
                f"weights, round-to-nearest) screened at {drop:+.1%}; calibration has kept at "
                f"least {CALIBRATION_KEEPS:.0%} of that loss (docs/quantization.md), so the best "
                f"expected is {best:+.1%} > {limit:.1%} (the screen's limit); not built"
            )
    return None
