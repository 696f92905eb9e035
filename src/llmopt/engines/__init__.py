"""Engine registry: one dict, filled by the explicit imports at the bottom of this module.

>>> from llmopt.engines import get_engine
>>> get_engine("hf").name
'hf'

An engine whose library is not installed is still registered; `Engine.missing()` says so and
how to install it, and the planner lists its candidates as skipped instead of failing the run.
"""

from __future__ import annotations

from llmopt.engines.base import CausalLMRunner, EmbeddingRunner, Engine

__all__ = [
    "ENGINES",
    "register_engine",
    "get_engine",
    "load_best",
    "Engine",
    "CausalLMRunner",
    "EmbeddingRunner",
]

ENGINES: dict[str, Engine] = {}


def register_engine(cls: type[Engine]) -> type[Engine]:
    """Class decorator: instantiate the engine and register it under `cls.name`."""
    assert cls.name not in ENGINES, f"engine {cls.name!r} registered twice"
    ENGINES[cls.name] = cls()
    return cls


def get_engine(name: str) -> Engine:
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; choose one of: {', '.join(ENGINES)}") from None


def load_best(best_dir) -> CausalLMRunner | EmbeddingRunner:
    """Load the runner of a run's chosen candidate from its `best/` folder.

    >>> runner = load_best("runs/minilm-l6/best")           # doctest: +SKIP
    >>> runner.embed(["hello world"]).shape                    # doctest: +SKIP
    (1, 384)
    """
    from llmopt.core.recipes import get_recipe
    from llmopt.rundir.best import Best

    best = Best.read(best_dir)
    cand = best.candidate
    return get_engine(cand.engine).load(best.artifact, best.model, get_recipe(cand.recipe), cand.settings)


# Explicit registration. These modules import their heavy libraries lazily, inside methods.
from llmopt.engines import onnxruntime as _onnxruntime  # noqa: E402,F401
from llmopt.engines import torch_hf as _torch_hf  # noqa: E402,F401
from llmopt.engines.native import engine as _native  # noqa: E402,F401
