"""The engine interface: what builds a candidate's artifact and runs it.

An engine is a plugin registered by name (see `llmopt.engines.ENGINES`). It answers three
questions before any work starts (is it installed? can it run this model with this recipe?) and
then does two things: `build` writes a self-contained artifact folder, `load` returns a runner.

Runners are small protocols the stages call: verification and benchmarking only ever see a
`CausalLMRunner` or an `EmbeddingRunner`, so a new engine plugs in without touching them. The
stages load runners through `llmopt.engines.load_runner`, never `Engine.load` directly.

An engine that batches generation continuously (`batching = True`) also implements
`load_generator`, which returns a `BatchGenerator` (`llmopt.engines.generation`): that is all
`llmopt serve` needs to serve a causal LM on it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np
    import torch

    from llmopt.core.recipes import Recipe
    from llmopt.core.settings import EngineSettings
    from llmopt.engines.generation import BatchGenerator, GeneratorSpec
    from llmopt.model.info import ModelInfo

__all__ = ["Engine", "CausalLMRunner", "EmbeddingRunner"]


@runtime_checkable
class EmbeddingRunner(Protocol):
    """Turns texts into sentence embeddings, pooled and normalized as the model's config says."""

    def embed(self, texts: Sequence[str], batch_size: int = 32) -> np.ndarray:
        """Return a float32 array of shape (len(texts), dim)."""
        ...


@runtime_checkable
class CausalLMRunner(Protocol):
    """Scores and extends token sequences. All tensors live on CPU at the interface."""

    tokenizer: Any

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full-sequence forward without a cache: (B, T) int64 -> (B, T, V) float32 logits."""
        ...

    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Run the prompt (B, T) and return (last-position logits (B, V), cache state)."""
        ...

    def decode(self, tokens: torch.Tensor, state: Any) -> tuple[torch.Tensor, Any]:
        """Append one token per sequence (B, 1) and return (logits (B, V), new state)."""
        ...


class Engine(ABC):
    """Base class of engine plugins. Subclasses set the class attributes and implement the rest."""

    name: ClassVar[str]
    tasks: ClassVar[tuple[str, ...]]  # "causal-lm", "embedding"
    extra: ClassVar[str | None] = None  # the `pip install llmopt[extra]` that provides it
    gguf: ClassVar[bool] = False  # runs llama.cpp's GGUF types (the gguf-* recipes)
    batching: ClassVar[bool] = False  # has `load_generator` (continuous batching, `llmopt serve`)
    # Runs as its own server process (vLLM): no in-process runner; `server()` returns a context
    # manager with `base_url` and `model`, and the stages verify and bench it over HTTP.
    served: ClassVar[bool] = False

    def missing(self) -> str | None:
        """None when the engine can run here, else why not and the exact install command."""
        return None

    @abstractmethod
    def incompatible(self, info: ModelInfo, recipe: Recipe, device: str) -> str | None:
        """None when this engine can run `recipe` on this model and device, else the reason."""

    @abstractmethod
    def build(self, source: Path, info: ModelInfo, recipe: Recipe, out: Path) -> dict[str, Any]:
        """Write the candidate's artifact into the (empty) folder `out`; return facts for build.json.

        `source` is only read, never written. It is the user's model folder, except for
        calibrated recipes (`recipe.calibrated`: AWQ, GPTQ, FP8...): the build stage quantizes
        first (`llmopt.quant`) and `source` is then that compressed-tensors checkpoint, which an
        engine converts or, like the `torch` engine, only links in.
        """

    @abstractmethod
    def load(
        self, artifact: Path, info: ModelInfo, recipe: Recipe, settings: EngineSettings
    ) -> CausalLMRunner | EmbeddingRunner:
        """Load a built artifact and return a runner for `info.task`."""

    def start_seconds(self, device: str) -> float:
        """A typical start of this engine's own server on `device` (served engines start one in
        each verify and bench stage); 0 for in-process engines, whose load is part of what the
        budget already measures. The search's time estimates add it until it has timed a start."""
        return 0.0

    def settings_space(self, info: ModelInfo, recipe: Recipe, device: str) -> list[dict[str, Any]]:
        """Setting variations worth measuring as separate candidates, each a partial
        `EngineSettings` as a dict (the first is the default, `{}`)."""
        return [{}]

    def load_generator(self, spec: GeneratorSpec) -> BatchGenerator:
        """A continuous-batching generator for `spec` (engines with `batching = True`).

        The default refuses: this engine loads runners (`load`) but cannot be served with
        continuous batching.
        """
        raise NotImplementedError(
            f"engine {self.name!r} has no batching generator (Engine.batching is False); "
            "serve causal LMs on an engine that has one, such as 'torch'"
        )
