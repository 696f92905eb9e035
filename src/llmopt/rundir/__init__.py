"""The run directory of `llmopt optimize`: its paths, its identity, and the `best/` folder."""

from __future__ import annotations

from llmopt.rundir.paths import RunDir

__all__ = ["RunDir"]
