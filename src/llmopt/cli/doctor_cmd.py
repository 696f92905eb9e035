"""`llmopt doctor`: can this machine run what we plan? Evidence and fixes."""

from __future__ import annotations

from typing import Annotated

import typer

from llmopt.cli.options import (
    JsonOpt,
    emit_json,
)
from llmopt.cli.render import console
from llmopt.cli.render_ops import render_doctor
from llmopt.doctor import run_doctor


def doctor(
    target: Annotated[
        str,
        typer.Option(help="auto, cpu or cuda: decides whether a missing GPU is ok, warn or fail."),
    ] = "auto",
    as_json: JsonOpt = False,
) -> None:
    """Can this machine run what we plan? Driver, GPUs, CUDA, engines, container: evidence and fixes."""

    if as_json:
        report = run_doctor(target)
        emit_json(report.to_dict())
    else:
        with console.status("checking this machine"):
            report = run_doctor(target)
        render_doctor(report)
    raise typer.Exit(report.exit_code)


def register(app: typer.Typer) -> None:
    """Add `doctor` to the `llmopt` app."""
    app.command("doctor")(doctor)
