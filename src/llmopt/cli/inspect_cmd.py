"""`llmopt inspect`: what a model folder holds, read from its config and weight headers."""

from __future__ import annotations

from typing import Annotated

import typer

from llmopt.cli.options import JsonOpt, ModelArg, emit_json
from llmopt.cli.render import console, render_inspect
from llmopt.model.info import inspect_model


def inspect(
    model: ModelArg,
    allow_pickle: Annotated[
        bool,
        typer.Option(
            "--allow-pickle",
            help="Allow reading pickled .bin/.pt weights (pickle can run code; only for files you trust).",
        ),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """What is this model? Architecture, sizes, context, dtype, KV-cache bytes per token."""

    with console.status(f"inspecting {model}"):
        info = inspect_model(model, allow_pickle=allow_pickle)
    emit_json(info.to_dict()) if as_json else render_inspect(info)


def register(app: typer.Typer) -> None:
    """Add `inspect` to the `llmopt` app."""
    app.command("inspect")(inspect)
