"""Typer options shared by several commands, defined once, and the JSON printer."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer

__all__ = ["DEFAULT_MODEL", "ModelArg", "JsonOpt", "emit_json"]

DEFAULT_MODEL = "smollm2-135m"
ModelArg = Annotated[
    str,
    typer.Argument(
        help="A built-in name (smollm2-135m, minilm-l6) or a path to a Hugging Face folder."
    ),
]
JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")
]


def emit_json(obj: Any) -> None:
    """Print `obj` as indented JSON on stdout (what every `--json` flag prints)."""
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
