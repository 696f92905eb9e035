"""Engine registry: one dict, filled by the explicit imports at the bottom of this module.

>>> from llmopt.engines import get_engine
>>> get_engine("hf").name
'hf'

An engine whose library is not installed is still registered; `Engine.missing()` says so and
how to install it, and the planner lists its candidates as skipped instead of failing the run.

Runners are loaded one way, `load_runner` (which `load_best` and every stage use), and batch
generators (`llmopt serve`) through `get_engine(name).load_generator(spec)`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from llmopt.core.recipes import Recipe, get_recipe
from llmopt.core.settings import EngineSettings
from llmopt.engines.base import CausalLMRunner, EmbeddingRunner, Engine
from llmopt.rundir.best import Best

__all__ = [
    "ENGINES",
    "register_engine",
    "get_engine",
    "load_best",
    "load_runner",
    "Engine",
    "CausalLMRunner",
    "EmbeddingRunner",
]

log = logging.getLogger(__name__)

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


def served_by_llmopt(engine_name: str) -> bool:
    """Whether `llmopt serve` can serve a causal-LM artifact this engine built: with the
    engine's own generator (`Engine.batching`), its own server (`Engine.served`: vLLM) or
    llama.cpp's server (`Engine.gguf`). An engine with runners only would be measured and
    verified, but not served.

    >>> served_by_llmopt("torch"), served_by_llmopt("llamacpp"), served_by_llmopt("openvino")
    (True, True, True)
    >>> served_by_llmopt("onnxruntime")  # embedders only: no causal-LM artifact to serve
    False
    """
    e = get_engine(engine_name)
    return bool(e.batching or e.served or e.gguf)


def load_runner(
    engine_name: str,
    artifact: str | Path,
    info: Any,
    recipe: str | Recipe,
    settings: EngineSettings | Mapping[str, Any] | None = None,
) -> CausalLMRunner | EmbeddingRunner:
    """Load a built artifact with engine `engine_name` and return its runner for `info.task`.

    The one legacy rule lives here: runs written before the engine rename name the
    transformers engine "torch" for embedders, so an embedding model on an engine that does not
    embed is loaded with "hf" (and a warning says so).

    >>> runner = load_runner("hf", "runs/minilm-l6/best/artifact", info, "fp32")  # doctest: +SKIP
    """
    engine = get_engine(engine_name)
    if getattr(info, "task", None) == "embedding" and "embedding" not in engine.tasks:
        log.warning("engine %r does not embed; loading the artifact with 'hf'", engine.name)
        engine = get_engine("hf")
    return engine.load(Path(artifact), info, get_recipe(recipe), EngineSettings.from_dict(settings))


def load_best(best_dir) -> CausalLMRunner | EmbeddingRunner:
    """Load the runner of a run's chosen candidate from its `best/` folder.

    >>> runner = load_best("runs/minilm-l6/best")           # doctest: +SKIP
    >>> runner.embed(["hello world"]).shape                    # doctest: +SKIP
    (1, 384)
    """

    best = Best.read(best_dir)
    cand = best.candidate
    return load_runner(cand.engine, best.artifact, best.model, cand.recipe, cand.settings)


# Explicit registration. These modules import their heavy libraries lazily, inside methods.
from llmopt.engines import llamacpp as _llamacpp  # noqa: E402,F401
from llmopt.engines import onnxruntime as _onnxruntime  # noqa: E402,F401
from llmopt.engines import openvino as _openvino  # noqa: E402,F401
from llmopt.engines import torch_hf as _torch_hf  # noqa: E402,F401
from llmopt.engines import vllm as _vllm  # noqa: E402,F401
from llmopt.engines.native import engine as _native  # noqa: E402,F401
