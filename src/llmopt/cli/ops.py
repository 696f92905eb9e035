"""CLI commands for environment and serving operations: `plan` (and, later, `doctor`, `deploy`)."""

from __future__ import annotations

from typing import Annotated

import typer

from llmopt.cli.render import render_plan


def plan(
    model: Annotated[str, typer.Argument(help="A built-in name (smollm2-135m, minilm-l6) or a path to a Hugging Face folder.")],
    target: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    threads: Annotated[int | None, typer.Option(help="CPU threads (default: all).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")] = False,
) -> None:
    """What fits and what would run it? Memory math and the candidate list with skip reasons."""
    from llmopt.cli.main import emit_json
    from llmopt.modelinfo import inspect_model
    from llmopt.plan import detect_target, make_plan

    info = inspect_model(model)
    p = make_plan(info, detect_target(target, threads))
    emit_json(p.to_dict()) if as_json else render_plan(info, p)


def register(app: typer.Typer) -> None:
    """Add this module's commands to the `llmopt` app."""
    app.command()(plan)
