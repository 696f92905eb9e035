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

from dataclasses import dataclass, field

from llmopt.core.recipes import Recipe, get_recipe

__all__ = [
    "CALIBRATION_KEEPS",
    "SCREEN_TOLERANCE",
    "screen_order",
    "predicted_miss",
    "ValueModel",
    "weight_bits",
]

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


# Bits per weight that decode reads (what a memory-bound step scales with). llama.cpp's types:
# Q8_0 is 8.5 (a 16-bit scale per 32), Q6_K 6.56, Q5_K_M ~5.7, Q4_K_M ~4.9, Q4_0 4.5.
GGUF_BITS = {"Q8_0": 8.5, "Q6_K": 6.56, "Q5_K_M": 5.7, "Q4_K_M": 4.9, "Q4_0": 4.5}
_DTYPE_BITS = {"float32": 32.0, "bfloat16": 16.0, "float16": 16.0}
# The chance a recipe of this many weight bits passes a 1% perplexity budget before anything is
# measured: 8 bits and more pass on every model measured (docs/quantization.md), 6-bit K-quants
# were at the edge on SmolLM2 (+1.02%), 4-bit ones 20-45% off.
_PASS_PRIOR = ((8.0, 1.0), (6.0, 0.5), (5.0, 0.3), (0.0, 0.1))
# How fast an engine decodes against eager transformers at the same bits, before this run has
# measured it: llama.cpp's CPU kernels are the fastest measured (docs/benchmarks.md), the native
# engine a little ahead of eager transformers. Replaced by this run's own screens as they finish.
# OpenVINO's prior is a guess until docs/benchmarks.md has its row: its CPU plugin runs int8 and
# int4 weights in its own fused kernels with the KV cache kept in the plugin, so it is ranked
# between llama.cpp and the native engine.
ENGINE_PRIOR = {"llamacpp": 2.0, "openvino": 1.5, "torch": 1.1, "hf": 1.0}


def weight_bits(recipe: Recipe) -> float:
    """Bits per weight decode reads for `recipe` (its dtype when weights stay in float).

    >>> weight_bits(get_recipe("w8a16")), weight_bits(get_recipe("gguf-q4_k_m"))
    (8.0, 4.9)
    """
    if recipe.gguf_type:
        return GGUF_BITS.get(recipe.gguf_type, 8.0)
    if recipe.weight_bits:
        return float(recipe.weight_bits)
    return _DTYPE_BITS.get(recipe.dtype, 32.0)


@dataclass
class ValueModel:
    """The predicted value of screening a candidate: its expected speed-up over the reference
    (32 bits / its bits, times its engine's speed at equal bits) times its chance to pass the
    quality budget. Each finished screen replaces the engine's prior with what it measured
    (`observe`), so after llama.cpp's first screen its other types are ranked by llama.cpp's
    measured speed on this machine, not by the prior.

    >>> m = ValueModel()
    >>> round(m.value("llamacpp", "gguf-q8_0"), 2), round(m.value("hf", "w8a16"), 2)
    (7.53, 4.0)
    >>> m.observe("llamacpp", "gguf-q8_0", 1.2)  # measured 1.2x the reference at the screen
    >>> round(m.value("llamacpp", "gguf-q6_k"), 2)
    0.78
    """

    speed: dict[str, list[float]] = field(default_factory=dict)  # engine -> measured factors

    def engine_factor(self, engine: str) -> float:
        got = self.speed.get(engine)
        if got:
            return sorted(got)[len(got) // 2]
        return ENGINE_PRIOR.get(engine, 1.0)

    def value(self, engine: str, recipe_name: str) -> float:
        r = get_recipe(recipe_name)
        bits = weight_bits(r)
        p = next(p for floor, p in _PASS_PRIOR if bits >= floor)
        return self.engine_factor(engine) * (32.0 / bits) * p

    def observe(self, engine: str, recipe_name: str, score: float | None) -> None:
        """A finished screen: `score` is the candidate's objective relative to the reference."""
        if score is None or score <= 0:
            return
        bits = weight_bits(get_recipe(recipe_name))
        self.speed.setdefault(engine, []).append(score / (32.0 / bits))


def screen_order(
    recipes: list[str], engines: list[str] | None = None, model: ValueModel | None = None
) -> list[int]:
    """Indices of `recipes` in the order to screen them: cheap builds first, then RTN at the
    bits the calibrated ones use (their screens decide whether the calibrations can pass), then
    the calibrated ones; within each class the highest predicted value first (`ValueModel`,
    when `engines` are given), else the plan's order.

    >>> screen_order(["w4a16-awq-g128", "w8a16", "w4a16-rtn-g128", "bf16"])
    [1, 3, 2, 0]
    >>> screen_order(["fp32", "gguf-q8_0", "bf16"], ["torch", "llamacpp", "hf"])
    [1, 2, 0]
    """
    classes = [_cost_class(get_recipe(r)) for r in recipes]
    if engines is None:
        return sorted(range(len(recipes)), key=lambda i: classes[i])
    m = model or ValueModel()
    values = [m.value(e, r) for e, r in zip(engines, recipes, strict=True)]
    return sorted(range(len(recipes)), key=lambda i: (classes[i], -values[i]))


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
