"""`llmopt bench lm`: one engine+recipe benchmarked in process, with roofline attribution.

This is the same measurement `optimize` runs per candidate (`bench_causal_lm`), plus the sweep
over decode batch sizes and prefill lengths, and the machine's ceilings measured in the same
process just before, so each phase gets an achieved bandwidth/FLOP/s and a verdict.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llmopt.assets import resolve_model
from llmopt.assets.text import evaluation_text
from llmopt.bench.lm import bench_causal_lm
from llmopt.bench.roofline import above_ceiling, attribute_lm, best_ceilings, measure_ceilings
from llmopt.bench.timing import environment
from llmopt.core.recipes import get_recipe
from llmopt.core.units import DTYPE_BYTES
from llmopt.engines import get_engine, load_runner
from llmopt.hardware.runtime import peak_rss_bytes
from llmopt.model.info import inspect_model

__all__ = ["bench_lm_model", "lm_roofline", "weight_bytes"]


def weight_bytes(num_parameters: int, dtype: str, weight_bits: int | None) -> float:
    """Bytes of weights read per forward (int8 weight-only: 1 byte per weight, approximately).

    Example:
        >>> weight_bytes(100, "float32", None), weight_bytes(100, "float32", 8)
        (400.0, 100.0)
    """
    if weight_bits:
        return num_parameters * weight_bits / 8.0
    return float(num_parameters * DTYPE_BYTES.get(dtype, 4))


def lm_roofline(
    metrics, info, recipe, prompt_tokens: int, new_tokens: int, ceilings
) -> dict[str, Any]:
    """{"ceilings", "phases"} for `BenchResult.roofline`: every phase of `metrics` attributed.

    Args:
        metrics: {name: Stat} from `bench_causal_lm`.
        info: the model's `ModelInfo` (parameters, KV bytes per token).
        recipe: the candidate's `Recipe` (dtype, weight bits).
        prompt_tokens / new_tokens: the benchmark's lengths.
        ceilings: `measure_ceilings()` from the same process.

    Example:
        >>> roof = lm_roofline(metrics, info, recipe, 100, 128, measure_ceilings())  # doctest: +SKIP
    """

    kv = info.kv_bytes_per_token.get(recipe.dtype) or info.kv_bytes_per_token.get("float32", 0)
    wb = weight_bytes(info.num_parameters, recipe.dtype, recipe.weight_bits)
    rows = attribute_lm(
        metrics, prompt_tokens, new_tokens, info.num_parameters, wb, kv, ceilings, recipe.dtype
    )
    return {"ceilings": ceilings.to_dict(), "phases": rows}


def bench_lm_model(
    model: str,
    engine: str = "hf",
    recipe: str = "fp32",
    batch_sizes: Sequence[int] = (1, 4),
    prompt_lengths: Sequence[int] = (32,),
    prompt_tokens: int = 100,
    new_tokens: int = 32,
    repeats: int = 3,
    threads: int | None = None,
    checkpoint: Path | None = None,
) -> dict[str, Any]:
    """Build (when the recipe changes the weights), load and benchmark one causal LM candidate.

    Args:
        model: built-in name or Hugging Face folder.
        engine / recipe: registry names, as `llmopt plan` lists them.
        batch_sizes: decode batch sizes; prompt_lengths: extra prefill lengths.
        prompt_tokens / new_tokens: the full prompt and decode steps per repeat.
        repeats: timed repetitions per point (warm-up excluded and reported).
        threads: CPU threads.
        checkpoint: for a calibrated recipe (`Recipe.calibrated`), the compressed-tensors folder
            `llmopt.quant.build_checkpoint` wrote from `model`; the caller quantizes (bench sits
            beside quant and does not import it), the engine only takes the folder in.

    Returns:
        {"metrics": {name: Stat dict}, "warmup_seconds", "ceilings", "roofline": [rows], "settings",
        "env", "peak_rss_bytes"}.

    Example:
        >>> res = bench_lm_model("smollm2-135m", batch_sizes=(1, 4), repeats=2)  # doctest: +SKIP
    """
    import torch

    folder, _ = resolve_model(model)
    info = inspect_model(folder)
    if info.task != "causal-lm":
        raise ValueError(f"{model} is a {info.task} model; `bench lm` measures causal LMs")
    eng, rec = get_engine(engine), get_recipe(recipe)
    why = eng.missing() or eng.incompatible(info, rec, "cpu")
    if why:
        raise ValueError(f"{engine}/{recipe} cannot run {model}: {why}")
    if rec.calibrated and checkpoint is None:
        raise ValueError(
            f"{recipe} is a calibrated recipe: quantize {model} first and pass the "
            "folder as `checkpoint` (`llmopt bench lm` does this)"
        )
    settings = {"threads": threads} if threads else {}
    with tempfile.TemporaryDirectory(prefix="llmopt-bench-") as tmp:
        artifact = Path(tmp) / "artifact"
        artifact.mkdir()
        eng.build(Path(checkpoint) if rec.calibrated else folder, info, rec, artifact)
        t0 = time.perf_counter()
        runner = load_runner(engine, artifact, info, rec, settings)
        load_s = time.perf_counter() - t0
        # Ceilings first, in this process and with these threads, so the shares are like for like.
        ceilings = measure_ceilings("cpu")
        ids = runner.tokenizer(evaluation_text()[:20000], add_special_tokens=False)["input_ids"]
        prompt = torch.tensor([ids[:prompt_tokens]], dtype=torch.long)
        metrics, warm = bench_causal_lm(
            runner,
            prompt,
            new_tokens,
            repeats,
            batch_sizes=batch_sizes,
            prompt_lengths=prompt_lengths,
        )
        roof = lm_roofline(metrics, info, rec, prompt.shape[1], new_tokens, ceilings)
        remeasured = False
        if above_ceiling(roof["phases"]):
            # A phase past a ceiling means that measurement was low (contention while it ran):
            # measure again after the benchmark and keep the best of both.
            ceilings = best_ceilings(ceilings, measure_ceilings("cpu"))
            roof = lm_roofline(metrics, info, rec, prompt.shape[1], new_tokens, ceilings)
            remeasured = True
    return {
        "model": info.name,
        "engine": engine,
        "recipe": recipe,
        "ceilings_remeasured": remeasured,
        "candidate": f"{engine}-{recipe}",
        "metrics": {k: v.to_dict() for k, v in metrics.items()},
        "warmup_seconds": warm,
        "load_seconds": load_s,
        "ceilings": roof["ceilings"],
        "roofline": roof["phases"],
        "settings": {
            "prompt_tokens": prompt.shape[1],
            "new_tokens": new_tokens,
            "repeats": repeats,
            "batch_sizes": list(batch_sizes),
            "prompt_lengths": list(prompt_lengths),
            "threads": torch.get_num_threads(),
        },
        "peak_rss_bytes": peak_rss_bytes(),
        "env": environment(),
    }
