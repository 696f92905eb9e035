"""`llmopt deploy`: a ready-to-run, validated bundle for a run's choice or a model folder."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from llmopt.cli.options import (
    ConcOpt,
    CpuOpt,
    GpuOpt,
    GpusOpt,
    InOpt,
    JsonOpt,
    KvOpt,
    MaxLenOpt,
    OutOpt,
    ParamsOpt,
    PrecOpt,
    RateOpt,
    ThreadsOpt,
    TpOpt,
    TpotOpt,
    TtftOpt,
    UtilOpt,
    emit_json,
    serving_target,
    workload,
)
from llmopt.cli.render_ops import render_deploy
from llmopt.deploy import resolve_source, write_bundle
from llmopt.deploy.source import run_target
from llmopt.hardware.target import Target


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
    gpu: GpuOpt = None,
    gpus: GpusOpt = None,
    cpu: CpuOpt = False,
    threads: ThreadsOpt = None,
    params: ParamsOpt = None,
    input_len: InOpt = 1024,
    output_len: OutOpt = 256,
    concurrency: ConcOpt = None,
    rate: RateOpt = None,
    ttft_ms: TtftOpt = None,
    tpot_ms: TpotOpt = None,
    max_model_len: MaxLenOpt = None,
    precision: PrecOpt = None,
    kv_dtype: KvOpt = "auto",
    gpu_memory_utilization: UtilOpt = None,
    tp: TpOpt = None,
    image: Annotated[
        str | None, typer.Option(help="Container image name for compose and Kubernetes.")
    ] = None,
    no_validate: Annotated[
        bool, typer.Option("--no-validate", help="Skip the validators.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Write a ready-to-run bundle (container, compose, nginx, Kubernetes, start script), validated here."""

    src = resolve_source(source, params=params)
    recorded = None
    if src.kind == "run" and target is None and not (gpu or cpu):
        recorded = run_target(src.model_dir)
    if recorded is not None:
        st = recorded
        if threads:
            st = Target.cpu_host(threads) if st.device == "cpu" else st
        sys.stderr.write(f"target: the run's own ({st.device}); pass --target/--gpu to change\n")
    else:
        st = serving_target(target or "cuda", gpu, gpus, cpu, threads)
    wl = workload(
        input_len=input_len,
        output_len=output_len,
        concurrency=concurrency,
        request_rate=rate,
        ttft_ms=ttft_ms,
        tpot_ms=tpot_ms,
        max_model_len=max_model_len,
    )
    kw = {"kv_dtype": kv_dtype, "utilization": gpu_memory_utilization, "tp": tp}
    if precision:
        kw["precision"] = precision
    res = write_bundle(src, out, st, wl, image=image, validate=not no_validate, **kw)
    emit_json(res.to_dict()) if as_json else render_deploy(res)
    if not res.ok:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add `deploy` to the `llmopt` app."""
    app.command("deploy")(deploy)
