"""Bridge to lm-evaluation-harness for users who have its task data locally.

Optional: lm-eval is not a dependency. `lm_eval_available()` says whether it is importable, and
`run_lm_eval` raises `EngineUnavailableError` with the install command when it is not. Both models
are run through lm-eval's own HF backend on the same tasks, and each task's accuracy becomes a
Metric of candidate next to reference, so the gate table shows them like every other metric.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from llmopt.core.errors import EngineUnavailableError
from llmopt.core.schema import Metric

__all__ = ["lm_eval_available", "run_lm_eval"]


def lm_eval_available() -> bool:
    """True when lm-evaluation-harness is importable."""
    return importlib.util.find_spec("lm_eval") is not None


def _accuracies(folder: str | Path, tasks: list[str], limit: int | None) -> dict[str, float]:
    import lm_eval

    out = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={folder},dtype=float32",
        tasks=tasks,
        limit=limit,
        device="cpu",
    )
    acc = {}
    for task, res in out["results"].items():
        value = res.get("acc,none", res.get("acc"))
        if value is not None:
            acc[task] = float(value)
    return acc


def run_lm_eval(
    reference: str | Path,
    candidate: str | Path,
    tasks: list[str],
    limit: int | None = None,
    max_drop: float = 0.02,
) -> list[Metric]:
    """Accuracy of both HF folders on lm-eval `tasks`, one gated Metric per task.

    Args:
        reference, candidate: HF folders lm-eval's `hf` backend can load.
        tasks: lm-eval task names whose data is available locally (e.g. ["arc_easy"]).
        limit: items per task (None: all).
        max_drop: largest absolute accuracy drop allowed.

    >>> run_lm_eval("ref/", "cand/", ["arc_easy"], limit=100)  # doctest: +SKIP
    [Metric(name='lm_eval/arc_easy', ...)]
    """
    if not lm_eval_available():
        raise EngineUnavailableError(
            "lm-evaluation-harness is not installed", hint="pip install lm-eval"
        )
    ref = _accuracies(reference, tasks, limit)
    cand = _accuracies(candidate, tasks, limit)
    return [
        Metric(
            f"lm_eval/{t}",
            ref[t],
            cand.get(t, float("nan")),
            True,
            ref[t] - max_drop,
            bool(cand.get(t, float("nan")) >= ref[t] - max_drop),
            limit or 0,
            "",
            "lm-evaluation-harness acc",
        )
        for t in sorted(ref)
    ]
