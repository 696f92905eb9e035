"""What `llmopt serve` was asked to serve: a run's chosen candidate, a folder or a built-in."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmopt.core.errors import LlmoptError
from llmopt.model.info import inspect_model
from llmopt.rundir.best import Best, NoBestError
from llmopt.rundir.best import find_best as read_best

__all__ = ["ServeSourceError", "find_best", "describe_source"]


class ServeSourceError(LlmoptError):
    """What was asked to be served cannot be served (no chosen candidate, conflicting options)."""


def find_best(model: str) -> Path | None:
    """`runs/NAME` or `runs/NAME/best` -> the best/ folder; None for anything else."""

    try:
        best = read_best(Path(model).expanduser())
    except NoBestError as e:
        raise ServeSourceError(
            e.message, "look at its report.html, or serve the model folder itself"
        ) from e
    return best.dir if best is not None else None


def describe_source(
    model: str, recipe: str | None, default: str = "fp32"
) -> tuple[Path | None, Any, str]:
    """(the run's best/ folder or None, its ModelInfo, the recipe to serve it with).

    A run's best brings its verified recipe (`recipe` must agree); a folder or built-in takes
    `recipe`, else `default`.
    """

    best_dir = find_best(model)
    if best_dir is None:
        return None, inspect_model(model), recipe or default
    best = Best.read(best_dir)
    if recipe and recipe != best.recipe:
        raise ServeSourceError(
            f"{best_dir} was verified with recipe {best.recipe!r}, not {recipe!r}",
            "drop --recipe, or serve the model folder with that recipe",
        )
    return best_dir, best.model, best.recipe
