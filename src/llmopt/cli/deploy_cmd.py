"""`llmopt deploy`: a ready-to-run, validated bundle for a run's choice or a model folder."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from llmopt.cli.options import (
    SERVING_DEFAULTS,
    JsonOpt,
    ServingOptions,
    emit_json,
    with_serving_options,
)
from llmopt.cli.render_ops import render_deploy
from llmopt.deploy import resolve_source, write_bundle
from llmopt.deploy.source import run_target
from llmopt.hardware.target import Target


@with_serving_options
def deploy(
    source: Annotated[
        str,
        typer.Argument(
            help="A run directory (its best/ candidate), a model folder or a built-in name."
        ),
    ],
    out: Annotated[
        Path, typer.Option("--out", help="Bundle folder to write (replaced if it exists).")
    ],
    target: Annotated[
        str | None,
        typer.Option(
            help="cpu or cuda (cuda: the GPUs doctor finds here). Default: a run's own target "
            "(what it measured on), else cuda."
        ),
    ] = None,
    serving: ServingOptions = SERVING_DEFAULTS,  # --gpu ... --tp
    image: Annotated[
        str | None, typer.Option(help="Container image name for compose and Kubernetes.")
    ] = None,
    no_validate: Annotated[
        bool, typer.Option("--no-validate", help="Skip the validators.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Write a ready-to-run bundle (container, compose, nginx, Kubernetes, start script), validated here."""

    o = serving
    src = resolve_source(source, params=o.params)
    recorded = None
    if src.kind == "run" and target is None and not (o.gpu or o.cpu):
        recorded = run_target(src.model_dir)
    if recorded is not None:
        st = recorded
        if o.threads:
            st = Target.cpu_host(o.threads) if st.device == "cpu" else st
        sys.stderr.write(f"target: the run's own ({st.device}); pass --target/--gpu to change\n")
    else:
        st = o.target(target or "cuda")
    wl = o.workload()
    kw = {"kv_dtype": o.kv_dtype, "utilization": o.gpu_memory_utilization, "tp": o.tp}
    if o.precision:
        kw["precision"] = o.precision
    res = write_bundle(src, out, st, wl, image=image, validate=not no_validate, **kw)
    emit_json(res.to_dict()) if as_json else render_deploy(res)
    if not res.ok:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add `deploy` to the `llmopt` app."""
    app.command("deploy")(deploy)
