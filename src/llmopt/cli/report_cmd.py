"""`llmopt report`: re-render a run directory's report."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from llmopt.cli.render import console
from llmopt.report import write_report


def report(
    run_dir: Annotated[Path, typer.Argument(help="A run directory written by `llmopt optimize`.")],
) -> None:
    """Re-render report.md and report.html from a run directory."""

    md, html = write_report(run_dir)
    console.print(f"report: {html}\n        {md}")


def register(app: typer.Typer) -> None:
    """Add `report` to the `llmopt` app."""
    app.command("report")(report)
