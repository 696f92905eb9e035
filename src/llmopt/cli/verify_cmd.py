"""CLI commands of the verify stage (filled in by the verify issue's work)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this module's commands to the `llmopt` app."""
