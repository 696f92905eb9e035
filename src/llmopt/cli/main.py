"""`llmopt` command line: wiring only. Each command module calls one library function and
renders its result; this module builds the app from them, in the order `llmopt --help` lists.

Heavy imports (torch, transformers, engines) happen inside the commands so `llmopt --help` is
instant. User mistakes (llmopt.core.errors.LlmoptError, ValueError from config objects) print one
message with the fix and exit with code 2; no traceback.
"""

from __future__ import annotations

import sys

import typer
from rich.markup import escape

from llmopt.cli import (
    assets_cmd,
    bench_cmd,
    deploy_cmd,
    doctor_cmd,
    engines_cmd,
    inspect_cmd,
    optimize_cmd,
    plan_cmd,
    quantize_cmd,
    report_cmd,
    serve_cmd,
    verify_cmd,
)
from llmopt.cli.render import err_console
from llmopt.core.errors import LlmoptError

__all__ = ["app", "main"]

app = typer.Typer(
    name="llmopt",
    help="Turn a Hugging Face model folder into the fastest deployment that keeps its quality.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
for _module in (
    inspect_cmd,
    optimize_cmd,
    report_cmd,
    assets_cmd,
    engines_cmd,
    doctor_cmd,
    plan_cmd,
    deploy_cmd,
    verify_cmd,
    bench_cmd,
    serve_cmd,
    quantize_cmd,
):
    _module.register(app)


def main() -> None:
    try:
        app()
    except (LlmoptError, ValueError) as e:
        # escape(): messages carry literal brackets (pip install 'llmopt[vllm]').
        err_console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False)
        sys.exit(2)


if __name__ == "__main__":
    main()
